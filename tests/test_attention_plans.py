"""The attention kernels' launch plans (kernels/attention/launch.py ``PLANNED``: kernels/backend.py PlannedKernel).

CPU: the five kernels replaced by stand-ins for Triton's compile and launch (tests/plan_helpers.py) while the launchers
run on CPU tensors: decode steps whose lengths, batch, pointers and grids change, on the one-pass and the split grid,
packed and paged sequences and the backward. Every launch must run the binary Triton compiles for that call (a stride
that moves between specialization classes gives a new plan) with the argument list Triton's own launcher would build
(no stale length, stride, scale, pointer or grid). Nothing is computed.
GPU: the same calls on the real kernels through the plans and through Triton's own launch (``plans=False``): the same
bits, at lengths that change from call to call, and the decode steps equal the prefill's rows."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton.backends.nvidia.driver")

import detkit.kernels.attention.launch as attention_launch  # noqa: E402
from detkit.kernels import backend  # noqa: E402
from detkit.kernels.attention import attention, attention_fwd_bound  # noqa: E402
from detkit.kernels.attention.launch import (  # noqa: E402
    PLANNED, Logits, Sequences, attention_bwd_launch, attention_fwd_launch, check_paged,
)
from detkit.kernels.backend import PlannedKernel  # noqa: E402
from detkit.toolkit.contract import check_bound  # noqa: E402
from detkit.toolkit.fixtures import bf16_randn  # noqa: E402
from tests.attention_helpers import cu_seqlens, forced_paths, i32  # noqa: E402
from tests.conftest import TEST_DEVICE, assert_bits_equal  # noqa: E402
from tests.plan_helpers import Compiling, check_last_launch, jit_twin  # noqa: E402


# The stand-in tests launch on CPU tensors, which the kernels' backend accepts only under the interpreter (CI's run).
interpreter_only = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="CPU tensors need the Triton interpreter (the CPU run)")


class _Spy(PlannedKernel):
    """A PlannedKernel that remembers its last launch's (grid, args, options)."""

    __slots__ = ("last",)

    def launch(self, grid, args, options):
        self.last = (grid, list(args), dict(options))
        super().launch(grid, args, options)


@pytest.fixture
def standins(monkeypatch):
    monkeypatch.setattr(backend, "_current_device", lambda: 0)
    monkeypatch.setattr(backend, "_raw_stream", lambda index: Compiling.STREAM)
    kernels = {}
    for name, planned in list(PLANNED.items()):
        kernels[name] = Compiling(planned.kernel)
        spy = _Spy(kernels[name])
        spy.last = None
        monkeypatch.setitem(PLANNED, name, spy)
    attention_launch.clear_launch_plans()
    yield kernels
    attention_launch.clear_launch_plans()


def _check_launched(kernels: dict, names) -> list[int]:
    """Each named kernel's last launch: its own binary, Triton's argument list; returns the binaries."""
    ran = []
    for name in names:
        spy = PLANNED[name]
        assert spy.last is not None, f"{name} did not launch"
        ran.append(check_last_launch(kernels[name], *spy.last))
        spy.last = None
        assert all(plan.raw is not None for plan in spy.plans.values()), f"{name}: a plan left the C entry point"
    return ran


def test_constexprs_are_each_kernels_last_parameters():
    # The launchers pass every parameter in order, the constexprs last (launch._constexprs).
    for name, planned in PLANNED.items():
        constexpr = [p.is_constexpr for p in jit_twin(planned.kernel).params]
        first = constexpr.index(True)
        assert all(constexpr[first:]) and not any(constexpr[:first]), name
    with pytest.raises(TypeError, match="constexprs .* are not its last parameters"):
        attention_launch._constexprs("delta", {"HEAD_DIM": 64})


@interpreter_only
@pytest.mark.parametrize("head_dim", [64, 72])  # 72: q/k/v strides move between multiples of 16 and not
def test_decode_steps_run_their_own_binary_with_their_own_arguments(head_dim, standins):
    device = torch.device("cpu")
    paths = forced_paths(device, 128 if head_dim == 72 else head_dim)
    heads_q, heads_kv = 4, 2
    cache = bf16_randn((3, heads_kv, 120, head_dim), 1, device)
    binaries = set()
    for batch in (1, 3):
        for keys in (1, 2, 17, 31, 32, 33, 70, 101, 120):
            q = bf16_randn((batch, heads_q, 1, head_dim), keys, device)
            k, v = cache[:batch, :, :keys], cache[:batch, :, :keys].clone()  # a cache view and a fresh tensor
            for path, cfg in paths.items():
                seqs = Sequences(False, batch, 1, keys, None, None)
                _, _, launch = attention_fwd_launch(q, k, v, seqs, 0.1 + keys / 1000, cfg)
                assert launch.split_grid == (path == "split_grid" and keys > cfg.split_of(keys))
                binaries.update(_check_launched(standins, ["fwd", "combine"] if launch.split_grid else ["fwd"]))
    # One pass and split grid, and with head dim 72 each stride class: more than one binary, fewer than launches.
    assert 2 <= len(binaries) < 60


