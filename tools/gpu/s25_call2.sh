#!/usr/bin/env bash
# s25 call 2: the GPU tests of the FP32/FP16 GEMM route, the grouped GEMM route and the attention variants, with
# det_gemm's BF16 gpu tests (its kernels gained a precision switch). Usage: OUT=DIR bash tools/gpu/s25_call2.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devwheels/*.whl
export PYTHONPATH=/tmp/site
source tools/gpu_steps.sh
OUT=$OUT/call2
begin_run
export TRITON_CACHE_DIR=/tmp/triton-cache
P=(env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra)
step fp32 150 "${P[@]}" tests/test_det_gemm_fp32.py tests/test_mode_fp32.py
step bf16-gemm 60 "${P[@]}" -m gpu tests/test_det_gemm.py
step grouped 150 "${P[@]}" tests/test_grouped.py tests/test_mode_grouped.py
step attention 200 "${P[@]}" -k "not offline" tests/test_attention_variants.py tests/test_mode_attention_variants.py
echo "finished failed=$failed"
