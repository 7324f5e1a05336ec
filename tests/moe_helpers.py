"""Helpers shared by the MoE kernel tests (tests/test_moe.py, tests/test_moe_fp8.py)."""

import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from detkit.audits.moe import MoeCase, invariance_variants
from detkit.kernels.det_gemm.launch import GemmConfig
from detkit.kernels.moe.layer import deinterleave_gate_up
from detkit.kernels.moe.routing import sync_checks
from detkit.toolkit.contract import compare_bits


def assert_stages(stage_checks: Callable[[dict], tuple[dict, dict]], inp: dict) -> dict:
    """Every stage within its bound and every padding row zero; returns the checks' extra details."""
    results, extra = stage_checks(inp)
    failed = {s: r for s, r in results.items() if not r.passed}
    assert not failed, failed
    assert all(extra["padding_zero"].values()), extra
    return extra


def layer_args(inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The forward's positional inputs: x, w1, w2, topk_ids, scores."""
    return inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"]


def assert_forward_batch_invariant(fwd: Callable[..., tuple], inp: dict, case: MoeCase, seed: int) -> None:
    """Each invariance variant's compared tokens have the output bits they have in the full batch."""
    full = fwd(*layer_args(inp))[0]
    for variant, sub, rows, full_rows in invariance_variants(inp, case, seed):
        got = fwd(*layer_args(sub))[0]
        res = compare_bits(got[rows.to(got.device)], full[full_rows.to(full.device)])
        assert res.equal, (variant, res)


def assert_rejected(fwd: Callable[..., tuple], inp: dict, change: dict, exc_type: type) -> None:
    """``fwd`` raises ``exc_type`` in the validating mode (bad ids and scores; outside it they poison the outputs:
    tests/test_moe_nosync.py)."""
    bad = {**inp, **change}
    with sync_checks(), pytest.raises(exc_type):
        fwd(*layer_args(bad))


def forbid_kernels(monkeypatch, module, *names: str) -> None:
    """Makes each of ``module``'s functions ``names`` (the first kernel launches of a layer call) fail the test: a
    refusal that is checked with these forbidden happens before any kernel is queued."""
    def queued(*args, **kwargs):
        raise AssertionError("a kernel was queued before the refusal")

    for name in names:
        monkeypatch.setattr(module, name, queued)


def compile_sm90_offline(script: str, tmp_path, *argv: str) -> dict:
    """Runs ``script`` (which compiles kernels for sm_90 with Triton's bundled ptxas and prints a JSON report
    as its last line) in a fresh interpreter without TRITON_INTERPRET; skips when Triton has no NVIDIA
    backend."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"Triton's NVIDIA backend is not installed: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fp8_stage_runs(inp: dict[str, torch.Tensor], routing, backend: str) -> tuple[dict[str, Callable], dict]:
    """The four FP8 grouped GEMM stages on one input set (x; its rows reversed as dout), each a function of a
    config returning a tuple of outputs, and the BF16 intermediates they start from (h, gu, dgu)."""
    from detkit.kernels.moe.fp8.quant import quantize_rowwise, quantize_weight
    from detkit.kernels.moe.fp8.layer import moe_fp8_dgrad, moe_fp8_dgrad_dswiglu, moe_fp8_down, moe_fp8_dx_route, moe_fp8_up_swiglu

    x_q, x_s = quantize_rowwise(inp["x"])
    dout_q, dout_s = quantize_rowwise(inp["x"].flip(0))
    w1f, w2f = quantize_weight(inp["w1"]), quantize_weight(inp["w2"])
    gu, h, h_q, h_s = moe_fp8_up_swiglu(x_q, x_s, w1f, routing, backend)
    dgu, dgu_q, dgu_s = moe_fp8_dgrad_dswiglu(dout_q, dout_s, w2f, gu, routing, backend)
    runs = {
        "up": lambda c: moe_fp8_up_swiglu(x_q, x_s, w1f, routing, backend, config=c),
        "down": lambda c: (moe_fp8_down(h_q, h_s, w2f, routing, backend, config=c),),
        "dgrad": lambda c: moe_fp8_dgrad(dout_q, dout_s, w2f, gu, routing, backend, config=c, h=h),  # + dscore partials
        "dx": lambda c: (moe_fp8_dx_route(dgu_q, dgu_s, w1f, routing, backend, config=c),),
    }
    return runs, {"h": h, "gu": gu, "dgu": dgu}


def skewed_ids(t: int, e: int, k: int, seed: int) -> torch.Tensor:
    """top-k ids [t, k] int32 where expert 0 gets no rows and expert 1 a single one (a padding-only tile and an
    almost empty one), the rest spread over experts 2..e-1."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e - 2, generator=gen)[:k] + 2 for _ in range(t)]).to(torch.int32)
    ids[0, 0] = 1
    return ids


def assert_ws_refused_off_sm90(runs: dict[str, Callable], config, device: torch.device) -> None:
    """Off sm_90 (the interpreter) every stage refuses the valid Gluon "ws" ``config`` by name, after its host-side
    checks passed; on the GPU the bit tests run the same stages."""
    if device.type != "cpu":
        return
    for run in runs.values():
        with pytest.raises(ValueError, match="variant 'ws' is a Gluon kernel for sm_90 and has no 'triton_interpreter'"):
            run(config)


# The Triton tiles of the FP8 stages whose sm_90 picks are Gluon configs: the bit references of the Gluon kernels on
# the GPU, and what the offline sm_90 compile checks for the Triton kernels.
FP8_TRITON_TILES = {
    "up": GemmConfig(64, 128, 128, 1, 4, 3, "tma"), "down": GemmConfig(64, 128, 128, 1, 4, 3, "tma"),
    "dgrad": GemmConfig(128, 64, 128, 1, 4, 4, "tma"), "dx": GemmConfig(64, 128, 128, 1, 4, 3, "tma"),
    "wgrad": GemmConfig(64, 128, 128, 1, 4, 3, "tma"),
}



def run_on_parameters(layer: Callable[..., torch.Tensor], inp: dict, split: bool, main_grads: bool = False,
                      **kwargs) -> dict[str, torch.Tensor]:
    """``layer`` (moe_mlp or moe_mlp_fp8) forward and backward as a model calls it, ``split``: inp's weights held as
    transformers holds them (gate_up_proj [E, 2I, H], down_proj [E, H, I]) and passed as views with gate_up="split",
    gradients as their .grad; else on the layer's own layout (w1 interleaved, w2 [E, I, H]), gradients converted to
    the parameters' layouts. ``main_grads``: FP32 accumulators starting at 0.5, in w1's and w2's layouts, instead of
    .grad. Returns out, dx, dscores, d_gate_up_proj, d_down_proj."""
    x, s = inp["x"].clone().requires_grad_(), inp["scores"].clone().requires_grad_()
    if split:
        g = deinterleave_gate_up(inp["w1"]).transpose(1, 2).contiguous().requires_grad_()
        d = inp["w2"].transpose(1, 2).contiguous().requires_grad_()
        w1, w2 = g.transpose(1, 2), d.transpose(1, 2)
    else:
        w1, w2 = (inp[n].clone().requires_grad_() for n in ("w1", "w2"))
    mg = tuple(torch.full_like(w, 0.5, dtype=torch.float32) for w in (w1, w2)) if main_grads else None
    out = layer(x, w1, w2, inp["topk_ids"], s, mg, gate_up="split" if split else "interleaved", **kwargs)
    out.backward(inp["dout"])
    if split:
        d_gate_up, d_down = (mg[0].transpose(1, 2), mg[1].transpose(1, 2)) if main_grads else (g.grad, d.grad)
    else:
        dw1, dw2 = mg if main_grads else (w1.grad, w2.grad)
        d_gate_up, d_down = deinterleave_gate_up(dw1).transpose(1, 2), dw2.transpose(1, 2)
    return {"out": out, "dx": x.grad, "dscores": s.grad, "d_gate_up_proj": d_gate_up, "d_down_proj": d_down}
