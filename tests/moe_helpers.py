"""Helpers shared by the MoE kernel tests (tests/test_moe.py, tests/test_moe_fp8.py)."""

import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from audits.moe import MoeCase, invariance_variants
from toolkit.contract import compare_bits


def assert_stages(stage_checks: Callable[[dict], tuple[dict, dict]], inp: dict) -> dict:
    """Every stage within its bound and every padding row zero; returns the checks' extra details."""
    results, extra = stage_checks(inp)
    failed = {s: r for s, r in results.items() if not r.passed}
    assert not failed, failed
    assert all(extra["padding_zero"].values()), extra
    return extra


def layer_args(inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The forward's positional inputs: x, w1, w2, topk_ids, scores."""
    return inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"]


def assert_forward_batch_invariant(fwd: Callable[..., tuple], inp: dict, case: MoeCase, seed: int) -> None:
    """Each invariance variant's compared tokens have the output bits they have in the full batch."""
    full = fwd(*layer_args(inp))[0]
    for variant, sub, rows, full_rows in invariance_variants(inp, case, seed):
        got = fwd(*layer_args(sub))[0]
        res = compare_bits(got[rows.to(got.device)], full[full_rows.to(full.device)])
        assert res.equal, (variant, res)


def assert_rejected(fwd: Callable[..., tuple], inp: dict, change: dict, exc_type: type) -> None:
    bad = {**inp, **change}
    with pytest.raises(exc_type):
        fwd(*layer_args(bad))


def compile_sm90_offline(script: str, tmp_path, *argv: str) -> dict:
    """Runs ``script`` (which compiles kernels for sm_90 with Triton's bundled ptxas and prints a JSON report
    as its last line) in a fresh interpreter without TRITON_INTERPRET; skips when Triton has no NVIDIA
    backend."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"Triton's NVIDIA backend is not installed: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
