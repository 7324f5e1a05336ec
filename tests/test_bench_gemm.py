"""bench/gemm.py as a bench plug-in (cases / run / summarize / plots): its option checks, the zoo's shapes derived
from the models' published configs, validation that can fail, the target arithmetic, and a tiny run end to end on
the interpreter (plumbing, not speed). On the GPU (DETKIT_TEST_DEVICE=cuda): host, eager and graph timings and the
cuBLASLt no-split-K worker at a small shape."""

import json
import math
import statistics
from pathlib import Path

import pytest
import torch

import detkit.bench.gemm as bench
from detkit.kernels.det_gemm.launch import LAUNCHERS
from detkit.toolkit.harness import RunContext
from detkit.toolkit.presets import GEMM_PRESETS, MODELS, ZOO_M_VALUES, ModelDims, model_layers, zoo_shapes
from tests.conftest import TEST_DEVICE

interpreter_only = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="runs the Triton interpreter (CI); the GPU "
                                      "host's numpy does not run it")

CPU = RunContext(device=torch.device("cpu"), backend="triton_interpreter", preset="tiny")
# cases() does no GPU work: a CUDA context object is enough to plan the zoo on any machine.
GPU = RunContext(device=torch.device("cuda"), backend="cuda_sm90", preset="qwen3-8b-tp2")


def _model(name: str) -> ModelDims:
    return next(m for m in MODELS if m.name == name)


# ---- the zoo: shapes from the models' configs ----------------------------------------------------------------
def test_model_layers_follow_megatron_and_vllm_sharding():
    # Hand-computed from config.json: Qwen3-8B hidden 4096, 32 heads x 128, 8 KV heads, intermediate 12288,
    # vocab 151936.
    assert model_layers(_model("Qwen3-8B"), 2) == [
        ("q", 4096, 2048), ("k", 4096, 512), ("v", 4096, 512), ("o", 2048, 4096),
        ("gate", 4096, 6144), ("up", 4096, 6144), ("down", 6144, 4096),
        ("lm_head", 4096, 75968), ("lm_head_full", 4096, 151936)]
    # Llama-3.1-70B at TP 8: 64 heads -> 8 per rank, 8 KV heads -> 1 per rank, vocab 128256 / 8.
    assert model_layers(_model("Llama-3.1-70B"), 8) == [
        ("q", 8192, 1024), ("k", 8192, 128), ("v", 8192, 128), ("o", 1024, 8192),
        ("gate", 8192, 3584), ("up", 8192, 3584), ("down", 3584, 8192),
        ("lm_head", 8192, 16032), ("lm_head_full", 8192, 128256)]
    # Qwen3-30B-A3B: the attention projections only (hidden 2048, 32 heads, 4 KV heads).
    assert model_layers(_model("Qwen3-30B-A3B"), 1) == [("q", 2048, 4096), ("k", 2048, 512), ("v", 2048, 512),
                                                          ("o", 4096, 2048)]
    # Fewer KV heads than ranks: each rank keeps one (replicated).
    assert ("k", 4096, 128) in model_layers(ModelDims("x", 4096, None, 32, 4, 128, None, (8,)), 8)
    with pytest.raises(ValueError, match="Qwen3-8B does not split evenly over TP=3"):
        model_layers(_model("Qwen3-8B"), 3)


