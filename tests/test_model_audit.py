"""audits/model.py: the model audit's comparisons can fail and say where (a batch-dependent perturbation in one
module is caught and named by the first-divergence hooks), the model comes from DETKIT_MODEL_CONFIG or the
default (toolkit/models.py), and the plug-in run yields its correctness rows and no speed rows (decode vs trainer
FAILED with the reason while the attention kernel is absent) and writes model.md / model.json (where the README's
main job runs in CI, its `--suite all` is the dense plug-in run on the interpreter: tests/test_container_build.py
checks the same). The serving check runs in the dense model's plug-in run only (CI's time: about 15 s of the interpreter); the MoE runs leave it out, and
tests/test_model_serving.py holds its can-fail and not-run cases."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is the optional extra detkit[models]")

from detkit.audits import model as audit_model  # noqa: E402
from detkit.toolkit import models  # noqa: E402
from detkit.mode.attention import attention_module  # noqa: E402
from detkit.toolkit.harness import RunContext  # noqa: E402

ONE_LAYER = dict(models.QWEN3_TINY, num_hidden_layers=1)
SMALL_PLAN = audit_model.CPU_PLAN  # the interpreter's plan; the GPU runs of these tests use it too


def _without_serving(monkeypatch):
    """The MoE plug-in runs leave the serving check out (CI's time; the dense run has it)."""
    monkeypatch.setattr(audit_model.Audit, "serving", lambda self: [])


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"model_type": "qwen3", **ONE_LAYER}))
    monkeypatch.setenv(models.CONFIG_ENV, str(path))
    return path


def test_model_source_reads_a_json_config_or_a_directory_and_refuses_anything_else(config_file, tmp_path,
                                                                                  monkeypatch):
    config, weights, description = models.model_source(torch.device("cpu"))
    assert (config.hidden_size, config.num_hidden_layers, weights) == (128, 1, None)
    assert description.endswith("(random init)")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    config.save_pretrained(checkpoint)
    monkeypatch.setenv(models.CONFIG_ENV, str(checkpoint))
    config, weights, description = models.model_source(torch.device("cpu"))
    assert config.num_hidden_layers == 1 and weights is None and "config only" in description
    monkeypatch.setenv(models.CONFIG_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="neither a preset .*, a JSON config file nor a checkpoint directory"):
        models.model_source(torch.device("cpu"))


def test_default_configs_are_qwen3_8b_widths_on_cuda_and_tiny_on_cpu(monkeypatch):
    monkeypatch.delenv(models.CONFIG_ENV, raising=False)
    cuda, _, _ = models.model_source(torch.device("cuda"))
    cpu, _, _ = models.model_source(torch.device("cpu"))
    assert (cuda.hidden_size, cuda.intermediate_size, cuda.num_attention_heads, cuda.num_key_value_heads,
            cuda.head_dim, cuda.vocab_size, cuda.num_hidden_layers) == (4096, 12288, 32, 8, 128, 151936, 2)
    assert cpu.hidden_size <= 128 and cpu.num_hidden_layers == 2 and cpu.head_dim in (64, 128)


def test_the_moe_presets_are_qwen3_30b_a3b_widths_and_a_tiny_moe(monkeypatch):
    monkeypatch.setenv(models.CONFIG_ENV, "qwen3-moe-30b-a3b")
    big, weights, description = models.model_source(torch.device("cuda"))
    assert big.model_type == "qwen3_moe" and weights is None and "30B-A3B" in description
    assert (big.hidden_size, big.moe_intermediate_size, big.num_experts, big.num_experts_per_tok, big.norm_topk_prob,
            big.num_attention_heads, big.num_key_value_heads, big.head_dim, big.vocab_size,
            big.decoder_sparse_step, big.mlp_only_layers) == (2048, 768, 128, 8, True, 32, 4, 128, 151936, 1, [])
    monkeypatch.setenv(models.CONFIG_ENV, "qwen3-moe-tiny")
    tiny, _, _ = models.model_source(torch.device("cpu"))
    assert tiny.model_type == "qwen3_moe" and tiny.hidden_size <= 64 and tiny.num_experts <= 8


def test_a_batch_dependent_module_is_caught_and_named(device, config_file):
    """A perturbation that depends on the batch size in one module: batch invariance fails in the audit's
    comparison and the first-divergence hooks name that module, not an earlier one."""
    model, _ = models.build_model(device, seed=1)
    target = model.model.layers[0].mlp.up_proj
    handle = target.register_forward_hook(lambda m, args, out: out + 0.01 * (out.shape[0] - 1))
    try:
        audit = audit_model.Audit(model, device, SMALL_PLAN, seed=1)
        results = audit.batch_invariance(locate=True)
    finally:
        handle.remove()
    assert results and all(not r.equal for r in results)
    assert {r.extra["first_divergence"] for r in results} == {"model.layers.0.mlp.up_proj"}


