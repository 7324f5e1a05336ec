#!/bin/bash
# s24 call 2: where the time goes at the presets and sweep points the FP8 targets miss: every kernel of one real
# forward+backward call (BF16, FP8, FP8 with warm weights) at Qwen3-235B-A22B, OLMoE, Mixtral-8x7B and the
# 3072x1536 sweep points E=32 and E=64 at K=2, T=8192.
set -x
O=$OUT/call2; mkdir -p $O
nvidia-smi > $O/gpu.txt
stamp() { echo "$1 $(date -u +%H:%M:%S)" >> $O/times.txt; }
stamp start
for impl in bf16 fp8 fp8_warm; do
  timeout 150 python -m tools.moe_kernels_profile --preset qwen3-235b-a22b --preset olmoe --preset mixtral-8x7b --shape 8192,3072,1536,32,2 --shape 8192,3072,1536,64,2 --impl $impl --out $O/profile-$impl > $O/profile-$impl.log 2>&1
  stamp $impl
done
timeout 60 python -m tools.moe_kernels_profile --preset qwen3-30b-a3b --preset reference --impl fp8_warm --out $O/profile-fp8_warm-30b > $O/profile-fp8_warm-30b.log 2>&1
stamp warm-30b
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv >> $O/gpu.txt
cd $OUT && tar czf call2.tgz call2