def test_zoo_covers_every_layer_once_per_shape_with_narrow_outputs_and_lm_heads():
    shapes = zoo_shapes()
    kn = [(s.k, s.n) for s in shapes]
    assert len(kn) == len(set(kn)) == 36
    expected_layers = sum(len(model_layers(m, tp)) for m in MODELS for tp in m.tps)
    assert sum(len(s.layers) for s in shapes) == expected_layers
    by_kn = {(s.k, s.n): s for s in shapes}
    assert "Qwen3-8B tp1 lm_head" in by_kn[(4096, 151936)].layers
    assert "Qwen3-32B tp8 lm_head_full" in by_kn[(5120, 151936)].layers
    assert "Llama-3.1-70B tp8 lm_head_full" in by_kn[(8192, 128256)].layers
    assert by_kn[(4096, 1024)].layers == ("Qwen3-8B tp1 k", "Qwen3-8B tp1 v", "Qwen3-8B tp4 q")
    # N <= 1024: (K, N) = (4096, 1024), (4096, 512), (4096, 256), (4096, 128), (5120, 1024), (5120, 128),
    # (8192, 1024), (8192, 128), (2048, 512)
    assert sorted((s.k, s.n) for s in shapes if s.narrow) == sorted([
        (4096, 1024), (4096, 512), (4096, 256), (4096, 128), (5120, 1024), (5120, 128), (8192, 1024), (8192, 128),
        (2048, 512)])
    assert GEMM_PRESETS["zoo"].kn_shapes == tuple(kn) and GEMM_PRESETS["zoo"].layouts == ("linear",)
    assert ZOO_M_VALUES[0] == 1 and ZOO_M_VALUES[-1] == 16384


# ---- cases: every option checked before any work -----------------------------------------------------------
def test_cases_default_to_the_qwen3_8b_tp2_mlp_shapes_and_tiny_ones_on_the_interpreter():
    gpu = bench.cases(GPU)
    assert {(c.k, c.n) for c in gpu} == {(4096, 6144), (6144, 4096)}
    assert {c.m for c in gpu} == set(bench.M_VALUES) and {c.layout for c in gpu if c.op == "db"} == {"kn"}
    assert len(gpu) == 2 * len(bench.M_VALUES) * (2 + 2 + 1)
    cpu = bench.cases(CPU, ops=("fwd",), m_values=(1, 7), layouts=("linear",))
    assert [c.name for c in cpu] == ["det_gemm_fwd [M=1, N=56, K=40] bf16 b=linear",
                                     "det_gemm_fwd [M=7, N=56, K=40] bf16 b=linear"]
    one = bench.cases(GPU, ops=("da",), m_values=(8,), kn_shapes=("512,128",))
    assert [(c.k, c.n) for c in one] == [(512, 128)] * 2


def test_zoo_cases_take_linear_weights_every_m_and_a_layer_filter():
    zoo = bench.cases(GPU, zoo=True)
    assert len(zoo) == 36 * 3 * len(ZOO_M_VALUES)
    assert {c.layout for c in zoo} == {"linear", "kn"} and {c.layout for c in zoo if c.op != "db"} == {"linear"}
    tp2 = bench.cases(GPU, zoo=True, layers=("Qwen3-8B tp2",), m_values=(1, 4096), ops=("fwd",))
    assert {(c.k, c.n) for c in tp2} == {(4096, 2048), (4096, 512), (2048, 4096), (4096, 6144), (6144, 4096),
                                        (4096, 75968), (4096, 151936)}
    assert all(c.layers for c in tp2)


@pytest.mark.parametrize("options,message", [
    ({"ops": ("dx",)}, r"--ops \('dx',\) not supported; supported: \('fwd', 'da', 'db'\)"),
    ({"m_values": (0,)}, r"--m \[0\]: M values must be integers in \[1, 2\*\*30\)"),
    ({"layouts": ("nk",)}, r"--layouts \('nk',\) not supported"),
    ({"kn_shapes": ("4096x6144",)}, r"--kn '4096x6144' is not K,N \(two integers\)"),
    ({"kn_shapes": ("0,8",)}, r"--kn '0,8': K and N must be in \[1, 2\*\*30\)"),
    ({"timings": ("wall",)}, r"--timings \['wall'\] not supported"),
    ({"layers": ("Qwen3-8B",)}, r"--layers selects zoo shapes: add --zoo"),
    ({"zoo": True, "kn_shapes": ("8,8",)}, r"--kn and --zoo both choose the shapes: pass one"),
    ({"zoo": True, "layers": ("GPT-5",)}, r"--layers \('GPT-5',\) matches no zoo layer"),
])
def test_cases_refuse_bad_options_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        bench.cases(GPU, **options)


def test_zoo_is_refused_on_the_interpreter():
    with pytest.raises(ValueError, match=r"--zoo needs cuda_sm90"):
        bench.cases(CPU, zoo=True)


