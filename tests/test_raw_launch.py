"""RawLaunch (kernels/backend.py) against Triton's own launcher, on the CPU: both hand a recording stand-in for the
launcher's C entry point their final argument lists, which must be the same (pointers as addresses), and a
descriptor is encoded once per base address."""

from __future__ import annotations

from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch

driver = pytest.importorskip("triton.backends.nvidia.driver")

from detkit.kernels.backend import MAX_CACHED_DESCRIPTORS, HostDescriptor, RawLaunch  # noqa: E402

SIGNATURE = {"a_desc": "tensordesc<bf16[64, 128]>", "c_ptr": "*bf16", "R": "i32", "BLOCK_M": "constexpr",
             "b_desc": "tensordesc<bf16[128, 32]>", "twin_ptr": "*fp32"}
METAS = [dict(swizzle=3, elem_size=2, elem_type=9, block_size=[64, 128], fp4_padded=False),
         dict(swizzle=2, elem_size=2, elem_type=9, block_size=[128, 32], fp4_padded=False)]


class Recorder:
    """Stands in for the launcher's C entry point (a callable without a closure, as a C function is)."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.fixture
def encodes(monkeypatch):
    """Triton's descriptor encoder replaced by one that records its calls and returns their arguments."""
    calls = []

    def fill(ptr, swizzle, elem_size, elem_type, block, shape, strides, padding):
        calls.append(ptr)
        return ("map", ptr, swizzle, elem_size, elem_type, tuple(block), tuple(shape), tuple(strides), padding)

    fake = SimpleNamespace(active=SimpleNamespace(utils=SimpleNamespace(fill_tma_descriptor=fill)))
    monkeypatch.setattr(driver.triton.runtime, "driver", fake)
    return calls


def _compiled(entry: Recorder):
    launcher = driver.CudaLauncher.__new__(driver.CudaLauncher)
    launcher.launch = driver.wrap_handle_tensordesc(entry, SIGNATURE, METAS)
    launcher.num_ctas, launcher.launch_cooperative_grid, launcher.launch_pdl = 1, False, False
    launcher.global_scratch_size = launcher.profile_scratch_size = 0
    launcher.global_scratch_align = launcher.profile_scratch_align = 1
    meta = namedtuple("Meta", "tensordesc_meta")(METAS)
    return SimpleNamespace(src=SimpleNamespace(signature=SIGNATURE), metadata=meta, run=launcher,
                           function=1234, packed_metadata=(4, 1, 0))


def _args(a, b, c, twin):
    return [HostDescriptor(a, [300, 200], [200, 1]), c, 300, 64, HostDescriptor(b, [264, 200], [200, 1]), twin]


def _tensors():
    return (torch.zeros(300, 200, dtype=torch.bfloat16), torch.zeros(264, 200, dtype=torch.bfloat16),
            torch.zeros(300, 264, dtype=torch.bfloat16), torch.zeros(300, 264))


def test_raw_launch_hands_the_entry_point_what_tritons_launcher_does(encodes):
    entry = Recorder()
    compiled = _compiled(entry)
    first = _args(*_tensors())
    raw = RawLaunch.of(compiled, (7,), first, dynamic=(0, 1, 4, 5))
    assert raw is not None
    for tensors in (_tensors(), _tensors()):
        args = _args(*tensors)
        compiled.run(7, 1, 1, 99, compiled.function, compiled.packed_metadata, None, None, None, *args)
        raw(args, 99)
        want, got = entry.calls[-2], entry.calls[-1]
        want = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in want)
        assert got == want
        assert got[4 + 9] == ("map", tensors[0].data_ptr(), 3, 2, 8, (64, 128), (300, 200), (200, 1), 0)


def test_raw_launch_encodes_a_descriptor_once_per_base_address(encodes):
    entry = Recorder()
    a, b, c, twin = _tensors()
    raw = RawLaunch.of(_compiled(entry), (7,), _args(a, b, c, twin), dynamic=(0, 1, 4, 5))
    encodes.clear()
    raw(_args(a, b, c, twin), 5)
    raw(_args(a, b, torch.zeros_like(c), twin), 5)
    assert encodes == [a.data_ptr(), b.data_ptr()]  # the second call found both
    other = torch.zeros_like(a)
    raw(_args(other, b, c, twin), 5)
    assert encodes[-1] == other.data_ptr() and len(encodes) == 3
    assert entry.calls[-1][13] == ("map", other.data_ptr(), 3, 2, 8, (64, 128), (300, 200), (200, 1), 0)