def test_the_plugin_yields_its_rows_and_writes_the_model_report(device, config_file, tmp_path, monkeypatch):
    if device.type == "cpu":
        from tests.test_container_build import skip_where_the_main_job_runs

        skip_where_the_main_job_runs("runs this plug-in on the interpreter, with this plan, and checks its rows and "
                                     "files")
    monkeypatch.setattr(audit_model, "CPU_PLAN", SMALL_PLAN)
    monkeypatch.setattr(audit_model, "CUDA_PLAN", SMALL_PLAN)
    backend = "triton_interpreter" if device.type == "cpu" else "cuda_sm90"
    ctx = RunContext(device=device, backend=backend, preset="tiny", seed=3, out_dir=tmp_path)
    rows = list(audit_model.run(ctx))
    by_check: dict[str, list] = {}
    for row in rows:
        by_check.setdefault(row.check, []).append(row)
    assert set(by_check) == {"model", "default_drift", "batch_invariance", "padding", "trainer_vs_rollout",
                             "decode_vs_trainer", "generate", "serving", "backward_repeat", "strict", "counters"}
    assert all(r.passed for r in by_check["default_drift"])  # informational
    for check in ("batch_invariance", "trainer_vs_rollout", "backward_repeat", "counters"):
        assert all(r.passed for r in by_check[check]), [r.details for r in by_check[check]]
    decode = by_check["decode_vs_trainer"]
    assert len(decode) == 2
    if attention_module() is None:  # decode, generate and serving fail while attention runs on torch
        assert not any(r.passed for r in decode + by_check["generate"] + by_check["serving"])
        assert all("no detkit attention kernel" in json.dumps(r.details["attention_not_routed"]) for r in decode)
    else:
        assert all(r.passed for r in decode + by_check["generate"] + by_check["serving"] + by_check["strict"])
    # serving: 2 requests (3 and 2 prompt tokens, pages of 4), the second arriving after the first's first token and
    # sharing a step with it; 2 sampled tokens each; the same run in default mode beside it
    (serving,) = by_check["serving"]
    assert (serving.details["tokens"], serving.details["elements"], serving.details["arrivals"]) == (4, 4, [0, 1])
    assert serving.details["shared_steps"] >= 1, serving.details
    assert [r.details["check"] for r in by_check["default_drift"]].count("serving") == 1
    counters = by_check["counters"][0].details
    assert counters["routed"]["mm -> det_gemm_fwd"] > 0 and counters["gemm_not_routed"] == {}
    report = (tmp_path / "model.md").read_text()
    assert "## Drift" in report and "mm -> det_gemm_fwd" in report
    model_json = json.loads((tmp_path / "model.json").read_text())
    assert model_json["counters"] == {k: v for k, v in counters.items() if k in ("routed", "not_routed")}
    # Speed is `detkit bench model`'s: the audit's own files hold none.
    assert "speed" not in model_json and "## Speed" not in report


def test_the_plugin_runs_every_check_on_a_tiny_moe_model(device, tmp_path, monkeypatch):
    """CI's MoE run: the Qwen3-MoE tiny preset (8 experts, top-2; one layer to keep the interpreter under a minute)
    through every detkit-mode check, each MoE block on detkit's layer (counted), the backward with the router's aux
    loss."""
    path = tmp_path / "moe.json"
    path.write_text(json.dumps({"model_type": "qwen3_moe", **models.QWEN3_MOE_TINY, "num_hidden_layers": 1}))
    monkeypatch.setenv(models.CONFIG_ENV, str(path))
    monkeypatch.setattr(audit_model, "CPU_PLAN", SMALL_PLAN)
    monkeypatch.setattr(audit_model, "CUDA_PLAN", SMALL_PLAN)
    _without_serving(monkeypatch)
    backend = "triton_interpreter" if device.type == "cpu" else "cuda_sm90"
    ctx = RunContext(device=device, backend=backend, preset="tiny", seed=5, out_dir=tmp_path)
    rows = list(audit_model.run(ctx))
    by_check: dict[str, list] = {}
    for row in rows:
        by_check.setdefault(row.check, []).append(row)
    assert by_check["model"][0].details["moe"]["experts"] == 8
    checks = ["batch_invariance", "padding", "trainer_vs_rollout", "backward_repeat", "counters"]
    if attention_module() is not None:
        checks += ["decode_vs_trainer", "generate", "routing", "strict"]
    for check in checks:
        assert by_check[check] and all(r.passed for r in by_check[check]), [r.details for r in by_check[check]]
    assert "router aux loss" in by_check["backward_repeat"][0].details["case"]
    assert by_check["routing"][0].details["decisions"] == sum(n + SMALL_PLAN.gen_len - 1
                                                              for n in SMALL_PLAN.prompt_lens())  # 1 MoE layer
    counters = by_check["counters"][0].details
    assert counters["moe_experts_routed"] > 0 and counters["moe_not_routed"] == {}
    assert "MoE:" in (tmp_path / "model.md").read_text()


