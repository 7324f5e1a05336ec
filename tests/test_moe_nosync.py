"""The MoE layers (BF16 and FP8) without host synchronization: no device-to-host read in the forward or the backward
(a dispatch-level detector that catches the synchronous validating mode's one read), the same bits as that mode
(which runs over the exact P), a refused batch poisoning every output with NaN and setting the sticky error flags
without a read, the validating mode refusing with check_topk's messages, and (GPU) forward+backward captured in a
CUDA graph and replayed on new inputs with the eager calls' bits."""

from __future__ import annotations

import contextlib

import pytest
import torch

from detkit.audits.moe import MoeCase, make_inputs
from detkit.kernels.moe.layer import check_moe_errors, error_flags, moe_mlp, moe_mlp_bwd, moe_mlp_fwd, sync_checks
from detkit.kernels.moe.fp8.layer import moe_mlp_fp8, moe_mlp_fp8_bwd, moe_mlp_fp8_fwd
from detkit.kernels.moe.routing import max_padded_rows
from detkit.toolkit.host_reads import host_reads as no_host_reads
from tests.conftest import assert_bits_equal

H, I, E, K = 32, 48, 8, 2
H8 = I8 = 128  # the FP8 layer needs multiples of 128


def _inputs(device, fp8=False, t=24, seed=3):
    """Routes on experts 3 and 5 only (one masked): P = 256 while the bound is 512, so the rows and tiles past P are
    gated on the device."""
    h, i = (H8, I8) if fp8 else (H, I)
    inp = make_inputs(MoeCase(t, h, i, E, K, "random", seed), device)
    ids = inp["topk_ids"]
    ids[:, 0], ids[:, 1] = 3, 5
    ids[7, 1] = -1
    assert max_padded_rows(ids.numel(), E) > 256
    return inp


def _layer(fp8):
    if fp8:
        return (lambda *a: moe_mlp_fp8_fwd(*a, weight_cache=None)), moe_mlp_fp8_bwd
    return moe_mlp_fwd, moe_mlp_bwd


def _run(inp, fp8, main_grads=None):
    fwd, bwd = _layer(fp8)
    out, saved = fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])
    grads = bwd(inp["dout"], saved, main_grads=main_grads)
    return {"out": out, "dx": grads.dx, "dw1": grads.dw1, "dw2": grads.dw2, "dscores": grads.dscores}, saved


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_forward_and_backward_read_nothing_back(fp8, device):
    inp = _inputs(device, fp8)
    fwd, bwd = (moe_mlp_fp8_fwd, moe_mlp_fp8_bwd) if fp8 else (moe_mlp_fwd, moe_mlp_bwd)  # FP8: the weight cache
    error_flags(device)  # allocated once per device, before the first call (as before a graph capture)
    with no_host_reads() as reads:
        out, saved = fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])
    assert reads == [], f"forward: {reads}"
    with no_host_reads() as reads:
        bwd(inp["dout"], saved)
    assert reads == [], f"backward: {reads}"
    assert saved.routing.padded_rows == max_padded_rows(inp["topk_ids"].numel(), E)  # the bound, not P = 256


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_autograd_forward_and_backward_read_nothing_back(fp8, device):
    inp = _inputs(device, fp8, t=8)
    x, w1, w2, scores = (inp[n].clone().requires_grad_() for n in ("x", "w1", "w2", "scores"))
    layer = (lambda *a: moe_mlp_fp8(*a, weight_cache=None)) if fp8 else moe_mlp
    error_flags(device)
    with no_host_reads() as reads:
        out = layer(x, w1, w2, inp["topk_ids"], scores)
        grads = torch.autograd.grad(out, (x, w1, w2, scores), inp["dout"])
    assert reads == [], reads
    assert all(bool(g.isfinite().all()) for g in grads)


