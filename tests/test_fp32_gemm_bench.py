"""tools/fp32_gemm_bench.py on the interpreter (CPU): it validates each case against the FP64 oracle and the M = 1
call's bits before timing, compares every candidate's bits with the table pick's, writes one row per case with the
candidates' eager and graph times, restores torch's precision setting, and fails on a wrong result. Timings on the CPU
are plumbing only."""

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
    assert all(r["public_bits_as_launch"] is True for r in rows)  # the timed public op (tf32 dB: a forward product)
    assert all(r["eager_ratio"] > 0 and r["graph_ratio"] > 0 for r in rows)
    for r in rows:
        (label,) = r["candidates"]
        cand = r["candidates"][label]
        assert label == "BM16_BN32_BK32_G1_w4_s3" and cand["bits_as_pick"] is True
        assert all(isinstance(cand[f"{t}_{s}_us"], float) for t in ("eager", "graph") for s in ("median", "p20", "p80"))
    assert "det_gemm_fwd [M=3, N=48, K=32] fp32 tf32" in {r["name"] for r in rows}
    assert "| fwd | 32 | 48 | linear | 3 | tf32 |" in (tmp_path / "summary.md").read_text()


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


def test_small_m_candidates_are_bit_checked_and_timed_beside_the_pick(tmp_path, device):
    """--candidates at M <= 16: every small-M candidate (each variant) and the tile references, timed with the pick
    and torch.matmul, each with the pick's bits; the summary lists them with the fastest marked."""
    if device.type != "cpu":
        pytest.skip("the GPU run is tools/gpu/fp32_gemm.sh")
    from detkit.kernels.det_gemm.configs import GemmConfig, gemv_candidates

    rc = fp32_gemm_bench.main(["--device", "cpu", "--out", str(tmp_path), "--ops", "fwd", "--kn", "32,48", "--m", "1",
                               "--rounds", "1", "--precision", "ieee", "--layouts", "kn", "--candidates"])
    assert rc == 0
    (row,) = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    pick, *others = gemv_candidates(1, 48)
    assert row["config"] == pick.label() and row["layout"] == "kn"
    want = [c.label() for c in dict.fromkeys((*others, GemmConfig(16, 64, 32, 1, 4, 4), GemmConfig(1, 128, 32, 1, 4, 4)))]
    assert list(row["candidates"]) == want
    assert all(c["bits_as_pick"] is True and c["graph_median_us"] > 0 and c["eager_ratio"] > 0
               for c in row["candidates"].values())
    text = (tmp_path / "summary.md").read_text()
    assert "## Candidates" in text and text.count("(fastest)") == 1 and "_gemv_tile" in text


def test_a_candidate_with_other_bits_or_a_refusal_fails_the_run(tmp_path, device, monkeypatch):
    """A candidate whose bits differ from the pick's, or that raises (e.g. fails to compile), fails the run; its row
    says which, and the other candidates are still timed."""
    if device.type != "cpu":
        pytest.skip("the GPU run is tools/gpu/fp32_gemm.sh")
    from detkit.kernels.det_gemm import launch

    real = launch.LAUNCHERS["fwd"]

    def wrong_or_refused(x, y, **kw):
        config = kw.get("config")
        if config is not None and config.block_n == 64:
            raise RuntimeError("no such kernel\nsecond line")
        c, record = real(x, y, **kw)
        return (c.clone().index_fill_(1, torch.tensor([0]), 1.0) if config is not None else c), record

    monkeypatch.setitem(launch.LAUNCHERS, "fwd", wrong_or_refused)
    rc = fp32_gemm_bench.main(["--device", "cpu", "--out", str(tmp_path), "--kn", "32,48", "--m", "2", "--rounds",
                               "1", "--precision", "ieee", "--config", "16,32,32,1,4,3", "16,64,32,1,4,3"])
    assert rc == 1
    (row,) = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert row["valid"] is True and row["candidates"]["BM16_BN32_BK32_G1_w4_s3"]["bits_as_pick"] is False
    assert row["candidates"]["BM16_BN32_BK32_G1_w4_s3"]["graph_median_us"] > 0
    assert row["candidates"]["BM16_BN64_BK32_G1_w4_s3"] == {"error": "RuntimeError: no such kernel"}
    assert "| BM16_BN64_BK32_G1_w4_s3 | RuntimeError: no such kernel |" in (tmp_path / "summary.md").read_text()


