"""The grouped GEMM family's TMA variant (``GroupedConfig(..., variant="tma")``: grouped_mm_tma_kernel,
grouped_wgrad_tma_kernel): the same bits as the pointer kernels with the same tile and, under the interpreter, as the
sequential reference, at uneven groups (empty groups, groups shorter than a tile, rows past the last offset), both
weight layouts; other groups' rows in a TMA box never reach a stored row; every refusal in one line (among them the
layouts whose contiguous dim is the one the offsets split: a TMA box's offset along the contiguous dim must be a
multiple of 16 bytes, and groups start at any row); the table's route for a "tma" pick; an offline sm_90 compile to
TMA loads and wgmma without spills. CPU under the Triton interpreter (which runs tensor descriptors), compiled with
DETKIT_TEST_DEVICE=cuda on an H100/H200, plus the `gpu`-marked tests at MoE widths."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from detkit.kernels.grouped import grouped_mm_sequential, grouped_wgrad_sequential
from detkit.kernels.grouped import launch as grouped_launch
from detkit.kernels.grouped.configs import CONFIG_TABLE, GroupedConfig, select_config
from detkit.kernels.grouped.launch import grouped_mm_launch, grouped_wgrad_launch
from detkit.toolkit.fixtures import bf16_randn

from tests.conftest import assert_bits_equal, backend_of
from tests.test_grouped import offsets, weights


def tiles(device, op: str = "mm") -> list[GroupedConfig]:
    """The pointer twins of the TMA configs under test: two small tiles under the interpreter, whose
    [BLOCK_M, BLOCK_K, BLOCK_N] products must stay small; on the GPU the table's pick of ``op`` (each tile is a
    compile there; the bench's candidates are the gpu-marked tests')."""
    if device.type == "cpu":
        return [GroupedConfig(16, 32, 16, 4, 1), GroupedConfig(32, 16, 32, 4, 1)]
    return [select_config(op, "cuda_sm90")]


def _tma(config: GroupedConfig) -> GroupedConfig:
    return replace(config, variant="tma")


# An empty group, a group of one row, groups shorter than a tile and across tile edges; K = 24 and N = 40 leave a
# partial K step and a partial column tile. TMA needs 16-byte strides: K and N multiples of 8.
SIZES = [(5, 0, 15, 13), (1, 30), (0, 0, 7)]


@pytest.mark.parametrize("layout", ["kn", "transposed"])
@pytest.mark.parametrize("sizes", SIZES)
def test_tma_mm_bits_equal_the_pointer_kernel_and_the_reference(device, layout, sizes):
    m = sum(sizes) + 3  # three rows no group owns: written 0
    k, n = 24, 40
    a = bf16_randn((m, k), 1, device)
    b = weights(len(sizes), k, n, 2, layout, device)
    offs = offsets(sizes, device)
    for config in tiles(device):
        ptr, ptr_launch = grouped_mm_launch(a, b, offs, config=config)
        tma, tma_launch = grouped_mm_launch(a, b, offs, config=_tma(config))
        assert tma_launch.config.variant == "tma" and tma_launch.route == "config"
        assert tma_launch.name == ptr_launch.name + " tma" and tma_launch.layout == ("nn" if layout == "kn" else "nt")
        assert_bits_equal(tma, ptr, f"TMA vs pointer kernel, {config}")
        zeros = torch.zeros(3, n, dtype=torch.bfloat16, device=device)
        assert_bits_equal(tma[sum(sizes):], zeros, "rows past offs[-1]")
        if device.type == "cpu":
            assert_bits_equal(tma, grouped_mm_sequential(a, b, offs), "TMA vs the sequential reference")


def test_other_groups_rows_in_a_tma_box_never_reach_a_stored_row(device):
    """A tile's TMA box of A runs past its group's last row into the next groups' rows. Fill every other group's
    rows with Inf: group 1's rows keep the bits they have alone, and no stored row of group 1 is Inf or NaN."""
    k, n = 32, 24
    b = weights(3, k, n, 5, "transposed", device)
    rows = bf16_randn((6, k), 6, device)
    for config in tiles(device):
        alone = grouped_mm_launch(rows, b, offsets([0, 6, 0], device), config=_tma(config))[0]
        inf = torch.full((9, k), float("inf"), dtype=torch.bfloat16, device=device)
        a = torch.cat([inf[:4], rows, inf[4:]])
        crowded = grouped_mm_launch(a, b, offsets([4, 6, 5], device), config=_tma(config))[0]
        assert_bits_equal(crowded[4:10], alone, f"group 1 among Inf rows vs alone, {config}")


