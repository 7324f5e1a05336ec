"""Pure-torch references for kernels/attention/launch.py and its numerical contract against an FP64 oracle.

``attention_ref`` computes what the kernels compute, in plain torch: FP32 scores and softmax from the same BF16
inputs, one BF16 rounding of the output (the reference tests and audits compare to). ``attention_oracle`` is the
same math in FP64 with the exact gradients; ``attention_fwd_bound`` and ``attention_bwd_bound`` give the
per-element bounds derived in docs/attention.md: every element of the kernels' o, dq, dk, dv lies within them of
the FP64 oracle. Shapes and semantics as ``attention``: q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv]
(Dv = D, or MLA's other value head dim, computed unpadded), causal with query i at key position kv_end - Sq + i,
keys [kv_start, kv_end) visible. Dense [B, Hq, Sq, Skv] intermediates: for test and audit shapes.
"""

from __future__ import annotations

import math

import torch

# Unit roundoffs and the approximate-instruction errors the bound allows (docs/attention.md).
U_BF16 = 2.0**-8
U_FP32 = 2.0**-23  # a full FP32 ulp: tensor-core adds may truncate
U_FP64 = 2.0**-53
ETA_BF16 = 2.0**-134  # half the spacing of BF16 subnormals
E_EXP2 = 2.0**-21  # relative error of ex2.approx.f32 (with margin)
E_LOG2 = 2.0**-21  # absolute error of lg2.approx.f32 per unit of |log2 x| + 1 (with margin)
E_DIV = 2.0**-22  # relative error of FP32 division (div.full.f32: 2 ulp)
FLUSH = 2.0**-125  # what flushing a subnormal FP32 weight to zero can lose, per term
E_TANH = 2.0**-19  # absolute error of the kernels' tanh (exp2 formula; derived in docs/attention.md, softcap)


def gamma(n: int, unit: float = U_FP32) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of an n-term recursive sum."""
    if n < 0 or n * unit >= 1.0:
        raise ValueError(f"gamma({n}) is undefined for unit {unit}")
    return n * unit / (1.0 - n * unit)


def visibility(batch: int, seq_q: int, seq_k: int, kv_start: torch.Tensor | None, kv_end: torch.Tensor | None,
               device: torch.device, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible [B, 1, Sq, Skv] bool, bad [B] bool): query i of sequence b (at position p = kv_end[b] - Sq + i) sees
    keys kv_start[b] <= j <= p, and with a window only j > p - window; ``bad`` marks bounds the kernels refuse
    in-band (NaN outputs). With a window kv_start may be negative (keys dropped by a sliding-window cache) while no
    query's window reaches below key 0."""
    start = torch.zeros(batch, dtype=torch.int64, device=device) if kv_start is None else kv_start.to(device).long()
    end = torch.full((batch,), seq_k, dtype=torch.int64, device=device) if kv_end is None else kv_end.to(device).long()
    if window is None:
        bad = (start < 0) | (start > end) | (end > seq_k)
    else:
        bad = ((start < 0) & (end - seq_q - window + 1 < 0)) | (start > end) | (end > seq_k)
    j = torch.arange(seq_k, device=device)
    pos = end[:, None] - seq_q + torch.arange(seq_q, device=device)[None, :]  # [B, Sq]
    visible = (j >= start[:, None, None]) & (j <= pos[:, :, None]) & (j < end[:, None, None])
    if window is not None:
        visible &= j > pos[:, :, None] - window
    return visible[:, None], bad


