"""kernels/moe/fp8/choice.py: which layer a shape asked to run in FP8 gets, against the measurements it was fitted on
(the H200 sweep and presets of reports/2026-12-03-h200-s24, call 1, through tools/fp8_choice_fit.py): never FP8 at a
shape where FP8 was below 1.0x at some T >= 2048, FP8 at the shapes where it never was; no T in the rule; refusals.
No kernel runs (pure host code)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from detkit.kernels.moe.fp8 import choice
from detkit.kernels.moe.fp8.choice import FP8_FASTER_SHAPES, MeasuredShape, fp8_choice

import tools.fp8_choice_fit as fit

ROOT = Path(__file__).resolve().parent.parent
S24 = ROOT / "reports" / "2026-12-03-h200-s24" / "call1"
REPORTS = [S24 / "sweep-3072" / "report.json", S24 / "sweep-2048" / "report.json", S24 / "bench" / "report.json"]
SM90, INTERP = "cuda_sm90", "triton_interpreter"


@pytest.fixture(scope="module")
def measured():
    """(backend, wgrad, H, I, E, K) -> ShapeData of the s24 reports (the evidence docs/moe_fp8.md cites)."""
    return fit.collect(fit.load_rows(REPORTS))


@pytest.mark.parametrize("shape, layer", [
    ((3072, 1536, 8, 8), "fp8"),  # the reference shape: 1.089-1.321x
    ((3072, 1536, 8, 4), "fp8"),  # the smallest shape measured faster at every T: 1.008x at T=2048 eager
    ((3072, 1536, 128, 2), "bf16"),  # 0.66-0.92x
    ((2048, 768, 128, 8), "bf16"),  # Qwen3-30B-A3B widths: 0.71-1.10x, and 0.85-0.92x as a preset
    ((2048, 768, 8, 8), "bf16"),  # narrow: 0.708x at T=2048 eager
    ((3072, 1536, 32, 8), "bf16"),  # 512 rows per expert at T=2048: 0.898x as a graph
    ((4096, 14336, 8, 2), "bf16"),  # Mixtral-8x7B: 1.28-1.30x at T=8192, T=2048 not measured (K/E 1/4)
    ((4096, 1536, 128, 8), "bf16"),  # Qwen3-235B-A22B: K/E 1/16
    ((4096, 14336, 8, 4), "fp8"),  # unmeasured, at least as favourable as 3072x1536, E=8, K=4 in all three
    ((3072, 1536, 4, 2), "bf16"),  # unmeasured: K/E as measured, but K*H*I half of it
])
@pytest.mark.parametrize("backend", [SM90, INTERP])
def test_the_rule_at_measured_and_nearby_shapes(shape, layer, backend):
    got = fp8_choice(*shape, backend)
    assert got.layer == layer, got.reason
    assert "\n" not in got.reason


def test_a_shape_given_to_bf16_says_which_bounds_it_misses():
    assert fp8_choice(2048, 768, 128, 8, SM90).reason == (
        "K/E 8/128 < 4/8, H*I 2048*768 < 3072*1536, K*H*I 8*2048*768 < 4*3072*1536 (FP8 is faster at every "
        "T >= 2048 from H=3072, I=1536, E=8, K=4)")
    assert fp8_choice(3072, 1536, 8, 8, SM90).reason == (
        "at least as favourable as H=3072, I=1536, E=8, K=4 (FP8 faster at every T >= 2048; worst 1.008x at "
        "T=2048 eager)")
    # BF16 weight gradients inside the FP8 layer were never swept: BF16 everywhere, said so
    got = fp8_choice(3072, 1536, 8, 8, SM90, wgrad="bf16")
    assert got.layer == "bf16" and got.reason == "FP8 with wgrad='bf16' was not measured faster on cuda_sm90 at any shape"


def test_the_rule_takes_no_t():
    """No parameter for T, the routing or a timing: the choice is a function of (H, I, E, K), backend, wgrad."""
    assert list(inspect.signature(choice.fp8_choice.__wrapped__).parameters) == [
        "hidden", "inter", "experts", "top_k", "backend", "wgrad"]


def test_the_pinned_table_is_the_fit_of_the_s24_measurements(measured):
    """Every measured shape: the pick is never fp8 where FP8 was below 1.0x at some T >= 2048 (UNSAFE), and is fp8
    wherever FP8 held >= 1.0x at every T from 2048 (so the table is not more conservative than its data); the fitted
    minimal shapes are the pinned ones; no measured bf16 shape is at least as favourable as an fp8 one."""
    rows = fit.rows_of(measured)
    assert len(rows) == 27  # 24 sweep shapes + 3 presets off the sweep (Mixtral, Qwen3-235B-A22B, OLMoE)
    assert [r for r in rows if r["check"] != "ok"] == []
    verdicts = {(r["H"], r["I"], r["E"], r["K"]): r["verdict"] for r in rows}
    assert sorted(k for k, v in verdicts.items() if v == "fp8") == [(3072, 1536, 8, 4), (3072, 1536, 8, 8)]
    assert sorted(k for k, v in verdicts.items() if v == "undecided") == [
        (2048, 1024, 64, 8), (4096, 1536, 128, 8), (4096, 14336, 8, 2)]  # presets timed at T=8192 only
    table, conflicts = fit.fit(measured)
    assert conflicts == [] and fit.pinned_differences(table) == []
    pinned = FP8_FASTER_SHAPES[(SM90, "fp8")]
    assert [(m.hidden, m.inter, m.experts, m.top_k, m.worst, m.worst_at) for m in pinned] == [
        (m.hidden, m.inter, m.experts, m.top_k, m.worst, m.worst_at) for m in table[(SM90, "fp8")]]
    assert FP8_FASTER_SHAPES[(INTERP, "fp8")] == pinned  # CI runs the choice a GPU makes


def test_the_fit_marks_a_slow_point_a_missing_t_and_a_conflict():
    """Synthetic rows: one point below 1.0x makes a shape bf16; no T=2048 row leaves it undecided; a bf16 shape at
    least as favourable as an fp8 one is a conflict; an fp8 pick on a bf16 verdict is UNSAFE."""
    def rows(h, i, e, k, ratios):
        return [("synthetic", {"impl": "fp8", "measure": "fwd_bwd", "timing": timing, "hardware_result": True,
                               "T": t, "H": h, "I": i, "E": e, "K": k, "backend": SM90, "default_wgrad": "fp8",
                               "passed": True, "validated": True, "speedup_vs_bf16": r})
                for (t, timing), r in ratios.items()]
    both = {(2048, "eager"): 1.1, (2048, "graph"): 1.2, (8192, "eager"): 1.3, (8192, "graph"): 1.3}
    shapes = fit.collect(rows(3072, 1536, 8, 8, both) + rows(3072, 1536, 8, 2, {**both, (8192, "graph"): 0.99})
                         + rows(2048, 768, 8, 8, {(8192, "eager"): 1.5, (8192, "graph"): 1.5})
                         + rows(4096, 4096, 8, 8, {**both, (2048, "eager"): 0.9}))
    verdict = {key[2:]: d.verdict() for key, d in shapes.items()}
    assert verdict == {(3072, 1536, 8, 8): "fp8", (3072, 1536, 8, 2): "bf16", (2048, 768, 8, 8): "undecided",
                       (4096, 4096, 8, 8): "bf16"}
    table, conflicts = fit.fit(shapes)
    assert [m.label() for m in table[(SM90, "fp8")]] == ["H=3072, I=1536, E=8, K=8"]
    assert conflicts == [f"{(SM90, 'fp8')}: H=4096, I=4096, E=8, K=8 is bf16 but at least as favourable as the fp8 "
                         "shape H=3072, I=1536, E=8, K=8"]
    checks = {(r["H"], r["I"], r["E"], r["K"]): r["check"] for r in fit.rows_of(shapes)}
    assert checks[(4096, 4096, 8, 8)] == "UNSAFE"  # the pinned table gives it FP8; this data says it is slower
    assert checks[(3072, 1536, 8, 2)] == "ok"


def test_dominance_is_exact_at_the_bounds():
    m = MeasuredShape(3072, 1536, 8, 4, 1.0, "T=2048 eager", "test")
    assert m.dominated_by(3072, 1536, 8, 4) == []
    assert m.dominated_by(3072, 1536, 16, 8) == []  # K/E 8/16 == 4/8
    assert m.dominated_by(1536, 3072, 8, 4) == []  # H*I equal
    assert m.dominated_by(3072, 1536, 17, 8) == ["K/E 8/17 < 4/8"]
    assert m.dominated_by(3072, 1535, 8, 4) == ["H*I 3072*1535 < 3072*1536", "K*H*I 4*3072*1535 < 4*3072*1536"]


@pytest.mark.parametrize("args, exc, message", [
    ((0, 1536, 8, 8, SM90), ValueError, "hidden must be >= 1; got 0"),
    ((3072, 1536, 8, True, SM90), TypeError, "top_k must be an int; got bool"),
    ((3072, 1536.0, 8, 8, SM90), TypeError, "inter must be an int; got float"),
    ((3072, 1536, 8, 8, "cuda_sm80"), ValueError,
     "backend 'cuda_sm80' is not supported; supported: 'cuda_sm90', 'triton_interpreter'"),
    ((3072, 1536, 8, 8, SM90, "fp16"), ValueError, "wgrad 'fp16' is not supported"),
])
def test_bad_arguments_are_refused_by_name(args, exc, message):
    with pytest.raises(exc, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        fp8_choice(*args)
    assert "\n" not in str(info.value)


def test_the_fit_tool_exits_zero_on_the_s24_reports(capsys):
    assert fit.main([str(p) for p in REPORTS]) == 0
    out = capsys.readouterr().out
    assert "('cuda_sm90', 'fp8'): FP8 from H=3072, I=1536, E=8, K=4 (worst 1.008x at T=2048 eager)" in out
    assert "pinned table: matches the fit" in out


def test_bench_rows_say_which_layer_the_rule_picks():
    """bench/moe: an FP8 row carries rule_picks / rule_reason for its shape and weight gradients (fp8_wgrad_bf16:
    "bf16"); the sweep's per-shape summary and both report tables have the column."""
    from detkit.bench import moe, moe_fp8

    ref, qwen = moe.sweep_point(3072, 1536, 8, 8, 2048), moe.sweep_point(2048, 768, 128, 8, 16384)
    assert moe_fp8.rule_fields(ref, SM90, "fp8") == {"rule_picks": "fp8",
                                                    "rule_reason": fp8_choice(3072, 1536, 8, 8, SM90).reason}
    assert moe_fp8.rule_fields(ref, SM90, "fp8_warm")["rule_picks"] == "fp8"
    assert moe_fp8.rule_fields(ref, SM90, "fp8_wgrad_bf16")["rule_picks"] == "bf16"
    assert moe_fp8.rule_fields(qwen, INTERP, "fp8")["rule_picks"] == "bf16"

    def row(p, impl, timing, median):
        r = {"sweep": True, "measure": "fwd_bwd", "impl": impl, "timing": timing, "T": p.t, "H": p.h, "I": p.i,
             "E": p.e, "K": p.k, "validated": True, "passed": True, "median_us": median, "name": f"{p.name} {impl}"}
        if impl == "fp8":
            r.update(moe_fp8.rule_fields(p, SM90, impl), bf16_median_us=100.0, speedup_vs_bf16=100.0 / median)
        return r
    rows = [row(p, impl, timing, 100.0 if impl == "bf16" else median) for p, median in ((ref, 90.0), (qwen, 120.0))
            for timing in moe.TIMINGS for impl in ("bf16", "fp8")]
    summary = {(s["H"], s["timing"]): s["rule_picks"] for s in moe.sweep_summary(rows)}
    assert summary == {(3072, "eager"): "fp8", (3072, "graph"): "fp8", (2048, "eager"): "bf16",
                       (2048, "graph"): "bf16"}
    md = moe.summarize(rows, {"hardware_result": False})
    sweep_table, crossover_table = md.split("## Sweep")[1].split("### Crossover")
    for table in (sweep_table, crossover_table):
        lines = [[c.strip() for c in line.split("|")] for line in table.splitlines() if line.startswith("| ")]
        header, body = lines[0], lines[1:]
        picks = {(r[header.index("H")], r[header.index("rule_picks")]) for r in body}
        assert picks == {("3072", "fp8"), ("2048", "bf16")}
