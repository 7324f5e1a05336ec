#!/bin/bash
# s23 call 2: the token-major scale pass (moe_scale_rows_kernel reads each dout row once) against the row-major one of
# BASE, kernel by kernel in a real BF16 forward+backward; then the BF16 GPU tests and the MoE audit on the new tree.
set -x
O=$OUT/call2; mkdir -p $O
nvidia-smi > $O/gpu.txt
BASE=$1
python -m tools.moe_kernels_profile --preset reference --preset qwen3-30b-a3b --shape 16384,2048,768,128,8 --impl bf16 --out $O/profile-new > $O/profile-new.log 2>&1
(cd base_$BASE && PYTHONPATH=$PWD/..//base_$BASE:/tmp/site python -m tools.moe_kernels_profile --preset reference --preset qwen3-30b-a3b --shape 16384,2048,768,128,8 --impl bf16 --out $O/profile-base > $O/profile-base.log 2>&1)
python -m tools.moe_kernels_profile --preset reference --preset qwen3-30b-a3b --shape 16384,2048,768,128,8 --impl bf16 --out $O/profile-new2 > $O/profile-new2.log 2>&1
DETKIT_TEST_DEVICE=cuda timeout 300 python -m pytest -q -m gpu tests/test_moe.py tests/test_moe_ws.py tests/test_moe_nosync.py tests/test_mode_moe.py > $O/pytest.log 2>&1
python -m detkit audit --device cuda --suite moe --out $O/audit-moe > $O/audit.log 2>&1
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv >> $O/gpu.txt
cd $OUT && tar czf call2.tgz call2
