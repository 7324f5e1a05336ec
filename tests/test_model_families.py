"""The model audit's family matrix (audits/model.py, toolkit/models.py FAMILIES): every family's presets build (real
widths with 2 layers, and tiny), DETKIT_MODEL_CONFIG's list and ``families`` resolve or are refused by name before
any work, the generate and routing checks can fail and say where, a refusal under strict is a failed cell naming it,
and a one-layer gpt-oss (detkit attention with sinks and a window, grouped-GEMM experts, routing) and a one-layer
DeepSeek-V3 (MLA on the attention kernel zero-padded, the FP32 router, grouped-GEMM experts) run through the matrix
on the interpreter, every check passing (about 70 s each on 2 idle cores, the file about 150 s). The whole matrix on
the interpreter (about a minute per family) is beyond CI's budget: its results are in docs/mode.md, and
tools/gpu/model_families.sh runs it at real widths."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is the optional extra detkit[models]")

from detkit.audits import model as audit_model  # noqa: E402
from detkit.toolkit import models  # noqa: E402
from detkit.toolkit.harness import RunContext  # noqa: E402

PLAN = audit_model.MATRIX_CPU_PLAN
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # detkit.kernels.attention's
MLA_MAX_HEAD_DIM = 256  # MLA's query/key and value head dims, each zero-padded to one of SUPPORTED_HEAD_DIMS


def test_every_family_has_a_real_width_and_a_tiny_preset_that_build():
    """The real-width presets on the meta device (no memory), 2 layers each; every preset's head dims are ones the
    attention kernel runs (DeepSeek-V3's MLA: query/key and value head dims that differ, each at most 256)."""
    assert len(models.FAMILIES) == 13
    for family, (real, tiny) in models.FAMILIES.items():
        for name in (real, tiny):
            preset = models.MODEL_PRESETS[name]
            config = transformers.AutoConfig.for_model(preset.model_type, **preset.fields)
            assert config.num_hidden_layers == (2 if name != "qwen3-moe-tiny-128" else 1), name
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            if hasattr(config, "v_head_dim"):  # MLA
                qk = config.qk_nope_head_dim + config.qk_rope_head_dim
                assert qk != config.v_head_dim and max(qk, config.v_head_dim) <= MLA_MAX_HEAD_DIM, name
            else:
                assert head_dim in SUPPORTED_HEAD_DIMS, (name, head_dim)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.for_model(models.MODEL_PRESETS[real].model_type,
                                                  **models.MODEL_PRESETS[real].fields), dtype=torch.bfloat16)
        assert model.config.hidden_size >= 2048, family
    assert models.MODEL_PRESETS["gemma2-9b"].attn_implementation == "detkit"  # softcap: no sdpa path
    assert models.MODEL_PRESETS["gpt-oss-20b"].attn_implementation == "detkit"  # sinks: no sdpa path
    gpt_oss = models.MODEL_PRESETS["gpt-oss-20b"].fields
    assert (gpt_oss["hidden_size"], gpt_oss["num_local_experts"], gpt_oss["num_experts_per_tok"]) == (2880, 32, 4)


def test_config_values_resolve_to_presets_and_unknown_names_are_refused():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert models.model_specs(cpu, "families") == [tiny for _, tiny in models.FAMILIES.values()]
    assert models.model_specs(cuda, "families") == [real for real, _ in models.FAMILIES.values()]
    assert models.model_specs(cpu, "gemma2, mixtral-8x7b") == ["gemma2-tiny", "mixtral-8x7b"]
    assert models.model_specs(cuda, "gpt-oss") == ["gpt-oss-20b"]
    assert models.model_specs(cpu, "some/config.json") == ["some/config.json"]  # model_source reads it
    assert models.model_specs(cpu, "") == ["qwen3-tiny"]
    with pytest.raises(ValueError, match=r"^DETKIT_MODEL_CONFIG: 'gemma4' is neither a preset \(qwen3-8b, .*\), a "
                                         r"family \(llama3, .*\) nor 'families'$"):
        models.model_specs(cpu, "gemma2,gemma4")
    assert [audit_model.is_matrix(v) for v in ("families", "gemma2", "qwen3-tiny,llama3-tiny", "qwen3-tiny",
                                               "x.json", None)] == [True, True, True, False, False, False]


def test_an_unknown_name_in_the_list_is_refused_before_any_model_is_built(monkeypatch):
    monkeypatch.setenv(models.CONFIG_ENV, "llama3,nope")

    def build_model(*args):
        raise AssertionError("a model was built")

    monkeypatch.setattr(audit_model, "build_model", build_model)
    ctx = RunContext(device=torch.device("cpu"), backend="triton_interpreter", preset="tiny")
    with pytest.raises(ValueError, match="'nope' is neither a preset"):
        list(audit_model.run(ctx))


def _tiny_moe(name="mixtral-tiny"):
    model, _ = models.build_model(torch.device("cpu"), 3, name)
    return model


