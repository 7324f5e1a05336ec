#!/bin/bash
# s23 call 4: the FP8 column-wise quantizer visiting the experts' blocks side by side (gathered operands: x, dy)
# against BASE's block order, kernel by kernel in a real FP8 forward+backward; the FP8 GPU tests and audit;
# `detkit bench moe` and the E x K sweep on this tree.
set -x
O=$OUT/call4; mkdir -p $O
nvidia-smi > $O/gpu.txt
BASE=$1
S="--preset reference --preset qwen3-30b-a3b --shape 16384,2048,768,128,8 --shape 8192,2048,768,128,2 --impl fp8"
python -m tools.moe_kernels_profile $S --out $O/profile-new > $O/profile-new.log 2>&1
(cd base_$BASE && PYTHONPATH=$PWD/../base_$BASE:/tmp/site python -m tools.moe_kernels_profile $S --out $O/profile-base > $O/profile-base.log 2>&1)
python -m tools.moe_kernels_profile $S --out $O/profile-new2 > $O/profile-new2.log 2>&1
DETKIT_TEST_DEVICE=cuda timeout 240 python -m pytest -q -m gpu tests/test_moe_fp8.py tests/test_moe_fp8_ws.py tests/test_mode_moe_fp8.py tests/test_moe_nosync.py > $O/pytest.log 2>&1
python -m detkit audit --device cuda --suite moe-fp8 --out $O/audit-moe-fp8 > $O/audit.log 2>&1
python -m detkit bench moe --device cuda --preset reference --preset qwen3-30b-a3b --impl bf16 --impl fp8 --measure fwd_bwd --rounds 3 --no-stages --out $O/bench > $O/bench.log 2>&1
python -m detkit bench moe --device cuda --preset reference --impl bf16 --impl fp8 --measure fwd_bwd --sweep --sweep-e 8 --sweep-e 128 --sweep-k 2 --sweep-k 8 --rounds 2 --no-stages --out $O/moe-sweep > $O/sweep.log 2>&1
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv >> $O/gpu.txt
cd $OUT && tar czf call4.tgz call4