def test_option_defaults():
    assert bench.resolve_options() == (("host", "eager", "graph"), True)
    assert bench.resolve_options(zoo=True) == (("graph",), False)
    assert bench.resolve_options(zoo=True, timings=("host", "graph"), nosplitk=True) == (("host", "graph"), True)


# ---- validation can fail; the target arithmetic ----------------------------------------------------------
@pytest.mark.parametrize("op", ["fwd", "da", "db"])
def test_validation_passes_the_kernel_and_fails_a_wrong_element(op, device, monkeypatch):
    case = bench.BenchCase(op, 37, 40, 56, "linear")
    x, y, _ = bench.operands(case, device)
    c = LAUNCHERS[op](x, y)[0]
    # Blocks of 16 output rows/columns: the oracle in many pieces gives the whole-output verdict.
    monkeypatch.setattr(bench, "ORACLE_ELEMENTS", 16)
    passed, worst = bench.validate(op, x, y, c)
    assert passed and 0 < worst <= 1
    bad = c.clone()
    bad[-1, -1] = bad[-1, -1] * 2 + 1  # far outside the bound of one element
    assert bench.validate(op, x, y, bad)[0] is False


def _row(op, m, ratio, **extra):
    return {"name": f"{op} {m}", "passed": True, "op": op, "M": m, "N": 6144, "K": 4096, "layout": "linear",
            "ratio_graph": ratio, **extra}


def test_target_summary_takes_medians_over_m_and_the_worst_row():
    rows = [_row("fwd", m, r) for m, r in ((1, 1.3), (16, 1.2), (128, 1.1), (256, 1.0), (1024, 1.06),
                                             (4096, 1.04), (16384, 1.0))]
    (s,) = bench.target_summary(rows)
    assert s["median_M<=256"] == statistics.median([1.3, 1.2, 1.1, 1.0]) == 1.15
    assert s["median_M>=1024"] == 1.04 and s["worst"] == 1.3 and s["worst_M"] == 1 and s["met"] is True
    rows[-1]["ratio_graph"] = 1.2  # the median over M >= 1024 becomes 1.06 > 1.05
    assert bench.target_summary(rows)[0]["met"] is False
    rows[-1]["ratio_graph"] = 1.0
    rows[0]["ratio_graph"] = 1.6  # no row may exceed 1.5, whatever the medians
    assert bench.target_summary(rows)[0]["met"] is False


def test_per_row_targets_and_the_summary_text():
    rows = [_row("fwd", 1, 1.0, ratio_host=1.1, ratio_eager=1.05), _row("fwd", 2, 1.0, ratio_host=1.3, ratio_eager=1.2)]
    host = bench.per_row_summary(rows, "host", 1.2)
    assert (host["met"], host["rows"], host["worst"], host["worst_row"]) == (1, 2, 1.3, "fwd 2")
    text = bench.summarize(rows, {})
    assert "- host <= 1.2 on every row: NOT met (within the target on 1 of 2 rows; worst 1.300, fwd 2)" in text
    assert "- eager <= 1.1 on every row: NOT met" in text
    assert "Validation (contract bound of the FP64 oracle, before timing): 2 of 2 rows passed" in text


def test_replays_and_bursts_scale_with_the_case():
    big, small = bench.BenchCase("fwd", 16384, 151936, 4096, "linear"), bench.BenchCase("fwd", 1, 128, 512, "linear")
    assert bench.graph_replays(bench.BenchCase("fwd", 1, 1024, 4096, "linear"), 16) >= 3
    assert bench.graph_replays(big, 1) == 3 and bench.graph_replays(small, 1) == 10
    # An lm_head call at M=16384 is ~30 ms of GPU work: two calls a burst; a tiny one: the most.
    assert bench.burst_calls(big, 16) == 2 and bench.burst_calls(small, 16) == 16


