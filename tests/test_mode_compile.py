"""mode/compile.py: a torch.compile'd model inside ``batch_invariant_mode`` runs its GEMMs and last-dim
means on detkit's kernels (the post-grad pass puts them on ``detkit::mode_*`` ops), with the bits eager mode
gives, the config chosen from each call's M (one dynamic graph, rows invariant), and torch's kernels when the
same graph runs outside the mode; the ops' own autograd; CUDA-graph capture and replay (GPU)."""

from __future__ import annotations

import pytest
import torch

import detkit
from detkit.mode import compile as mode_compile
from detkit.toolkit.contract import compare_bits
from detkit.toolkit.fixtures import bf16_randn


def assert_bits(got, want, what=""):
    result = compare_bits(got, want)
    assert result.equal, f"{what}: {result}"


class LinearChain(torch.nn.Module):
    """GEMMs only (no elementwise op for Inductor to fuse differently from eager): eager and compiled must
    give the same bits when both run detkit's kernels."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(48, 64, bias=True)
        self.down = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.down(self.up(x))


def chain(device):
    torch.manual_seed(0)
    return LinearChain().to(device=device, dtype=torch.bfloat16)


def run(model, x, dy):
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.backward(dy)
    return y.detach(), x.grad, [p.grad for p in model.parameters()]


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    detkit.reset_mode_counters()
    yield
    assert not detkit.is_batch_invariant_mode_enabled()


def test_compiled_model_runs_detkit_kernels_with_eager_bits_and_runtime_m(device):
    model = chain(device)
    compiled = torch.compile(model, dynamic=True)
    x = bf16_randn((2, 9, 48), 1, device)
    dy = bf16_randn((2, 9, 32), 2, device)
    with detkit.batch_invariant_mode():
        eager = run(model, x, dy)
        eager_routes = detkit.mode_counters().as_dict()["routed"]
        detkit.reset_mode_counters()
        got = run(compiled, x, dy)
        compiled_routes = detkit.mode_counters().as_dict()["routed"]
        detkit.reset_mode_counters()
        one_row = compiled(x[:1, :1]).detach()  # same graph (dynamic), M = 1: its own det_gemm config
    assert compiled_routes == eager_routes == {"addmm -> det_gemm_fwd": 1, "mm -> det_gemm_fwd": 1,
                                               "mm -> det_gemm_da": 2, "mm -> det_gemm_db": 2}
    assert_bits(got[0], eager[0], "output")
    assert_bits(got[1], eager[1], "grad_input")
    for i, (g, e) in enumerate(zip(got[2], eager[2])):
        assert_bits(g, e, f"parameter {i} grad")
    assert_bits(one_row, eager[0][:1, :1], "one row vs the batch")
    assert detkit.mode_counters().as_dict()["routed"] == {"addmm -> det_gemm_fwd": 1, "mm -> det_gemm_fwd": 1}

    # Outside the mode the same compiled graph runs torch's kernels (addmm / mm as in eager).
    outside = compiled(x).detach()
    assert_bits(outside, model(x).detach(), "outside the mode")
    assert detkit.mode_counters().as_dict()["routed"] == {"addmm -> det_gemm_fwd": 1, "mm -> det_gemm_fwd": 1}


def test_compiled_rmsnorm_mean_runs_the_row_mean(device):
    def rms(x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    x = bf16_randn((6, 40), 3, device)
    with detkit.batch_invariant_mode():
        out = torch.compile(rms)(x)
    assert detkit.mode_counters().as_dict()["routed"] == {"mean.dim -> row_mean": 1}
    assert out.shape == x.shape


def test_rewrite_graph_replaces_every_gemm_and_mean_node():
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    a, b, bias = graph.placeholder("a"), graph.placeholder("b"), graph.placeholder("bias")
    mm = graph.call_function(aten.mm.default, (a, b))
    addmm = graph.call_function(aten.addmm.default, (bias, a, b), {"beta": 0})
    bmm = graph.call_function(aten.bmm.default, (a, b))
    mean = graph.call_function(aten.mean.dim, (mm, [-1], True))
    graph.output((addmm, bmm, mean))
    assert mode_compile.rewrite_graph(graph) == 4
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.detkit.mode_mm.default, torch.ops.detkit.mode_addmm.default,
                       torch.ops.detkit.mode_bmm.default, torch.ops.detkit.mode_mean_dim.default]
    addmm_node = next(n for n in graph.nodes if n.target == torch.ops.detkit.mode_addmm.default)
    assert addmm_node.args[3:] == (0.0, 1.0)


def test_the_ops_autograd_matches_aten_in_the_mode(device):
    a = bf16_randn((7, 24), 4, device)
    w = bf16_randn((16, 24), 5, device)
    bias = bf16_randn((16,), 6, device)
    dy = bf16_randn((7, 16), 7, device)
    mean_in = bf16_randn((7, 24), 8, device)

    def grads(fn, *inputs):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        fn(*leaves).backward(dy)
        return [t.grad for t in leaves]

    with detkit.batch_invariant_mode():
        ours = grads(lambda a, w, bias: torch.ops.detkit.mode_addmm(bias, a, w.t(), 1.0, 1.0), a, w, bias)
        theirs = grads(lambda a, w, bias: torch.addmm(bias, a, w.t()), a, w, bias)
        mean_ours = grads(lambda x: torch.ops.detkit.mode_mean_dim(x, [-1], True, None).expand(7, 16), mean_in)
        mean_theirs = grads(lambda x: x.mean(-1, keepdim=True).expand(7, 16), mean_in)
    for name, o, t in zip(("a", "w", "bias"), ours, theirs):
        assert_bits(o, t, name)
    assert_bits(mean_ours[0], mean_theirs[0], "mean")


@pytest.mark.gpu
def test_cuda_graph_capture_replays_the_mode_kernels(device):
    model = chain(device)
    x = bf16_randn((4, 48), 9, device)
    static_x = x.clone()
    with detkit.batch_invariant_mode(), torch.no_grad():
        eager = model(x)
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(static_x)  # warm-up (Triton compiles outside the capture)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = model(static_x)
    before = detkit.mode_counters()
    graph.replay()
    torch.cuda.synchronize()
    assert_bits(static_y, eager, "CUDA-graph replay")
    assert (detkit.mode_counters() - before).routed == {}  # a replay launches the captured kernels, no Python


@pytest.mark.gpu
def test_compiled_reduce_overhead_runs_detkit_kernels(device):
    model = chain(device)
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)
    x = bf16_randn((8, 48), 10, device)
    with detkit.batch_invariant_mode(), torch.no_grad():
        eager = model(x)
        for _ in range(3):  # record, then replay
            got = compiled(x)
        torch.cuda.synchronize()
    assert_bits(got, eager, "compiled + CUDA graphs vs eager")
    assert detkit.mode_counters().as_dict()["routed"]["addmm -> det_gemm_fwd"] >= 2


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped GEMM")
def test_rewrite_graph_puts_grouped_gemms_on_the_mode_op():
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    a, b, offs = graph.placeholder("a"), graph.placeholder("b"), graph.placeholder("offs")
    fwd = graph.call_function(aten._grouped_mm.default, (a, b, offs))
    wgrad = graph.call_function(aten._grouped_mm.default, (a, b), {"offs": offs, "out_dtype": torch.bfloat16})
    graph.output((fwd, wgrad))
    assert mode_compile.rewrite_graph(graph) == 2
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    assert [n.target for n in nodes] == [torch.ops.detkit.mode_grouped_mm.default] * 2
    assert [n.args[2:] for n in nodes] == [(offs, None, None), (offs, None, torch.bfloat16)]


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped GEMM")
def test_a_compiled_grouped_linear_runs_detkits_grouped_kernels_with_eager_bits(device):
    """Forward and backward of a compiled grouped linear: in the mode the eager route's bits and counts (the backward
    graph's grad_input and grad_weight included); outside it torch's kernel through the same graph."""
    import torch.nn.functional as F

    def grouped_linear(x, w, offs):
        return F.grouped_mm(x, w.transpose(-2, -1), offs=offs)

    x, w = bf16_randn((21, 16), 9, device), bf16_randn((3, 24, 16), 10, device)
    offs = torch.tensor([5, 5, 19], dtype=torch.int32, device=device)
    dy = bf16_randn((21, 24), 11, device)

    def run_once(fn):
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = fn(xl, wl, offs)
        y.backward(dy)
        return y.detach(), xl.grad, wl.grad

    with detkit.batch_invariant_mode(strict=True):
        eager = run_once(grouped_linear)
        detkit.reset_mode_counters()
        compiled = run_once(torch.compile(grouped_linear))
    for name, got, want in zip(("y", "x.grad", "w.grad"), compiled, eager):
        assert_bits(got, want, name)
    assert detkit.mode_counters().as_dict()["routed"] == {"_grouped_mm -> detkit.grouped_mm": 2,
                                                          "_grouped_mm -> detkit.grouped_wgrad": 1}
    detkit.reset_mode_counters()
    outside = run_once(torch.compile(grouped_linear))
    assert detkit.mode_counters().as_dict() == {"routed": {}, "not_routed": {}}
    assert_bits(outside[0][:19], grouped_linear(x, w, offs)[:19], "outside the mode: torch's kernel")


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped GEMM")
def test_the_grouped_ops_autograd_matches_aten_in_the_mode(device):
    x, w = bf16_randn((13, 16), 12, device), bf16_randn((2, 8, 16), 13, device)
    offs = torch.tensor([6, 13], dtype=torch.int32, device=device)
    dy = bf16_randn((13, 8), 14, device)

    def grads(fn):
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        fn(xl, wl.transpose(-2, -1)).backward(dy)
        return xl.grad, wl.grad

    with detkit.batch_invariant_mode():
        ours = grads(lambda a, b: torch.ops.detkit.mode_grouped_mm(a, b, offs, None, None))
        theirs = grads(lambda a, b: torch._grouped_mm(a, b, offs=offs))
    assert_bits(ours[0], theirs[0], "grad_input")
    assert_bits(ours[1], theirs[1], "grad_weight")
