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
    from tests.test_container_build import skip_where_the_main_job_runs

    skip_where_the_main_job_runs("runs this suite on the interpreter and checks its rows")
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


# ---- the presets' knobs for large shapes (the zoo), on the interpreter at tiny sizes ---------------------------------
@pytest.fixture
def tiny_preset():
    from detkit.toolkit.presets import GEMM_PRESETS, GemmPreset

    GEMM_PRESETS["test-knobs"] = GemmPreset("test-knobs", ((40, 56), (24, 32)), (1, 7, 40), chunk=16, repetitions=2,
                                            determinism_m=(7,), layouts=("linear",), config_m=9,
                                            determinism_kn=((24, 32),), contract_max_elements=7 * 20)
    yield "test-knobs"
    del GEMM_PRESETS["test-knobs"]


def _ctx(preset):
    import torch

    from detkit.toolkit.harness import RunContext

    return RunContext(device=torch.device(TEST_DEVICE), preset=preset, seed=5,
                      backend="triton_interpreter" if TEST_DEVICE == "cpu" else "cuda_sm90")


def test_zoo_preset_covers_the_zoo_with_device_draws_and_bounded_checks():
    from detkit.toolkit.presets import GEMM_PRESETS, zoo_shapes

    zoo = GEMM_PRESETS["zoo"]
    assert zoo.kn_shapes == tuple((s.k, s.n) for s in zoo_shapes()) and zoo.device_draws
    assert (4096, 151936) in zoo.kn_shapes and (4096, 151936) not in zoo.determinism_kn
    assert all(k * n <= 2**26 for k, n in zoo.determinism_kn) and len(zoo.determinism_kn) == 28
    assert zoo.config_m == 1024 <= zoo.m_max and zoo.layouts == ("linear",)


def test_contract_checks_the_first_and_last_columns_of_a_large_output():
    from detkit.audits.gemm_contract import checked_columns

    assert checked_columns(7, 40, None) == [(0, 40)] and checked_columns(7, 40, 280) == [(0, 40)]
    assert checked_columns(7, 40, 140) == [(0, 10), (30, 40)]
    assert checked_columns(4096, 151936, 2**24) == [(0, 2048), (149888, 151936)]
    assert checked_columns(1000, 3, 10) == [(0, 1), (2, 3)]


interpreter_only = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="audit logic at tiny sizes (CI); on the GPU the "
                                      "audit runs at its presets")


@interpreter_only
def test_contract_on_column_blocks_passes_the_kernel_and_fails_a_wrong_column(tiny_preset, monkeypatch):
    import detkit.audits.gemm_contract as contract

    rows = list(contract.run(_ctx(tiny_preset)))
    assert rows and all(r.passed for r in rows)
    subset = [r for r in rows if "checked_columns" in r.details]
    # Every output above 140 elements is checked on two column blocks (e.g. fwd at M=7: 7 x 56, two blocks of 10).
    assert subset and all(len(r.details["checked_columns"]) == 2 for r in subset)
    real = contract.launch

    def wrong_last_column(op, x, y, **kw):
        c, info = real(op, x, y, **kw)
        c[:, -1] += 1.0  # inside the last checked block
        return c, info

    monkeypatch.setattr(contract, "launch", wrong_last_column)
    bad = list(contract.run(_ctx(tiny_preset)))
    assert all(not r.passed for r in bad if "checked_columns" in r.details)


@interpreter_only
def test_cross_config_rows_at_config_m_and_determinism_shapes(tiny_preset):
    import detkit.audits.gemm_batch_invariance as bi
    import detkit.audits.gemm_determinism as det

    rows = list(bi.run(_ctx(tiny_preset)))
    configs = [r for r in rows if r.check == "config"]
    assert configs and all(r.passed for r in rows)
    assert all("[M=9," in r.name and r.details["reference_m"] == 40 for r in configs)
    cases = det._cases(_ctx(tiny_preset))
    assert {(c.k, c.n) for c in cases} == {(24, 32)} and {c.m for c in cases} == {7}