def test_generate_check_catches_a_decode_only_difference():
    """Outside the mode (torch on the CPU): generate's log-probs equal the trainer's; a perturbation of one-token
    forwards (decode steps) only makes the check fail from the second completion token on."""
    model = _tiny_moe()
    audit = audit_model.Audit(model, torch.device("cpu"), PLAN, seed=4)
    logprobs, routing = audit.generate()
    assert logprobs.equal and routing.equal and routing.elements > 0, (logprobs, routing)
    target = model.model.layers[1].self_attn.o_proj
    handle = target.register_forward_hook(lambda m, args, out: out + 0.05 * (out.shape[1] == 1))
    try:
        logprobs, routing = audit.generate()
    finally:
        handle.remove()
    assert not logprobs.equal and logprobs.first_mismatch[1] == 1  # token 0 comes from the prefill
    assert logprobs.mismatches <= logprobs.elements // PLAN.gen_len * (PLAN.gen_len - 1)


def test_routing_check_counts_decisions_that_differ_between_rollout_and_trainer():
    """A router perturbed only in decode steps (one token per sequence): the routing comparison counts those
    tokens' decisions at that layer and names the first (layer, sequence, token)."""
    model = _tiny_moe()
    audit = audit_model.Audit(model, torch.device("cpu"), PLAN, seed=4)
    gate = model.model.layers[0].mlp.gate

    def flip(module, args, out):
        if args[0].shape[0] == PLAN.decode_batch:  # a decode step's [B, H] tokens
            logits, weights, ids = out
            return logits, weights, (ids + 1) % model.config.num_local_experts
        return out

    handle = gate.register_forward_hook(flip)
    try:
        _, routing = audit.generate()
    finally:
        handle.remove()
    decode_decisions = PLAN.decode_batch * (PLAN.gen_len - 1)  # one layer's decode-step tokens
    assert not routing.equal and routing.mismatches == decode_decisions, routing
    layer, seq, token = routing.first_mismatch
    assert layer == 0 and token == PLAN.prompt_lens()[seq]  # the first fed completion token


def test_a_refusal_under_strict_is_a_failed_cell_naming_it(monkeypatch):
    """A head dim the attention kernel does not have (a tiny Llama with heads of 288, wider than its widest, 256)
    under strict: the attention call is refused by name; the matrix cell says FAIL with it."""
    import detkit

    tiny = models.MODEL_PRESETS["llama3-tiny"]
    monkeypatch.setitem(models.MODEL_PRESETS, "llama3-tiny-d288", models.ModelPreset(
        tiny.model_type, dict(tiny.fields, head_dim=288), "Llama-3 tiny, heads of 288"))
    model, _ = models.build_model(torch.device("cpu"), 5, "llama3-tiny-d288")
    ids = torch.randint(3, 256, (1, 4), generator=torch.Generator().manual_seed(6))
    with pytest.raises(detkit.ModeNotRoutedError, match="attention") as refused, torch.no_grad(), \
            detkit.batch_invariant_mode(strict=True):
        model(input_ids=ids)
    message = str(refused.value)
    assert "head_dim 288" in message, message
    result = {"spec": "llama3-tiny-d288", "family": "llama3", "counters_passed": True, "routing_check": {},
              "meta": {"gaps": []}, "counters": {"not_routed": {}},
              "drift": [{"mode": "detkit", "check": "strict", "refusals": {"padding": message}, "passed": False}]}
    cell = audit_model.matrix_cell(result, "strict")
    assert cell.startswith("FAIL (1 check(s) refused): ") and message.split(": ")[-1][:40] in cell
    assert audit_model.matrix_cell(result, "routing") == "n/a"


