"""PlannedKernel (kernels/backend.py) on the CPU, against a stand-in for Triton's compile and launch
(tests/plan_helpers.py: a real JITFunction's parameters, Triton's own binder, Triton's CudaLauncher with a recording C
entry point). ``planned[grid](...)`` binds its arguments as Triton does (positional, keywords, defaults; launch options
apart) and ``planned.launch(grid, args, options)`` takes them in order; each launches through Triton's own
``kernel[grid]`` once per specialization and then through that plan's C entry point. Every launch must run the binary
Triton compiles for that call and hand the entry point the argument list Triton's launcher would: per-call grids,
pointers, integers, floats and bools are never taken from a stale template, and an argument that moves to another
specialization class starts a new plan. The GPU's bits through planned launches are the MoE and attention GPU tests
(tests/test_moe*.py, tests/test_attention_plans.py)."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("triton.backends.nvidia.driver")

from detkit.kernels import backend  # noqa: E402
from detkit.kernels.backend import (  # noqa: E402
    CONSTEXPR, MAX_PLANS, NOT_ON_ALIGNMENT, NOT_SPECIALIZED, SPECIALIZED, PlannedKernel, key_function, signature_of,
)
from tests.plan_helpers import Compiling, check_last_launch  # noqa: E402

# A kernel's Python signature (the body never runs): m is not specialized, as the attention kernels' lengths are.
PROBE_SOURCE = '''
import triton.language as tl


def probe(x_ptr, n, out_ptr, scale, m, flag, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass
'''


@pytest.fixture(scope="module")
def probe_fn(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe") / "plan_probe.py"
    path.write_text(PROBE_SOURCE)  # a JITFunction reads its source from a file
    sys.path.insert(0, str(path.parent))
    try:
        import plan_probe
        yield plan_probe.probe
    finally:
        sys.path.remove(str(path.parent))
        sys.modules.pop("plan_probe", None)


@pytest.fixture
def kernel(probe_fn):
    from triton.runtime.jit import JITFunction

    return Compiling(JITFunction(probe_fn, do_not_specialize=["m"]))


@pytest.fixture(autouse=True)
def one_cuda_device(monkeypatch):
    monkeypatch.setattr(backend, "_current_device", lambda: 0)
    monkeypatch.setattr(backend, "_raw_stream", lambda index: Compiling.STREAM)


def _tensors(dtype=torch.float32, offset=0):
    base = torch.zeros(64, dtype=dtype)
    return base[offset:offset + 32], torch.zeros(32, dtype=dtype)


def test_calls_bind_as_triton_binds_and_reuse_one_plan(kernel):
    planned = PlannedKernel(kernel)
    x, out = _tensors()
    planned[(5,)](x, 32, out, 0.5, 3, True, BLOCK=16, num_warps=4)
    assert len(kernel.cache) == 1 and len(kernel.entry.calls) == 1  # Triton's own launch compiled it
    check_last_launch(kernel, (5,), [x, 32, out, 0.5, 3, True, 16, False], {"num_warps": 4})  # FLAG's default
    y, out2 = _tensors()
    planned[(5,)](y, 48, out_ptr=out2, scale=0.25, m=9, flag=False, BLOCK=16, num_warps=4)
    assert len(kernel.cache) == 1 and len(planned.plans) == 1
    check_last_launch(kernel, (5,), [y, 48, out2, 0.25, 9, False, 16, False], {"num_warps": 4})


def test_every_launch_runs_its_own_binary_with_its_own_arguments(kernel):
    # Calls whose grid, pointers, ints, floats and bools change; some stay in their specialization classes (one plan),
    # some move (n: a multiple of 16, not one, the constant 1, 64-bit; m, not specialized: 32- then 64-bit; a
    # misaligned pointer; a constexpr; an option). Each must run the binary Triton picks for it, with the argument list
    # Triton's launcher builds; the plans compile exactly once per distinct specialization.
    planned = PlannedKernel(kernel)
    x, out = _tensors()
    calls = [((5,), 32, 1, 0.5, True, {}), ((3, 4), 48, 7, 0.25, False, {}), ((5, 6, 7), 96, 2**20, 1.5, True, {}),
             ((2,), 33, 1, 0.5, True, {}), ((2, 2), 1, 1, 0.5, True, {}), ((1,), 2**31 + 16, 1, 0.5, True, {}),
             ((1,), 2**31 + 17, 1, 0.5, True, {}), ((4, 1, 2), 64, 2**40, 0.5, True, {}),
             ((4,), 64, 3, 0.5, True, {"misaligned": True}), ((4,), 64, 3, 0.5, True, {"BLOCK": 32}),
             ((4,), 64, 3, 0.5, True, {"num_warps": 8}), ((9, 9), 160, 5, -2.0, False, {})]
    keys = set()
    for grid, n, m, scale, flag, change in calls:
        x, out = _tensors(offset=1 if change.get("misaligned") else 0)  # new tensors every call
        args = [x, n, out, scale, m, flag, change.get("BLOCK", 16), False]
        options = {"num_warps": change.get("num_warps", 4)}
        planned.launch(grid, args, options)
        check_last_launch(kernel, grid, args, options)
        keys.add(kernel.key(args, options))
    assert len(kernel.cache) == len(keys) == len(planned.plans) == 9
    assert all(plan.raw is not None for plan in planned.plans.values())  # later launches: the C entry point
    later = [c for c in kernel.entry.calls if c[3] == Compiling.STREAM]
    assert len(later) == len(calls)  # one launch each (the first of a plan is Triton's own)


def test_the_grid_is_passed_per_call_in_three_dims(kernel):
    planned = PlannedKernel(kernel)
    x, out = _tensors()
    for grid in ((7,), (7, 3), (7, 3, 2), [1, 1, 1]):
        planned[grid](x, 32, out, 0.5, 3, True, BLOCK=16)
        assert kernel.entry.calls[-1][:3] == (*grid, *(1,) * (3 - len(grid)))
    assert len(planned.plans) == 1


@pytest.mark.parametrize("mode", [SPECIALIZED, NOT_ON_ALIGNMENT, NOT_SPECIALIZED])
def test_the_key_partitions_arguments_as_triton_specializes_them(mode):
    # signature_of(a) == signature_of(b) exactly when Triton 3.6's specialization of a and b is the same, over ints
    # around every class boundary, bools, floats and tensors of two dtypes and alignments.
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    specialize, align = mode != NOT_SPECIALIZED, mode == SPECIALIZED
    base = torch.zeros(64)
    values = [0, 1, 2, 15, 16, 17, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1,
              -2**31 - 16, 2**63 - 16, 2**63, 2**63 + 16, 2**64 - 1, True, False, 1.0, 0.5, 0.0, base, base[1:],
              base.to(torch.bfloat16), base.to(torch.bfloat16)[8:]]
    triton_key = [native_specialize_impl(CUDABackend, v, False, specialize, align) for v in values]
    # signature_of, and the plan's key: the types, then the generated key function's classes
    for ours in ([signature_of(v, mode) for v in values],
                 [(type(v), *key_function((type(v),), (mode,))((v,))) for v in values]):
        for i in range(len(values)):
            for j in range(len(values)):
                assert (ours[i] == ours[j]) == (triton_key[i] == triton_key[j]), (values[i], values[j], mode)


def test_constexprs_key_on_their_value_and_type(kernel):
    assert signature_of(16, CONSTEXPR) == 16 != signature_of(32, CONSTEXPR)
    assert signature_of(True, CONSTEXPR) != signature_of(1, CONSTEXPR) != signature_of(1.0, CONSTEXPR)
    planned = PlannedKernel(kernel)
    x, out = _tensors()
    keys = {planned.signature([x, 32, out, 0.5, 3, True, 16, flag]) for flag in (True, 1, 1.0, False, 0, None)}
    assert len(keys) == 6


def test_refusals_name_the_value(kernel):
    planned = PlannedKernel(kernel)
    x, out = _tensors()
    for grid in ((2, 3, 4, 5), (), (2.0,), (-1,)):
        with pytest.raises(ValueError, match=r"a launch grid is 1 to 3 non-negative ints; got"):
            planned[grid]
    with pytest.raises(TypeError, match="missing argument 'BLOCK'"):
        planned[(2,)](x, 32, out, 0.5, 3, True)
    with pytest.raises(TypeError, match="launch takes all 8 parameters in order; got 7 arguments"):
        planned.launch((2,), [x, 32, out, 0.5, 3, True, 16], {})


def test_an_annotated_runtime_parameter_is_refused(kernel):
    kernel.params[1].__dict__["annotation"] = "i32"  # what `n: tl.int32` gives (a cached property)
    with pytest.raises(NotImplementedError, match="parameter 'n' is annotated 'i32'"):
        PlannedKernel(kernel)


def test_plans_are_bounded(kernel):
    planned = PlannedKernel(kernel)
    x, out = _tensors()
    for block in range(MAX_PLANS + 3):
        planned[(1,)](x, 32, out, 0.5, 3, True, BLOCK=block)
    assert 0 < len(planned.plans) <= MAX_PLANS and len(kernel.cache) == MAX_PLANS + 3


def test_an_interpreted_kernel_launches_as_triton_does(kernel, monkeypatch):
    monkeypatch.setattr(backend, "kernel_is_interpreted", lambda k: k is kernel)
    planned = PlannedKernel(kernel)
    x, out = _tensors()
    planned[(2, 3)](x, 32, out, 0.5, 3, True, BLOCK=16)
    planned.launch((2, 3), [x, 32, out, 0.5, 3, True, 16, False], {})
    assert len(kernel.entry.calls) == 2 and not planned.plans
