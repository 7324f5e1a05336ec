#!/bin/bash
# s24 call 1: `detkit bench moe` at every GPU preset (BF16, FP8, FP8 with warm weights) and the issue's full sweep
# (E 8/32/64/128, K 2/4/8, T 2048/8192/16384, both widths) on the landed layer.
set -x
O=$OUT/call1; mkdir -p $O
nvidia-smi > $O/gpu.txt
stamp() { echo "$1 $(date -u +%H:%M:%S)" >> $O/times.txt; }
stamp start
timeout 230 python -m detkit bench moe --device cuda --impl bf16 --impl fp8 --impl fp8_warm --measure fwd_bwd --rounds 3 --no-stages --out $O/bench > $O/bench.log 2>&1
stamp bench
timeout 170 python -m detkit bench moe --device cuda --sweep --sweep-width 3072x1536 --impl bf16 --impl fp8 --measure fwd_bwd --rounds 2 --no-stages --out $O/sweep-3072 > $O/sweep-3072.log 2>&1
stamp sweep-3072
timeout 140 python -m detkit bench moe --device cuda --sweep --sweep-width 2048x768 --impl bf16 --impl fp8 --measure fwd_bwd --rounds 2 --no-stages --out $O/sweep-2048 > $O/sweep-2048.log 2>&1
stamp sweep-2048
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv >> $O/gpu.txt
cd $OUT && tar czf call1.tgz call1