def _expand_kv(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    return t.repeat_interleave(heads_q // t.shape[1], dim=1)


def _softmax_weights(scores: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax over the visible keys; rows with none give all-zero weights (and a finite gradient). ``sinks`` ([Hq],
    same dtype as scores): one more logit per head in every row's denominator, without a value (gpt-oss)."""
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).to(scores.dtype)
        masked = scores.masked_fill(~visible, float("-inf"))
        m = torch.maximum(masked.amax(-1, keepdim=True), sink)
        e = torch.exp(masked - m)
        return e / (e.sum(-1, keepdim=True) + torch.exp(sink - m))
    any_visible = visible.any(-1, keepdim=True)
    masked = scores.masked_fill(~visible, float("-inf"))
    masked = torch.where(any_visible, masked, torch.zeros_like(masked))
    return torch.where(visible, torch.softmax(masked, dim=-1), torch.zeros_like(masked))


def _capped(z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _scale(scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def attention_math(q, k, v, scale, kv_start, kv_end, dtype: torch.dtype, window=None, softcap=None,
                   sinks=None) -> torch.Tensor:
    """Unrounded attention in ``dtype`` (float32 or float64): [B, Hq, Sq, D]; NaN rows for bad bounds."""
    batch, heads_q, seq_q, head_dim = q.shape
    visible, bad = visibility(batch, seq_q, k.shape[2], kv_start, kv_end, q.device, window)
    qd, kd, vd = q.to(dtype), _expand_kv(k.to(dtype), heads_q), _expand_kv(v.to(dtype), heads_q)
    z = _capped((qd @ kd.transpose(-1, -2)) * _scale(scale, head_dim), softcap)
    w = _softmax_weights(z, visible, None if sinks is None else sinks.to(dtype))
    out = w @ vd
    return torch.where(bad[:, None, None, None], torch.full_like(out, float("nan")), out)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                  kv_start: torch.Tensor | None = None, kv_end: torch.Tensor | None = None,
                  window: int | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``attention`` in pure torch: FP32 scores and softmax, one BF16 rounding. [B, Hq, Sq, D]."""
    return attention_math(q, k, v, scale, kv_start, kv_end, torch.float32, window, softcap, sinks).to(torch.bfloat16)


def _exact_order_dot(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """acc + a @ b in FP32 (a [..., M, K], b [..., K, N]), the products added one at a time in ascending k: the
    kernels' order on the interpreter (det_gemm.mac_step). BF16 products are exact in FP32."""
    a, b = a.float(), b.float()
    for i in range(a.shape[-1]):
        acc = acc + a[..., i:i + 1] * b[..., i:i + 1, :]
    return acc


def attention_split_ref(q, k, v, *, split_tiers, block_n: int, scale=None, kv_start=None, kv_end=None,
                        window=None, softcap=None, sinks=None) -> torch.Tensor:
    """``attention`` computed the way the kernels order it, in pure torch: the keys of sequence b cut from its first
    key kv_start[b] into tiles of ``block_n`` keys, and each row's into splits of its tier's keys (``split_tiers``,
    as ``AttnConfigs.split_tiers``: the row's key extent e = its position - kv_start[b] + 1 picks the first tier whose
    bound is >= e); each split's FP32 online softmax over its tiles in ascending order from the start state (m =
    -inf, l = 0, acc = 0), the dots adding products in ascending order; a row's splits folded in ascending order (a
    split that holds none of its keys skipped, the first taken as it is, the others rescaled to the larger max); then
    the sink, o = acc / l, one BF16 rounding. [B, Hq, Sq, Dv]. Its bits equal the interpreter's wherever the
    exponentials are exact (the kernels' exp2 and row sums are numpy's there), and it lies within the FP64 bound
    everywhere."""
    if not split_tiers or split_tiers[-1][0] is not None or any(s % block_n for _, s in split_tiers):
        raise ValueError(f"split_tiers {split_tiers!r} is not supported; supported: (bound, split) pairs, the last "
                         f"bound None, each split a multiple of block_n {block_n}")
    batch, heads_q, seq_q, head_dim = q.shape
    seq_k, head_dim_v = k.shape[2], v.shape[-1]
    visible, bad = visibility(batch, seq_q, seq_k, kv_start, kv_end, q.device, window)
    s = _scale(scale, head_dim)
    # The kernels' FP32 multipliers: scale * log2(e), or with a softcap c, c * log2(e) and scale / c.
    dev = q.device
    qk_scale = torch.tensor((s if softcap is None else softcap) * math.log2(math.e), dtype=torch.float32, device=dev)
    tanh_scale = torch.tensor(0.0 if softcap is None else s / softcap, dtype=torch.float32, device=dev)
    start = torch.zeros(batch, dtype=torch.int64, device=dev) if kv_start is None else kv_start.to(dev).long()
    start = torch.where(bad, 0, start)
    end = torch.full((batch,), seq_k, dtype=torch.int64, device=dev) if kv_end is None else kv_end.to(dev).long()
    # Each row's key tiles per split, from its key extent (position - first key + 1), [B, 1, Sq, 1].
    extent = end[:, None] - seq_q + torch.arange(seq_q, device=dev)[None, :] - start[:, None] + 1
    split = torch.full_like(extent, split_tiers[-1][1])
    for bound, keys in reversed(split_tiers[:-1]):
        split = torch.where(extent <= bound, keys, split)
    row_tiles = (split // block_n)[:, None, :, None]
    n_tiles = -(-(seq_k - int(start.min())) // block_n)
    kx, vx = _expand_kv(k, heads_q).float(), _expand_kv(v, heads_q).float()
    qf = q.float()
    neg_inf = torch.tensor(float("-inf"), device=dev)

    def fresh():
        return (torch.full((batch, heads_q, seq_q, 1), float("-inf"), device=dev),
                torch.zeros(batch, heads_q, seq_q, 1, device=dev),
                torch.zeros(batch, heads_q, seq_q, head_dim_v, device=dev))

    m_all, l_all, acc_all = fresh()
    m_i, l_i, acc = fresh()
    for t in range(n_tiles):
        idx = start[:, None] + t * block_n + torch.arange(block_n, device=dev)  # [B, block_n]: the tile's keys
        ok = (idx >= 0) & (idx < seq_k)
        safe = idx.clamp(0, seq_k - 1)
        gather = safe[:, None, :, None].expand(batch, heads_q, block_n, max(head_dim, head_dim_v))
        kt = torch.where(ok[:, None, :, None], torch.gather(kx, 2, gather[..., :head_dim]), 0.0)
        vt = torch.where(ok[:, None, :, None], torch.gather(vx, 2, gather[..., :head_dim_v]), 0.0)
        vis = torch.gather(visible.expand(batch, 1, seq_q, seq_k), 3,
                           safe[:, None, None, :].expand(batch, 1, seq_q, block_n)) & ok[:, None, None, :]
        qk = _exact_order_dot(qf, kt.transpose(-1, -2), torch.zeros(batch, heads_q, seq_q, block_n, device=dev))
        if softcap is not None:  # the kernels' tanh: sign(x) (1 - e) / (1 + e), e = 2^(-2 log2(e) |x|)
            x = qk * tanh_scale
            e = torch.exp2(x.abs() * torch.tensor(-2.8853900817779268, dtype=torch.float32, device=dev))
            th = (1.0 - e) / (1.0 + e)
            qk = torch.where(x < 0, -th, th)
        qk = torch.where(vis, qk, neg_inf)
        m_new = torch.maximum(m_i, qk.amax(-1, keepdim=True) * qk_scale)
        m_ref = torch.where(m_new == float("-inf"), 0.0, m_new)
        p = torch.exp2(qk * qk_scale - m_ref)
        alpha = torch.where(m_new == m_i, 1.0, torch.exp2(m_i - m_ref))
        l_i = l_i * alpha + p.sum(-1, keepdim=True)
        acc = _exact_order_dot(p.to(torch.bfloat16), vt, acc * alpha)
        m_i = m_new
        # Rows whose split ends at this tile (or whose keys end: the last tile) fold it; the others keep their state.
        ends = ((t + 1) % row_tiles == 0) | (t + 1 == n_tiles)
        m_new = torch.maximum(m_all, m_i)
        m_ref = torch.where(m_new == float("-inf"), 0.0, m_new)
        a = torch.where(m_new == m_all, 1.0, torch.exp2(m_all - m_ref))
        b = torch.where(m_new == m_i, 1.0, torch.exp2(m_i - m_ref))
        empty = (m_i == float("-inf")) | ~ends
        first = m_all == float("-inf")
        l_all = torch.where(empty, l_all, torch.where(first, l_i, l_all * a + l_i * b))
        acc_all = torch.where(empty, acc_all, torch.where(first, acc, acc_all * a + acc * b))
        m_all = torch.where(empty, m_all, m_new)
        m_fresh, l_fresh, acc_fresh = fresh()
        m_i, l_i, acc = (torch.where(ends, x, y) for x, y in ((m_fresh, m_i), (l_fresh, l_i), (acc_fresh, acc)))
    if sinks is not None:
        sink = (sinks.float() * torch.tensor(math.log2(math.e), dtype=torch.float32, device=dev)).reshape(1, -1, 1, 1)
        m_fin = torch.maximum(m_all, sink)
        alpha = torch.where(m_fin == m_all, 1.0, torch.exp2(m_all - m_fin))
        l_all = l_all * alpha + torch.exp2(sink - m_fin)
        acc_all = acc_all * alpha
    seen = l_all > 0
    out = acc_all / torch.where(seen, l_all, 1.0)
    out = torch.where(bad[:, None, None, None], float("nan"), out)
    return out.to(torch.bfloat16)


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                         scale: float | None = None, window: int | None = None, kv_start: torch.Tensor | None = None,
                         softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``attention_varlen`` in pure torch, one sequence at a time (``kv_start`` [n], as ``attention_ref``'s for each):
    [Tq, Hq, Dv] BF16."""
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for n in range(len(cq) - 1):
        qs = q[cq[n]:cq[n + 1]].transpose(0, 1)[None]
        ks, vs = (t[ck[n]:ck[n + 1]].transpose(0, 1)[None] for t in (k, v))
        if qs.shape[2] == 0:
            continue
        if ks.shape[2] == 0:
            out[cq[n]:cq[n + 1]] = 0
            continue
        start = None if kv_start is None else kv_start[n:n + 1]
        out[cq[n]:cq[n + 1]] = attention_ref(qs, ks, vs, scale=scale, kv_start=start, window=window,
                                             softcap=softcap, sinks=sinks)[0].transpose(0, 1)
    return out


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """A paged storage's keys (or values) as a contiguous packing: cache [P, page_size, H, D], sequence n's key j at
    row j % page_size of page block_table[n, j // page_size] -> [Tk, H, D], sequence n at rows
    cu_seqlens_k[n]..cu_seqlens_k[n + 1] (``attention_varlen``'s key layout)."""
    page_size = cache.shape[1]
    cu = cu_seqlens_k.tolist()
    parts = []
    for n in range(len(cu) - 1):
        j = torch.arange(cu[n + 1] - cu[n], device=block_table.device)
        pages = block_table[n].long()[j // page_size].to(cache.device)
        parts.append(cache[pages, (j % page_size).to(cache.device)])
    return torch.cat(parts)


def attention_paged_ref(q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k, *, scale=None, window=None,
                        softcap=None, sinks=None) -> torch.Tensor:
    """``attention_paged`` in pure torch: the pages gathered into a contiguous packing (``gather_pages``), then
    ``attention_varlen_ref``. [Tq, Hq, D] BF16."""
    k = gather_pages(k_cache, block_table, cu_seqlens_k)
    v = gather_pages(v_cache, block_table, cu_seqlens_k)
    return attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, window=window, softcap=softcap,
                                sinks=sinks)


def attention_oracle(q, k, v, *, scale=None, kv_start=None, kv_end=None, window=None, softcap=None, sinks=None,
                     do=None) -> dict[str, torch.Tensor]:
    """FP64 from the same BF16 inputs: ``o`` [B, Hq, Sq, Dv], and with ``do`` ([B, Hq, Sq, Dv]) the exact ``dq``,
    ``dk``, ``dv`` (the gradients of sum(o * do)), plus the intermediates the bounds use."""
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    s = _scale(scale, head_dim)
    visible, _ = visibility(batch, seq_q, seq_k, kv_start, kv_end, q.device, window)
    q64, k64, v64 = q.double(), _expand_kv(k.double(), heads_q), _expand_kv(v.double(), heads_q)
    t = (q64 @ k64.transpose(-1, -2)) * s  # exact scaled scores (to FP64 rounding)
    z = _capped(t, softcap)  # the logits
    sink64 = None if sinks is None else sinks.double()
    w = _softmax_weights(z, visible, sink64)
    out = {"o": w @ v64, "w": w, "z": z, "visible": visible.expand_as(w), "windowed": window is not None,
           "softcap": softcap, "sinks": sink64}
    if sink64 is not None:
        zs = z.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(torch.cat([zs, sink64.reshape(1, -1, 1, 1).expand(*zs.shape[:3], 1)], -1), -1,
                              keepdim=True)
        out["w_sink"] = torch.exp(sink64.reshape(1, -1, 1, 1) - lse)  # [B, Hq, Sq, 1]
    if do is not None:
        do64 = do.double()
        delta = (do64 * out["o"]).sum(-1, keepdim=True)
        d = do64 @ v64.transpose(-1, -2) - delta  # dP* - delta*
        ds = w * d  # the gradient at the logits z
        if softcap is not None:
            out["sech2"] = 1 - torch.tanh(t / softcap) ** 2
            ds = ds * out["sech2"]  # through the cap, at the scaled scores
        if sink64 is not None:
            out["dsinks"] = -(out["w_sink"] * delta).sum((0, 2, 3))
            out["delta"] = delta
        per_kv = (batch, heads_kv, group * seq_q)
        out.update(
            d=d, ds=ds,
            dq=s * (ds @ k64),
            dk=s * (ds.transpose(-1, -2).reshape(batch, heads_kv, group, seq_k, seq_q).transpose(2, 3)
                    .reshape(batch, heads_kv, seq_k, group * seq_q) @ q64.reshape(*per_kv, head_dim)),
            dv=(w.transpose(-1, -2).reshape(batch, heads_kv, group, seq_k, seq_q).transpose(2, 3)
                .reshape(batch, heads_kv, seq_k, group * seq_q) @ do64.reshape(*per_kv, v.shape[-1])),
        )
    return out


def _row_terms(q, k, oracle: dict, scale: float, block_n: int, split_n: int) -> dict[str, torch.Tensor]:
    """Per-row quantities of the bound: visible count n, key tiles T, key splits S, max |q|.|k| (A_max), logit
    range R."""
    heads_q = q.shape[1]
    vis = oracle["visible"]
    a = q.double().abs() @ _expand_kv(k.double().abs(), heads_q).transpose(-1, -2)
    a_max = torch.where(vis, a, torch.zeros_like(a)).amax(-1, keepdim=True)
    z = oracle["z"]
    z_hi = torch.where(vis, z, torch.full_like(z, float("-inf"))).amax(-1, keepdim=True)
    z_lo = torch.where(vis, z, torch.full_like(z, float("inf"))).amin(-1, keepdim=True)
    n = vis.sum(-1, keepdim=True).double()
    any_visible = n > 0
    if oracle.get("sinks") is not None:  # the sink is one more logit of the row (for the range R)
        sink = oracle["sinks"].reshape(1, -1, 1, 1)
        z_hi = torch.where(any_visible, torch.maximum(z_hi, sink), z_hi)
        z_lo = torch.where(any_visible, torch.minimum(z_lo, sink), z_lo)
    # A row's visible keys start at a tile boundary (the sequence's first key), except under a window, whose lower
    # edge may fall inside a tile: one tile more.
    tiles = torch.ceil(n / block_n) + (1.0 if oracle["windowed"] else 0.0) * any_visible
    splits = torch.ceil(n / split_n) + (1.0 if oracle["windowed"] else 0.0) * any_visible
    return {"n": n, "tiles": tiles, "splits": splits, "a_max": a_max, "any": any_visible,
            "range": torch.where(any_visible, z_hi - z_lo, torch.zeros_like(n)),
            "z_abs": torch.where(any_visible, torch.maximum(z_hi.abs(), z_lo.abs()), torch.zeros_like(n))}


def _gamma_t(n: torch.Tensor, unit: float = U_FP32) -> torch.Tensor:
    return n * unit / (1.0 - n * unit)


def _forward_terms(q, k, v, oracle: dict, scale: float, block_n: int, split_n: int | None = None
                   ) -> dict[str, torch.Tensor]:
    """The forward's error terms (docs/attention.md): per-term weight errors eta (acc) and eta' (l), and the
    bound of |o - o*| before and after the BF16 rounding. ``split_n`` None: every tile its own split (the most
    splits, the most conservative)."""
    head_dim = q.shape[-1]
    rows = _row_terms(q, k, oracle, scale, block_n, split_n or block_n)
    u, sa = U_FP32, scale * rows["a_max"]
    kappa = (1 + gamma(head_dim)) * (1 + u) ** 2 - 1
    e_logit = kappa * sa  # a logit's error in natural units (docs/attention.md, forward step 1)
    softcap, sinks = oracle.get("softcap"), oracle.get("sinks")
    if softcap is not None:
        # tanh is 1-Lipschitz: the scaled score's error passes through, plus tanh's own E_TANH, times the cap, and
        # the product by fl(softcap * log2 e).
        e_logit = (1 + u) ** 2 * (kappa * sa + softcap * E_TANH) + 3 * u * softcap
    # Each split adds one rescale (its fold) and one addition per term (docs/attention.md, split-KV).
    t = rows["tiles"] + rows["splits"]
    terms = rows["n"] + t
    if sinks is not None:
        # The sink's exponent fl(s log2 e) (two roundings), one more rescale and one more term of l.
        e_logit = torch.maximum(e_logit, 3 * u * sinks.abs().reshape(1, -1, 1, 1))
        t = t + 1
        terms = terms + 1
    e_exp = e_logit + 2 * u * (rows["range"] + 2 * e_logit)
    eta_l = torch.exp(e_exp) * (1 + E_EXP2) ** (t + 1) * (1 + u) ** t - 1
    eta_acc = (1 + eta_l) * (1 + U_BF16) - 1
    g = _gamma_t(terms)
    rho, rho_l = (1 + eta_acc) * (1 + g) - 1, (1 + eta_l) * (1 + g) - 1
    o_star = oracle["o"]
    w = oracle["w"]
    v_abs = _expand_kv(v.double().abs(), q.shape[1])
    a_sum = w @ v_abs  # sum_j w_j |v_jd|
    delta = (rho * a_sum + rho_l * o_star.abs()) / (1 - rho_l)
    delta = delta + E_DIV * (o_star.abs() + delta)
    flush = terms * FLUSH * (v_abs.amax(-2, keepdim=True) + o_star.abs())
    cap = 0.0 if softcap is None else softcap
    oracle_err = _gamma_t(2 * rows["n"] + head_dim + 8, U_FP64) * (1 + sa + rows["range"] + cap) \
        * (a_sum + o_star.abs())
    bound = U_BF16 * o_star.abs() + (1 + U_BF16) * (delta + flush) + ETA_BF16 + oracle_err
    return {**rows, "eta_l": eta_l, "rho_l": rho_l, "e_exp": e_exp, "e_logit": e_logit,
            "bound": torch.where(rows["any"], bound, ETA_BF16)}


def attention_fwd_bound(q, k, v, *, scale=None, kv_start=None, kv_end=None, window=None, softcap=None, sinks=None,
                        block_n: int = 16, split_n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o*, bound), both FP64 [B, Hq, Sq, D]: every element of the kernels' o must satisfy |o - o*| <= bound.
    ``block_n``: the forward's key tile (fewer keys per tile means more rescales; 16 is the most conservative);
    ``split_n``: its smallest keys per split (``AttnConfigs.smallest_split``: no row has more splits than with it;
    None: block_n, the most conservative)."""
    s = _scale(scale, q.shape[-1])
    oracle = attention_oracle(q, k, v, scale=s, kv_start=kv_start, kv_end=kv_end, window=window, softcap=softcap,
                              sinks=sinks)
    return oracle["o"], _forward_terms(q, k, v, oracle, s, block_n, split_n)["bound"]


def attention_bwd_bound(q, k, v, do, *, scale=None, kv_start=None, kv_end=None, window=None, softcap=None,
                        sinks=None, block_n: int = 16, block_m: int = 16, split_n: int | None = None
                        ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{"dq": (dq*, bound), "dk": ..., "dv": ...} (and "dsinks" with sinks) in FP64: the exact gradients of
    sum(o * do) and the per-element bounds the kernels' gradients must satisfy (docs/attention.md). ``block_n`` /
    ``block_m``: the smallest key and query tiles of the backward (more tiles means more accumulations; 16 is the
    most conservative); ``split_n``: the forward's smallest keys per split, as for ``attention_fwd_bound``."""
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_k, head_dim_v = k.shape[1], k.shape[2], v.shape[-1]
    group = heads_q // heads_kv
    s = _scale(scale, head_dim)
    oracle = attention_oracle(q, k, v, scale=s, kv_start=kv_start, kv_end=kv_end, window=window, softcap=softcap,
                              sinks=sinks, do=do)
    fwd = _forward_terms(q, k, v, oracle, s, block_n, split_n)
    u, ub = U_FP32, U_BF16
    sa = s * fwd["a_max"]
    w, vis = oracle["w"], oracle["visible"]
    # Recomputed P = exp2(s c - lse): the logit's error, lse's (its terms' errors, l's, lg2's, the add), the
    # subtraction's and exp2's.
    lse_nat = torch.where(fwd["any"], torch.logsumexp(oracle["z"].masked_fill(~vis, float("-inf")), -1, keepdim=True),
                          torch.zeros_like(fwd["n"]))
    if sinks is not None:  # lse holds the sink too
        lse_nat = torch.logaddexp(torch.where(fwd["any"], lse_nat, float("-inf")),
                                  oracle["sinks"].reshape(1, -1, 1, 1).expand_as(lse_nat))
    e_p = (2 * fwd["e_exp"] + fwd["rho_l"] + math.log(2) * E_LOG2 * (1 + torch.log2(fwd["n"].clamp(min=1)) + 1)
           + 3 * u * (lse_nat.abs() + sa + 1))
    eps_p = torch.exp(e_p) * (1 + E_EXP2) - 1  # [B, Hq, Sq, 1]
    do64 = do.double()
    v_abs, k_abs = _expand_kv(v.double().abs(), heads_q), _expand_kv(k.double().abs(), heads_q)
    b_dp = do64.abs() @ v_abs.transpose(-1, -2)  # sum_d |do||v|
    b_o = fwd["bound"]
    # delta = rowsum(o * do) and dP = do . v are dots over the value head dim.
    beta = gamma(head_dim_v) * ((oracle["o"].abs() + b_o) * do64.abs()).sum(-1, keepdim=True) \
        + (do64.abs() * b_o).sum(-1, keepdim=True)
    d_abs = oracle["d"].abs()
    e_d = gamma(head_dim_v) * b_dp + beta
    e_d = e_d + u * (d_abs + e_d)
    r = (1 + u) * (1 + ub)
    if softcap is None:
        sigma = r * (w * (1 + eps_p) * e_d + eps_p * w * d_abs) + (r - 1) * w * d_abs + FLUSH * (d_abs + e_d)
        ds_abs = w * d_abs
    else:
        # dS = bf16(fl(fl(P d) * fl(1 - th^2))): fl(P d)'s error as above, then the factor g = 1 - th^2 with
        # |g - sech^2| <= e_g (th's error e_th: the scaled score's plus tanh's own; the square and the subtraction),
        # the product, then the BF16 rounding.
        sech2 = oracle["sech2"]
        e_th = (kappa_of(head_dim) * sa) / softcap + E_TANH
        e_g = 2 * e_th + e_th ** 2 + 2 * u
        pre = (1 + u) * (w * (1 + eps_p) * e_d + eps_p * w * d_abs) + u * w * d_abs
        ds_abs = w * d_abs * sech2
        after_g = pre * (sech2 + e_g) * (1 + u) + w * d_abs * (e_g * (1 + u) + u * sech2)
        sigma = after_g * (1 + ub) + ub * ds_abs + FLUSH * (d_abs + e_d)
    sigma = torch.where(vis, sigma, torch.zeros_like(sigma))
    ds_mag = ds_abs + sigma

    def scaled_grad(star, e_acc):
        e1 = s * e_acc + u * (star.abs() + s * e_acc)
        return ub * star.abs() + (1 + ub) * e1 + ETA_BF16

    def per_kv(x):  # [B, Hq, Sq, Skv] -> [B, Hkv, Skv, G*Sq]: the rows one key's gradient sums
        return x.transpose(-1, -2).reshape(batch, heads_kv, group, seq_k, seq_q).transpose(2, 3) \
            .reshape(batch, heads_kv, seq_k, group * seq_q)

    n_q = fwd["n"]
    # Under a window a row's keys (and a key's rows) need not start at a tile boundary: one more tile per walk
    # (dk, dv: per head of the group, plus one).
    extra_q, extra_kv = (1.0, group + 1.0) if window is not None else (0.0, 0.0)
    g_q = _gamma_t(n_q + torch.ceil(n_q / block_n) + extra_q)
    dq_acc = sigma @ k_abs + g_q * (ds_mag @ k_abs)
    rows_kv = per_kv(vis.double()).sum(-1, keepdim=True)
    g_kv = _gamma_t(rows_kv + torch.ceil(rows_kv / block_m) + extra_kv)
    q_abs = q.double().abs().reshape(batch, heads_kv, group * seq_q, head_dim)
    do_abs = do64.abs().reshape(batch, heads_kv, group * seq_q, head_dim_v)
    dk_acc = per_kv(sigma) @ q_abs + g_kv * (per_kv(ds_mag) @ q_abs)
    eps_v = (1 + eps_p) * (1 + ub)
    dv_err = per_kv(w * eps_v - w) @ do_abs + g_kv * (per_kv(w * eps_v) @ do_abs) \
        + per_kv(FLUSH * vis.double()) @ do_abs
    mags = {"dq": ds_mag @ k_abs, "dk": per_kv(ds_mag) @ q_abs, "dv": per_kv(w) @ do_abs}
    n_all = seq_k + group * seq_q + max(head_dim, head_dim_v)
    oracle_err = {key: _gamma_t(torch.tensor(4.0 * n_all + 16), U_FP64) * (1 + sa.amax() + fwd["range"].amax()) * 4
                  * (m * (s if key != "dv" else 1.0)) for key, m in mags.items()}
    out = {
        "dq": (oracle["dq"], scaled_grad(oracle["dq"], dq_acc) + oracle_err["dq"]),
        "dk": (oracle["dk"], scaled_grad(oracle["dk"], dk_acc) + oracle_err["dk"]),
        "dv": (oracle["dv"], ub * oracle["dv"].abs() + (1 + ub) * dv_err + ETA_BF16 + oracle_err["dv"]),
    }
    if sinks is not None:
        # dsinks = -sum over rows (B x Sq per head) of p_sink * delta: p_sink's error eps_p, delta's beta, the
        # product, an FP32 sum in any order (gamma of the row count), one rounding to the sinks' dtype.
        w_s, delta_abs = oracle["w_sink"], oracle["delta"].abs()
        per_row = (1 + u) * (w_s * (1 + eps_p) * beta + eps_p * w_s * delta_abs) + u * w_s * delta_abs
        rows_n = batch * seq_q
        mag = (w_s * (1 + eps_p) * (delta_abs + beta) * (1 + u)).sum((0, 2, 3))
        err = per_row.sum((0, 2, 3)) + gamma(rows_n) * mag
        u_out = U_BF16 if sinks.dtype == torch.bfloat16 else 0.0
        star = oracle["dsinks"]
        oracle_s = _gamma_t(torch.tensor(4.0 * n_all + 16), U_FP64) * (1 + sa.amax() + fwd["range"].amax()) * 4 * mag
        out["dsinks"] = (star, u_out * star.abs() + (1 + u_out) * err + ETA_BF16 + oracle_s)
    return out


def kappa_of(head_dim: int) -> float:
    """The relative error of a scaled score fl(fl(q.k) * c) against scale * q.k (docs/attention.md, step 1)."""
    return (1 + gamma(head_dim)) * (1 + U_FP32) ** 2 - 1


# ---------------------------------------------------------------------------------------------
# A transformers mask as per-sequence key windows (masks.py runs it on the device)
# ---------------------------------------------------------------------------------------------
def mask_windows(attn_mask: torch.Tensor, batch: int, seq_q: int, seq_k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_start int32 [B], kv_end int32 [B], ok bool scalar) of a causal + padding mask: ``mask_key_windows``
    without a sliding window."""
    return mask_key_windows(attn_mask, batch, seq_q, seq_k)[:3]


def mask_key_windows(attn_mask: torch.Tensor, batch: int, seq_q: int, seq_k: int, window: int | None = None,
                     anchor: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_start int32 [B], kv_end int32 [B], ok bool scalar, hidden bool scalar), all on the mask's device, no host
    sync. ``ok``: the mask is exactly causal + one padding window per sequence (+ the sliding ``window``: query at
    position p sees keys > p - window), rows of padded queries excepted as described in the module docstring; then
    its valid rows see exactly what ``attention(kv_start=, kv_end=, window=)`` gives them. ``anchor`` (int32 [B],
    see ``tag_mask_anchor``): each sequence's first key when known from elsewhere; without it the first key is read
    off the mask, and ``hidden`` says a window hid it from every row (the key tiles' anchor is then unknown)."""
    mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    if mask.dtype == torch.bool:
        visible, values_ok = mask, torch.ones((), dtype=torch.bool, device=mask.device)
    else:
        visible = mask == 0
        values_ok = (visible | (mask <= torch.finfo(mask.dtype).min)).all()
    j = torch.arange(seq_k, device=mask.device)
    i = torch.arange(seq_q, device=mask.device)
    # Per row: its first and last visible key; per sequence (over heads and rows): the window and the offset o
    # with row i's last visible key o + i (clipped rows of right padding have less; empty rows none).
    first = torch.where(visible, j, seq_k).amin(-1)  # [B|1, H|1, Sq]
    last = torch.where(visible, j, -1).amax(-1)
    nonempty = last >= 0
    start = first.amin(-1).amin(-1)  # [B|1]
    end = last.amax(-1).amax(-1)
    offset = torch.where(nonempty, last - i, torch.iinfo(torch.int64).min).amax(-1).amax(-1)
    any_visible = end >= 0
    start = torch.where(any_visible, start, seq_k)
    offset = torch.where(any_visible, offset, seq_k - seq_q)
    kv_end = offset + seq_q
    hidden = torch.zeros((), dtype=torch.bool, device=mask.device)
    if window is not None:
        # The first nonempty row r sees keys from max(start, o + r - window + 1): if that is its window's edge, the
        # sequence's first key may lie anywhere at or before it.
        rows = nonempty.any(1)  # [B|1, Sq]
        r = torch.where(rows.any(-1), rows.to(torch.int8).argmax(-1), 0)  # [B|1]
        hidden = (any_visible & (offset + r - window + 1 >= start)).any()
    if anchor is not None:
        start = torch.where(any_visible, anchor.to(device=mask.device, dtype=torch.int64), seq_k)  # [B]
        hidden = torch.zeros((), dtype=torch.bool, device=mask.device)
    hi = torch.minimum(offset[:, None] + i, end[:, None])  # [B|1, Sq]
    expected = (j >= start[:, None, None, None]) & (j <= hi[:, None, :, None])
    if window is not None:
        expected &= j > (offset[:, None] + i - window)[:, None, :, None]
    ok = values_ok & (visible == expected).all() & ((kv_end <= seq_k) & (kv_end >= start)).all()
    kv_start = start.to(torch.int32).expand(batch).contiguous()
    kv_end = kv_end.clamp(0, seq_k).to(torch.int32).expand(batch).contiguous()
    return kv_start, kv_end, ok, hidden
