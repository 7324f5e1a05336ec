"""bench/model.py, ``detkit bench model``, with a tiny Qwen3 (one layer) at tiny sizes: its cases follow the model and
refuse bad input before any work, a run through the CLI writes the model speed rows the claims generator reads, each
mode's time is its own calls' time, and a row fails when its detkit-mode calls ran off detkit's kernels or its step
could not be captured. On the CPU (the interpreter, CUDA graphs stood in for) this is plumbing, not speed; with
DETKIT_TEST_DEVICE=cuda the same tests capture real graphs and time with CUDA events."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("transformers", reason="transformers is the optional extra detkit[models]")

from detkit.bench import model as bench  # noqa: E402
from detkit.mode import state as mode_state  # noqa: E402
from detkit.toolkit import benches, models  # noqa: E402
from detkit.toolkit.harness import RunContext  # noqa: E402
from tests.bench_helpers import one_process, read_rows  # noqa: E402
from tests.conftest import backend_of  # noqa: E402
from tools import claims  # noqa: E402

ONE_LAYER = dict(models.QWEN3_TINY, num_hidden_layers=1)
# Tiny sizes on either device: prefill 1 x 4 tokens, decode at batch 2 on a 4-token cache, one sample a round.
SMALL_PLAN = bench.SpeedPlan((1, 4), (2, 4), (1, 4), reps=1, train_reps=1, graph_replays=1, generate=(2, 3, 2))


@pytest.fixture
def small_plan(monkeypatch):
    monkeypatch.setattr(bench, "CPU_PLAN", SMALL_PLAN)
    monkeypatch.setattr(bench, "CUDA_PLAN", SMALL_PLAN)
    return SMALL_PLAN


def context(device: torch.device, **kwargs) -> RunContext:
    return RunContext(device=device, backend=backend_of(device), preset="default", seed=3, **kwargs)


@pytest.fixture
def tiny_config(tmp_path, monkeypatch):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"model_type": "qwen3", **ONE_LAYER}))
    monkeypatch.setenv(models.CONFIG_ENV, str(path))
    return path


def tiny_bench(device: torch.device, rounds: int = 1) -> bench.ModelBench:
    ctx = context(device, rounds=rounds)
    model, description = models.build_model(ctx.device, ctx.seed)
    return bench.ModelBench(ctx, model, description, "bf16", "quantize")


def test_cases_follow_the_model_and_bad_input_is_refused_before_any_work(device, tiny_config, monkeypatch):
    def build_model(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(models, "build_model", build_model)
    ctx = context(device)
    assert bench.cases(ctx) == list(bench.MODEL_CASES)
    # A MoE config adds its block cases; --preset names the model over DETKIT_MODEL_CONFIG.
    moe = context(device, presets=("qwen3-moe-tiny",))
    assert bench.cases(moe) == [*bench.MODEL_CASES, *bench.BLOCK_CASES]
    with pytest.raises(ValueError, match=r"^bench model times one model; got --preset \['qwen3-tiny', "
                                         r"'qwen3-moe-tiny'\]$"):
        bench.cases(context(device, presets=("qwen3-tiny", "qwen3-moe-tiny")))
    with pytest.raises(ValueError, match=r"^layers 0 is not supported; supported: an int >= 1$"):
        bench.cases(ctx, layers=0)
    monkeypatch.setenv(models.EXPERTS_ENV, "fp4")
    with pytest.raises(ValueError, match=f"^{models.EXPERTS_ENV}='fp4' is not supported; supported: bf16, fp8$"):
        bench.cases(ctx)


def test_layers_repeat_the_presets_layer_pattern(device):
    """--layers 5 on Gemma-2's 2-layer preset (sliding, full): the pattern repeated, not re-chosen."""
    config, weights, description = models.model_source(device, "gemma2-tiny", layers=5)
    assert weights is None and config.num_hidden_layers == 5 and description.endswith(", 5 layers")
    pattern = models.MODEL_PRESETS["gemma2-tiny"].fields["layer_types"]
    assert config.layer_types == [pattern[i % len(pattern)] for i in range(5)]
    assert config.layer_types != [pattern[0]] * 5
    plain, _, _ = models.model_source(device, "qwen3-tiny", layers=3)
    assert plain.num_hidden_layers == 3


