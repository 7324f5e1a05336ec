"""Shard references for the TP=2 x CP=2 layout, computed in one process without any process group.

From seeded, independent BF16 fixtures of the global tensors (``x``, ``hidden``, ``d_gate``,
``d_up``, ``d_out`` and the three weights) this module cuts every rank's local operands exactly as
``toolkit.layout`` places them, runs the local det_gemm of each of the nine sharded GEMMs of the
Qwen3 MLP (table below) and forms the reductions with the version-1 oracle::

    reduced = (p0.float() + p1.float()).bfloat16()        # p_i in group-rank order

| spec          | local GEMM (det_gemm op)                 | reduction  | global region of the result       |
|---------------|------------------------------------------|------------|-----------------------------------|
| gate_fwd/up_fwd | fwd(x_c, W[:, I_t])  [M_l, I/2]        | none       | Y[rows(c), I_t]                    |
| down_fwd      | fwd(hidden_ct, W_down[I_t, :]) [M_l, H]  | TP sum     | Y[rows(c), :]                      |
| gate_dx/up_dx | da(dProj_ct, W[:, I_t])  [M_l, H]        | TP sum     | dX[rows(c), :]                     |
| down_dhidden  | da(dOut_c, W_down[I_t, :]) [M_l, I/2]    | none       | dHidden[rows(c), I_t]              |
| gate_dw/up_dw | db(x_c, dProj_ct)  [H, I/2]              | CP sum     | dW[:, I_t]                         |
| down_dw       | db(hidden_ct, dOut_c)  [I/2, H]          | CP sum     | dW_down[I_t, :]                    |

(``c``/``t``: the rank's CP/TP coordinates, ``rows(c)``: its CP rows, ``I_t``: its intermediate
shard.) The FP64 oracle of a result is computed from the *global* operands of its region, i.e. with
the reduced dimension un-sharded, so a reduced tensor is compared with the true global product.

Fixture kinds:
- ``randn``: Gaussian BF16 values (weights scaled by K**-0.5, gradients by M**-0.5); results are
  checked against the contract bound (``gemm_bound`` / ``reduced_bound``).
- ``exact``: sparse values in {-1, 0, +1}: every product and partial sum is a small integer, so the
  FP64 oracle is exactly representable in BF16 and every result, partial or reduced, must equal it
  bit for bit; any other value is a bug. ``oracle_is_exact`` verifies the premise per tensor.

``hidden`` and the gradients are independent fixtures, not the SwiGLU of the forward pass: a complete
Qwen3 MLP is not covered until the SwiGLU operator exists.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from detkit.kernels.det_gemm.launch import LAUNCHERS, REFERENCES, GemmLaunch
from detkit.toolkit.contract import check_bound, compare_bits, drift_stats, gemm_bound, reduced_bound
from detkit.toolkit.layout import CP_SIZE, TP_SIZE, TpCpLayout

FIXTURE_KINDS = ("randn", "exact")
ACTIVATIONS = ("x", "hidden", "d_gate", "d_up", "d_out")
WEIGHTS = ("w_gate", "w_up", "w_down")
# Seed offsets: every tensor has its own generator, so a fixture does not depend on the others.
_SEED_OFFSET = {name: i for i, name in enumerate(ACTIVATIONS + WEIGHTS)}
# Exact fixtures: expected non-zero products per output element (density**2 * K) stays near this,
# far below the 256 up to which BF16 holds every integer.
_EXACT_TERMS = 16


def reduce_v1(p0: torch.Tensor, p1: torch.Tensor) -> torch.Tensor:
    """Version-1 reduction oracle of two BF16 partials: one FP32 add, one BF16 rounding.

    With two operands the sum is rounded once, so it is independent of operand order and of
    NCCL's algorithm (``reduce_v1(p0, p1)`` and ``reduce_v1(p1, p0)`` have the same bits)."""
    for name, p in (("p0", p0), ("p1", p1)):
        if p.dtype != torch.bfloat16:
            raise TypeError(f"reduce_v1: {name} has dtype {p.dtype}; supported: torch.bfloat16")
    if p0.shape != p1.shape:
        raise ValueError(f"reduce_v1: partial shapes differ: {tuple(p0.shape)} vs {tuple(p1.shape)}")
    return (p0.float() + p1.float()).bfloat16()


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fixtures:
    """Global BF16 tensors. Activations are [M, *] in the layout's token order; weights are stored
    as nn.Linear weights ``[out, in]`` (``w_gate``/``w_up`` [I, H], ``w_down`` [H, I]) and used as
    ``weight.t()`` in the ``b [K, N]`` convention."""

    layout: TpCpLayout
    kind: str
    seed: int
    tensors: dict[str, torch.Tensor] = field(repr=False)

    def weight_kn(self, name: str) -> torch.Tensor:
        """The global weight in the ``b [K, N]`` convention (a view, no copy)."""
        return self.tensors[name].t()


