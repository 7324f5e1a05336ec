"""detkit mode across processes, the audit's jobs (audits/model_parallel.py; docs/mode_parallel.md): TP=2, DP=2 (plain,
DDP, FSDP2) and TP=2 x DP=2 on real gloo process groups against the one-process model, bitwise. Their own module so
the test runner can spread these multi-process jobs and the one-process checks of tests/test_mode_parallel.py over
its workers."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.conftest import cpu_ranks_only


def _launch_and_compare(kind: str, model: str):
    from detkit.audits.model_parallel import Job, compare, launch, reference

    job = Job(kind, model, "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        ranks = launch(job, Path(tmp), timeout_s=600)
    return job, compare(job, ranks, reference(job))


def _failed(rows):
    return [(r["name"], {k: v for k, v in r["details"].items() if k in ("mismatches", "first", "not_routed")})
            for r in rows if not r["passed"]]


QWEN3_PARAMETERS = {f"model.layers.0.{m}.weight" for m in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj", "self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm")} | {
    "lm_head.weight", "model.norm.weight", "model.embed_tokens.weight"}


def job_rows(rows: list[dict], job: str) -> list[dict]:
    """The rows of one job (``"tp2 qwen3"``) of a model-parallel report, ``informational`` made explicit."""
    return [{**r, "informational": r["details"].get("informational", False)} for r in rows
            if r["name"].startswith(job + " ")]


def check_tp2_qwen3_rows(rows: list[dict]) -> None:
    """The tp2:qwen3 job's rows (the audit's interpreter default, also run by the README main job's --suite all)."""
    assert rows and not _failed(rows), _failed(rows)
    checks = {r["check"] for r in rows if not r["informational"]}
    assert checks == {"logprobs", "routed", "grads", "generate_vs_trainer"}
    assert all(r["details"]["pg_backend"] == "gloo" and r["details"]["ranks"] == 2 for r in rows)
    claimed = {r["name"].split(" ")[2] for r in rows if r["check"] == "grads"}
    assert claimed == QWEN3_PARAMETERS  # every parameter, q_norm / k_norm on their head-sharded route included
    assert next(r for r in rows if r["check"] == "grad_scope")["details"]["outside"] == {}
    drift = [r["details"]["mismatches"] for r in rows if r["check"] == "default_drift"]
    assert len(drift) == 2  # informational: recorded per rank, not asserted either way


def check_dp2_qwen3_rows(rows: list[dict]) -> None:
    """The dp2:qwen3 job's rows (the audit's interpreter default, also run by the README main job's --suite all)."""
    assert rows and not _failed(rows), _failed(rows)
    claimed = {r["name"].split(" ")[2] for r in rows if r["check"] == "grads"}
    assert claimed == QWEN3_PARAMETERS
    scope = next(r for r in rows if r["check"] == "grad_scope")["details"]
    assert scope["outside"] == {} and set(scope["kinds"].values()) == {"invariant"}
    assert any(r["check"] == "grads_repeat" and r["passed"] for r in rows)
    plain = next(r for r in rows if r["check"] == "plain_dp_drift")["details"]["mismatches"]
    assert set(plain) >= claimed  # what differs without the invariant reduction: counted per parameter


def _skip_where_the_main_job_runs_it() -> None:
    __tracebackhide__ = True  # the skip reported at the test's line
    from tests.test_container_build import skip_where_the_main_job_runs  # lazily: that module imports this one

    skip_where_the_main_job_runs("runs this job on the interpreter and checks its rows")