# ---- a tiny run end to end -------------------------------------------------------------------------------------
@interpreter_only
def test_run_yields_validated_rows_with_every_timing_and_a_report(tmp_path):
    selected = bench.cases(CPU, ops=("fwd", "db"), m_values=(7,), layouts=("linear",))
    rows = list(bench.run(CPU, selected, rounds=1))
    assert [r["name"] for r in rows] == [c.name for c in selected]
    for r in rows:
        assert r["passed"] and r["contract_passed"] and r["backend"] == "triton_interpreter"
        for impl in ("detkit", "cublas"):
            for timing in ("_host", "_eager", ""):
                assert r[f"{impl}{timing}_median_us"] > 0
        assert math.isclose(r["ratio_host"], r["detkit_host_median_us"] / r["cublas_host_median_us"])
        assert r["ratio_vs_cublas"] == r["ratio_graph"] and "ratio_vs_cublaslt_nosplitk" not in r
    text = bench.summarize(rows, {"backend": "triton_interpreter"})
    assert text.startswith("Interpreter run: every timing is CPU emulation, not a hardware result.")
    assert "## Host time per call (us)" in text and "## GPU time per call" in text
    paths = bench.plots(tmp_path, rows)
    assert [p.name for p in paths] == ["gemm_tflops.png"] and paths[0].stat().st_size > 0


@interpreter_only
def test_detkit_bench_gemm_writes_rows_report_and_plots(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "detkit", "bench", "gemm", "--device", "cpu", "--out", str(out),
                           "--ops", "da", "--m", "1", "--layouts", "kn", "--timings", "graph", "--rounds", "1"],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert [r["name"] for r in rows] == ["det_gemm_da [M=1, N=56, K=40] bf16 b=kn"] and rows[0]["passed"]
    report = json.loads((out / "report.json").read_text())
    assert report["rows"] == rows and report["meta"]["backend"] == "triton_interpreter"
    assert "GPU time (graph replay)" in (out / "report.md").read_text()


# ---- on the GPU --------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_run_times_host_eager_graph_and_the_nosplitk_worker():
    ctx = RunContext(device=torch.device("cuda"), backend="cuda_sm90", preset="qwen3-8b-tp2")
    selected = bench.cases(ctx, ops=("fwd", "da", "db"), m_values=(16,), kn_shapes=("1024,512",),
                           layouts=("linear",))
    rows = list(bench.run(ctx, selected, rounds=2))
    assert len(rows) == 3
    for r in rows:
        assert r["passed"] and r["backend"] == "cuda_sm90" and r["rotation_sets"] == bench.MAX_SETS
        # Host time is Python time: microseconds, far below a millisecond; eager includes it.
        assert 0 < r["detkit_host_median_us"] < 1000 and 0 < r["cublas_host_median_us"] < 1000
        assert r["detkit_eager_median_us"] >= 0.5 * r["detkit_median_us"] > 0
        assert r["cublaslt_nosplitk_median_us"] > 0 and r["ratio_vs_cublaslt_nosplitk"] > 0
        assert r["measured_ceiling_tflops"] > 100


# ---- the GPU-run tools: candidate sweep and parallel warm-up ----------------------------------------------------
def test_candidate_configs_parse_and_refuse_by_name():
    from detkit.kernels.det_gemm.launch import GemmConfig
    from tools.gemm_candidates import parse_config

    assert parse_config("64,16,128,1,4,6,tma") == GemmConfig(64, 16, 128, 1, 4, 6, "tma")
    assert parse_config("16,16,128,1,4,6") == GemmConfig(16, 16, 128, 1, 4, 6)
    with pytest.raises(ValueError, match=r"--config '16,16': expected BM,BN,BK,GROUP_M,warps,stages\[,variant\]"):
        parse_config("16,16")
    with pytest.raises(ValueError, match="GemmConfig.variant 'wgmma' is not supported"):
        parse_config("64,64,64,1,4,3,wgmma")


