"""The attention audit suite end to end through the CLI on the interpreter: every check passes at the tiny
shapes, rows stream to rows.jsonl, the report says it is not a hardware result. (On the H200 the suite runs as
its own step of tools/gpu/attention.sh.)"""

import json
import os
import subprocess
import sys

import pytest
import torch

from detkit.audits.attention import _decode_positions, bits_row
from detkit.kernels.attention import HEAD_DIMS
from detkit.toolkit.harness import SUITES, RunContext
from tests.conftest import TEST_DEVICE

EXPECTED_CHECKS = {"decode", "chunked_prefill", "batch_size", "batch_position", "padding", "varlen", "repetitions",
                   "fresh_process", "bound", "variant_decode", "variant_chunked_prefill", "variant_batch_position",
                   "variant_padding", "variant_bound"}


def test_attention_suite_passes_on_interpreter(tmp_path):
    if TEST_DEVICE != "cpu":
        pytest.skip("interpreter run; the GPU run is tools/gpu/attention.sh")
    from tests.test_container_build import skip_where_the_main_job_runs

    skip_where_the_main_job_runs("runs this suite on the interpreter and checks its rows")
    assert SUITES["attention"] == ("detkit.audits.attention",)
    proc = subprocess.run([sys.executable, "-m", "detkit", "audit", "--device", "cpu", "--suite", "attention",
                           "--out", str(tmp_path), "--no-progress"], capture_output=True, text=True,
                          env=dict(os.environ), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    rows = report["rows"]
    assert rows and all(r["passed"] for r in rows), [r for r in rows if not r["passed"]][:3]
    assert {r["check"] for r in rows} == EXPECTED_CHECKS
    assert all(r["suite"] == "attention" and r["backend"] == "triton_interpreter" for r in rows)
    bounds = [r for r in rows if r["check"] == "bound"]
    assert {r["details"]["tensor"] for r in bounds} == {"o", "dq", "dk", "dv"} and len(bounds) == 4 * len(HEAD_DIMS)
    variant_bounds = [r for r in rows if r["check"] == "variant_bound"]
    assert {r["details"]["tensor"] for r in variant_bounds} == {"o", "dq", "dk", "dv", "dsinks"}
    assert all(0 < r["details"]["worst_ratio"] <= 1 for r in bounds)
    streamed = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["name"] for r in streamed] == [r["name"] for r in rows]
    assert "NOT a hardware result" in (tmp_path / "report.md").read_text()


def test_bits_row_fails_on_one_flipped_bit_and_decode_positions_cover_tile_edges():
    ctx = RunContext(device=torch.device("cpu"), backend="triton_interpreter", preset="tiny")
    x = torch.randn(3, 4).to(torch.bfloat16)
    y = x.clone()
    y.view(torch.int16)[1, 2] ^= 1
    assert bits_row(ctx, "decode", "n", [(x, x)]).passed
    row = bits_row(ctx, "decode", "n", [(x, x), (y, x)])
    assert not row.passed and row.details["mismatches"] == 1 and row.details["failed_comparisons"] == 1
    positions = _decode_positions(100, 7, 16, 8)
    assert {15, 16, 17, 31, 32, 33, 99, 0}.issubset(positions) and positions == sorted(set(positions))
