"""The model audit's serving check (audits/model.py ``Audit.serving``, toolkit/serving.py): it can fail -- a
difference in the engine's forwards only is counted token by token --, a strict refusal raised in the engine's thread
reaches the audit as itself (so the strict row names it), transformers' own failure is a failed comparison naming it,
and a model the check cannot serve under the mode is not run, saying why: a transformers without the pieces the
check uses (named, with its version); sliding-window models are served. Outside the mode (torch's kernels): a few
seconds. The check passing under the mode is tests/test_model_audit.py's plug-in run (sliding-window layers with
dropped keys: tests/test_mode_continuous_batching.py)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is the optional extra detkit[models]")

import detkit  # noqa: E402
from detkit.audits import model as audit_model  # noqa: E402
from detkit.toolkit import models, serving  # noqa: E402

PLAN = audit_model.MATRIX_CPU_PLAN  # 2 requests (3 and 2 prompt tokens), 2 sampled tokens each, pages of 4


def _audit(device, spec="qwen3-tiny", seed=21):
    model, _ = models.build_model(device, seed, spec)
    return model, audit_model.Audit(model, device, PLAN, seed=seed)


def _in_engine(module) -> bool:
    """True in the engine's forwards: the trainer's forward runs in training mode, continuous batching in eval."""
    return not module.training


def test_a_difference_in_the_engines_forwards_is_counted_per_token(device):
    """Every forward of the engine perturbed (one attention output projection), the trainer's not: every sampled
    token's log-prob differs, the first at request 0's first token."""
    model, audit = _audit(device)
    target = model.model.layers[1].self_attn.o_proj
    handle = target.register_forward_hook(lambda m, args, out: out + 0.05 * _in_engine(m))
    try:
        (cmp,) = audit.serving()
    finally:
        handle.remove()
    tokens = PLAN.decode_batch * PLAN.gen_len
    assert (cmp.check, cmp.equal, cmp.elements, cmp.mismatches, cmp.first_mismatch) == ("serving", False, tokens,
                                                                                          tokens, (0, 0)), cmp
    assert cmp.extra["tokens"] == tokens and cmp.extra["requests"] == PLAN.decode_batch
    assert cmp.extra["arrivals"] == PLAN.arrivals() == [0, 1] and cmp.extra["shared_steps"] >= 1, cmp.extra


def test_a_strict_refusal_in_the_engines_thread_reaches_the_audit_as_itself(device):
    """A ModeNotRoutedError raised in a forward of the engine's generation thread is raised by the check as such (the
    audit's strict pass records it and runs the check again); any other failure of the engine is a failed
    comparison naming it."""
    model, audit = _audit(device)
    target = model.model.layers[0].self_attn.o_proj

    def refuse(m, args, out):
        if _in_engine(m):
            raise detkit.ModeNotRoutedError("o_proj: refused for the test")

    handle = target.register_forward_hook(refuse)
    try:
        with pytest.raises(detkit.ModeNotRoutedError, match="o_proj: refused for the test"):
            audit.serving()
    finally:
        handle.remove()

    def fail(m, args, out):
        if _in_engine(m):
            raise ValueError("o_proj: failed for the test")

    handle = target.register_forward_hook(fail)
    try:
        (cmp,) = audit.serving()
    finally:
        handle.remove()
    assert not cmp.equal and cmp.extra["error"] == "ValueError: o_proj: failed for the test", cmp.extra
    result = {"drift": [{"mode": "detkit", "check": "serving", "passed": False, **cmp.details()}]}
    assert audit_model.matrix_cell(result, "serving") == "FAIL: ValueError: o_proj: failed for the test"


def test_sliding_window_models_are_served():
    """Mistral (every layer sliding, the window in the config) and Gemma-3 (a sliding layer then a global one, the
    window on the layer): nothing keeps them from the check (the mode's paged attention anchors a sliding-window
    layer's requests at their first token), so their serving row runs. Built on the meta device: nothing is served."""
    for preset in ("mistral-tiny", "gemma3-tiny"):
        spec = models.MODEL_PRESETS[preset]
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
                spec.model_type, **spec.fields))
        assert model.config.sliding_window == models.TINY_WINDOW
        assert serving.unsupported(model) is None, preset


def test_a_transformers_without_the_pieces_is_not_run_naming_them_and_its_version(device, monkeypatch):
    """transformers without the IO class's prepare_batch_update (what the logits are paired with requests through):
    not run, naming the piece and the installed version."""
    from transformers.generation.continuous_batching import input_outputs

    _, audit = _audit(device)
    monkeypatch.delattr(input_outputs.ContinuousBatchingIOs, "prepare_batch_update")
    (cmp,) = audit.serving()
    assert cmp.extra["not_run"] == (f"transformers {transformers.__version__} has no continuous_batching.input_outputs."
                                    "ContinuousBatchingIOs.prepare_batch_update (continuous batching pieces used "
                                    "here)"), cmp.extra
    assert cmp.extra["transformers"] == transformers.__version__