def test_the_descriptor_cache_is_bounded(encodes):
    entry = Recorder()
    a, b, c, twin = _tensors()
    raw = RawLaunch.of(_compiled(entry), (7,), _args(a, b, c, twin), dynamic=(0, 1, 4, 5))
    bases = [torch.zeros_like(a) for _ in range(MAX_CACHED_DESCRIPTORS + 3)]
    for base in bases:
        raw(_args(base, b, c, twin), 5)
    cache = raw.descriptors[0][4]
    assert 0 < len(cache) <= MAX_CACHED_DESCRIPTORS
    assert entry.calls[-1][13][1] == bases[-1].data_ptr()


def test_raw_launch_passes_per_call_scalars_and_grids(encodes):
    # An integer that changes per call (R) and the grid: each call's own values, as Triton's launcher passes them.
    entry = Recorder()
    compiled = _compiled(entry)
    raw = RawLaunch.of(compiled, (7,), _args(*_tensors()), dynamic=(0, 1, 2, 4, 5))
    for rows, grid in ((300, (7, 1, 1)), (301, (3, 2, 1)), (2**20, (1, 1, 5))):
        args = _args(*_tensors())
        args[2] = rows
        compiled.run(*grid, 99, compiled.function, compiled.packed_metadata, None, None, None, *args)
        raw(args, 99, grid)
        want, got = entry.calls[-2], entry.calls[-1]
        assert got == tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in want)
        assert got[:3] == grid and rows in got


def test_raw_launch_declines_what_it_does_not_mirror(encodes):
    entry = Recorder()
    compiled = _compiled(entry)
    first = _args(*_tensors())
    compiled.src.signature = {**SIGNATURE, "R": "nvTmaDesc"}
    assert RawLaunch.of(compiled, (7,), first, dynamic=(0, 1, 2)) is None  # a per-call argument of another kind
    compiled.src.signature = SIGNATURE
    compiled.run.global_scratch_size = 128
    assert RawLaunch.of(compiled, (7,), first) is None  # scratch buffers: Triton's launcher allocates them
    compiled.run.global_scratch_size = 0
    compiled.run = SimpleNamespace(launch=entry)  # not Triton's CudaLauncher
    assert RawLaunch.of(compiled, (7,), first) is None


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["16,32,128,1,4,6,ptr", "64,64,128,1,4,6,tma", "64,192,64,8,4,6,tma3",
                                    "128,256,64,8,8,3,ws"])
@pytest.mark.parametrize("op", ["fwd", "da", "db"])
def test_raw_launches_give_the_bits_of_tritons_own_launch(op, config, monkeypatch):
    # Every call after a plan's first goes through RawLaunch; each must equal a first call (Triton's own launch,
    # plans cleared), on new operands and on the same ones (cached descriptors).
    from detkit.kernels.det_gemm.launch import LAUNCHERS, GemmConfig, clear_launch_plans

    bm, bn, bk, g, w, s, variant = config.split(",")
    cfg = GemmConfig(int(bm), int(bn), int(bk), int(g), int(w), int(s), variant)
    raw_calls = []
    real_call = RawLaunch.__call__
    monkeypatch.setattr(RawLaunch, "__call__",
                        lambda self, args, stream, grid=None: raw_calls.append(1) or real_call(self, args, stream, grid))
    gen = torch.Generator(device="cuda").manual_seed(7)
    shapes = {"fwd": ((300, 512), (512, 264)), "da": ((300, 264), (512, 264)), "db": ((300, 512), (300, 264))}[op]
    operands = [[torch.randn(s, generator=gen, device="cuda").to(torch.bfloat16) for s in shapes] for _ in range(3)]
    outs = [LAUNCHERS[op](x, y, config=cfg)[0] for x, y in operands + operands[:1]]
    assert len(raw_calls) == 3
    for (x, y), got in zip(operands + operands[:1], outs):
        clear_launch_plans()
        want = LAUNCHERS[op](x, y, config=cfg)[0]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    clear_launch_plans()


def test_raw_launch_keeps_no_reference_to_the_first_calls_tensors(encodes):
    import gc
    import weakref

    entry = Recorder()
    tensors = _tensors()
    refs = [weakref.ref(t) for t in tensors]
    raw = RawLaunch.of(_compiled(entry), (7,), _args(*tensors), dynamic=(0, 1, 4, 5))
    del tensors
    gc.collect()
    assert raw is not None and all(r() is None for r in refs)  # a plan must not pin a batch's operands in memory
