#!/bin/bash
# s23 call 5: `detkit bench moe` (BF16 and FP8, reference and Qwen3-30B-A3B) and the E x K sweep on the tree that lands.
set -x
O=$OUT/call5; mkdir -p $O
nvidia-smi > $O/gpu.txt
python -m detkit bench moe --device cuda --preset reference --preset qwen3-30b-a3b --impl bf16 --impl fp8 --measure fwd_bwd --rounds 3 --no-stages --out $O/bench > $O/bench.log 2>&1
python -m detkit bench moe --device cuda --preset reference --impl bf16 --impl fp8 --measure fwd_bwd --sweep --sweep-e 8 --sweep-e 128 --sweep-k 2 --sweep-k 8 --rounds 2 --no-stages --out $O/moe-sweep > $O/sweep.log 2>&1
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv >> $O/gpu.txt
cd $OUT && tar czf call5.tgz call5