def test_the_detector_catches_the_validating_modes_read(device):
    # The synchronous mode reads the routing's counts back once per forward (what the layer did before): the
    # detector must see it, or the tests above prove nothing.
    inp = _inputs(device)
    with sync_checks(), no_host_reads() as reads:
        moe_mlp_fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])
    assert reads, "the validating mode's device-to-host read was not detected"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_bound_gives_the_exact_routings_bits(fp8, device):
    inp = _inputs(device, fp8)
    got, saved = _run(inp, fp8)
    with sync_checks():
        want, exact = _run(inp, fp8)
    assert exact.routing.padded_rows == 256 < saved.routing.padded_rows
    for name in want:
        assert_bits_equal(got[name], want[name], name)
    # main_grad accumulation too: the same FP32 sums over each expert's rows
    inits = [torch.randn(inp[n].shape, generator=torch.Generator().manual_seed(9)).to(device) for n in ("w1", "w2")]
    mg_got, mg_want = [t.clone() for t in inits], [t.clone() for t in inits]
    _run(inp, fp8, main_grads=mg_got)
    with sync_checks():
        _run(inp, fp8, main_grads=mg_want)
    for name, g, w in zip(("main_grad_w1", "main_grad_w2"), mg_got, mg_want):
        assert_bits_equal(g, w, name)


@pytest.fixture(autouse=True)
def no_earlier_refusals(device):
    """Each test starts with the device's error flags clear: tests of other files in this process may have fed the
    layer refused batches (the read clears the flags)."""
    with contextlib.suppress(ValueError):
        check_moe_errors(device)


def _bad(inp, kind):
    bad = dict(inp)
    if kind == "duplicate":
        ids = inp["topk_ids"].clone()
        ids[2, 1] = ids[2, 0]
        bad["topk_ids"] = ids
    elif kind == "out_of_range":
        ids = inp["topk_ids"].clone()
        ids[4, 0] = E
        bad["topk_ids"] = ids
    else:
        scores = inp["scores"].clone()
        scores[1, 1] = float("inf")
        bad["scores"] = scores
    return bad