@pytest.mark.parametrize("sizes", [(5, 0, 15, 13), (0, 0, 7), (32,), (16, 17)])
def test_tma_wgrad_bits_equal_the_pointer_kernel_and_the_reference(device, sizes):
    """Groups whose rows are a multiple of BLOCK_K (TMA steps only), groups with a partial last step (pointer loads
    masked to the group), empty groups (exact zeros), rows past the last offset (in no group's sum); A as autograd
    passes it (grad.T)."""
    r = sum(sizes) + 2  # rows past the last offset
    dy, x = bf16_randn((r, 24), 8, device), bf16_randn((r, 40), 9, device)
    offs = offsets(sizes, device)
    for config in tiles(device, "wgrad"):
        ptr = grouped_wgrad_launch(dy.t(), x, offs, config=config)[0]
        tma, record = grouped_wgrad_launch(dy.t(), x, offs, config=_tma(config))
        assert record.config.variant == "tma" and record.name.endswith(" tma") and record.layout == "tn"
        assert_bits_equal(tma, ptr, f"TMA vs pointer kernel, {config}")
        for g, size in enumerate(sizes):
            if size == 0:
                assert_bits_equal(tma[g], torch.zeros_like(tma[g]), f"empty group {g}")
        if device.type == "cpu":
            assert_bits_equal(tma, grouped_wgrad_sequential(dy.t(), x, offs), "TMA vs the sequential reference")


def _unaligned(shape, seed, device):
    """A contiguous view of ``shape`` starting 2 bytes past a 16-byte boundary."""
    numel = 1
    for d in shape:
        numel *= d
    return bf16_randn((numel + 1,), seed, device)[1:].view(shape)


@pytest.mark.parametrize("op, make, detail", [
    # K = 12: a's row stride is 24 bytes
    ("mm", lambda d: (bf16_randn((8, 12), 1, d), bf16_randn((2, 12, 16), 2, d)),
     r"a \(shape \(8, 12\), strides \(12, 1\), data_ptr % 16 = 0\): a stride not a multiple of 8 elements"),
    # b[g] with no unit-stride dim
    ("mm", lambda d: (bf16_randn((8, 16), 1, d), bf16_randn((2, 16, 32), 2, d)[:, :, ::2]),
     r"b \(shape \(2, 16, 16\), strides \(512, 32, 2\), data_ptr % 16 = 0\): neither of its last two dims"),
    # groups 18 bytes apart: b = w[:, :, :8] of a [2, 16, 9] stack
    ("mm", lambda d: (bf16_randn((8, 16), 1, d), bf16_randn((2, 16, 9), 2, d)[:, :, :8]),
     r"b \(shape \(2, 16, 8\), strides \(144, 9, 1\).*a stride not a multiple of 8 elements"),
    ("mm", lambda d: (_unaligned((8, 16), 1, d), bf16_randn((2, 16, 16), 2, d)),
     r"a \(shape \(8, 16\), strides \(16, 1\), data_ptr % 16 = 2\): a base not 16-byte aligned"),
    ("mm", lambda d: (bf16_randn((8, 0), 1, d), bf16_randn((2, 0, 16), 2, d)), r"a \(shape \(8, 0\).*an empty dim"),
    # the weight gradient's x with Q = 12: its row stride is 24 bytes
    ("wgrad", lambda d: (bf16_randn((8, 16), 1, d).t(), bf16_randn((8, 12), 2, d)),
     r"b \(shape \(8, 12\), strides \(12, 1\), data_ptr % 16 = 0\): a stride not a multiple of 8 elements"),
    # the dim the offsets split is contiguous: grouped_mm's A transposed, grouped_wgrad's A row-major, its B transposed
    ("mm", lambda d: (bf16_randn((16, 8), 1, d).t(), bf16_randn((2, 16, 16), 2, d)),
     r"a \(shape \(8, 16\), strides \(1, 8\), data_ptr % 16 = 0\): its contiguous dim is the one the offsets split"),
    ("wgrad", lambda d: (bf16_randn((16, 8), 1, d), bf16_randn((8, 16), 2, d)),
     r"a \(shape \(16, 8\), strides \(8, 1\).*: its contiguous dim is the one the offsets split"),
    ("wgrad", lambda d: (bf16_randn((8, 16), 1, d).t(), bf16_randn((16, 8), 2, d).t()),
     r"b \(shape \(8, 16\), strides \(1, 8\).*: its contiguous dim is the one the offsets split"),
])
def test_tma_refuses_operands_it_cannot_address_in_one_line(device, op, make, detail):
    a, b = make(device)
    offs = offsets([3, 5], device)
    launcher = grouped_mm_launch if op == "mm" else grouped_wgrad_launch
    config = tiles(device, op)[0]
    with pytest.raises(ValueError, match=rf"variant 'tma' cannot describe {detail}") as refused:
        launcher(a, b, offs, config=_tma(config))
    assert "\n" not in str(refused.value) and "use a 'ptr' config" in str(refused.value)
    out, record = launcher(a, b, offs, config=config)  # the pointer kernel takes the same operands as they are
    assert record.config.variant == "ptr" and out.dtype == torch.bfloat16


