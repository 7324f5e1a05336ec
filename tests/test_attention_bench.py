"""The attention bench plug-in (BENCH_PROTOCOL): its case list, its validation and rows, its report. The timings
themselves mean something only on the GPU (tools/gpu/attention.sh runs it there)."""

import pytest
import torch

import detkit.bench.attention as bench
from detkit.toolkit.harness import RunContext


def _ctx(backend: str) -> RunContext:
    device = torch.device("cpu" if backend == "triton_interpreter" else "cuda")
    return RunContext(device=device, backend=backend, preset="tiny", seed=7)


def test_cases_cover_the_issue_grid_and_refuse_unknown_modes():
    full = bench.cases(_ctx("cuda_sm90"))
    by_mode = {m: [(c.batch, c.seq_q, c.seq_k) for c in full if c.mode == m] for m in bench.MODES}
    assert by_mode["prefill"] == [(b, s, s) for s in (1024, 4096, 16384) for b in (1, 8)]
    assert by_mode["decode"] == [(b, 1, s) for s in (1024, 8192, 32768) for b in (1, 8, 64)]
    assert by_mode["fwd_bwd"] == [(1, 4096, 4096), (1, 16384, 16384)]
    assert by_mode["paged_decode"] == []  # not in the default modes
    paged = bench.cases(_ctx("cuda_sm90"), modes="paged_decode")
    assert [(c.batch, c.seq_k, c.page_size) for c in paged] == [
        *((b, s, 16) for s in (1024, 8192, 32768) for b in (1, 8, 64)), (8, 8192, 256)]
    assert {c.baseline for c in paged} == {"detkit_contiguous"} and paged[0].name.endswith("bf16 paged16")
    with pytest.raises(ValueError, match="--modes paged_decode with --variants window is not supported"):
        bench.cases(_ctx("cuda_sm90"), modes="paged_decode", variants="window")
    full += paged
    assert all((c.heads_q, c.heads_kv, c.head_dim) == (32, 8, 128) for c in full)
    assert len({c.name for c in full}) == len(full)
    assert [c.mode for c in bench.cases(_ctx("cuda_sm90"), modes="decode", quick=True)] == ["decode"]
    with pytest.raises(ValueError, match="--modes 'prefill,foo' is not supported"):
        bench.cases(_ctx("cuda_sm90"), modes="prefill,foo")
    # FLOPs: 4 D per visible pair; fwd+bwd 3.5x; decode bytes are the cache's K and V.
    case = bench.BenchCase("prefill", 1, 4, 4, 2, 1, 64)
    assert case.flops == 4 * 64 * 10 * 2
    assert bench.BenchCase("fwd_bwd", 1, 4, 4, 2, 1, 64).flops == 3.5 * case.flops
    assert bench.BenchCase("decode", 2, 1, 100, 2, 1, 64).kv_bytes == 2 * 2 * 2 * 1 * 100 * 64


def test_run_validates_against_sdpa_and_reports_every_mode(device):
    if device.type != "cpu":
        pytest.skip("the CPU plumbing; the GPU run is tools/gpu/attention.sh")
    ctx = _ctx("triton_interpreter")
    rows = list(bench.run(ctx, bench.cases(ctx, modes=",".join(bench.MODES), quick=True), rounds=1))
    assert [r["mode"] for r in rows] == list(bench.MODES)
    for row in rows:
        assert row["passed"] and row["validated"] and row["max_abs_diff_vs_sdpa"] <= bench.VALIDATION_ATOL, row
        assert row["detkit_eager_us"] > 0 and row["sdpa_eager_us"] > 0 and row["ratio_eager"] > 0
        assert row["name"].startswith("detkit_attention_") and row["meets_target"] is None  # no target off the GPU
    paged = rows[-1]  # against detkit's contiguous decode, bit for bit; the checked call's host time beside it
    assert paged["baseline"] == "detkit_contiguous" and paged["bits_equal_baseline"] and paged["host_checked_us"] > 0
    text = bench.summarize(rows, {"backend": "triton_interpreter"})
    assert "NOT a hardware result" in text and "## decode" in text and "## Targets" not in text
    assert "## paged_decode (target <= 1.10x; baseline detkit_contiguous" in text


