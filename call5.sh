#!/bin/bash
# s24 call 5: the model audit at Qwen3-30B-A3B widths (2 layers) with FP8 experts, the captured decode step on
# static FP8 weights (DETKIT_MODEL_FP8_GRAPH_WEIGHTS=static) and, in the same session, quantizing them in the graph
# (the default); then the model audit's FP8 GPU tests.
set -x
O=$OUT/call5; mkdir -p $O
nvidia-smi > $O/gpu.txt
for gw in static quantize; do
  DETKIT_MODEL_CONFIG=qwen3-moe-30b-a3b DETKIT_MODEL_MOE_EXPERTS=fp8 DETKIT_MODEL_FP8_GRAPH_WEIGHTS=$gw \
    timeout 200 python -m detkit audit --device cuda --suite model --no-progress --out $O/model-audit-fp8-$gw \
    > $O/model-audit-fp8-$gw.log 2>&1
  echo "$gw $(date -u +%H:%M:%S)" >> $O/times.txt
done
DETKIT_TEST_DEVICE=cuda timeout 100 python -m pytest -q -p no:cacheprovider tests/test_model_audit.py -k fp8 > $O/pytest.log 2>&1
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv >> $O/gpu.txt
cd $OUT && tar czf call5.tgz call5
