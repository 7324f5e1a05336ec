#!/usr/bin/env bash
# Set up a machine without a GPU for detkit: a virtual environment at .venv with the pinned CPU
# stack (requirements-ci.txt), detkit installed editable, the Debian Slurm packages the
# real-cluster test uses, and Debian's docker.io and debootstrap for the container build test
# (.ci/docker.sh; skipped with a message where they cannot be installed). Idempotent; run from anywhere.
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
if [[ "${DETKIT_SKIP_DOCKER_INSTALL:-0}" != 1 ]]; then
    rc=0
    bash .ci/docker.sh install || rc=$?
    ((rc == 0 || rc == 3)) || exit "$rc"  # 3: not installable here; tests/test_container_build.py skips
fi
.venv/bin/python - <<'PY'
import torch, triton, numpy
print(f"detkit setup: torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__}")
PY
