#!/usr/bin/env bash
# Session 21, call 1: the MoE GPU tests through launch plans; host time per call, the tree before (base_s21/, 7193cb1)
# and after, alternating; `detkit bench moe --sweep` at 2048x768, E=8 on both trees, base first.
set -u
NEW=$1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devwheels/*.whl
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/call1; mkdir -p $R/host
nvidia-smi > $R/smi.txt
(export PYTHONPATH=$PWD:/tmp/site DETKIT_GIT_COMMIT=$NEW DETKIT_TEST_DEVICE=cuda
 timeout 250 python -m pytest -q -m gpu tests/test_planned_kernel.py tests/test_moe_nosync.py tests/test_moe_fp8.py \
   tests/test_moe_fp8_ws.py tests/test_moe.py tests/test_moe_ws.py tests/test_mode_moe_fp8.py tests/test_mode_moe.py \
   > $R/pytest-moe.log 2>&1; echo "rc=$?" >> $R/pytest-moe.log)
tail -3 $R/pytest-moe.log
for cfg in "bf16:--shape 8192 2048 768 8 2" "fp8:--fp8 --shape 8192 2048 768 8 2" "bf16-t2048:" "fp8-t2048:--fp8" \
           "block-bf16-decode:--block --shape 8 2048 768 128 8" "block-fp8-decode:--block --fp8 --shape 8 2048 768 128 8"; do
  name=${cfg%%:*}; args=${cfg#*:}
  for tree in base new; do
    if [ $tree = base ]; then P=$PWD/base_s21; C=7193cb1; else P=$PWD; C=$NEW; fi
    (cd $P && PYTHONPATH=$P:/tmp/site DETKIT_GIT_COMMIT=$C timeout 45 python -m tools.moe_host --device cuda $args \
       --calls 10 --rounds 7 --json $R/host/$name-$tree.json > $R/host/$name-$tree.log 2>&1)
    grep -E "^\| (fwd|fwd_bwd|infer) " $R/host/$name-$tree.log | sed "s/^/$name $tree /"
  done
done
for tree in base new; do
  if [ $tree = base ]; then P=$PWD/base_s21; C=7193cb1; else P=$PWD; C=$NEW; fi
  (cd $P && PYTHONPATH=$P:/tmp/site DETKIT_GIT_COMMIT=$C timeout -s INT 100 python -m detkit bench moe --device cuda \
     --sweep --sweep-width 2048x768 --sweep-e 8 --sweep-k 2 --sweep-k 8 --rounds 3 --out $R/sweep-$tree \
     > $R/sweep-$tree.log 2>&1)
  grep -E "^\| +(2048|8192|16384) " $R/sweep-$tree/report.md | sed "s/^/$tree /"
done
cd $OUT && tar czf call1.tgz call1