def test_validation_fails_a_wrong_result():
    case = bench.BenchCase("prefill", 1, 4, 4, 2, 1, 64)
    good = torch.zeros(1, 2, 4, 64)
    assert bench.validate(case, good, good)["validated"]
    assert not bench.validate(case, good + 0.1, good)["validated"]
    assert not bench.validate(case, good + float("nan"), good)["validated"]
    lines = bench.target_lines([{"mode": "decode", "ratio_graph": 1.5}, {"mode": "decode", "ratio_graph": 1.0},
                                {"mode": "paged_decode", "ratio_graph": 1.05}])
    assert lines == ["- decode: 1/2 cases <= 1.20x SDPA flash (graph time); worst 1.500x, median 1.250x: "
                     "missed by 25.0% at worst",
                     "- paged_decode: 1/1 cases <= 1.10x detkit's contiguous decode (graph time); worst 1.050x, "
                     "median 1.050x: met"]
    # A paged row validates on equal bits only: one ulp off fails it, though far below the tolerance.
    paged = bench.BenchCase("paged_decode", 2, 1, 40, 2, 1, 64, page_size=16)
    want = torch.ones(2, 2, 1, 64, dtype=torch.bfloat16)
    assert bench.validate(paged, want[:, :, 0], want)["validated"]
    off = want.clone()
    off.view(torch.int16)[0, 0, 0, 0] += 1
    row = bench.validate(paged, off[:, :, 0], want)
    assert not row["validated"] and not row["bits_equal_baseline"] and row["max_abs_diff_vs_sdpa"] < 2**-6


def test_variants_validate_against_their_named_baselines(device):
    if device.type != "cpu":
        pytest.skip("the CPU plumbing; the GPU run is tools/gpu/attention_variants.sh")
    gpu = bench.cases(_ctx("cuda_sm90"), variants="window,softcap,sinks")
    specs = {(c.variant, c.heads_q, c.heads_kv, c.head_dim, c.window, c.softcap, c.sinks, c.baseline) for c in gpu}
    assert specs == {("window", 32, 8, 128, 1024, None, False, "sdpa_mask"),
                     ("softcap", 16, 8, 256, 4096, 50.0, False, "torch_eager"),
                     ("sinks", 64, 8, 64, 128, None, True, "torch_eager")}
    assert len({c.name for c in gpu}) == len(gpu)
    with pytest.raises(ValueError, match="--variants 'foo' is not supported"):
        bench.cases(_ctx("cuda_sm90"), variants="foo")
    ctx = _ctx("triton_interpreter")
    rows = list(bench.run(ctx, bench.cases(ctx, modes="prefill,decode", quick=True, variants="window,softcap,sinks"),
                          rounds=1))
    assert len(rows) == 6
    for row in rows:
        assert row["passed"] and row["max_abs_diff_vs_sdpa"] <= bench.VALIDATION_ATOL, row
        assert row["baseline"] == ("sdpa_mask" if row["variant"] == "window" else "torch_eager")
    text = bench.summarize(rows, {"backend": "triton_interpreter"})
    assert "baseline torch_eager" in text and "baseline sdpa_mask" in text


@pytest.mark.parametrize("mode", ["prefill", "fwd_bwd"])
def test_against_torch_eager_the_fp64_oracle_decides_a_large_difference(mode):
    """Against the eager formulation (BF16 scores: itself off), a difference above the tolerance validates only
    when detkit's error against the FP64 oracle is no larger than the baseline's."""
    from detkit.kernels.attention.reference import attention_oracle

    case = bench.BenchCase(mode, 2, 8, 8, 2, 1, 64, variant="softcap", window=4, softcap=5.0)
    assert case.baseline == "torch_eager"
    inp = bench.make_inputs(case, torch.device("cpu"))[0]
    one = {k: t[:1].detach() for k, t in inp.items()}
    exact = attention_oracle(one["q"], one["k"], one["v"], window=4, softcap=5.0,
                             do=one.get("do"))["dq" if mode == "fwd_bwd" else "o"]
    accurate = exact.float().expand(2, *exact.shape[1:]).contiguous()
    off = accurate + 0.05
    row = bench.validate(case, accurate, off, inp)
    assert row["validated"] and row["max_abs_diff_vs_sdpa"] > bench.VALIDATION_ATOL
    assert row["max_abs_err_vs_fp64_detkit"] < 1e-6 < 0.04 < row["max_abs_err_vs_fp64_baseline"]
    row = bench.validate(case, off, accurate, inp)
    assert not row["validated"] and row["max_abs_err_vs_fp64_detkit"] > row["max_abs_err_vs_fp64_baseline"]