def test_a_table_tma_pick_runs_where_addressable_else_the_same_tile_by_pointers(device, monkeypatch):
    """With a "tma" pick for the forward's layout ("nt"): an addressable call runs the TMA kernel; one TMA cannot
    address (K = 12) runs the same tile by pointers, the reason in its route, decided when its plan is built; another
    layout keeps its own entry. The same bits as the pointer config either way."""
    backend = backend_of(device)
    pointer = select_config("mm", backend, "nt")
    monkeypatch.setitem(CONFIG_TABLE, ("mm", backend, "nt"), _tma(pointer))
    monkeypatch.setattr(grouped_launch, "_PLANS", {})
    offs = offsets([3, 0, 4], device)
    for k, variant in ((16, "tma"), (12, "ptr")):
        a, b = bf16_randn((9, k), 1, device), weights(3, k, 24, 2, "transposed", device)
        out, record = grouped_mm_launch(a, b, offs)
        assert record.config == replace(pointer, variant=variant) and record.layout == "nt"
        assert record.name.endswith(" tma") == (variant == "tma")
        if variant == "tma":
            assert record.route == "table"
        else:
            assert record.route.startswith("table: the 'tma' pick runs as 'ptr': a (shape (9, 12), strides (12, 1)")
        assert_bits_equal(out, grouped_mm_launch(a, b, offs, config=pointer)[0], f"table pick at K={k}")
        kn = weights(3, k, 24, 2, "kn", device)
        assert grouped_mm_launch(a, kn, offs)[1].config == select_config("mm", backend, "nn")


def test_config_rules():
    assert GroupedConfig(128, 256, 64, 8, 3).variant == "ptr"
    assert GroupedConfig(128, 256, 64, 8, 3, variant="tma").label() == "128x256x64_w8_s3_g8_tma"
    with pytest.raises(ValueError, match=r"variant 'cp_async' is not supported; supported: \('ptr', 'tma'\)"):
        GroupedConfig(128, 256, 64, 8, 3, variant="cp_async")
    with pytest.raises(ValueError, match="boxes of at most 256 elements a dim; got block_m 128, block_n 512"):
        GroupedConfig(128, 512, 64, 8, 3, variant="tma")
    with pytest.raises(ValueError, match=r"layout 'xy' is not supported"):
        select_config("mm", "cuda_sm90", "xy")
    # every layout has a config on both backends; on sm_90 TMA where the H100 run measured it faster (transformers'
    # forward "nt", grad_weight "tn"), pointer loads elsewhere and on the interpreter
    tma = {("mm", "cuda_sm90", "nt"), ("wgrad", "cuda_sm90", "tn")}
    for op in ("mm", "wgrad"):
        for backend in ("cuda_sm90", "triton_interpreter"):
            for layout in ("nn", "nt", "tn", "tt", "ss"):
                want = "tma" if (op, backend, layout) in tma else "ptr"
                assert select_config(op, backend, layout).variant == want, (op, backend, layout)


_SASS_SCRIPT = """
import json, tempfile
from tools.grouped_sass import CASES, build
print(json.dumps([build(case, "tma", tempfile.mkdtemp()) for case in CASES]))
"""


