"""transformers' continuous batching (``generate_batch`` and its manager, the paged KV cache) under detkit mode: every
request gets the tokens and the logits bits of the same request run alone (``generate``, DynamicCache) and of the
trainer's forward over prompt + completion (grad on), whatever shares its steps: requests of other lengths, requests
arriving while others decode, a prompt prefilled in chunks, a prompt whose prefix pages are already cached (prefix
sharing), pages of 4 or 16 tokens; sliding-window layers whose paged cache dropped a request's first keys
(tiny Mistral, every layer sliding). The adapter itself (mode/paged_attention.py) against the padded kernel, with
the keys gathered from pages in a shuffled placement, sliding-window requests anchored at their first token, and
what it refuses. Tiny random Qwen3 and Mistral on the CPU interpreter.
"""

from __future__ import annotations

import types

import pytest
import torch

import detkit
from detkit.kernels.attention.host_values import host_reads
from detkit.mode import attention as mode_attention
from detkit.mode import paged_attention
from detkit.toolkit.contract import compare_bits
from detkit.toolkit.fixtures import bf16_randn

transformers = pytest.importorskip("transformers", reason="transformers is the optional extra detkit[models]")
from detkit.toolkit import serving  # noqa: E402  (needs transformers)

NEW = 3  # tokens generated per request


def _model(device, layers=2):
    from detkit.toolkit.models import QWEN3_TINY

    config = transformers.Qwen3Config(**dict(QWEN3_TINY, num_hidden_layers=layers))
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                             attn_implementation="sdpa").eval()


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=g).tolist() for n in lengths]


def _assert_equal_bits(got, want, what):
    result = compare_bits(got.float(), want.float())
    assert result.equal, f"{what}: {result.mismatches}/{result.elements} differ, first at {result.first_mismatch}"


def _check_against_alone_and_trainer(model, prompts, served):
    """Per request: tokens and logits bits equal to generate() alone and to the trainer's forward."""
    assert len(served) == len(prompts)
    trained = serving.trainer_logits(model, [p + t for p, (t, _) in zip(prompts, served)], [len(p) for p in prompts],
                                     NEW)
    for i, (prompt, (tokens, logits), want_trainer) in enumerate(zip(prompts, served, trained)):
        alone_tokens, alone = serving.alone_logits(model, prompt, NEW)
        assert tokens == alone_tokens, f"request {i} (prompt {len(prompt)} tokens): tokens {tokens} != alone's {alone_tokens}"
        _assert_equal_bits(logits, alone, f"request {i}: logits vs generate() alone")
        _assert_equal_bits(logits, want_trainer, f"request {i}: logits vs the trainer's forward")


def _cb_counts(before):
    after = detkit.mode_counters() - before
    routed = sum(n for (op, _), n in after.routed.items() if op == paged_attention.CB_OP)
    return routed, dict(after.not_routed)


def test_generate_batch_gives_each_request_its_bits_alone(device):
    """Three prompts of different lengths in one generate_batch (strict): each request's tokens and logits equal
    generate() of it alone and the trainer's forward; every continuous-batching attention call ran on the kernel."""
    model = _model(device, layers=1)
    prompts = _prompts((5, 11, 3))
    before = detkit.mode_counters()
    with detkit.batch_invariant_mode(strict=True):
        served = serving.run_continuous_batching(model, prompts, NEW, serving.cb_config(page_size=16))
        routed, not_routed = _cb_counts(before)
        _check_against_alone_and_trainer(model, prompts, served)
    assert routed == NEW and not not_routed  # one prefill step + NEW - 1 decode steps, 1 layer


def test_requests_arriving_while_others_decode_with_chunked_prefill(device):
    """The manager: request i joins once request i - 1 has streamed a token; 8 batch tokens split the 11-token
    prompt's prefill over steps shared with decodes; pages of 4 tokens (a request spans several)."""
    model = _model(device, layers=1)
    prompts = _prompts((5, 11, 3), seed=2)
    steps = []
    with detkit.batch_invariant_mode(strict=True):
        served = serving.run_continuous_batching(model, prompts, NEW, serving.cb_config(page_size=4, max_batch_tokens=8),
                                                 arrivals=[0, 1, 1], steps=steps)
        _check_against_alone_and_trainer(model, prompts, served)
    # the schedule this test is about: a step mixing a prefill chunk with a decode, and the 11-token prompt split
    assert any(1 in lens and max(lens) > 1 for lens in steps), f"query lengths per step: {steps}"
    assert all(11 not in lens for lens in steps) and sum(sum(lens) for lens in steps) == 19 + len(prompts) * (NEW - 1), \
        f"query lengths per step: {steps}"