def _fixture(shape: tuple[int, int], seed: int, kind: str, scale: float, density: float,
             device: torch.device | str) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if kind == "randn":
        t = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
    else:
        sign = torch.randint(-1, 2, shape, generator=gen, dtype=torch.int8)
        keep = torch.rand(shape, generator=gen) < density
        t = (sign * keep).to(torch.float32)
    return t.to(torch.bfloat16).to(device)


def make_fixtures(layout: TpCpLayout, seed: int, device: torch.device | str = "cpu",
                  kind: str = "randn") -> Fixtures:
    """Seeded global fixtures, drawn on the CPU (same bits in every process), then moved."""
    if kind not in FIXTURE_KINDS:
        raise ValueError(f"fixture kind {kind!r} is not supported; supported: {FIXTURE_KINDS}")
    h, i, m = layout.model.hidden_size, layout.model.intermediate_size, layout.m
    density = min(1.0, math.sqrt(_EXACT_TERMS / max(h, i, m)))
    shapes_scales = {
        "x": ((m, h), 1.0), "hidden": ((m, i), 1.0),
        "d_gate": ((m, i), m**-0.5), "d_up": ((m, i), m**-0.5), "d_out": ((m, h), m**-0.5),
        "w_gate": ((i, h), h**-0.5), "w_up": ((i, h), h**-0.5), "w_down": ((h, i), i**-0.5),
    }
    tensors = {name: _fixture(shape, seed * 100 + _SEED_OFFSET[name], kind, scale, density, device)
               for name, (shape, scale) in shapes_scales.items()}
    return Fixtures(layout=layout, kind=kind, seed=seed, tensors=tensors)


def operand(fx: Fixtures, name: str, cp: int | None, tp: int | None) -> torch.Tensor:
    """A rank's copy of tensor ``name``: CP rows ``cp`` (None: all M rows) and intermediate shard
    ``tp`` (None: all of I). Activations come back contiguous in local row order; weights as the
    ``.t()`` view of a contiguous nn.Linear shard, as a rank stores them."""
    layout = fx.layout
    t = fx.tensors[name]
    if name in ACTIVATIONS:
        if cp is not None:
            t = layout.shard_rows(t, cp)
        if tp is not None and name in ("hidden", "d_gate", "d_up"):
            t = t[:, layout.i_shard(tp)]
        return t.contiguous()
    if name in ("w_gate", "w_up"):  # [I, H]: ColumnParallel shards the output (I) rows
        return (t[layout.i_shard(tp)] if tp is not None else t).contiguous().t()
    if name == "w_down":  # [H, I]: RowParallel shards the input (I) columns
        return (t[:, layout.i_shard(tp)] if tp is not None else t).contiguous().t()
    raise ValueError(f"tensor {name!r} is not a fixture; supported: {ACTIVATIONS + WEIGHTS}")