def test_a_gpt_oss_family_through_the_matrix_on_the_interpreter(device, tmp_path, monkeypatch):
    """A family through the matrix path (rows named "<preset>: ..."): the tiny gpt-oss with one layer, sliding (detkit
    attention with sinks and a 4-key window; 4 grouped-GEMM experts, top-2) -- one layer instead of the preset's two
    keeps CI's interpreter time near a minute. Every detkit-mode row passes -- strict with nothing refused,
    generate's log-probs and every routing decision equal to the trainer's -- and serving where the installed
    transformers' continuous batching takes a model built with "detkit" (5.17, as "paged|detkit"; its sliding layer
    anchored on the paged cache); 5.24's refuses that name (gpt-oss has no sdpa path: sinks), a failed row naming
    transformers' error. model.md / model.json hold the family x check table."""
    tiny = models.MODEL_PRESETS["gpt-oss-tiny"]
    preset = "gpt-oss-tiny-1-layer"
    monkeypatch.setitem(models.MODEL_PRESETS, preset, models.ModelPreset(
        tiny.model_type, dict(tiny.fields, num_hidden_layers=1, layer_types=["sliding_attention"]),
        "gpt-oss tiny, one sliding layer", tiny.attn_implementation))
    monkeypatch.setitem(models.FAMILIES, "gpt-oss-1-layer", (preset, preset))
    monkeypatch.setenv(models.CONFIG_ENV, "gpt-oss-1-layer")
    backend = "triton_interpreter" if device.type == "cpu" else "cuda_sm90"
    ctx = RunContext(device=device, backend=backend, preset="tiny", seed=11, out_dir=tmp_path)
    rows = list(audit_model.run(ctx))
    assert all(r.name.startswith(f"{preset}: ") for r in rows)
    by_check: dict[str, list] = {}
    for row in rows:
        by_check.setdefault(row.check, []).append(row)
    assert set(by_check) == {"model", "default_drift", "batch_invariance", "padding", "trainer_vs_rollout",
                             "decode_vs_trainer", "generate", "routing", "serving", "backward_repeat", "strict",
                             "counters"}
    failed = [(r.name, r.details) for r in rows if not r.passed]
    (serving,) = by_check["serving"]
    if serving.passed:  # transformers 5.17
        assert not failed and serving.details["tokens"] == serving.details["elements"] > 0, (failed, serving.details)
    else:  # transformers 5.24
        assert [name for name, _ in failed] == [f"{preset}: detkit serving " + serving.details["case"]]
        assert failed[0][1]["error"].startswith("ValueError: Implementation detkit is not supported for continuous "
                                                "batching"), failed
    routing = by_check["routing"][0].details
    assert routing["decisions"] == sum(n + PLAN.gen_len - 1 for n in PLAN.prompt_lens())  # 1 MoE layer
    counters = by_check["counters"][0].details
    assert counters["not_routed"] == {}
    assert any(k.startswith("moe experts (transformers) -> detkit.") for k in counters["routed"]), counters["routed"]
    table = json.loads((tmp_path / "model.json").read_text())["matrix"]
    assert [row["family"] for row in table] == ["gpt-oss-1-layer"]
    assert {c: table[0][c].split(":")[0] for c in audit_model.MATRIX_CHECKS} == {
        **dict.fromkeys(audit_model.MATRIX_CHECKS, "pass"), "serving": "pass" if serving.passed else "FAIL"}
    report = (tmp_path / "model.md").read_text()
    assert "CPU, Triton interpreter (not a hardware result)" in report or device.type == "cuda"
    assert "| gpt-oss-1-layer" in report and "decisions differ (default mode:" in report


def test_a_deepseek_v3_family_through_the_matrix_on_the_interpreter(device, tmp_path, monkeypatch):
    """The tiny DeepSeek-V3 (MLA with query/key head dim 64 and value head dim 32) with one layer, a MoE one (the
    preset's dense first layer dropped for CI's time), through the matrix: its attention runs on the kernel with v
    zero-padded to 64, counted under the padded kernel's name, and every check passes -- strict with nothing
    refused, decode and generate's log-probs and every routing decision equal to the trainer's -- beside the
    grouped-GEMM experts, the FP32 router and the norms. Under a minute on the interpreter (the serving check left
    out, for CI's time: its cell is n/a)."""
    tiny = models.MODEL_PRESETS["deepseek-v3-tiny"]
    preset = "deepseek-v3-tiny-1-layer"
    monkeypatch.setitem(models.MODEL_PRESETS, preset, models.ModelPreset(
        tiny.model_type, dict(tiny.fields, num_hidden_layers=1, first_k_dense_replace=0), "DeepSeek-V3 tiny, one MoE "
        "layer", tiny.attn_implementation, tiny.gaps))
    monkeypatch.setitem(models.FAMILIES, "deepseek-v3-1-layer", (preset, preset))
    monkeypatch.setenv(models.CONFIG_ENV, "deepseek-v3-1-layer")
    monkeypatch.setattr(audit_model.Audit, "serving", lambda self: [])
    backend = "triton_interpreter" if device.type == "cpu" else "cuda_sm90"
    ctx = RunContext(device=device, backend=backend, preset="tiny", seed=13, out_dir=tmp_path)
    rows = list(audit_model.run(ctx))
    by_check: dict[str, list] = {}
    for row in rows:
        by_check.setdefault(row.check, []).append(row)
    assert set(by_check) == {"model", "default_drift", "batch_invariance", "padding", "trainer_vs_rollout",
                             "decode_vs_trainer", "generate", "routing", "backward_repeat", "strict", "counters"}
    failed = [(r.name, r.details) for r in rows if not r.passed]
    assert not failed, failed
    assert by_check["strict"][0].details["refusals"] == {}
    counters = by_check["counters"][0].details
    assert counters["not_routed"] == {}
    routed = counters["routed"]
    assert routed["attention (transformers) -> detkit.attention (qk head dim 64, v 32: zero-padded)"] > 0, routed
    assert not any(k.startswith("attention (transformers) -> detkit.attention") and "zero-padded" not in k
                   for k in routed), routed
    assert any(k.startswith("moe experts (transformers) -> detkit.") for k in routed), routed
    assert routed["mm -> det_gemm_fwd fp32 ieee"] > 0
    table = json.loads((tmp_path / "model.json").read_text())["matrix"]
    assert {c: table[0][c].split(":")[0] for c in audit_model.MATRIX_CHECKS} == {
        **dict.fromkeys(audit_model.MATRIX_CHECKS, "pass"), "serving": "n/a"}
    report = (tmp_path / "model.md").read_text()
    assert "| deepseek-v3-1-layer " in report and "## Missing, with the reason\n\n- none\n" in report