@pytest.mark.parametrize("overlap", [False, True], ids=["after", "overlapping"])
def test_a_cached_prefix_gives_the_cold_bits(device, monkeypatch, overlap):
    """Prefix sharing: requests whose prompts start with another request's full pages prefill only the rest on top
    of the cached pages (one token, and three); their bits equal the same request run cold (alone, and the trainer's
    forward). "after": each arrives once the one before has finished (the cached prefill alone in its step);
    "overlapping": once it has its first token (steps shared with decodes; the default path drifts there on the CPU).
    The prefix match is asserted, so a run without sharing fails."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    matches = []
    original = PagedAttentionCache.search_prefix_match

    def spy(self, request_id, prompt_ids):
        matched = original(self, request_id, prompt_ids)
        matches.append((request_id, matched))
        return matched

    monkeypatch.setattr(PagedAttentionCache, "search_prefix_match", spy)
    model = _model(device, layers=2 if overlap else 1)
    (base,) = _prompts((9,), seed=3)
    prompts = [base, base[:8] + [17], base[:4] + [5, 6, 7]]
    arrivals = [0, 1, 1] if overlap else [0, NEW, NEW]
    steps = []
    with detkit.batch_invariant_mode(strict=True):
        reads = host_reads()
        served = serving.run_continuous_batching(
            model, prompts, NEW, serving.cb_config(page_size=4, allow_block_sharing=True), arrivals=arrivals,
            steps=steps)
        reads = host_reads() - reads
        _check_against_alone_and_trainer(model, prompts, served)
    by_request = dict(matches)
    assert by_request.get("r1") == 8 and by_request.get("r2") == 4, f"prefix matches: {matches}"
    # the step's lengths read on the host once, by its first layer; every later call of the step remembers them
    assert reads == len(steps), f"{reads} host reads of the lengths in {len(steps)} steps"


def test_sliding_window_layers_with_dropped_keys_give_the_trainers_bits(device, monkeypatch):
    """Tiny Mistral (window 4 on every layer) through the manager: request i joins once request i - 1 has a token;
    8 batch tokens chunk the 18- and 13-token prompts. Transformers' paged sliding cache hands each step only the
    last 3 cached keys, so the requests' first keys are dropped; the adapter anchors their key tiles at their first
    token (the interpreter's tiles are 16 keys, and the windows of positions 16..18 straddle that edge), so every
    request's tokens and logits equal generate() alone and the trainer's forward. Every attention call ran on the
    kernel (strict), with the keys dropped in some."""
    from detkit.toolkit import models

    model, _ = models.build_model(device, 0, "mistral-tiny")
    window = model.config.sliding_window
    prompts = _prompts((18, 5, 13), seed=4)
    steps, dropped = [], []
    original = paged_attention._anchors

    def spy(*args):
        anchors = original(*args)
        dropped.append(0 if anchors is None else -int(anchors.min()))
        return anchors

    monkeypatch.setattr(paged_attention, "_anchors", spy)
    with detkit.batch_invariant_mode(strict=True):
        reads = host_reads()
        served = serving.run_continuous_batching(
            model, prompts, NEW, serving.cb_config(page_size=4, max_batch_tokens=8), arrivals=[0, 1, 1], steps=steps)
        reads = host_reads() - reads
        _check_against_alone_and_trainer(model, prompts, served)
    # per step the lengths, then the positions (the anchors), each read once for all its layers
    assert reads == 2 * len(steps), f"{reads} host reads of the lengths and positions in {len(steps)} steps"
    # the schedule this test is about: keys dropped with a first query at position 16 or later (dropped + window - 1)
    assert max(dropped) + window - 1 >= 16, f"keys dropped per sliding-window call: {dropped}"
    assert any(1 in lens and max(lens) > 1 for lens in steps), f"query lengths per step: {steps}"


# ---------------------------------------------------------------------------------------------
# the adapter (mode/paged_attention.py), no model
# ---------------------------------------------------------------------------------------------
def _packed(device, q_lens, k_lens, heads=(4, 2), d=64, page=4, seed=0):
    """Per request: q [1, Hq, q, D], k/v [1, Hkv, k, D]; packed, with the keys written to pages of ``page`` rows in a
    shuffled placement and gathered back in order through a read index (as transformers' index-based cache does)."""
    hq, hkv = heads
    qs = [bf16_randn((1, hq, n, d), seed + 10 * i, device) for i, n in enumerate(q_lens)]
    ks = [bf16_randn((1, hkv, n, d), seed + 10 * i + 1, device) for i, n in enumerate(k_lens)]
    vs = [bf16_randn((1, hkv, n, d), seed + 10 * i + 2, device) for i, n in enumerate(k_lens)]
    pages = [(n + page - 1) // page for n in k_lens]
    placement = torch.randperm(sum(pages) + 3, generator=torch.Generator().manual_seed(seed)).tolist()
    cache_k = torch.zeros(len(placement) * page, hkv, d, dtype=torch.bfloat16, device=device)
    cache_v = torch.zeros_like(cache_k)
    read, first = [], 0
    for k, v, n, p in zip(ks, vs, k_lens, pages):
        rows = torch.tensor([placement[first + j // page] * page + j % page for j in range(n)], device=device)
        cache_k[rows], cache_v[rows] = k[0].transpose(0, 1), v[0].transpose(0, 1)
        read.append(rows)
        first += p
    read = torch.cat(read)
    key = cache_k.index_select(0, read).transpose(0, 1).unsqueeze(0)
    value = cache_v.index_select(0, read).transpose(0, 1).unsqueeze(0)
    query = torch.cat(qs, dim=2)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    kwargs = dict(cu_seq_lens_q=cu(q_lens), cu_seq_lens_k=cu(k_lens), max_length_q=max(q_lens),
                  max_length_k=max(k_lens), read_index=[read], write_index=[read], block_table=None)
    return qs, ks, vs, query, key, value, kwargs


class _Layer(torch.nn.Module):
    def __init__(self, groups=2, sliding_window=None):
        super().__init__()
        self.num_key_value_groups, self.layer_idx, self.is_causal = groups, 0, True
        self.sliding_window = sliding_window


def test_the_adapter_gives_the_padded_kernel_bits_for_pages_in_any_placement(device):
    """Packed requests (a cold prefill, a prefill on cached keys, decodes) with keys gathered from shuffled pages:
    each request's rows equal detkit's padded kernel on that request alone."""
    from detkit.kernels.attention import attention, attention_varlen

    q_lens, k_lens = (7, 3, 1, 1), (7, 12, 20, 5)
    qs, ks, vs, query, key, value, kwargs = _packed(device, q_lens, k_lens)
    out, _ = paged_attention.paged_attention_forward(attention_varlen, _Layer(), query, key, value, None,
                                                     scaling=0.125, **kwargs)
    assert out.shape == (1, sum(q_lens), 4, 64)
    start = 0
    for i, (q, k, v) in enumerate(zip(qs, ks, vs)):
        want = attention(q, k, v, scale=0.125).transpose(1, 2)[0]
        _assert_equal_bits(out[0, start:start + q.shape[2]], want, f"request {i}")
        start += q.shape[2]


def test_the_adapter_takes_the_cache_update_of_transformers_5_17(device):
    """5.17's shape: the attention function gets ``cache`` and calls update(read_index=, write_index=) itself
    (keys [Tk, Hkv, D] back); the output equals the 5.24 shape's (keys gathered before the call)."""
    from detkit.kernels.attention import attention_varlen

    _, _, _, query, key, value, kwargs = _packed(device, (3, 1), (3, 6))
    want, _ = paged_attention.paged_attention_forward(attention_varlen, _Layer(), query, key, value, None, **kwargs)
    calls = []

    class Cache:
        def update(self, key_states, value_states, layer_idx, read_index, write_index):
            calls.append((tuple(key_states.shape), layer_idx, read_index is kwargs["read_index"]))
            return key[0].transpose(0, 1), value[0].transpose(0, 1)

    new_k, new_v = key[:, :, -4:], value[:, :, -4:]  # what the model hands the function: the step's new keys only
    got, _ = paged_attention.paged_attention_forward(attention_varlen, _Layer(), query, new_k, new_v, None,
                                                     cache=Cache(), **kwargs)
    assert calls == [((1, 2, 4, 64), 0, True)]
    _assert_equal_bits(got, want, "5.17 cache update vs 5.24 gathered keys")

    class OtherCache:
        def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
            raise AssertionError("not called")

    with pytest.raises(NotImplementedError, match=r"OtherCache.update of transformers .* is not supported"):
        paged_attention.paged_attention_forward(attention_varlen, _Layer(), query, new_k, new_v, None,
                                                cache=OtherCache(), **kwargs)


def test_the_adapter_anchors_sliding_window_requests_at_their_first_token(device):
    """Sliding-window requests as transformers' paged sliding cache hands them over (5.24's gathered keys and 5.17's
    cache update): the min(position, window - 1) cached keys before each request's queries, then its new ones. Each
    request's rows equal the padded kernel's prefill over its whole sequence (window 6; the interpreter's 16-key tiles
    put the windows of positions 16..20 across a tile edge). A step it cannot anchor is refused by name."""
    from detkit.kernels.attention import attention, attention_varlen

    window, seq = 6, 24
    q, k, v = (bf16_randn((2, hq, seq, 64), 7 + i, device) for i, hq in enumerate((4, 2, 2)))
    prefill = attention(q, k, v, window=window)
    requests = [(0, 17, 1), (1, 14, 4), (1, 0, 3), (0, 3, 2), (0, 21, 1)]  # (sequence, first position, queries)
    parts, cu_q, cu_k, positions = [], [0], [0], []
    for b, p0, n in requests:
        kept = p0 - min(p0, window - 1)
        parts.append((q[b, :, p0:p0 + n], k[b, :, kept:p0 + n], v[b, :, kept:p0 + n]))
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + p0 + n - kept)
        positions += range(p0, p0 + n)
    query, key, value = (torch.cat([part[i] for part in parts], dim=1)[None] for i in range(3))

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    kwargs = dict(cu_seq_lens_q=i32(cu_q), cu_seq_lens_k=i32(cu_k), max_length_q=4, max_length_k=9,
                  position_ids=torch.tensor([positions], device=device), read_index=[None], write_index=[None],
                  block_table=None, sliding_window=window)
    out, _ = paged_attention.paged_attention_forward(attention_varlen, _Layer(), query, key, value, None, **kwargs)

    class Cache:  # 5.17: the function updates the cache; the keys come back [Tk, Hkv, D], the window on the layer
        def update(self, key_states, value_states, layer_idx, read_index, write_index):
            return key[0].transpose(0, 1), value[0].transpose(0, 1)

    sliding = {name: arg for name, arg in kwargs.items() if name != "sliding_window"}
    sliding["cu_seq_lens_k"] = {"full_attention": i32(cu_q), "sliding_attention": i32(cu_k)}
    out_517, _ = paged_attention.paged_attention_forward(attention_varlen, _Layer(sliding_window=window), query,
                                                         key[:, :, :1], value[:, :, :1], None, cache=Cache(), **sliding)
    _assert_equal_bits(out_517, out, "5.17 cache update vs 5.24 gathered keys")
    for (b, p0, n), start in zip(requests, cu_q):
        _assert_equal_bits(out[0, start:start + n], prefill[b, :, p0:p0 + n].transpose(0, 1),
                           f"request at position {p0} of sequence {b}")
    # Not transformers' sliding cache, refused: keys dropped with fewer than window - 1 kept (request 2 at position
    # 1 with none cached), more keys cached than lie before the position (request 3 at 2 with 3), no positions.
    shifted = dict(kwargs, position_ids=kwargs["position_ids"] + 1)
    with pytest.raises(NotImplementedError, match=r"sliding_window 6: request 2 \(first query at position 1\) has 0 "
                                                  r"cached keys before its queries in transformers \S+'s paged cache"):
        paged_attention.paged_attention_forward(attention_varlen, _Layer(), query, key, value, None, **shifted)
    early = kwargs["position_ids"].clone()
    early[0, cu_q[3]:cu_q[4]] -= 1
    with pytest.raises(NotImplementedError, match=r"request 3 \(first query at position 2\) has 3 cached keys"):
        paged_attention.paged_attention_forward(attention_varlen, _Layer(), query, key, value, None,
                                                **dict(kwargs, position_ids=early))
    with pytest.raises(NotImplementedError, match=r"sliding_window 6: position_ids NoneType from transformers"):
        paged_attention.paged_attention_forward(attention_varlen, _Layer(), query, key, value, None,
                                                **dict(kwargs, position_ids=None))


@pytest.mark.parametrize("case", ["block_table", "sliding_window"])
def test_what_the_adapter_refuses_is_counted_or_raises_under_strict(device, case):
    """A block table (the decode fast path) and a sliding-window step it cannot anchor (no position_ids) are refused
    by name: counted as not routed (transformers' own SDPA runs) and, under strict, ModeNotRoutedError before any
    work."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _, _, _, query, key, value, kwargs = _packed(device, (3, 1), (3, 6))
    layer = _Layer()
    if case == "block_table":
        kwargs["block_table"] = torch.zeros(1, 2, 4, dtype=torch.int32, device=device)
        match = "block_table"
    else:
        layer.sliding_window = 4
        match = "sliding_window 4: position_ids NoneType"
    mask = torch.zeros(1, 1, 4, 9, dtype=torch.bool, device=device)
    mask[0, 0, :3, :3] = torch.ones(3, 3, device=device).tril().bool()
    mask[0, 0, 3, 3:] = True
    before = detkit.mode_counters()
    with detkit.batch_invariant_mode():
        out, _ = mode_attention.transformers_sdpa_route(layer, query, key, value, mask, **kwargs)
    routed, not_routed = _cb_counts(before)
    assert routed == 0 and list(not_routed) == [(paged_attention.CB_OP, next(iter(not_routed))[1])]
    assert match in next(iter(not_routed))[1]
    want, _ = sdpa_attention_forward(layer, query, key, value, mask, **kwargs)
    _assert_equal_bits(out, want, "the counted fallback is transformers' SDPA")
    with pytest.raises(detkit.ModeNotRoutedError, match=match), detkit.batch_invariant_mode(strict=True):
        mode_attention.transformers_sdpa_route(layer, query, key, value, mask, **kwargs)


def test_a_packed_trainer_batch_is_not_taken_for_continuous_batching():
    """cu_seq_lens_q alone (a packed trainer batch) is not a continuous-batching call; with the cache's write
    index it is."""
    assert not paged_attention.is_continuous_batching_call({"cu_seq_lens_q": 1, "cu_seq_lens_k": 1})
    assert paged_attention.is_continuous_batching_call({"cu_seq_lens_q": 1, "write_index": [1]})


def test_paged_detkit_is_registered():
    """transformers 5.17 runs a model built with "detkit" as "paged|detkit" under continuous batching."""
    from transformers.modeling_utils import AttentionInterface

    mode_attention.register_transformers_attention()
    assert AttentionInterface._global_mapping["paged|detkit"] is mode_attention.detkit_attention


def test_an_implementation_the_mode_does_not_route_is_counted(device):
    """transformers' other attention implementations (flash attention, which continuous batching switches to on its
    own when flash-attn is installed; "paged|eager"; any registered before the mode is entered) are counted as not
    routed while the mode is entered (strict raises before the call) and restored on exit."""
    from transformers.modeling_utils import AttentionInterface

    calls = []

    def other(module, query, key, value, attention_mask, **kwargs):
        calls.append(kwargs.get("scaling"))
        return query.transpose(1, 2), None

    AttentionInterface.register("other_attention", other)
    mapping = AttentionInterface._global_mapping
    _, _, _, query, key, value, _ = _packed(device, (3, 1), (3, 6))
    before = detkit.mode_counters()
    try:
        with detkit.batch_invariant_mode():
            for name in ("paged|eager", "flash_attention_2"):
                assert name not in mapping or hasattr(mapping[name], "detkit_unrouted"), name
            out, _ = mapping["other_attention"](_Layer(), query, key, value, None, scaling=0.125)
        assert mapping["other_attention"] is other and not hasattr(mapping["paged|eager"], "detkit_unrouted")
        reasons = [reason for (op, reason) in (detkit.mode_counters() - before).not_routed
                   if op == mode_attention.HF_OP]
        assert len(reasons) == 1 and "'other_attention' is not routed" in reasons[0], reasons
        assert calls == [0.125] and out.shape == (1, 4, 4, 64)
        with pytest.raises(detkit.ModeNotRoutedError, match="'other_attention' is not routed"), \
                detkit.batch_invariant_mode(strict=True):
            mapping["other_attention"](_Layer(), query, key, value, None, scaling=0.125)
        assert calls == [0.125]  # strict raised before the call
    finally:
        mapping.pop("other_attention", None)
