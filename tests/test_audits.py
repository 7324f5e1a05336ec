"""The gemm audit suite end to end through the CLI: every batch-invariance, determinism and contract
check passes on the interpreter at the tiny preset, rows stream to rows.jsonl, and the report says it
is not a hardware result. On a Hopper GPU (DETKIT_TEST_DEVICE=cuda) the same at the Qwen3-8B shapes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TEST_DEVICE

EXPECTED_CHECKS = {
    ("gemm_batch_invariance", "m_sweep"), ("gemm_batch_invariance", "position"),
    ("gemm_batch_invariance", "zero_padding"), ("gemm_batch_invariance", "permutation"),
    ("gemm_batch_invariance", "chunking"), ("gemm_batch_invariance", "config"),
    ("gemm_determinism", "repetitions"), ("gemm_determinism", "db_zero_rows"),
    ("gemm_determinism", "fresh_process"), ("gemm_contract", "bound"),
}


def _run_audit(out: Path, device: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if device == "cuda":
        env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "detkit", "audit", "--device", device, "--suite", "gemm",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=3000)


def _check_report(out: Path, backend: str) -> dict:
    report = json.loads((out / "report.json").read_text())
    rows = report["rows"]
    assert rows and all(r["passed"] for r in rows), [r for r in rows if not r["passed"]][:3]
    assert {(r["suite"], r["check"]) for r in rows} == EXPECTED_CHECKS
    assert all(r["backend"] == backend for r in rows)
    streamed = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert [r["name"] for r in streamed] == [r["name"] for r in rows]
    return report


def test_gemm_suite_passes_on_interpreter(tmp_path):
    if TEST_DEVICE != "cpu":
        pytest.skip("interpreter run; DETKIT_TEST_DEVICE selects cuda")
    proc = _run_audit(tmp_path, "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _check_report(tmp_path, "triton_interpreter")
    assert report["meta"]["hardware_result"] is False
    assert "NOT a hardware result" in (tmp_path / "report.md").read_text()
    assert "NOT a hardware result" in proc.stderr


@pytest.mark.gpu
def test_gemm_suite_passes_on_hopper(tmp_path):
    proc = _run_audit(tmp_path, "cuda")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _check_report(tmp_path, "cuda_sm90")
    assert report["meta"]["hardware_result"] is True and report["meta"]["preset"] == "qwen3-8b-tp2"