@dataclass(frozen=True)
class LocalInputs:
    """Everything one rank holds, in the shapes of ``TpCpLayout.local_shapes()``."""

    layout_rank: int
    cp: int
    tp: int
    tensors: dict[str, torch.Tensor]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def local_inputs(fx: Fixtures, layout_rank: int) -> LocalInputs:
    cp, tp = fx.layout.coords(layout_rank)
    return LocalInputs(layout_rank, cp, tp, {n: operand(fx, n, cp, tp) for n in ACTIVATIONS + WEIGHTS})


# ---------------------------------------------------------------------------------------------
# The nine sharded GEMMs
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardedGemm:
    name: str
    op: str  # det_gemm op: fwd | da | db
    x_name: str
    y_name: str
    reduce_axis: str | None  # None | "tp" | "cp"
    operator: str  # the kernels.parallel operator (or the plain det_gemm call) that computes it

    def local_operands(self, fx: Fixtures, layout_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        cp, tp = fx.layout.coords(layout_rank)
        return operand(fx, self.x_name, cp, tp), operand(fx, self.y_name, cp, tp)

    def region_operands(self, fx: Fixtures, layout_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global operands whose product is the region of the global result this rank's output
        (reduced output for a reduced spec) covers: the reduced dim is not sharded."""
        cp, tp = fx.layout.coords(layout_rank)
        if self.reduce_axis == "tp":
            tp = None
        elif self.reduce_axis == "cp":
            cp = None
        return operand(fx, self.x_name, cp, tp), operand(fx, self.y_name, cp, tp)

    def reduced_extent(self, layout: TpCpLayout, local: bool) -> int:
        """Terms summed for one element: in one rank's GEMM (``local``) or over the whole region."""
        if self.reduce_axis == "cp":  # dW: over the M rows of one CP shard, or all of them
            return layout.m_local if local else layout.m
        if self.reduce_axis == "tp":  # Down fwd, Gate/Up dX: over one intermediate shard, or all of I
            return layout.i_local if local else layout.model.intermediate_size
        return layout.model.hidden_size  # Gate/Up fwd, Down dHidden: over H, never sharded

    def group_of(self, layout: TpCpLayout, layout_rank: int) -> tuple[int, ...] | None:
        return None if self.reduce_axis is None else layout.group_of(self.reduce_axis, layout_rank)

    def dims(self, layout: TpCpLayout) -> dict[str, int]:
        """Local (M, N, K) of the layer GEMM, for names."""
        h, il, ml = layout.model.hidden_size, layout.i_local, layout.m_local
        table = {"gate_fwd": (ml, il, h), "up_fwd": (ml, il, h), "down_fwd": (ml, h, il),
                 "gate_dx": (ml, il, h), "up_dx": (ml, il, h), "down_dhidden": (ml, h, il),
                 "gate_dw": (ml, il, h), "up_dw": (ml, il, h), "down_dw": (ml, h, il)}
        return dict(zip("MNK", table[self.name]))


SPECS: dict[str, ShardedGemm] = {s.name: s for s in (
    ShardedGemm("gate_fwd", "fwd", "x", "w_gate", None, "det_gemm_fwd (ColumnParallel, no collective)"),
    ShardedGemm("up_fwd", "fwd", "x", "w_up", None, "det_gemm_fwd (ColumnParallel, no collective)"),
    ShardedGemm("down_fwd", "fwd", "hidden", "w_down", "tp", "row_parallel_fwd"),
    ShardedGemm("gate_dx", "da", "d_gate", "w_gate", "tp", "column_parallel_dx"),
    ShardedGemm("up_dx", "da", "d_up", "w_up", "tp", "column_parallel_dx"),
    ShardedGemm("down_dhidden", "da", "d_out", "w_down", None, "row_parallel_dhidden"),
    ShardedGemm("gate_dw", "db", "x", "d_gate", "cp", "replicated_dw"),
    ShardedGemm("up_dw", "db", "x", "d_up", "cp", "replicated_dw"),
    ShardedGemm("down_dw", "db", "hidden", "d_out", "cp", "replicated_dw"),
)}


def local_result(spec: ShardedGemm, fx: Fixtures, layout_rank: int) -> tuple[torch.Tensor, GemmLaunch]:
    """The det_gemm of ``layout_rank``'s local operands: the partial (reduced specs) or the result."""
    return LAUNCHERS[spec.op](*spec.local_operands(fx, layout_rank))


def reduced_result(spec: ShardedGemm, fx: Fixtures, layout_rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(reduce_v1 of the group's partials in group-rank order, the partials)."""
    if spec.reduce_axis is None:
        raise ValueError(f"{spec.name} has no reduction")
    partials = [local_result(spec, fx, r)[0] for r in spec.group_of(fx.layout, layout_rank)]
    return reduce_v1(*partials), partials


def unsharded_result(spec: ShardedGemm, fx: Fixtures, layout_rank: int) -> torch.Tensor:
    """TP=1, CP=1 det_gemm on the global operands, cut to this rank's region (non-reduced specs).

    Equal bits to the local result show the shard needs no reduction: each element is reduced
    over its full extent on one rank, in the same order as without sharding (det_gemm's order
    depends on the reduced length only, and rows and columns are independent)."""
    if spec.reduce_axis is not None:
        raise ValueError(f"{spec.name} is reduced; its TP=1 result is not bitwise comparable in version 1")
    layout = fx.layout
    cp, tp = layout.coords(layout_rank)
    full = LAUNCHERS[spec.op](operand(fx, spec.x_name, None, None), operand(fx, spec.y_name, None, None))[0]
    return full.index_select(0, layout.global_rows(cp, full.device))[:, layout.i_shard(tp)]


def oracle(spec: ShardedGemm, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(c*, |A| @ |B|) in FP64 from BF16 operands."""
    ref = REFERENCES[spec.op]
    return ref(x, y, torch.float64), ref(x.abs(), y.abs(), torch.float64)


def oracle_is_exact(c_star: torch.Tensor) -> bool:
    """True when every FP64 oracle value is a BF16 value (so the exact result has known bits)."""
    return bool((c_star.to(torch.bfloat16).to(torch.float64) == c_star).all())


# ---------------------------------------------------------------------------------------------
# Checks (the tp-cp-refs suite and the tests run these)
# ---------------------------------------------------------------------------------------------
@dataclass
class RefCheck:
    check: str
    name: str
    passed: bool
    details: dict


def _bitwise(check: str, name: str, got: torch.Tensor, want: torch.Tensor, **details) -> RefCheck:
    result = compare_bits(got, want)
    return RefCheck(check, name, result.equal, {**details, **result.as_row()})


def _contract(check: str, name: str, c: torch.Tensor, c_star: torch.Tensor, bound: torch.Tensor,
              prefix: str, **details) -> RefCheck:
    result = check_bound(c, c_star, bound)
    return RefCheck(check, name, result.passed,
                    {**details, **result.as_row(), **drift_stats(c, c_star, prefix, bound)})


def case_name(spec: ShardedGemm, layout: TpCpLayout, where: str, kind: str) -> str:
    dims = spec.dims(layout)
    return f"{spec.name} [M={dims['M']}, N={dims['N']}, K={dims['K']}] {where} {kind}"


def check_spec(spec: ShardedGemm, fx: Fixtures) -> Iterator[RefCheck]:
    """Every check of one spec over the whole layout, process-group free."""
    layout, kind = fx.layout, fx.kind
    if spec.reduce_axis is None:
        for r in range(TP_SIZE * CP_SIZE):
            cp, tp = layout.coords(r)
            name = case_name(spec, layout, f"rank {r} (cp{cp},tp{tp})", kind)
            local, launch = local_result(spec, fx, r)
            meta = {"layout_rank": r, "cp": cp, "tp": tp, "kind": kind, "config": launch.config.label()}
            yield _bitwise("tp1_equal", name, local, unsharded_result(spec, fx, r), **meta)
            c_star, abs_ab = oracle(spec, *spec.region_operands(fx, r))
            if kind == "exact":
                exact = oracle_is_exact(c_star)
                chk = _bitwise("exact_oracle", name, local, c_star.to(torch.bfloat16), oracle_exact=exact, **meta)
                yield RefCheck(chk.check, name, chk.passed and exact, chk.details)
            else:
                yield _contract("contract", name, local, c_star,
                                gemm_bound(c_star, abs_ab, spec.reduced_extent(layout, local=True)), "fp64", **meta)
        return
    for group in layout.groups(spec.reduce_axis):
        where = f"{spec.reduce_axis.upper()}{list(group)}"
        name = case_name(spec, layout, where, kind)
        reduced, partials = reduced_result(spec, fx, group[0])
        meta = {"group": list(group), "kind": kind}
        yield _bitwise("v1_order_free", name, reduce_v1(partials[1], partials[0]), reduced, **meta)
        c_star, abs_ab = oracle(spec, *spec.region_operands(fx, group[0]))
        partial_oracles = [oracle(spec, *spec.local_operands(fx, r)) for r in group]
        if kind == "exact":
            exact = oracle_is_exact(c_star) and all(oracle_is_exact(o) for o, _ in partial_oracles)
            for r, p, (p_star, _) in zip(group, partials, partial_oracles):
                chk = _bitwise("exact_oracle_partial", f"{name} partial rank {r}", p, p_star.to(torch.bfloat16),
                               oracle_exact=exact, layout_rank=r, **meta)
                yield RefCheck(chk.check, chk.name, chk.passed and exact, chk.details)
            chk = _bitwise("exact_oracle_reduced", name, reduced, c_star.to(torch.bfloat16), oracle_exact=exact, **meta)
            yield RefCheck(chk.check, chk.name, chk.passed and exact, chk.details)
            continue
        k_local = spec.reduced_extent(layout, local=True)
        for r, p, (p_star, p_abs) in zip(group, partials, partial_oracles):
            yield _contract("contract_partial", f"{name} partial rank {r}", p, p_star,
                            gemm_bound(p_star, p_abs, k_local), "pre_fp64", layout_rank=r, **meta)
        partial_abs_sum = sum(p_star.abs() for p_star, _ in partial_oracles)
        yield _contract("contract_reduced", name, reduced, c_star,
                        reduced_bound(c_star, partial_abs_sum, abs_ab, k_local), "post_fp64", **meta)


def check_token_order(layout: TpCpLayout) -> Iterator[RefCheck]:
    """CP shards partition the M rows exactly, and unshard(shard(t)) == t."""
    rows = [layout.global_rows(cp) for cp in range(CP_SIZE)]
    covered = torch.sort(torch.cat(rows)).values
    partition = torch.equal(covered, torch.arange(layout.m))
    seq_of_row = torch.cat(rows) // layout.seq_len
    in_order = all(bool((torch.diff(r) > 0).all()) for r in rows)
    yield RefCheck("token_order", f"cp shard rows [B={layout.batch}, S={layout.seq_len}]",
                   partition and in_order,
                   {"partition": partition, "ascending": in_order,
                    "shard_rows": [r.tolist() if r.numel() <= 64 else f"{r.numel()} rows" for r in rows],
                    "sequences_per_shard": int(seq_of_row.unique().numel())})
    probe = torch.arange(layout.m * 3, dtype=torch.float32).reshape(layout.m, 3).to(torch.bfloat16)
    back = layout.unshard_rows([layout.shard_rows(probe, cp) for cp in range(CP_SIZE)])
    yield _bitwise("token_roundtrip", f"unshard(shard(x)) [M={layout.m}]", back, probe)


def check_all(layout: TpCpLayout, seed: int, device: torch.device | str = "cpu",
              kinds: tuple[str, ...] = FIXTURE_KINDS) -> Iterator[RefCheck]:
    yield from check_token_order(layout)
    for kind in kinds:
        fx = make_fixtures(layout, seed, device, kind)
        for spec in SPECS.values():
            yield from check_spec(spec, fx)
