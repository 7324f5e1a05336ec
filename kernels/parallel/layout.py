"""The fixed TP=2, CP=2 layout of the Qwen3-8B dense MLP, as frozen, validated data: what the TP/CP operators
(kernels/parallel/operators.py, kernels/parallel/mlp.py) check their groups and local shapes against.

Ranks (axis sizes are fixed at 2 in version 1)::

    rank = cp * 2 + tp          TP groups [0, 1], [2, 3]  (intra-node)
                                CP groups [0, 2], [1, 3]  (inter-node, same TP lane)

Tensor dims (``Y[M, N] = X[M, K] @ W[K, N]``, weights in the ``b [K, N]`` convention):

- Gate/Up are ColumnParallel: TP rank ``t`` owns columns ``[t*I/2, (t+1)*I/2)`` of ``W_gate``/``W_up``
  ``[H, I]``. Down is RowParallel: TP rank ``t`` owns the matching rows of ``W_down [I, H]``.
- CP splits every sequence into two contiguous halves. Token order is explicit: a global
  activation has ``M = B*S`` rows with row ``b*S + s`` holding token ``s`` of sequence ``b``. CP rank
  ``c`` holds, for each sequence ``b`` in order, tokens ``[c*S/2, (c+1)*S/2)``; its local row
  ``b*S_local + j`` is global row ``b*S + c*S_local + j``. With ``B > 1`` a CP shard is therefore
  ``B`` blocks of ``S_local`` rows, not one contiguous block of ``B*S/2`` rows.
  ``global_rows(c)`` is that map; ``shard_rows`` / ``unshard_rows`` apply it.

``world`` says which layout ranks the processes of a job hold: process rank ``i`` holds layout rank
``world[i]``. The 4-rank run holds all four, ``(0, 1, 2, 3)``; a 2-GPU host can hold exactly one
TP group (``(0, 1)``) or one CP group (``(0, 2)``), and a report from such a run says which groups
it did not cover.

Model dims come from :class:`ModelDims`: the only production model is Qwen3-8B (hidden 4096,
intermediate 12288). Test dims must be named ``tiny...`` and are labelled as such in reports. The shape
presets the harness runs (``--preset``) map onto layouts in toolkit/layout.py.

:class:`AxisGroup` is the group handle the launcher (``toolkit.dist.build_groups``) builds: the
torch process group of one TP or CP group with its layout attached, so an operator can refuse a
group of the wrong size, axis or membership and local shapes that are not the configured ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

AXES = ("tp", "cp")
TP_SIZE = 2
CP_SIZE = 2
FULL_WORLD = (0, 1, 2, 3)
_TP_GROUPS = tuple(tuple(cp * TP_SIZE + tp for tp in range(TP_SIZE)) for cp in range(CP_SIZE))  # ((0, 1), (2, 3))
_CP_GROUPS = tuple(tuple(cp * TP_SIZE + tp for cp in range(CP_SIZE)) for tp in range(TP_SIZE))  # ((0, 2), (1, 3))


@dataclass(frozen=True)
class ModelDims:
    """Dense MLP dims: hidden size H and intermediate size I (no bias)."""

    name: str
    hidden_size: int
    intermediate_size: int

    PRODUCTION: ClassVar[dict[str, tuple[int, int]]] = {"qwen3-8b": (4096, 12288)}

    def __post_init__(self):
        for dim in ("hidden_size", "intermediate_size"):
            value = getattr(self, dim)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelDims.{dim} must be a positive int; got {value!r}")
        if self.name in self.PRODUCTION:
            want = self.PRODUCTION[self.name]
            if (self.hidden_size, self.intermediate_size) != want:
                raise ValueError(
                    f"model {self.name!r} has hidden {want[0]}, intermediate {want[1]}; "
                    f"got hidden {self.hidden_size}, intermediate {self.intermediate_size}"
                )
        elif not self.name.startswith("tiny"):
            raise ValueError(
                f"model name {self.name!r} is not supported: the production preset is 'qwen3-8b'; "
                "test dims must be named 'tiny...' so reports label them as such"
            )
        if self.intermediate_size % TP_SIZE:
            raise ValueError(
                f"intermediate_size {self.intermediate_size} is not divisible by TP={TP_SIZE}; "
                "supported: even shards only"
            )

    @property
    def production(self) -> bool:
        return self.name in self.PRODUCTION

    @property
    def label(self) -> str:
        dims = f"hidden {self.hidden_size}, intermediate {self.intermediate_size}"
        if self.production:
            return f"{self.name} ({dims})"
        return f"{self.name} (TEST-ONLY dims: {dims}; not Qwen3-8B)"


QWEN3_8B = ModelDims("qwen3-8b", 4096, 12288)
TINY = ModelDims("tiny", 64, 96)

@dataclass(frozen=True)
class TpCpLayout:
    """Qwen3-8B TP=2 x CP=2: rank mapping, groups, shard offsets and the CP token order."""

    model: ModelDims
    batch: int  # B sequences
    seq_len: int  # S tokens per sequence (global, before the CP split)
    world: tuple[int, ...] = FULL_WORLD  # layout rank held by each process rank

    tp_size: ClassVar[int] = TP_SIZE
    cp_size: ClassVar[int] = CP_SIZE

    def __post_init__(self):
        if not isinstance(self.model, ModelDims):
            raise TypeError(f"model must be a ModelDims; got {type(self.model).__name__}")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch must be a positive int; got {self.batch!r}")
        if not isinstance(self.seq_len, int) or self.seq_len < CP_SIZE or self.seq_len % CP_SIZE:
            raise ValueError(
                f"seq_len {self.seq_len!r} cannot be split into {CP_SIZE} equal CP shards; "
                f"supported: a positive multiple of {CP_SIZE} (even shards only)"
            )
        world = tuple(self.world)
        if world not in self.supported_worlds():
            raise ValueError(
                f"world {world!r} is not supported; supported: the full layout {FULL_WORLD}, "
                f"one TP group {self.tp_groups} or one CP group {self.cp_groups}"
            )
        object.__setattr__(self, "world", world)

    # ----------------------------------------------------------------------------- ranks
    @classmethod
    def supported_worlds(cls) -> tuple[tuple[int, ...], ...]:
        return (FULL_WORLD, *_TP_GROUPS, *_CP_GROUPS)

    @property
    def world_size(self) -> int:
        return len(self.world)

    @property
    def is_full(self) -> bool:
        return self.world == FULL_WORLD

    @staticmethod
    def coords(layout_rank: int) -> tuple[int, int]:
        """Layout rank -> (cp, tp)."""
        _check_layout_rank(layout_rank)
        return divmod(layout_rank, TP_SIZE)

    @staticmethod
    def layout_rank(cp: int, tp: int) -> int:
        """(cp, tp) -> layout rank = cp * 2 + tp."""
        if cp not in range(CP_SIZE) or tp not in range(TP_SIZE):
            raise ValueError(f"(cp, tp) = ({cp!r}, {tp!r}); supported: cp in 0..{CP_SIZE - 1}, tp in 0..{TP_SIZE - 1}")
        return cp * TP_SIZE + tp

    def layout_rank_of_process(self, process_rank: int) -> int:
        if not isinstance(process_rank, int) or not 0 <= process_rank < self.world_size:
            raise ValueError(f"process rank {process_rank!r} is outside this layout's world {self.world}")
        return self.world[process_rank]

    def process_rank(self, layout_rank: int) -> int:
        _check_layout_rank(layout_rank)
        if layout_rank not in self.world:
            raise ValueError(f"layout rank {layout_rank} is not held by any process of world {self.world}")
        return self.world.index(layout_rank)

    # ----------------------------------------------------------------------------- groups
    tp_groups: ClassVar[tuple[tuple[int, ...], ...]] = _TP_GROUPS
    cp_groups: ClassVar[tuple[tuple[int, ...], ...]] = _CP_GROUPS

    @staticmethod
    def group_of(axis: str, layout_rank: int) -> tuple[int, ...]:
        """The layout ranks of ``layout_rank``'s group on ``axis``, in group-rank order."""
        _check_axis(axis)
        cp, tp = TpCpLayout.coords(layout_rank)
        return _TP_GROUPS[cp] if axis == "tp" else _CP_GROUPS[tp]

    @staticmethod
    def groups(axis: str) -> tuple[tuple[int, ...], ...]:
        _check_axis(axis)
        return _TP_GROUPS if axis == "tp" else _CP_GROUPS

    def groups_present(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """The groups on ``axis`` whose every member is held by a process of this world."""
        return tuple(g for g in self.groups(axis) if all(r in self.world for r in g))

    def process_ranks_of(self, group: Sequence[int]) -> tuple[int, ...]:
        return tuple(self.process_rank(r) for r in group)

    # ----------------------------------------------------------------------------- dims
    @property
    def m(self) -> int:
        """Global token rows B*S."""
        return self.batch * self.seq_len

    @property
    def s_local(self) -> int:
        return self.seq_len // CP_SIZE

    @property
    def m_local(self) -> int:
        """Rows per CP shard, B*S/2 (TP does not split M)."""
        return self.batch * self.s_local

    @property
    def i_local(self) -> int:
        """Gate/Up N-shard = Down K-shard width, I/2."""
        return self.model.intermediate_size // TP_SIZE

    def i_shard(self, tp: int) -> slice:
        """Columns of W_gate/W_up [H, I] (ColumnParallel N-shard) and rows of W_down [I, H]
        (RowParallel K-shard) owned by TP rank ``tp``; the same offsets for both."""
        if tp not in range(TP_SIZE):
            raise ValueError(f"tp {tp!r}; supported: 0..{TP_SIZE - 1}")
        return slice(tp * self.i_local, (tp + 1) * self.i_local)

    def global_rows(self, cp: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global row of each local row of CP shard ``cp`` (int64 [M_local]); see the module doc."""
        if cp not in range(CP_SIZE):
            raise ValueError(f"cp {cp!r}; supported: 0..{CP_SIZE - 1}")
        seq_start = torch.arange(self.batch, device=device)[:, None] * self.seq_len
        offset = cp * self.s_local + torch.arange(self.s_local, device=device)[None, :]
        return (seq_start + offset).reshape(-1)

    def shard_rows(self, t: torch.Tensor, cp: int) -> torch.Tensor:
        """The CP shard ``cp`` of a global activation ``t [M, *]`` (a copy, local row order)."""
        if t.dim() < 1 or t.shape[0] != self.m:
            raise ValueError(f"shard_rows needs a global tensor of {self.m} rows (B*S); got shape {tuple(t.shape)}")
        return t.index_select(0, self.global_rows(cp, t.device))

    def unshard_rows(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """Rebuild a global activation from its CP shards, given in cp order."""
        if len(shards) != CP_SIZE:
            raise ValueError(f"unshard_rows needs {CP_SIZE} shards in cp order; got {len(shards)}")
        first = shards[0]
        for cp, s in enumerate(shards):
            if s.shape[0] != self.m_local or s.shape[1:] != first.shape[1:] or s.dtype != first.dtype:
                raise ValueError(
                    f"shard {cp} is {s.dtype}{tuple(s.shape)}; expected {first.dtype}"
                    f"{(self.m_local, *first.shape[1:])}"
                )
        out = torch.empty((self.m, *first.shape[1:]), dtype=first.dtype, device=first.device)
        for cp, s in enumerate(shards):
            out.index_copy_(0, self.global_rows(cp, first.device), s.to(first.device))
        return out

    def local_shapes(self) -> dict[str, tuple[int, int]]:
        """Configured local shapes (weights in the ``b [K, N]`` convention)."""
        h, il, ml = self.model.hidden_size, self.i_local, self.m_local
        return {
            "x": (ml, h), "hidden": (ml, il), "d_gate": (ml, il), "d_up": (ml, il), "d_out": (ml, h),
            "w_gate": (h, il), "w_up": (h, il), "w_down": (il, h),
        }

    def describe(self) -> dict[str, Any]:
        """JSON-ready summary for reports."""
        return {
            "model": self.model.label,
            "production_dims": self.model.production,
            "hidden_size": self.model.hidden_size,
            "intermediate_size": self.model.intermediate_size,
            "tp": TP_SIZE, "cp": CP_SIZE,
            "rank_rule": "rank = cp * 2 + tp",
            "batch": self.batch, "seq_len": self.seq_len, "s_local": self.s_local,
            "m": self.m, "m_local": self.m_local, "i_local": self.i_local,
            "i_shards": [[self.i_shard(t).start, self.i_shard(t).stop] for t in range(TP_SIZE)],
            "token_order": "global row b*S + s; CP rank c holds tokens [c*S/2, (c+1)*S/2) of every "
                           "sequence, local row b*S_local + j = global row b*S + c*S_local + j",
            "world": list(self.world),
            "tp_groups": [list(g) for g in self.tp_groups],
            "cp_groups": [list(g) for g in self.cp_groups],
            "tp_groups_present": [list(g) for g in self.groups_present("tp")],
            "cp_groups_present": [list(g) for g in self.groups_present("cp")],
        }


def _check_layout_rank(layout_rank: int) -> None:
    if not isinstance(layout_rank, int) or layout_rank not in FULL_WORLD:
        raise ValueError(f"layout rank {layout_rank!r}; supported: {FULL_WORLD}")


def _check_axis(axis: str) -> None:
    if axis not in AXES:
        raise ValueError(f"axis {axis!r}; supported: {AXES}")


@dataclass(frozen=True)
class AxisGroup:
    """One TP or CP group of a layout and the torch process group the launcher built for it.

    ``ranks`` are layout ranks in group-rank order (the order of the two operands of the
    reduction). ``group`` is the ``torch.distributed`` ProcessGroup, or
    ``torch.distributed.GroupMember.NON_GROUP_MEMBER`` on a process outside the group. Built by
    ``toolkit.dist.build_groups`` / ``toolkit.dist.attach_group``; operators check it, they never
    create or look up groups.
    """

    layout: TpCpLayout
    axis: str
    ranks: tuple[int, ...]
    group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.layout, TpCpLayout):
            raise TypeError(f"AxisGroup.layout must be a TpCpLayout; got {type(self.layout).__name__}")
        _check_axis(self.axis)
        ranks = tuple(self.ranks)
        if ranks not in self.layout.groups(self.axis):
            raise ValueError(
                f"{ranks} is not a {self.axis.upper()} group of the layout; supported: "
                f"{self.layout.groups(self.axis)}"
            )
        if not all(r in self.layout.world for r in ranks):
            raise ValueError(f"{self.axis.upper()} group {ranks} is not held by world {self.layout.world}")
        object.__setattr__(self, "ranks", ranks)

    @property
    def process_ranks(self) -> tuple[int, ...]:
        return self.layout.process_ranks_of(self.ranks)

    @property
    def label(self) -> str:
        return f"{self.axis.upper()}{list(self.ranks)}"
