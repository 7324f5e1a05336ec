"""tools/fp32_gemm_bench.py on the interpreter (CPU): it validates each case against the FP64 oracle and the M = 1
call's bits before timing, writes one row per case, restores torch's precision setting, and fails on a wrong result.
Timings on the CPU are plumbing only."""

from __future__ import annotations

import json

import pytest
import torch

from tools import fp32_gemm_bench


def test_rows_are_validated_timed_and_summarized(tmp_path, device):
    if device.type != "cpu":
        pytest.skip("the GPU run is tools/gpu/fp32_gemm.sh")
    before = torch.get_float32_matmul_precision()
    rc = fp32_gemm_bench.main(["--device", "cpu", "--out", str(tmp_path), "--ops", "fwd", "db", "--kn", "32,48",
                               "--m", "1", "3", "--rounds", "1", "--config", "16,32,32,1,4,3"])
    assert rc == 0 and torch.get_float32_matmul_precision() == before
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [(r["op"], r["m"], r["precision"]) for r in rows] == [
        (op, m, p) for p in ("ieee", "tf32") for op in ("fwd", "db") for m in (1, 3)]
    assert all(r["valid"] for r in rows)
    assert [r["row0_bits_as_m1"] for r in rows if r["op"] == "fwd"] == [True] * 4
    assert all(r["eager_ratio"] > 0 and r["graph_ratio"] > 0 for r in rows)
    assert all(isinstance(r["candidates_graph_median_us"]["BM16_BN32_BK32_G1_w4_s3"], float) for r in rows)
    assert "det_gemm_fwd [M=3, N=48, K=32] fp32 tf32" in {r["name"] for r in rows}
    assert "| fwd | 32 | 48 | 3 | tf32 |" in (tmp_path / "summary.md").read_text()


def test_a_wrong_result_fails_the_run(tmp_path, device, monkeypatch):
    if device.type != "cpu":
        pytest.skip("the GPU run is tools/gpu/fp32_gemm.sh")
    from detkit.kernels.det_gemm import launch

    real = launch.LAUNCHERS["fwd"]

    def off_by_a_bit(x, y, **kw):
        c, record = real(x, y, **kw)
        return c * (1 + 2.0**-10), record

    monkeypatch.setitem(launch.LAUNCHERS, "fwd", off_by_a_bit)
    rc = fp32_gemm_bench.main(["--device", "cpu", "--out", str(tmp_path), "--kn", "32,48", "--m", "2", "--rounds",
                               "1", "--precision", "ieee"])
    assert rc == 1
    (row,) = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert row["valid"] is False and row["worst_ratio_to_bound"] > 1
