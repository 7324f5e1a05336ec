"""The attention forward over a paged KV cache (issue #50, part 2): keys and values read through a block table, key
n of sequence b at row n % page_size of page block_table[b, n // page_size]. Its bits equal attention_varlen's on
the same keys gathered into a contiguous packing, for every page size (dividing the split size or not) and any page
placement, in decode, chunked prefill on cached pages (a cached prefix) and mixed batches, on both forward grids;
head dims the tiles do not have (MLA's narrower v_cache, one head dim between the kernel's) read in place with the
bits of zero-padded copies; within the FP64 bound; every refusal is one line, raised before any launch. Storages
are NaN outside the sequences' rows, so a row read from the wrong place would show. CPU shapes are tiny: the
interpreter's splits are 16, 32 and 64 keys (1, 2 and 4 tiles of 16) by each row's key extent (up to 32, up to 64,
beyond), so 70 keys cross both tier bounds."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import detkit.kernels.attention.launch as attention_launch
from detkit.kernels.attention import (
    attention, attention_fwd_bound, attention_paged, attention_paged_ref, attention_varlen, gather_pages,
)
from detkit.kernels.attention.configs import select_configs
from detkit.kernels.attention.launch import kernel_head_dim
from detkit.toolkit.contract import check_bound
from detkit.toolkit.fixtures import bf16_randn
from tests.attention_helpers import cu_seqlens, forced_paths, i32
from tests.conftest import assert_bits_equal, backend_of

SINKS = [0.5, -1.0, 2.0, 0.0]


@dataclasses.dataclass
class Paged:
    q: torch.Tensor  # [Tq, Hq, D]
    k: torch.Tensor  # [Tk, Hkv, D], the contiguous packing
    v: torch.Tensor
    k_cache: torch.Tensor  # [P, page_size, Hkv, D]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # int32 [n, max_pages], -1 past each sequence's pages
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    lens_q: list
    lens_k: list

    def paged(self, **kw):
        return attention_paged(self.q, self.k_cache, self.v_cache, self.block_table, self.cu_q, self.cu_k,
                               max(self.lens_q), max(self.lens_k), **kw)

    def varlen(self, **kw):
        return attention_varlen(self.q, self.k, self.v, self.cu_q, self.cu_k, max(self.lens_q), max(self.lens_k),
                                **kw)


def _make(lens_q, lens_k, page_size, device, heads_q=4, heads_kv=2, head_dim=64, seed=0, spare_pages=3,
          extra_columns=2, k=None, v=None, q=None, head_dim_v=None):
    """Sequences with lens_k keys (their last lens_q are the queries' positions), their K/V scattered over shuffled
    pages of a NaN storage with ``spare_pages`` never used, the table padded with -1 as transformers pads it.
    ``head_dim_v``: v's head dim, when other than q's and k's (MLA)."""
    head_dim_v = head_dim_v or head_dim
    pages = [-(-n // page_size) for n in lens_k]
    num_pages = sum(pages) + spare_pages
    gen = torch.Generator().manual_seed(seed)
    placement = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((len(lens_k), max(pages) + extra_columns), -1, dtype=torch.int32)
    q = q if q is not None else bf16_randn((sum(lens_q), heads_q, head_dim), seed + 1, device)
    k = k if k is not None else bf16_randn((sum(lens_k), heads_kv, head_dim), seed + 2, device)
    v = v if v is not None else bf16_randn((sum(lens_k), heads_kv, head_dim_v), seed + 3, device)
    k_cache = torch.full((num_pages, page_size, heads_kv, head_dim), float("nan"), dtype=torch.bfloat16,
                         device=device)
    v_cache = torch.full((num_pages, page_size, heads_kv, head_dim_v), float("nan"), dtype=torch.bfloat16,
                         device=device)
    start, used = 0, 0
    for b, (n, p) in enumerate(zip(lens_k, pages)):
        table[b, :p] = torch.tensor(placement[used:used + p], dtype=torch.int32)
        used += p
        j = torch.arange(n)
        page, row = table[b].long()[j // page_size], j % page_size
        k_cache[page, row] = k[start:start + n]
        v_cache[page, row] = v[start:start + n]
        start += n
    return Paged(q, k, v, k_cache, v_cache, table.to(device), cu_seqlens(lens_q, device), cu_seqlens(lens_k, device),
                 list(lens_q), list(lens_k))


# ---- bits: paged = contiguous -------------------------------------------------------------------------------
# 4 and 16 divide every split; 48 is larger than the 16- and 32-key splits and divides none, and 5 divides neither a
# tile nor a split. Both grids run the same load code: each page size on one, 16 and 5 on both; the split grid with
# runs of splits a program (paged_grouped) on 5; one table entry a page a key tile touches (paged_tile_page) where
# pages hold whole tiles (16 and 48 on the interpreter's 16-key tiles; 64 on the GPU's) or tiles whole pages (4 and
# 16 on the GPU's 64-key tiles, 4 on the interpreter's; both tables' choice, which 5 cannot take) or one a key; and
# with a program's first tile's entries read before its sequence's bounds (paged_early_pages; grouped: a program's
# first tile is its first launch split's), and with each tile's entries read one tile ahead (paged_prefetch_pages).
@pytest.mark.parametrize("page_size,path", [(4, "split_grid_per_key"), (16, "one_pass_per_key"),
                                            (16, "split_grid_per_key"), (48, "split_grid_per_key"), (5, "one_pass"),
                                            (5, "split_grid"), (5, "split_grid_grouped"), (16, "one_pass_tile_page"),
                                            (48, "split_grid_tile_page"), (64, "split_grid_tile_page"),
                                            (4, "one_pass_tile_page"), (4, "split_grid_tile_page"),
                                            (16, "one_pass_early"), (4, "split_grid_early"),
                                            (64, "split_grid_grouped_early"), (16, "one_pass_prefetch"),
                                            (4, "split_grid_prefetch"), (64, "split_grid_grouped_prefetch"),
                                            (48, "one_pass_prefetch")])
def test_paged_bits_equal_the_contiguous_keys_for_any_page_size_and_placement(page_size, path, device):
    # Decode at 70 keys (two 64-key splits), a one-key sequence, a 6-query chunk on 31 cached keys (its rows on both
    # sides of the 32-key bound), a 12-token prefill.
    lens_k, lens_q = [70, 1, 37, 12], [1, 1, 6, 12]
    case = _make(lens_q, lens_k, page_size, device, seed=page_size)
    paths = forced_paths(device, 64)
    paths["split_grid_grouped"] = dataclasses.replace(paths["split_grid"], paged_grouped=True)
    for name in ("one_pass", "split_grid"):
        paths[f"{name}_tile_page"] = dataclasses.replace(paths[name], paged_tile_page=True)
        paths[f"{name}_per_key"] = dataclasses.replace(paths[name], paged_tile_page=False)
        paths[f"{name}_early"] = dataclasses.replace(paths[name], paged_tile_page=True, paged_early_pages=True)
        paths[f"{name}_prefetch"] = dataclasses.replace(paths[f"{name}_early"], paged_prefetch_pages=True)
    paths["split_grid_grouped_early"] = dataclasses.replace(paths["split_grid_grouped"], paged_tile_page=True,
                                                            paged_early_pages=True)
    paths["split_grid_grouped_prefetch"] = dataclasses.replace(paths["split_grid_grouped_early"],
                                                               paged_prefetch_pages=True)
    configs = paths[path]
    out = case.paged(configs=configs)
    assert out.shape == case.q.shape and out.dtype == torch.bfloat16
    assert_bits_equal(out, case.varlen(configs=configs), f"paged (page size {page_size}, {path}) vs varlen")


def test_the_prefetch_rule_picks_by_the_launchs_programs_and_keeps_the_bits(device, monkeypatch):
    """``paged_prefetch_below``: a paged launch of fewer programs reads its table entries a tile ahead (speed only):
    every launch under a bound no grid reaches, none under a bound of one program; the varlen bits either way."""
    from detkit.kernels.attention import launch

    case = _make([1, 1, 6, 12], [70, 1, 37, 12], 16, device, seed=3)
    seen = []
    original = launch._fwd_tail

    def spy(static, heads, what, dim_qk, dim_v, flags, *rest):  # flags[5]: PAGED
        if what != "combine" and flags[5]:
            seen.append(rest[3] if len(rest) > 3 else False)
        return original(static, heads, what, dim_qk, dim_v, flags, *rest)
    monkeypatch.setattr(launch, "_fwd_tail", spy)
    early = dataclasses.replace(forced_paths(device, 64)["split_grid"], paged_tile_page=True, paged_early_pages=True)
    for below, want in ((1 << 30, True), (1, False)):
        launch.clear_launch_plans()
        seen.clear()
        configs = dataclasses.replace(early, paged_prefetch_below=below)
        assert_bits_equal(case.paged(configs=configs), case.varlen(configs=early), f"prefetch below {below}")
        assert seen and set(seen) == {want}, (below, seen)


# MLA's value head dim (64 / 32: v_cache's rows narrower than k_cache's, each with its own strides) and one head dim
# between the kernel's (24 on the 64 tiles), read in place by masked loads.
@pytest.mark.parametrize("dqk,dv,path", [(64, 32, "split_grid"), (64, 32, "one_pass"), (24, 24, "one_pass")])
def test_paged_head_dims_the_tiles_do_not_have_give_the_padded_bits(dqk, dv, path, device):
    lens_k, lens_q = [70, 1, 37], [1, 1, 6]
    case = _make(lens_q, lens_k, 5, device, head_dim=dqk, head_dim_v=dv, seed=dqk + dv)
    dim = kernel_head_dim(dqk, dv)
    configs = forced_paths(device, dim)[path]
    out = case.paged(configs=configs)
    assert out.shape == (sum(lens_q), 4, dv) and out.is_contiguous()
    assert_bits_equal(out, case.varlen(configs=configs), f"paged vs varlen ({dqk}/{dv}, {path})")
    padded = attention_varlen(*(F.pad(t, (0, dim - t.shape[-1])) for t in (case.q, case.k, case.v)), case.cu_q,
                              case.cu_k, max(lens_q), max(lens_k), scale=dqk ** -0.5, configs=configs)
    assert_bits_equal(out, padded[..., :dv], f"paged vs varlen on zero-padded copies ({dqk}/{dv}, {path})")


def test_paged_and_its_reference_lie_within_the_fp64_bound(device):
    """The pure-torch reference gathers the pages (the same keys as the contiguous packing); it and the kernel lie
    within the FP64 bound of each sequence."""
    lens_k, lens_q = [70, 1, 37, 12], [1, 1, 6, 12]
    case = _make(lens_q, lens_k, 5, device, seed=2)
    assert torch.equal(gather_pages(case.k_cache, case.block_table, case.cu_k), case.k)
    out = case.paged()
    ref = attention_paged_ref(case.q, case.k_cache, case.v_cache, case.block_table, case.cu_q, case.cu_k)
    block_n = select_configs(backend_of(device), 64).fwd.block_n
    for b in range(len(lens_k)):
        rows, keys = slice(int(case.cu_q[b]), int(case.cu_q[b + 1])), slice(int(case.cu_k[b]), int(case.cu_k[b + 1]))
        qs, ks, vs = (t[s].transpose(0, 1)[None] for t, s in ((case.q, rows), (case.k, keys), (case.v, keys)))
        o_star, bound = attention_fwd_bound(qs, ks, vs, block_n=block_n)
        for what, o in (("kernel", out), ("reference", ref)):
            result = check_bound(o[rows].transpose(0, 1)[None], o_star, bound)
            assert result.passed, (what, b, result)


def test_decode_and_chunks_on_cached_pages_give_the_prefill_bits(device):
    """A rollout over a paged cache (decode steps, a prefill chunk on cached prefix pages) gives the trainer's
    prefill bits: query i of the one-sequence prefill equals the paged step that sees keys 0..i."""
    seq, page_size = 45, 8
    q, k, v = (bf16_randn((seq, h, 64), s, device) for h, s in ((4, 31), (2, 32), (2, 33)))
    prefill = attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])[0].transpose(0, 1)
    for i in (0, 7, 8, 15, 16, 31, 32, 44):  # page and split edges, the 32-key bound
        case = _make([1], [i + 1], page_size, device, q=q[i:i + 1], k=k[:i + 1], v=v[:i + 1], seed=i)
        assert_bits_equal(case.paged(), prefill[i:i + 1], f"decode at key {i}")
    # Cached prefix pages (24 keys, 3 full pages) and a 21-token chunk, next to a decode step of another sequence.
    other = bf16_randn((1, 4, 64), 34, device), bf16_randn((12, 2, 64), 35, device), bf16_randn((12, 2, 64), 36, device)
    case = _make([21, 1], [seq, 12], page_size, device, q=torch.cat([q[24:], other[0]]),
                 k=torch.cat([k, other[1]]), v=torch.cat([v, other[2]]), seed=5)
    out = case.paged()
    assert_bits_equal(out[:21], prefill[24:], "chunk on cached pages")
    alone = attention(other[0].transpose(0, 1)[None], other[1].transpose(0, 1)[None], other[2].transpose(0, 1)[None])
    assert_bits_equal(out[21:], alone[0].transpose(0, 1), "decode beside the chunk")


def test_window_softcap_and_sinks_read_through_pages_keep_the_bits(device):
    case = _make([1, 5], [70, 29], 16, device, seed=9)
    kw = {"window": 37, "softcap": 5.0, "sinks": torch.tensor(SINKS, dtype=torch.bfloat16, device=device)}
    assert_bits_equal(case.paged(**kw), case.varlen(**kw), "paged vs varlen with window, softcap, sinks")
    # a window moves a program's first tile: the entries read one tile ahead start there
    paths = forced_paths(device, 64)
    for name in ("one_pass", "split_grid"):
        prefetch = dataclasses.replace(paths[name], paged_tile_page=True, paged_prefetch_pages=True)
        assert_bits_equal(case.paged(configs=prefetch, **kw), case.varlen(**kw),
                          f"paged ({name}, entries a tile ahead) vs varlen with window, softcap, sinks")


def test_transformers_page_views_are_read_without_a_copy(device):
    """transformers' full-attention cache (5.17-5.24, cache_allocators/full_attention.py): one tensor of pages,
    each page one layer's keys or values ([L0 K | L0 V | L1 K | L1 V] per block), a layer's keys the view
    flat[2 i * page_size:].view(-1, page_size, Hkv, D) and its table entries block id x (2 x layers). The kernel
    takes these views as they are."""
    page_size, layers, blocks, heads_kv, head_dim = 4, 2, 8, 2, 64
    lens_k, lens_q = [9, 14], [1, 3]
    flat = torch.full((blocks * layers * 2 * page_size, heads_kv, head_dim), float("nan"), dtype=torch.bfloat16,
                      device=device)
    pages_stride = 2 * layers  # a block: one key page and one value page per layer
    block_ids = [[4, 0, 2], [5, 1, 7, 3]]
    k = bf16_randn((sum(lens_k), heads_kv, head_dim), 41, device)
    v = bf16_randn((sum(lens_k), heads_kv, head_dim), 42, device)
    q = bf16_randn((sum(lens_q), 4, head_dim), 43, device)
    layer = 1
    k_view, v_view = flat[2 * layer * page_size:], flat[(2 * layer + 1) * page_size:]
    k_pages = k_view.view(-1, page_size, heads_kv, head_dim)
    v_pages = v_view.view(-1, page_size, heads_kv, head_dim)
    n = min(k_pages.shape[0], v_pages.shape[0])
    k_pages, v_pages = k_pages[:n], v_pages[:n]
    table = torch.full((2, 5), -1, dtype=torch.int32)
    start = 0
    for b, ids in enumerate(block_ids):
        table[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32) * pages_stride
        for j in range(lens_k[b]):
            page, row = int(table[b, j // page_size]), j % page_size
            k_pages[page, row], v_pages[page, row] = k[start + j], v[start + j]
        start += lens_k[b]
    assert k_pages.data_ptr() == flat.data_ptr() + 2 * layer * page_size * heads_kv * head_dim * flat.element_size()
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    out = attention_paged(q, k_pages, v_pages, table.to(device), cu_q, cu_k, max(lens_q), max(lens_k))
    assert_bits_equal(out, attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)), "transformers' views")


# ---- refusals -------------------------------------------------------------------------------------------------
def test_paged_refusals_are_one_line_and_come_before_any_launch(device, monkeypatch):
    case = _make([1, 3], [9, 14], 4, device, seed=3)
    num_pages = case.k_cache.shape[0]

    def launched(*args, **kwargs):
        raise AssertionError("a refused call reached the launch")

    monkeypatch.setattr(attention_launch, "attention_fwd_launch", launched)
    table = case.block_table
    out_of_range = table.clone()
    out_of_range[1, 2] = num_pages
    negative = table.clone()
    negative[0, 1] = -1
    short = table[:, :3].clone()  # sequence 1 has 14 keys: 4 pages of 4
    wide = torch.full((2, 12), 0, dtype=torch.int32, device=device)[:, ::2]
    def args(**over):
        return {"q": case.q, "k_cache": case.k_cache, "v_cache": case.v_cache, "block_table": table,
                "cu_seqlens_q": case.cu_q, "cu_seqlens_k": case.cu_k, "max_seqlen_q": 3, "max_seqlen_k": 14, **over}
    cases = [
        (args(block_table=out_of_range), ValueError,
         f"block_table[1, 2] = {num_pages} is not a page of k_cache/v_cache; supported: page ids in [0, {num_pages})"),
        (args(block_table=negative), ValueError, "block_table[0, 1] = -1 is not a page of k_cache/v_cache"),
        (args(block_table=short), ValueError,
         "block_table has 3 pages per sequence; sequence 1 has 14 keys, needing 4 pages of 4"),
        (args(v_cache=case.v_cache.view(-1, 2, 2, 64)), ValueError,
         "k_cache pages hold 4 keys and v_cache pages 2; supported: one page size"),
        (args(v_cache=case.v_cache[:-1]), ValueError, "must both be [P, page_size, Hkv, D]"),
        (args(v_cache=case.v_cache.new_zeros((num_pages, 4, 2, 288))), ValueError,
         "query/key head dim 64 with value head dim 288 is not supported"),
        (args(v_cache=case.v_cache.transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
         "k_cache strides (512, 128, 64, 1) and v_cache strides (512, 64, 256, 1) differ"),
        (args(block_table=table.long()), ValueError, "block_table must be an int32 tensor [n sequences (2), max_pages"),
        (args(block_table=table[:1]), ValueError, "block_table must be an int32 tensor [n sequences (2)"),
        (args(block_table=wide), ValueError, "block_table has strides (12, 2); supported: rows contiguous"),
        (args(block_table=table.tolist()), TypeError, "block_table must be a torch.Tensor; got list"),
        (args(cu_seqlens_k=i32([0, 14, 9], device)), ValueError, "cu_seqlens_k must start at 0 and never decrease"),
        (args(cu_seqlens_q=i32([0, 1, 3], device)), ValueError,
         "cu_seqlens_q must start at 0, never decrease and end at the packed length 4"),
        (args(max_seqlen_k=13), ValueError, "max_seqlen_k 13 is not supported"),
        (args(q=case.q[None]), ValueError, "q must be 3-D"),
        (args(k_cache=case.k_cache.float()), TypeError, "k_cache has dtype torch.float32"),
        (args(q=case.q[:, :3]), ValueError, "query heads 3 are not a multiple of key/value heads 2"),
        (args(q=case.q.detach().clone().requires_grad_()), NotImplementedError,
         "attention_paged has no backward (a paged KV cache is inference only)"),
    ]
    for kwargs, exc, message in cases:
        with pytest.raises(exc) as info:
            attention_paged(**kwargs)
        assert message in str(info.value) and "\n" not in str(info.value), (message, str(info.value))
    # Entries past a sequence's pages are never read (transformers pads them with -1) and pass the checks.
    monkeypatch.undo()
    padded = table.clone()
    padded[0, 3:] = num_pages + 7
    assert_bits_equal(attention_paged(**args(block_table=padded)), case.varlen(), "padded table")
    with torch.no_grad():  # inputs that require grad are fine without grad
        out = attention_paged(**args(q=case.q.detach().clone().requires_grad_()))
    assert_bits_equal(out, case.varlen(), "under no_grad")


# ---- GPU: real shapes ---------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 32, 64, 256])
def test_gpu_paged_bits_equal_contiguous_at_qwen3_shapes(page_size, device):
    # Qwen3-8B heads (32 on 8, D = 128): decode at 4k keys (8 splits of 512) and 1 key, a 200-token chunk on 3900
    # cached keys, a 700-token prefill (256-key splits: beside 4k keys a row of the call's largest, 512-key split);
    # pages shuffled. The default grid choice for this call, and both grids forced.
    lens_k, lens_q = [4096, 1, 4100, 700], [1, 1, 200, 700]
    case = _make(lens_q, lens_k, page_size, device, heads_q=32, heads_kv=8, head_dim=128, seed=page_size)
    assert_bits_equal(case.paged(), case.varlen(), f"page size {page_size}, default grid")
    for path, configs in forced_paths(device, 128).items():
        assert_bits_equal(case.paged(configs=configs), case.varlen(configs=configs), f"page size {page_size}, {path}")


@pytest.mark.gpu
def test_gpu_paged_decode_batch_gives_the_prefill_bits(device):
    """A batch of 8 decode steps over 4k-key paged caches against each sequence's one-sequence prefill (the rollout
    against the trainer), and within the FP64 bound."""
    seq, batch, page_size = 4096, 8, 16
    case = _make([1] * batch, [seq - 37 * b for b in range(batch)], page_size, device, heads_q=32, heads_kv=8,
                 head_dim=128, seed=11)
    out = case.paged()
    for b in range(batch):
        keys = slice(int(case.cu_k[b]), int(case.cu_k[b + 1]))
        n = keys.stop - keys.start
        q = bf16_randn((n, 32, 128), 100 + b, device)
        q[-1] = case.q[b]
        cu = cu_seqlens([n], device)
        prefill = attention_varlen(q, case.k[keys], case.v[keys], cu, cu, n, n)
        assert_bits_equal(out[b:b + 1], prefill[-1:], f"sequence {b}")
    qs, ks, vs = (t.transpose(0, 1)[None] for t in (case.q[:1, :8], case.k[:seq, :2], case.v[:seq, :2]))
    o_star, bound = attention_fwd_bound(qs, ks, vs, block_n=select_configs("cuda_sm90", 128).fwd.block_n)
    assert check_bound(out[:1, :8].transpose(0, 1)[None], o_star, bound).passed