@interpreter_only
def test_windowed_softcapped_padded_calls_and_the_backward(standins):
    device = torch.device("cpu")
    q = bf16_randn((2, 4, 5, 64), 3, device)
    k, v = bf16_randn((2, 2, 70, 64), 4, device), bf16_randn((2, 2, 70, 64), 5, device)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.bfloat16)
    for keys, start, window, softcap in ((40, 3, None, None), (70, 0, 21, 5.0), (55, 9, 33, None)):
        seqs = Sequences(False, 2, 5, keys, i32([start, 0], device), i32([keys, keys - 2], device), window)
        logits = Logits(softcap, sinks if window else None)
        for cfg in forced_paths(device, 64).values():
            o, lse, launch = attention_fwd_launch(q, k[:, :, :keys], v[:, :, :keys], seqs, 0.125, cfg, logits)
            _check_launched(standins, ["fwd", "combine"] if launch.split_grid else ["fwd"])
        do = torch.ones_like(o)
        attention_bwd_launch(do, q, k[:, :, :keys], v[:, :, :keys], o, lse, seqs, 0.125, None, logits)
        _check_launched(standins, ["delta", "dkdv", "dq"])


@interpreter_only
def test_packed_and_paged_calls_run_their_own_binary_with_their_own_arguments(standins):
    device = torch.device("cpu")
    for lens_q, lens_k in (([1, 1], [9, 40]), ([3, 1, 2], [3, 64, 70]), ([1], [1])):
        q = bf16_randn((sum(lens_q), 4, 64), 7, device)
        k, v = bf16_randn((sum(lens_k), 2, 64), 8, device), bf16_randn((sum(lens_k), 2, 64), 9, device)
        cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
        seqs = Sequences(True, len(lens_q), max(lens_q), max(lens_k), cu_q, cu_k)
        for cfg in forced_paths(device, 64).values():
            _, _, launch = attention_fwd_launch(q, k, v, seqs, 0.125, cfg)
            _check_launched(standins, ["fwd", "combine"] if launch.split_grid else ["fwd"])
        pages = [-(-n // 16) for n in lens_k]
        table = torch.arange(sum(pages), dtype=torch.int32).flip(0)
        table = torch.stack([torch.nn.functional.pad(t, (0, max(pages) - len(t)), value=-1)
                             for t in table.split(pages)])
        k_cache = bf16_randn((sum(pages), 16, 2, 64), 10, device)
        paged = check_paged(q, k_cache, k_cache, table, cu_q, cu_k, max(lens_q), max(lens_k))
        attention_fwd_launch(q, k_cache, k_cache, paged, 0.125)
        _check_launched(standins, ["fwd"])


@interpreter_only
def test_plans_false_is_tritons_own_launch(standins):
    device = torch.device("cpu")
    q, k = bf16_randn((1, 4, 1, 64), 1, device), bf16_randn((1, 2, 50, 64), 2, device)
    seqs = Sequences(False, 1, 1, 50, None, None)
    attention_fwd_launch(q, k, k, seqs, 0.125, forced_paths(device, 64)["one_pass"], plans=False)
    assert PLANNED["fwd"].last is None and not PLANNED["fwd"].plans  # the plan was not used
    assert len(standins["fwd"].entry.calls) == 1


# ---- GPU: the real kernels through the plans and through Triton's own launch ------------------------------------
def _launch_both(fwd_args: tuple, **kw):
    """The forward through the plans (twice: the second launch reuses the plan) and through Triton's own launch."""
    planned = attention_fwd_launch(*fwd_args, **kw)
    again = attention_fwd_launch(*fwd_args, **kw)
    triton_own = attention_fwd_launch(*fwd_args, plans=False, **kw)
    for got in (planned, again):
        assert_bits_equal(got[0], triton_own[0], "o through the plan")
        assert_bits_equal(got[1], triton_own[1], "lse through the plan")
    return planned


@pytest.fixture
def raw_calls(monkeypatch):
    """Counts launches that went straight into a launcher's C entry point (a plan's later launches)."""
    calls = []
    real = backend.RawLaunch.__call__
    monkeypatch.setattr(backend.RawLaunch, "__call__",
                        lambda self, args, stream, grid=None: calls.append(1) or real(self, args, stream, grid))
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["one_pass", "split_grid"])
def test_gpu_decode_at_changing_lengths_through_the_plans(path, device, raw_calls):
    batch, heads_q, heads_kv, head_dim, seq = 3, 32, 8, 128, 1800
    q = bf16_randn((batch, heads_q, seq, head_dim), 11, device)
    k, v = bf16_randn((batch, heads_kv, seq, head_dim), 12, device), bf16_randn((batch, heads_kv, seq, head_dim), 13,
                                                                                 device)
    cfg = forced_paths(device, head_dim)[path]
    kv_start = i32([0, 100, 7], device)
    prefill = attention(q, k, v, kv_start=kv_start, configs=cfg)
    scale = 1.0 / math.sqrt(head_dim)  # attention()'s default, to the bit
    for i in (1500, 100, 511, 512, 513, 1024, 1799, 700, 150):  # lengths up and down: a plan reused across them
        for b in (slice(0, 3), slice(1, 2)):
            s = Sequences(False, b.stop - b.start, 1, i + 1, kv_start[b], None)
            o, _, launch = _launch_both((q[b, :, i:i + 1], k[b, :, :i + 1], v[b, :, :i + 1], s, scale, cfg))
            assert launch.split_grid == (path == "split_grid" and i + 1 > cfg.split_of(i + 1))
            assert_bits_equal(o, prefill[b, :, i:i + 1], f"{path} decode {i} batch {b}")
    assert raw_calls, "no launch went through a plan's C entry point"


@pytest.mark.gpu
def test_gpu_prefill_packed_paged_and_backward_through_the_plans(device, raw_calls):
    heads_q, heads_kv, head_dim = 8, 2, 128
    for lens in ([1000, 37, 600], [5, 1300], [777]):
        q = bf16_randn((sum(lens), heads_q, head_dim), len(lens), device)
        k, v = (bf16_randn((sum(lens), heads_kv, head_dim), len(lens) + i, device) for i in (1, 2))
        cu = cu_seqlens(lens, device)
        seqs = Sequences(True, len(lens), max(lens), max(lens), cu, cu)
        for cfg in forced_paths(device, head_dim).values():
            _launch_both((q, k, v, seqs, 0.088, cfg))
        first = lens[0]
        one = Sequences(False, 1, first, first, None, None)
        qp, kp, vp = (t[:first].transpose(0, 1)[None] for t in (q, k, v))
        o, lse, _ = _launch_both((qp, kp, vp, one, 0.088))
        o_star, bound = attention_fwd_bound(qp, kp, vp, scale=0.088)  # a plan's arguments are the call's
        assert check_bound(o, o_star, bound).passed
        do = bf16_randn(o.shape, 5, device)
        grads = attention_bwd_launch(do, qp, kp, vp, o, lse, one, 0.088)
        triton_own = attention_bwd_launch(do, qp, kp, vp, o, lse, one, 0.088, plans=False)
        for name, got, want in zip(("dq", "dk", "dv"), grads, triton_own):
            assert_bits_equal(got, want, f"{name} through the plan")
    # Paged decode over a cache whose pages are shuffled.
    pages = torch.randperm(40, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    k_cache, v_cache = (bf16_randn((40, 64, heads_kv, head_dim), i, device) for i in (20, 21))
    for lens_k in ([700, 1], [64, 65, 1200]):
        n = len(lens_k)
        need = [-(-x // 64) for x in lens_k]
        table = torch.full((n, max(need)), -1, dtype=torch.int32)
        for b, (p0, p) in enumerate(zip([0, *torch.tensor(need).cumsum(0).tolist()], need)):
            table[b, :p] = pages[p0:p0 + p]
        q = bf16_randn((n, heads_q, head_dim), 22, device)
        seqs = check_paged(q, k_cache, v_cache, table.to(device), cu_seqlens([1] * n, device),
                           cu_seqlens(lens_k, device), 1, max(lens_k))
        _launch_both((q, k_cache, v_cache, seqs, 0.088))
    assert raw_calls, "no launch went through a plan's C entry point"