def test_warm_compiles_each_kernel_of_the_run_once(device):
    """--warm's launches: the table pick and every candidate, one per specialization. Two lm_heads whose sizes fall in
    the same classes (multiples of 16, K even in every BLOCK_K) share their kernels; M 7 and 8 share a band and a
    class; M 16 is a class of its own."""
    if device.type != "cpu":
        pytest.skip("the GPU run is tools/gpu/fp32_gemm.sh")
    import argparse

    from detkit.kernels.det_gemm.configs import GemmConfig, gemv_candidates

    args = argparse.Namespace(config=[], precision=["ieee"], ops=["fwd"], kn=["4096,151936", "5120,151936"],
                              layouts=["linear"], m=[7, 8, 16], candidates=True, fma=False)
    specs = fp32_gemm_bench.warm_specs(args)
    want = {(8, c) for c in gemv_candidates(8, 151936)} | {(16, c) for c in gemv_candidates(16, 151936)}
    want |= {(m, GemmConfig(16, 64, 32, 1, 4, 4)) for m in (8, 16)} | {(16, GemmConfig(16, 128, 32, 1, 4, 4)),
                                                                       (8, GemmConfig(8, 128, 32, 1, 4, 4))}
    got = [(16 if m == 16 else 8, GemmConfig(*fields)) for _, m, _, _, _, _, fields in specs]
    assert len(got) == len(set(got)) and set(got) == want
    assert {(op, layout, precision) for op, _, _, _, layout, precision, _ in specs} == {("fwd", "linear", "ieee")}


def test_fma_candidates_join_ieee_cases_above_16_rows_and_the_warm(device):
    """--fma: the Gluon FMA-dot tiles (configs.fma_candidates) beside the pick at M > 16 with "ieee" products, for
    every op; none at M <= 16 (the small-M kernel's rows) or with "tf32"; the warm compiles each once per
    specialization."""
    if device.type != "cpu":
        pytest.skip("the GPU run is tools/gpu/fp32_fma.sh")
    import argparse

    from detkit.kernels.det_gemm.configs import fma_candidates

    for op in ("fwd", "da", "db"):  # the pick left out (fwd's at 64 rows is one of them)
        pick = fp32_gemm_bench.table_pick(op, 64, 151936, 4096, "ieee")
        assert fp32_gemm_bench.candidate_configs(op, 64, 151936, 4096, "ieee", False, [], fma=True) == [
            c for c in fma_candidates() if c != pick]
    assert len(fp32_gemm_bench.candidate_configs("fwd", 64, 151936, 4096, "ieee", False, [], fma=True)) == len(
        fma_candidates()) - 1
    assert fp32_gemm_bench.candidate_configs("fwd", 16, 151936, 4096, "ieee", False, [], fma=True) == []
    assert fp32_gemm_bench.candidate_configs("fwd", 64, 151936, 4096, "tf32", False, [], fma=True) == []
    assert fp32_gemm_bench.candidate_configs("fwd", 64, 151936, 4096, "ieee", False, []) == []
    args = argparse.Namespace(config=[], precision=["ieee"], ops=["fwd", "da"], kn=["4096,151936", "4096,4096"],
                              layouts=["linear"], m=[64, 256, 1024, 4096], candidates=False, fma=True)
    specs = fp32_gemm_bench.warm_specs(args)
    fma = [(op, fields) for op, _, _, _, _, _, fields in specs if fields[-1] == "fma"]
    assert len(fma) == len(set(fma)) == 2 * len(fma_candidates())