REFUSALS = [("duplicate", "duplicate topk id", "more than once"),
            ("out_of_range", "out of range", "out of range"),
            ("non_finite", "non-finite score", "NaN or Inf")]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("kind, flag_msg, sync_msg", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_refused_batch_poisons_every_output_and_sets_the_flag(kind, flag_msg, sync_msg, fp8, device):
    bad = _bad(_inputs(device, fp8), kind)
    inits = [torch.zeros(bad[n].shape, device=device) for n in ("w1", "w2")]
    with no_host_reads() as reads:
        got, saved = _run(bad, fp8)
        _run(bad, fp8, main_grads=inits)
        refused = saved.routing.refused
    assert reads == []
    for name, t in {**got, "main_grad_w1": inits[0], "main_grad_w2": inits[1]}.items():
        assert bool(t.isnan().all()), f"{name}: not all NaN"
    assert bool(refused)
    with pytest.raises(ValueError, match=flag_msg):
        saved.routing.check()
    with pytest.raises(ValueError, match=flag_msg):
        check_moe_errors(device)
    check_moe_errors(device)  # cleared by the read: a good batch since then raises nothing
    good, saved = _run(_inputs(device, fp8), fp8)
    assert not bool(saved.routing.refused) and bool(good["out"].isfinite().all())
    saved.routing.check()
    check_moe_errors(device)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("kind, flag_msg, sync_msg", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_the_validating_mode_refuses_with_check_topks_messages(kind, flag_msg, sync_msg, fp8, device):
    bad = _bad(_inputs(device, fp8), kind)
    fwd, _ = _layer(fp8)
    with sync_checks(), pytest.raises(ValueError, match=sync_msg):
        fwd(bad["x"], bad["w1"], bad["w2"], bad["topk_ids"], bad["scores"])
    with sync_checks(False):  # nested: off again inside
        out = fwd(bad["x"], bad["w1"], bad["w2"], bad["topk_ids"], bad["scores"])[0]
    assert bool(out.isnan().all())
    with pytest.raises(ValueError, match=flag_msg):  # the poisoned call set the flag; the validating one too
        check_moe_errors(device)


# ---------------------------------------------------------------------------------------------
# GPU: forward + backward captured in a CUDA graph
# ---------------------------------------------------------------------------------------------
def _graph_step(fp8):
    layer = (lambda *a: moe_mlp_fp8(*a, weight_cache=None)) if fp8 else moe_mlp

    def step(x, w1, w2, ids, scores, dout):
        out = layer(x, w1, w2, ids, scores)
        return (out, *torch.autograd.grad(out, (x, w1, w2, scores), dout))
    return step


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_forward_backward_capture_in_a_cuda_graph(fp8, device):
    names = ("x", "w1", "w2", "topk_ids", "scores", "dout")
    t, h, i, e, k = (512, 256, 256, 8, 2)
    case = lambda seed: make_inputs(MoeCase(t, h, i, e, k, "random", seed), device)  # noqa: E731
    static = {n: v.clone() for n, v in case(11).items() if n in names}
    for n in ("x", "w1", "w2", "scores"):
        static[n].requires_grad_()
    step = _graph_step(fp8)
    args = [static[n] for n in names]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels, allocates the error flags
        for _ in range(2):
            step(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*args)
    for seed in (12, 13):  # new inputs copied into the static buffers, including a new routing
        new = case(seed)
        if seed == 13:  # a sparser routing: P below the first one's, the same bound
            new["topk_ids"][:, 0], new["topk_ids"][:, 1] = 1, 6
        with torch.no_grad():
            for n in names:
                static[n].copy_(new[n])
        graph.replay()
        torch.cuda.synchronize()
        eager = step(*[new[n].clone().requires_grad_(n in ("x", "w1", "w2", "scores")) for n in names])
        for name, g, w in zip(("out", "dx", "dw1", "dw2", "dscores"), captured, eager):
            assert_bits_equal(g, w, f"{name} (replay, seed {seed})")
            assert bool(g.isfinite().all()), name
    check_moe_errors(device)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_refused_batch_poisons_the_sm90_kernels_outputs(fp8, device):
    # At a shape the Gluon "ws" kernels take (their gated tile loops and their weight gradients' NaN stores).
    inp = make_inputs(MoeCase(512, 256, 256, 8, 2, "random", 21), device)
    inp["topk_ids"][5, 1] = inp["topk_ids"][5, 0]
    check_moe_errors(device)
    inits = [torch.zeros(inp[n].shape, device=device) for n in ("w1", "w2")]
    got, saved = _run(inp, fp8)
    _run(inp, fp8, main_grads=inits)
    for name, t in {**got, "main_grad_w1": inits[0], "main_grad_w2": inits[1]}.items():
        assert bool(t.isnan().all()), f"{name}: not all NaN"
    with pytest.raises(ValueError, match="duplicate topk id"):
        check_moe_errors(device)


def test_flags_made_under_inference_mode_are_cleared_outside_it(device, monkeypatch):
    """A rollout under torch.inference_mode() may be the flags' first use; a training step's check outside it (and
    one inside it) still reads and clears them."""
    from detkit.kernels.moe import routing

    monkeypatch.setattr(routing, "_ERROR_FLAGS", {})
    with torch.inference_mode():
        flags = routing.error_flags(device)
    assert not flags.is_inference() and flags.tolist() == [0] * routing.NUM_CHECKS
    flags[1] = 3  # what the routing kernels write for a batch with duplicate ids
    with pytest.raises(ValueError, match="since the last check: row\\(s\\) with a duplicate topk id"):
        check_moe_errors(device)
    assert flags.tolist() == [0] * routing.NUM_CHECKS
    flags[0] = 1
    with torch.inference_mode(), pytest.raises(ValueError, match="topk id\\(s\\) out of range"):
        check_moe_errors(device)
    assert flags.tolist() == [0] * routing.NUM_CHECKS
