#!/bin/bash
# s23 call 4: the E x K sweep (FP8 against the BF16 layer with the token-major scale pass), the FP8 audit (its
# wgrad="bf16" rows form dy with that pass) and the FP8 GPU tests.
set -x
O=$OUT/call4; mkdir -p $O
nvidia-smi > $O/gpu.txt
python -m detkit bench moe --device cuda --preset reference --impl bf16 --impl fp8 --measure fwd_bwd --sweep --sweep-e 8 --sweep-e 128 --sweep-k 2 --sweep-k 8 --rounds 2 --no-stages --out $O/moe-sweep > $O/sweep.log 2>&1
python -m detkit audit --device cuda --suite moe-fp8 --out $O/audit-moe-fp8 > $O/audit.log 2>&1
DETKIT_TEST_DEVICE=cuda timeout 240 python -m pytest -q -m gpu tests/test_moe_fp8.py tests/test_moe_fp8_ws.py tests/test_mode_moe_fp8.py > $O/pytest.log 2>&1
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv >> $O/gpu.txt
cd $OUT && tar czf call4.tgz call4
