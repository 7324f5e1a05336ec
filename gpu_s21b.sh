#!/usr/bin/env bash
# Session 21, call 2: `detkit bench moe` through launch plans (presets; the 2048x768, E=8 sweep points) and the
# same sweep points on the tree before (base_s21/, 7193cb1), base first.
set -u
NEW=$1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devwheels/*.whl
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/call2; mkdir -p $R
nvidia-smi > $R/smi.txt
for tree in base new; do
  if [ $tree = base ]; then P=$PWD/base_s21; C=7193cb1; else P=$PWD; C=$NEW; fi
  (cd $P && PYTHONPATH=$P:/tmp/site DETKIT_GIT_COMMIT=$C timeout -s INT 130 python -m detkit bench moe --device cuda \
     --sweep --sweep-width 2048x768 --sweep-e 8 --sweep-k 2 --sweep-k 8 --rounds 3 --out $R/sweep-$tree \
     > $R/sweep-$tree.log 2>&1)
  grep -E "^\| +(2048|8192|16384) " $R/sweep-$tree/report.md | sed "s/^/$tree /"
done
(PYTHONPATH=$PWD:/tmp/site DETKIT_GIT_COMMIT=$NEW timeout -s INT 200 python -m detkit bench moe --device cuda \
   --preset reference --preset qwen3-30b-a3b --impl bf16 --impl fp8 --measure fwd_bwd --rounds 3 --no-stages \
   --out $R/bench > $R/bench.log 2>&1)
grep -E "fp8_reference|fp8_presets|bf16_mfu" $R/bench/report.md | head -12
cd $OUT && tar czf call2.tgz call2
