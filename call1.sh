#!/bin/bash
# s23 call 1: 16-warp Triton tiles (128x256: 64 accumulator registers per thread) for the grouped stages, timed
# beside the pinned configs with bits compared (tools.moe_tune --config).
set -x
O=$OUT/call1; mkdir -p $O
nvidia-smi > $O/gpu.txt
P="--device cuda --preset reference qwen3-30b-a3b --rounds 2"
python -m tools.moe_tune $P --stages up --config BM128_BN256_BK64_G1_w16_s3_tma --config BM128_BN256_BK64_G1_w16_s4_tma \
  --config BM128_BN256_BK32_G1_w16_s5_tma --config BM128_BN256_BK64_G1_w8_s3_tma --config BM128_BN256_BK64_G1_w16_s3 \
  --out $O/up > $O/up.log 2>&1
python -m tools.moe_tune $P --stages dgrad dx --config BM128_BN128_BK64_G1_w16_s4_tma --config BM128_BN256_BK64_G1_w16_s3_tma \
  --out $O/dgrad-dx > $O/dgrad-dx.log 2>&1
python -m tools.moe_tune $P --stages fp8_up --config BM128_BN256_BK128_G1_w16_s3_tma --config BM128_BN256_BK128_G1_w16_s2_tma \
  --out $O/fp8-up > $O/fp8-up.log 2>&1
python -m tools.moe_tune $P --stages fp8_dgrad --config BM128_BN128_BK128_G1_w16_s3_tma --config BM128_BN64_BK128_G1_w16_s4_tma \
  --out $O/fp8-dgrad > $O/fp8-dgrad.log 2>&1
python -m tools.moe_tune $P --stages fp8_wgrad_w1 fp8_wgrad_w2 --config BM128_BN256_BK128_G1_w16_s3_tma \
  --config BM128_BN128_BK128_G1_w16_s4_tma --out $O/fp8-wgrad > $O/fp8-wgrad.log 2>&1
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv >> $O/gpu.txt
cd $OUT && tar czf call1.tgz call1