def test_tma_kernels_compile_for_sm90_offline_to_tma_loads_and_wgmma_without_spills(tmp_path):
    """The table's tiles as TMA kernels (forward "nt", grad_input "nn", weight gradient "tn"): TMA loads (UTMALDG)
    feeding wgmma (HGMMA), no cp.async (LDGSTS) left (the weight gradient's partial step loads through plain global
    loads), no mma.sync (HMMA), no stack frame (spills), shared memory within sm_90's 227 KiB per block."""
    from tests.moe_helpers import compile_sm90_offline

    rows = compile_sm90_offline(_SASS_SCRIPT, tmp_path)
    assert [(r["op"], r["layout"]) for r in rows] == [("mm", "nt"), ("mm", "nn"), ("wgrad", "tn")]
    for r in rows:
        assert r["UTMALDG"] > 0 and r["HGMMA"] > 0, r
        assert r["LDGSTS"] == 0 and r["HMMA"] == 0, r
        assert r["stack_bytes"] == 0 and r["shared_bytes"] <= 227 * 1024, r


# ---- on the GPU, at MoE widths ------------------------------------------------------------------------------------
def _tma_candidates(op: str) -> list[GroupedConfig]:
    from tools.grouped_mm_bench import candidate_configs

    return candidate_configs(op, torch.device("cuda"), variants=("tma",))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["transposed", "kn"])
def test_tma_bits_equal_the_pinned_pointer_config_at_mixtral_widths(device, layout):
    """Mixtral-8x7B's up projection (K 4096, N 28672) and its grad_input, both weight layouts, groups of 0-300 rows
    (one empty), rows past the last offset; the weight gradient of the same rows: every TMA candidate of the bench
    (the pinned tiles' twins first) gives the pinned pointer config's bits."""
    e, h, i = 8, 4096, 14336
    gen = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, 300, (e,), generator=gen).tolist()
    sizes[3] = 0
    m = sum(sizes) + 5
    offs = offsets(sizes, device)
    x, dy = bf16_randn((m, h), 1, device), bf16_randn((m, 2 * i), 2, device)
    # [E, H, 2I], the up projection's b: drawn on the GPU (a CPU draw of its 0.9 G values takes seconds)
    cuda_gen = torch.Generator(device).manual_seed(3)
    shape = (e, h, 2 * i) if layout == "kn" else (e, 2 * i, h)
    w = (torch.randn(shape, generator=cuda_gen, device=device) * h**-0.5).to(torch.bfloat16)
    w = w if layout == "kn" else w.transpose(-2, -1)
    for a, b in ((x, w), (dy, w.transpose(-2, -1))):  # forward, grad_input
        pinned, record = grouped_mm_launch(a, b, offs)
        assert record.config.variant == "ptr"
        for config in _tma_candidates("up"):
            assert_bits_equal(grouped_mm_launch(a, b, offs, config=config)[0], pinned, f"{config} at {record.name}")
    pinned = grouped_wgrad_launch(dy.t(), x, offs)[0]
    for config in _tma_candidates("up_wgrad"):
        assert_bits_equal(grouped_wgrad_launch(dy.t(), x, offs, config=config)[0], pinned, f"wgrad {config}")


@pytest.mark.gpu
def test_tma_launches_replay_in_a_cuda_graph_and_give_nan_on_invalid_offsets(device):
    """The TMA route reads no offset on the host: it captures in a CUDA graph and replays with the eager bits; invalid
    offsets make every element NaN, as the pointer kernels do."""
    x, w = bf16_randn((300, 2048), 1, device), weights(4, 2048, 1536, 2, "transposed", device)
    offs = offsets([100, 0, 150, 40], device)
    mm, wgrad = _tma_candidates("up")[0], _tma_candidates("up_wgrad")[0]
    dy = bf16_randn((300, 1536), 3, device)
    eager = grouped_mm_launch(x, w, offs, config=mm)[0]
    eager_wgrad = grouped_wgrad_launch(dy.t(), x, offs, config=wgrad)[0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = grouped_mm_launch(x, w, offs, config=mm)[0]
        captured_wgrad = grouped_wgrad_launch(dy.t(), x, offs, config=wgrad)[0]
    graph.replay()
    assert_bits_equal(captured, eager, "graph replay vs eager (grouped_mm, TMA)")
    assert_bits_equal(captured_wgrad, eager_wgrad, "graph replay vs eager (grouped_wgrad, TMA)")
    bad = torch.tensor([100, 50, 150, 40], dtype=torch.int32, device=device)
    assert torch.isnan(grouped_mm_launch(x, w, bad, config=mm)[0]).all()
    assert torch.isnan(grouped_wgrad_launch(dy.t(), x, bad, config=wgrad)[0]).all()