@interpreter_only
def test_candidate_sweep_times_every_candidate_and_records_refusals():
    from detkit.kernels.det_gemm.launch import GemmConfig
    from tools.gemm_candidates import summary, sweep

    configs = [GemmConfig(16, 32, 32, 1, 4, 2), GemmConfig(16, 16, 64, 1, 4, 2, "tma"),
               GemmConfig(64, 64, 64, 1, 4, 2, "ws")]  # ws: no interpreter path, refused by name
    rows = list(sweep(["fwd"], [(40, 56)], [7], configs, rounds=1, device=torch.device("cpu")))
    timed = [r for r in rows if "median_us" in r]
    assert [r["is_table"] for r in timed].count(True) == 1 and len(timed) == 3
    assert all(r["bits_equal_table"] for r in timed if not r["is_table"])
    (refused,) = [r for r in rows if "error" in r]
    assert refused["config"] == configs[2].label() and "has no 'triton_interpreter' path" in refused["error"]
    text = summary(rows)
    assert "| fwd  |  40 |  56 |   7 |" in text and "geomean_vs_table" in text


def test_warm_specs_follow_the_table_and_the_size_classes():
    import tools.gemm_warm as warm
    from detkit.kernels.det_gemm.launch import select_config

    assert [warm.size_class(v) for v in (1, 7, 16, 4096, 151936, 1000, 3000)] == [1, 7, 16, 16, 16, 24, 24]
    specs = warm.bench_specs(("fwd", "db"), [(4096, 151936)], (1, 16, 16384), ("linear",))
    ops_configs = {(s[0], s[1], s[5]) for s in specs}
    assert len(specs) == 6  # fwd and dB at three M classes, one pick each
    pick = select_config("fwd", 16384)
    assert ("fwd", 16, json.dumps(pick.__dict__)) in ops_configs and pick.variant == "ws"
    # An audit preset: its M values, the padded and zero-row batches, and every config at the cross-config rows.
    from detkit.kernels.det_gemm.launch import all_configs

    zoo = warm.preset_specs("zoo")
    assert {json.dumps(c.__dict__) for c in all_configs("fwd")} <= {s[5] for s in zoo if s[0] == "fwd"}


def test_summary_reports_the_nosplitk_worker_rows_without_graph_timing():
    rows = [{"name": "da 7", "passed": True, "op": "da", "M": 7, "N": 56, "K": 40, "layout": "linear",
             "ratio_host": 1.0, "detkit_median_us_worker": 11.0, "cublaslt_nosplitk_median_us": 10.0,
             "ratio_vs_cublaslt_nosplitk": 1.1}]
    text = bench.summarize(rows, {})
    assert "worst 1.100 (da 7); median 1.100" in text
    assert "## GPU time against cuBLASLt without split-K" in text


@pytest.mark.parametrize("op,bad", [("fwd", (-1, 3)), ("da", (-1, 5)), ("db", (4, -1))])
def test_validation_of_a_large_output_checks_its_first_and_last_rows_or_columns(op, bad, device, monkeypatch):
    case = bench.BenchCase(op, 37, 40, 56, "linear")
    x, y, _ = bench.operands(case, device)
    c = LAUNCHERS[op](x, y)[0]
    monkeypatch.setattr(bench, "VALIDATE_MAX_ELEMENTS", 4 * 40)  # two rows (columns) at each end
    assert bench._spans(37, 40, 160) == [(0, 2), (35, 37)]
    assert bench.validate(op, x, y, c)[0]
    wrong = c.clone()
    wrong[bad] = wrong[bad] * 2 + 1  # the last row (fwd, dA) or column (dB): inside the checked part
    assert bench.validate(op, x, y, wrong)[0] is False
    hidden = c.clone()
    hidden[10, 3] = hidden[10, 3] * 2 + 1  # outside the checked part: not seen
    assert bench.validate(op, x, y, hidden)[0] is True


def test_derive_counts_the_targets_for_the_report_meta():
    rows = [_row("fwd", m, r, ratio_host=h) for m, r, h in ((1, 1.0, 1.1), (4096, 1.2, 1.3))]
    derived = bench.derive(rows, {})
    assert derived["graph"] == {"groups": 1, "met": 0, "not_met": ["fwd K=4096 N=6144 linear"]}
    assert derived["host"]["met"] == 1 and derived["eager"] is None and derived["validated"] == 2
    assert bench.default_rounds(True) == 1 and bench.default_rounds(False) == 5
