#!/usr/bin/env bash
# Set up a machine without a GPU for detkit: a virtual environment at .venv with the pinned CPU
# stack (requirements-ci.txt), detkit installed editable, and the Debian Slurm packages the
# real-cluster test uses. Idempotent; run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-ci.txt
.venv/bin/python -m pip install -q --no-deps -e .
if [[ "${DETKIT_SKIP_SLURM_INSTALL:-0}" != 1 ]]; then
    bash .ci/slurm/install.sh
fi
.venv/bin/python - <<'PY'
import torch, triton, numpy
print(f"detkit setup: torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__}")
PY
