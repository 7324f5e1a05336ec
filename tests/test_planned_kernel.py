"""PlannedKernel (kernels/backend.py) on the CPU, against a stand-in for a compiled Triton kernel: ``planned[grid](...)``
binds its arguments as Triton does (positional, keywords, defaults; launch options apart), launches through Triton's
own ``kernel[grid]`` once per call signature and then through that plan's launcher with the call's own tensors, and
starts a new plan wherever Triton could specialize differently. The GPU's bits through planned launches are the MoE
layers' GPU tests (tests/test_moe*.py), whose calls after the first go through these plans."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from detkit.kernels import backend
from detkit.kernels.backend import MAX_PLANS, PlannedKernel


def stand_in(x_ptr, n, out_ptr, BLOCK, FLAG=False):  # noqa: N803 - a kernel's constexpr names
    """The Python signature a planned kernel binds by (the stand-in's body never runs)."""


class Kernel:
    """A compiled-kernel stand-in: ``kernel[grid](...)`` records Triton's own launch and returns a handle whose
    launcher records the plan's later launches."""

    arg_names = ["x_ptr", "n", "out_ptr", "BLOCK", "FLAG"]
    fn = stand_in

    def __init__(self):
        self.first, self.later = [], []
        self.compiled = SimpleNamespace(function=11, packed_metadata=(1,), run=self._run, launch_metadata=None)

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.first.append((grid, args, options))
            return self.compiled
        return launch

    def _run(self, gx, gy, gz, stream, function, packed, metadata, enter, exit_hook, *args):
        self.later.append(((gx, gy, gz), stream, args))


@pytest.fixture(autouse=True)
def one_cuda_device(monkeypatch):
    monkeypatch.setattr(backend, "_current_device", lambda: 0)
    monkeypatch.setattr(backend, "_raw_stream", lambda index: 77)


def _tensors(dtype=torch.float32, offset=0):
    base = torch.zeros(64, dtype=dtype)
    return base[offset:offset + 32], torch.zeros(32, dtype=dtype)


def test_calls_bind_as_triton_binds_and_reuse_one_plan():
    kernel = Kernel()
    planned = PlannedKernel(kernel)
    x, out = _tensors()
    planned[(5,)](x, 32, out, BLOCK=16, num_warps=4)
    assert kernel.first == [((5,), (x, 32, out, 16, False), {"num_warps": 4})]  # FLAG's default bound
    y, out2 = _tensors()
    planned[(5,)](y, 32, out_ptr=out2, BLOCK=16, num_warps=4)
    assert len(kernel.first) == 1 and len(planned.plans) == 1
    (grid, stream, args), = kernel.later
    assert grid == (5, 1, 1) and stream == 77
    assert args[0] is y and args[2] is out2 and args[1:2] + args[3:] == (32, 16, False)


@pytest.mark.parametrize("change", ["int", "constexpr", "type", "dtype", "alignment", "grid", "option"])
def test_whatever_triton_could_specialize_on_starts_a_new_plan(change):
    kernel = Kernel()
    planned = PlannedKernel(kernel)
    x, out = _tensors()
    planned[(5,)](x, 32, out, BLOCK=16, num_warps=4)
    grid, n, block, options = (5,), 32, 16, {"num_warps": 4}
    if change == "type":  # 0 == False: equal values of another type
        options = {"num_warps": 4, "FLAG": 0}
    elif change == "int":
        n = 33
    elif change == "constexpr":
        block = 32
    elif change == "dtype":
        x, out = _tensors(torch.float16)
    elif change == "alignment":
        x, out = _tensors(offset=1)[0], out  # 4 bytes past a 16-byte boundary
    elif change == "grid":
        grid = (6,)
    else:
        options = {"num_warps": 8}
    planned[grid](x, n, out, BLOCK=block, **options)
    assert len(kernel.first) == 2 and len(planned.plans) == 2 and not kernel.later


def test_refusals_name_the_value():
    planned = PlannedKernel(Kernel())
    x, out = _tensors()
    with pytest.raises(ValueError, match=r"one-dimensional grid; got \(2, 3\)"):
        planned[(2, 3)]
    with pytest.raises(TypeError, match="missing argument 'BLOCK'"):
        planned[(2,)](x, 32, out)


def test_plans_are_bounded():
    kernel = Kernel()
    planned = PlannedKernel(kernel)
    x, out = _tensors()
    for n in range(MAX_PLANS + 3):
        planned[(1,)](x, n, out, BLOCK=16)
    assert 0 < len(planned.plans) <= MAX_PLANS and len(kernel.first) == MAX_PLANS + 3


def test_an_interpreted_kernel_launches_as_triton_does(monkeypatch):
    kernel = Kernel()
    monkeypatch.setattr(backend, "kernel_is_interpreted", lambda k: k is kernel)
    planned = PlannedKernel(kernel)
    x, out = _tensors()
    for _ in range(2):
        planned[(2, 3)](x, 32, out, BLOCK=16)
    assert [call[0] for call in kernel.first] == [(2, 3), (2, 3)] and not planned.plans
