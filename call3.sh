#!/bin/bash
# s23 call 3: `detkit bench moe` (BF16 and FP8, reference and Qwen3-30B-A3B) and the Qwen3-30B-A3B T=16384 BF16 point
# on the tree with the token-major scale pass.
set -x
O=$OUT/call3; mkdir -p $O
nvidia-smi > $O/gpu.txt
python -m detkit bench moe --device cuda --preset reference --preset qwen3-30b-a3b --impl bf16 --impl fp8 --measure fwd_bwd --rounds 3 --no-stages --out $O/bench > $O/bench.log 2>&1
python -m detkit bench moe --device cuda --sweep --sweep-width 2048x768 --sweep-e 128 --sweep-k 8 --sweep-t 16384 --impl bf16 --rounds 3 --out $O/bench-30b16k > $O/bench-30b16k.log 2>&1
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv >> $O/gpu.txt
cd $OUT && tar czf call3.tgz call3