@cpu_ranks_only
def test_tp2_qwen3_equals_one_process_bitwise_through_the_audit_cli(tmp_path):
    """The suite as a user runs it (``detkit audit --suite model-parallel``), one job: it starts its 2 ranks."""
    import json
    import os
    import subprocess
    import sys

    _skip_where_the_main_job_runs_it()
    env = {**os.environ, "TRITON_INTERPRET": "1", "DETKIT_MODEL_PARALLEL_JOBS": "tp2:qwen3",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-m", "detkit", "audit", "--device", "cpu", "--suite", "model-parallel",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    check_tp2_qwen3_rows(job_rows(rows, "tp2 qwen3"))
    coverage = next(r for r in rows if r["check"] == "coverage")["details"]
    assert coverage["run"] == ["tp2:qwen3"] and "dp2:qwen3" in coverage["not_run"]


@cpu_ranks_only
def test_dp2_qwen3_reduced_gradients_equal_one_process_bitwise():
    _skip_where_the_main_job_runs_it()
    job, rows = _launch_and_compare("dp2", "qwen3")
    check_dp2_qwen3_rows(job_rows(rows, "dp2 qwen3"))


@cpu_ranks_only
def test_dp2_qwen3_moe_embedding_router_and_experts_gradients_equal_one_process_bitwise():
    """Qwen3-MoE (4 experts, top-2) at DP=2: the embedding (index_sum partials), the router (a DP Linear route) and
    the experts (the MoE layer's FP32 dW partials) reduced in rank order equal the one-process model prepared with
    dp_size=2, bitwise, twice; no parameter is left outside."""
    job, rows = _launch_and_compare("dp2", "qwen3-moe")
    assert not _failed(rows), _failed(rows)
    claimed = {r["name"].split(" ")[2] for r in rows if r["check"] == "grads"}
    assert {"model.embed_tokens.weight", "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.down_proj"} <= claimed
    scope = next(r for r in rows if r["check"] == "grad_scope")["details"]
    assert scope["outside"] == {} and set(scope["kinds"].values()) == {"invariant"}
    assert scope["covered"] == len(claimed) == 14  # every parameter of the tiny Qwen3-MoE
    assert any(r["check"] == "grads_repeat" and r["passed"] for r in rows)
    routed = {key.split(" -> ")[0] for r in rows if r["check"] == "routed" for key in r["details"]["routed"]}
    assert {"embedding (dp)", "moe experts (dp)", "linear (dp)"} <= routed


@cpu_ranks_only
def test_tp2_qwen3_moe_equals_one_process_bitwise():
    """Qwen3-MoE (4 experts, top-2) at TP=2: the plan shards attention and the lm_head, the router and experts stay
    replicated on the mode's MoE routes; log-probs, every gradient and generate() against the one-process trainer."""
    job, rows = _launch_and_compare("tp2", "qwen3-moe")
    assert not _failed(rows), _failed(rows)
    checks = {r["check"] for r in rows if not r["details"].get("informational", False)}
    assert {"logprobs", "routed", "grads", "generate_vs_trainer"} <= checks
    claimed = {r["name"].split(" ")[2] for r in rows if r["check"] == "grads"}
    assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.down_proj", "lm_head.weight"} <= claimed


@cpu_ranks_only
def test_tp2_dp2_qwen3_on_four_ranks_equals_one_process_bitwise():
    """TP=2 x DP=2 on a ("dp", "tp") mesh of 4 gloo ranks: each rank's log-probs and every reduced gradient (TP
    shards gathered, DP partials summed in rank order) against the one-process model prepared with both splits."""
    job, rows = _launch_and_compare("tp2dp2", "qwen3")
    assert not _failed(rows), _failed(rows)
    assert job.tp == 2 and job.dp == 2
    assert len([r for r in rows if r["check"] == "grads"]) == 14
    scope = next(r for r in rows if r["check"] == "grad_scope")["details"]
    assert scope["outside"] == {} and set(scope["kinds"].values()) == {"invariant"}


@cpu_ranks_only
@pytest.mark.parametrize("kind", ["dp2-ddp", "dp2-fsdp2"])
def test_dp2_under_ddp_and_fsdp2_reduced_linear_gradients_equal_one_process(kind):
    """DDP (backward under no_sync, then reduce_gradients) and FSDP2 (fully_shard per layer and root; the routes leave
    the Linear and RMSNorm weights' gradients to reduce_gradients(average=True), FSDP2 reduce-scatters the rest)."""
    job, rows = _launch_and_compare(kind, "qwen3")
    assert not _failed(rows), _failed(rows)
    assert len([r for r in rows if r["check"] == "grads"]) == 14  # 8 Linear, 5 RMSNorm weights, the embedding
    kinds = next(r for r in rows if r["check"] == "grad_scope")["details"]["kinds"]
    assert set(kinds.values()) == {"invariant"} and "model.embed_tokens.weight" in kinds