def test_decode_points_are_checked_before_any_work(device, tiny_config, small_plan, monkeypatch):
    """--decode-at: the decode cases once per point in the order given, the plan's point under the plain names the
    claims read; a malformed or repeated point, and one whose cache and timed steps pass the model's 512 positions,
    refused by name before any model is built."""
    def build_model(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(models, "build_model", build_model)
    ctx = context(device)
    assert bench.cases(ctx, decode_at=("1x12", "2x4")) == [
        "prefill", "decode_eager 1x12", "decode_eager", "decode_cuda_graph 1x12", "decode_cuda_graph",
        "forward_backward", "generate"]
    for bad in ("0x12", "1x0", "8", "8x", "x8", "-1x8", "1X8", "1x8x2"):
        with pytest.raises(ValueError, match=rf"^--decode-at '{bad}' is not supported; supported: BxL, batch B >= 1 "
                                             rf"and cache length L >= 1, e.g. 8x32768$"):
            bench.cases(ctx, decode_at=("1x12", bad))
    with pytest.raises(ValueError, match=r"^--decode-at 1x12 is given twice; supported: each point once$"):
        bench.cases(ctx, decode_at=("1x12", "2x20", "1x12"))
    # One round of one sample: a warm-up step and a timed one on each cache, so L <= 512 - 2.
    assert bench.decode_calls(small_plan, 1) == 2
    assert "decode_eager 1x510" in bench.cases(ctx, decode_at=("1x510",))
    with pytest.raises(ValueError, match=r"^--decode-at 1x511: a 511-token cache and the 2 decode steps timed on it "
                                         r"pass the model's max_position_embeddings 512; supported: L <= 510$"):
        bench.cases(ctx, decode_at=("1x511",))
    with pytest.raises(ValueError, match=r"the 4 decode steps .* supported: L <= 508$"):  # 3 rounds: 4 steps
        bench.cases(context(device, rounds=3), decode_at=("1x509",))


def test_a_run_at_decode_points_has_a_row_per_point(device, tiny_config, small_plan):
    """--decode-at 1x12 --decode-at 2x20, the plug-in's decode rows (the other cases run as without the option): each
    decode case timed at each point in both modes on detkit's kernels, its row naming the point and carrying its
    batch and cache length, and the report's table and derived ratios telling the points apart."""
    ctx, decode_at = context(device), ("1x12", "2x20")
    labels = [label for label in bench.cases(ctx, decode_at=decode_at) if label.startswith("decode_")]
    rows = list(bench.run(ctx, labels, decode_at=decode_at))
    points = [(1, 12), (2, 20)]
    assert [r["name"] for r in rows] == [f"speed {case} {b}x{n} detkit / default"
                                         for case in bench.DECODE_CASES for b, n in points]
    assert [(r["case"], r["batch"], r["tokens"], r["cache_len"]) for r in rows] == [
        (case, b, b, n) for case in bench.DECODE_CASES for b, n in points]
    assert [r["timing"] for r in rows] == ["eager", "eager", "graph", "graph"]
    for r in rows:
        assert r["passed"] and r["default_ms"] > 0 and r["detkit_ms"] > 0, r
        assert r["target"] == bench.TARGETS[r["case"]] and r["detkit_mode_routing"] == {"gemm_not_routed": {}}
    assert list(bench.derive(rows, {})["ratios"]) == ["decode_eager 1x12", "decode_eager 2x20",
                                                      "decode_cuda_graph 1x12", "decode_cuda_graph 2x20"]
    assert "| decode_cuda_graph 2x20 |" in bench.summarize(rows, {})


@pytest.mark.parametrize("spec", ["qwen3-tiny", "gemma3-tiny", "deepseek-v3-tiny"])
def test_a_filled_cache_is_a_prefilled_caches_state(device, spec):
    """The decode cases' cache (seeded random K/V through the cache's update) against a real 9-token prefill's at
    batch 2 (Qwen3; Gemma-3's sliding and global layers; DeepSeek-V3's MLA): per layer the same layer type, key and
    value shapes (a window-4 layer keeps its last 3 keys) and dtype, the same positions seen per layer and next
    position; the same values for either mode; a decode step on it runs, the full layers gaining a key, the sliding
    ones keeping their window's."""
    from transformers import DynamicCache

    model, description = models.build_model(device, seed=1, spec=spec, layers=2)
    b = bench.ModelBench(context(device), model, description, "bf16", "quantize")
    real = DynamicCache(config=model.config)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.inference_mode():  # SDPA as torch picks it: this CPU has no flash kernel for MLA's head dims
        model(input_ids=ids, **{b.cache_kwarg: real, "use_cache": True})
    filled, again = b.filled_cache(2, 9), b.filled_cache(2, 9)
    assert filled.get_seq_length() == real.get_seq_length() == 9
    assert len(filled.layers) == len(real.layers) == 2
    for f, r, a in zip(filled.layers, real.layers, again.layers):
        assert type(f) is type(r)
        assert (f.keys.shape, f.values.shape, f.keys.dtype) == (r.keys.shape, r.values.shape, r.keys.dtype)
        assert f.get_seq_length() == r.get_seq_length()  # a sliding layer's count of positions seen
        assert torch.equal(f.keys, a.keys) and torch.equal(f.values, a.values)
        assert f.keys.abs().amax() > 0 and not torch.equal(f.keys, f.values)
    if spec == "gemma3-tiny":
        assert [layer.keys.shape[2] for layer in filled.layers] == [3, 9]  # sliding (window 4), global
    lengths = [layer.keys.shape[2] for layer in filled.layers]
    with torch.inference_mode():
        logits = model(input_ids=b.decode_tokens(2), **{b.cache_kwarg: filled, "use_cache": True}).logits
    assert logits.shape == (2, 1, model.config.vocab_size) and torch.isfinite(logits.float()).all()
    assert filled.get_seq_length() == 10
    assert [layer.keys.shape[2] for layer in filled.layers] == [n if n < 9 else n + 1 for n in lengths]


def test_a_run_through_the_cli_writes_the_speed_rows_the_claims_read(device, tiny_config, small_plan, tmp_path,
                                                                      monkeypatch):
    """Every model case timed in both modes; the report is a `bench model` report whose rows the claims generator
    reads as it reads the old model-audit reports' speed rows."""
    one_process(monkeypatch)
    group = click.Group("bench")
    benches.add_commands(group, prepare=lambda device, ranks: None, plugins=["detkit.bench.model"])
    result = CliRunner().invoke(group, ["model", "--device", device.type, "--out", str(tmp_path / "out")],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = read_rows(tmp_path / "out")
    assert [r["name"] for r in rows] == [f"speed {case} detkit / default" for case in bench.MODEL_CASES]
    for r in rows:
        assert r["passed"] and r["default_ms"] > 0 and r["detkit_ms"] > 0, r
        assert math.isclose(r["ratio"], r["detkit_ms"] / r["default_ms"])
        assert r["default_p20_ms"] <= r["default_ms"] <= r["default_p80_ms"]
        assert r["target"] == bench.TARGETS[r["case"]] and r["detkit_mode_routing"] == {"gemm_not_routed": {}}
        if device.type == "cpu":  # no verdict from CPU emulation
            assert r["meets_target"] is None and r["hardware_result"] is False
        else:
            assert r["meets_target"] == (r["ratio"] <= r["target"]) and r["hardware_result"] is True
    assert [r["timing"] for r in rows] == ["eager", "eager", "graph", "eager", "eager"]
    assert rows[-1]["new_tokens"] == small_plan.generate[2]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["meta"]["command"] == "bench model" and report["meta"]["plan"]["decode"] == [2, 4]
    measured = claims.model_speeds(report)
    claimed = [r for r in rows if r["case"] in claims.MODE_SPEED_TARGETS]
    assert measured.text.startswith("; ".join(f"{r['ratio']:.2f}x" for r in claimed))
    assert "## Speed (median ms; ratio = detkit / default)" in (tmp_path / "out" / "report.md").read_text()


def test_each_mode_is_timed_on_its_own_calls(device, tiny_config, monkeypatch):
    """prefill replaced by a spin of 5 ms in default mode and 50 ms in detkit mode: each sample lasts at least its
    mode's spin, and default mode's median stays under 50 ms (it would not if the modes' calls were mixed or the
    mode were entered around the wrong calls); ratio is detkit / default of the medians, in ms."""
    def spin(self):
        end = time.perf_counter() + (0.050 if mode_state.active() else 0.005)
        while time.perf_counter() < end:
            pass

    monkeypatch.setattr(bench.ModelBench, "prefill", spin)
    three = bench.SpeedPlan((1, 4), (1, 4), (1, 4), reps=3, train_reps=1, graph_replays=1, generate=(1, 2, 1))
    monkeypatch.setattr(bench, "CPU_PLAN", three)
    monkeypatch.setattr(bench, "CUDA_PLAN", three)
    row = tiny_bench(device, rounds=2).measure("prefill")
    assert row["passed"] and row["default_samples"] == row["detkit_samples"] == 6, row
    assert 5.0 <= row["default_p20_ms"] and row["default_ms"] < 50.0 <= row["detkit_p20_ms"], row
    assert math.isclose(row["ratio"], row["detkit_ms"] / row["default_ms"]) and row["ratio"] > 1


def test_a_gemm_on_torch_in_detkit_mode_fails_its_row(device, tiny_config, small_plan):
    """An FP64 matmul in the model's last norm: detkit mode leaves it to torch (counted), so the detkit time is not
    detkit's and the row fails, naming the op."""
    b = tiny_bench(device)
    eye = torch.eye(b.model.config.hidden_size, device=device, dtype=torch.float64)
    b.model.model.norm.register_forward_hook(lambda m, args, out: (out.double() @ eye).to(out.dtype))
    row = b.measure("prefill")
    assert not row["passed"] and row["detkit_mode_routing"]["gemm_not_routed"], row
    assert row["failure"].startswith("detkit mode ran off detkit's kernels") and "mm: " in row["failure"]


def test_a_step_the_capture_would_refuse_fails_the_graph_row(device, tiny_config, small_plan):
    """A decode step that reads a value back to the host: its capture fails (on the CPU the graph timing's stand-in
    refuses it) in both modes, and the row fails with the reason instead of a time."""
    b = tiny_bench(device)
    b.model.model.norm.register_forward_hook(lambda m, args, out: out * (float(out.sum()) == float(out.sum())))
    row = b.measure("decode_cuda_graph")
    assert not row["passed"] and "ratio" not in row, row
    for mode in bench.MODES:
        # The step runs under torch.inference_mode, where a value is read as aten.item.
        reason = ("capture failed (cpu stand-in): reads device data on the host: aten.item.default"
                  if device.type == "cpu" else "capture failed: ")
        assert f"{mode}: {reason}" in row["failure"], row["failure"]


def test_a_moe_models_block_is_timed_on_detkits_layer(device, small_plan, monkeypatch):
    """The tiny Qwen3-MoE: its first block alone, detkit's BF16 layer under the mode (counted: at least one expert
    call, none on torch) against transformers' own block."""
    monkeypatch.setenv(models.CONFIG_ENV, "qwen3-moe-tiny")
    row = tiny_bench(device).measure("moe_block_decode")
    assert row["passed"] and row["tokens"] == 2 and row["target"] is None, row
    routing = row["detkit_mode_routing"]
    assert routing["moe_experts_routed"] > 0 and routing["moe_not_routed"] == routing["moe_other_precision"] == {}
    assert row["baseline"].startswith("transformers' block") and math.isclose(row["ratio"],
                                                                               row["detkit_ms"] / row["default_ms"])


def test_the_speed_table_merges_runs_with_their_verdicts_and_failures(tmp_path):
    """merge_speed_reports: one line per run folder, each case's ratio with ok / MISS against its target as the
    row recorded it, a failed row's reason listed, a folder without report.json named as not finished."""
    rows = [{"name": bench.row_name(label), "case": label.split()[0], "model": "m", **fields}
            for label, fields in (("prefill", {"passed": True, "ratio": 1.0234, "meets_target": True}),
                                  ("generate", {"passed": True, "ratio": 1.31, "meets_target": False}),
                                  ("decode_eager", {"passed": False, "failure": "out of memory"}),
                                  ("decode_eager 8x32768", {"passed": True, "ratio": 1.1, "meets_target": True}))]
    (tmp_path / "a-L2").mkdir()
    (tmp_path / "a-L2" / "report.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    bench.merge_speed_reports(tmp_path, [tmp_path / "a-L2", tmp_path / "b-L8"])
    runs = json.loads((tmp_path / "speed.json").read_text())["runs"]
    assert runs[0] == {"run": "a-L2", "model": "m", "prefill": "1.023 ok", "generate": "1.310 MISS",
                       "decode_eager": "failed", "decode_eager 8x32768": "1.100 ok"}
    assert runs[1] == {"run": "b-L8", "model": "no report.json (the run did not finish)"}
    assert "- a-L2 decode_eager: out of memory" in (tmp_path / "speed.md").read_text()


def test_default_mode_runs_the_baseline_attention(device):
    """Default mode's calls: flash SDPA, memory-efficient where flash cannot, for an "sdpa" model (no math or cuDNN
    attention), and transformers' eager attention for a "detkit" model (Gemma-2), its own implementation restored
    after."""
    sdpa_model, _ = models.build_model(device, seed=1, spec="qwen3-tiny", layers=1)
    with bench.baseline_attention(sdpa_model):
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert not (torch.backends.cuda.math_sdp_enabled() or torch.backends.cuda.cudnn_sdp_enabled())
    assert torch.backends.cuda.math_sdp_enabled()
    gemma, _ = models.build_model(device, seed=1, spec="gemma2-tiny", layers=1)
    with bench.baseline_attention(gemma):
        assert gemma.config._attn_implementation == "eager"
    assert gemma.config._attn_implementation == "detkit"
    gemma.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="^attn_implementation 'flex_attention' has no default-mode baseline; "
                                         "supported: sdpa, detkit$"):
        with bench.baseline_attention(gemma):
            pass


def test_the_speed_script_passes_its_decode_points_to_each_run(tmp_path):
    """tools/gpu/model_speed.sh's dry run: DECODE_AT's points as --decode-at flags on every model's command, none
    without it."""
    script = Path(__file__).resolve().parents[1] / "tools" / "gpu" / "model_speed.sh"
    env = dict(os.environ, OUT=str(tmp_path), DRY_RUN="1", FAMILIES="qwen3", LAYERS="2 4",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")

    def dry_run(**extra) -> list[str]:
        done = subprocess.run(["bash", str(script)], env={**env, **extra}, capture_output=True, text=True, check=True)
        return done.stdout.splitlines()

    assert dry_run(DECODE_AT="1x32768 8x32768") == [
        f"python -m detkit bench model --device cuda --preset qwen3-8b --layers {n} --decode-at 1x32768 --decode-at "
        f"8x32768 --out {tmp_path}/qwen3-L{n}" for n in (2, 4)]
    assert dry_run() == [f"python -m detkit bench model --device cuda --preset qwen3-8b --layers {n} --out "
                         f"{tmp_path}/qwen3-L{n}" for n in (2, 4)]