def test_the_plugin_runs_every_check_on_a_tiny_moe_model_with_fp8_experts(device, tmp_path, monkeypatch):
    """DETKIT_MODEL_MOE_EXPERTS=fp8 on the FP8-capable tiny MoE preset (H = I = 128, 4 experts, top-2, 1 layer):
    every detkit-mode check passes with the experts on the FP8 layer (counted as such, none on BF16), and the
    first block's output and gradients pass the FP8 precision gate against BF16 experts."""
    monkeypatch.setenv(models.CONFIG_ENV, "qwen3-moe-tiny-128")
    monkeypatch.setenv(models.EXPERTS_ENV, "fp8")
    monkeypatch.setattr(audit_model, "CPU_PLAN", SMALL_PLAN)
    monkeypatch.setattr(audit_model, "CUDA_PLAN", SMALL_PLAN)
    _without_serving(monkeypatch)
    backend = "triton_interpreter" if device.type == "cpu" else "cuda_sm90"
    ctx = RunContext(device=device, backend=backend, preset="tiny", seed=7, out_dir=tmp_path)
    by_check: dict[str, list] = {}
    for row in audit_model.run(ctx):
        by_check.setdefault(row.check, []).append(row)
    moe = by_check["model"][0].details["moe"]
    assert (moe["experts"], moe["detkit_experts"]) == (4, "fp8")
    checks = ["batch_invariance", "padding", "trainer_vs_rollout", "backward_repeat", "counters", "moe_precision"]
    if attention_module() is not None:
        checks.append("decode_vs_trainer")
    for check in checks:
        assert by_check[check] and all(r.passed for r in by_check[check]), [r.details for r in by_check[check]]
    counters = by_check["counters"][0].details
    assert counters["routed"]["moe experts (transformers) -> detkit.moe_mlp_fp8"] == counters["moe_experts_routed"] > 0
    assert counters["moe_other_precision"] == {} and counters["moe_not_routed"] == {}
    precision = {r.name.split()[1]: r.details for r in by_check["moe_precision"]}
    assert set(precision) == set(models.BLOCK_TENSORS)
    assert all(d["same_routing"] and 0.997 <= d["cosine_vs_bf16_experts"] < 1 for d in precision.values())
    assert "MoE precision: FP8 vs BF16 experts" in (tmp_path / "model.md").read_text()


def test_the_precision_check_reports_a_block_the_fp8_layer_refuses(device, monkeypatch):
    """The tiny MoE preset (H = 64, I = 32) with FP8 experts: the check's strict FP8 run is refused by name, and the
    row says so instead of comparing transformers' own experts."""
    monkeypatch.setenv(models.CONFIG_ENV, "qwen3-moe-tiny")
    model, _ = models.build_model(device, seed=8)
    audit = audit_model.Audit(model, device, SMALL_PLAN, seed=8, moe_experts="fp8")
    result = audit_model.moe_precision(audit)
    assert set(result) == {"error"} and "FP8 experts need H and I multiples of 128; got H = 64, I = 32" in result["error"]


@pytest.mark.parametrize("env, value, supported", [("EXPERTS_ENV", "fp4", "bf16, fp8"),
                                                    ("GRAPH_WEIGHTS_ENV", "cached", "quantize, static")])
def test_an_unsupported_mode_choice_is_refused_before_the_model_is_built(monkeypatch, env, value, supported):
    name = getattr(models, env)
    monkeypatch.setenv(name, value)

    def build_model(*args):
        raise AssertionError("the model was built")

    monkeypatch.setattr(audit_model, "build_model", build_model)
    ctx = RunContext(device=torch.device("cpu"), backend="triton_interpreter", preset="tiny")
    with pytest.raises(ValueError, match=f"^{name}='{value}' is not supported; supported: {supported}$"):
        list(audit_model.run(ctx))


def test_a_decode_only_difference_is_located_at_its_step_and_module(device, config_file):
    """A perturbation only in one-token forwards (decode steps): decode vs trainer fails from the first decode
    step on, and the hooks, comparing that step's forward with the trainer's position, name the module."""
    model, _ = models.build_model(device, seed=2)
    target = model.model.layers[0].self_attn.o_proj
    handle = target.register_forward_hook(lambda m, args, out: out + 0.01 * (out.shape[1] == 1))
    try:
        audit = audit_model.Audit(model, device, SMALL_PLAN, seed=2)
        alone, batch = audit.decode_vs_trainer(locate=True)
    finally:
        handle.remove()
    assert not alone.equal and not batch.equal
    assert alone.extra["located_step"] == 1  # token 0 comes from the prefill, unperturbed
    assert alone.extra["first_divergence"] == "model.layers.0.self_attn.o_proj"


def test_the_divergence_locator_skips_outputs_it_cannot_cut():
    """A module output whose second dim is shorter than the position asked for (DeepSeek-V3's MLA projections at a
    decode step, on an H100) is skipped, not an IndexError that ends the audit."""
    from detkit.audits.model import _batch_select

    select = _batch_select(2, 4, 63)
    t = torch.arange(4 * 70 * 3).reshape(4, 70, 3)
    assert torch.equal(select(t), t[2, 63])
    assert select(torch.zeros(4, 1, 3)) is None
    assert select(torch.zeros(3, 70)) is None  # no batch dim of 4 or 1
    assert torch.equal(_batch_select(0, 4, slice(None))(torch.ones(1, 5)), torch.ones(5))
