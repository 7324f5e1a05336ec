"""The attention checks remembered per signature (launch.check_padded, sdpa.sdpa_unsupported_reason): a call whose
signature differs from an accepted one in anything the check reads (dtype, strides, a flag's value or type) is
checked again and refused by name; a refusal is never remembered; through the mode's SDPA route such a call is
refused (strict) before any work. Host checks only: no kernel runs here except the one routed call."""

import importlib

import pytest
import torch
import torch.nn.functional as F

import detkit
from detkit.kernels.attention import launch
from detkit.kernels.attention.launch import check_padded
from detkit.kernels.attention.sdpa import sdpa_unsupported_reason
from detkit.mode.state import ModeNotRoutedError

sdpa_module = importlib.import_module("detkit.kernels.attention.sdpa")  # the package re-exports its function sdpa


def _qkv(device, dtype=torch.bfloat16):
    q = torch.zeros((1, 4, 1, 64), dtype=dtype, device=device)
    k = torch.zeros((1, 2, 8, 64), dtype=dtype, device=device)
    return q, k, k.clone()


def _head_dim_strided(t):
    """``t``'s shape and dtype with a head-dim stride of 2 (a view into a wider tensor)."""
    return torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)[..., ::2]


def test_check_padded_rechecks_another_dtype_or_stride_and_never_remembers_a_refusal(device):
    q, k, v = _qkv(device)
    assert check_padded(q, k, v) == (1, 4, 2, 1, 8, 64)
    assert check_padded(q, k, v) == (1, 4, 2, 1, 8, 64)  # remembered: the same answer
    with pytest.raises(TypeError, match="q has dtype torch.float16"):
        check_padded(q.half(), k, v)
    strided = _head_dim_strided(k)
    assert strided.shape == k.shape and strided.dtype == k.dtype
    with pytest.raises(ValueError, match="k has stride 2 on its head dim"):
        check_padded(q, strided, v)
    with pytest.raises(ValueError, match="k has stride 2 on its head dim"):  # refused again: not remembered
        check_padded(q, strided, v)
    assert launch.signature_of(q, strided, v, None, None) not in launch._checked_padded
    start = torch.zeros(1, dtype=torch.int32, device=device)
    assert check_padded(q, k, v, start) == (1, 4, 2, 1, 8, 64)
    with pytest.raises(ValueError, match="kv_start must be an int32 tensor"):
        check_padded(q, k, v, start.long())
    with pytest.raises(TypeError, match="kv_start must be a torch.Tensor or None; got int"):
        check_padded(q, k, v, 0)


def test_sdpa_reason_rechecks_another_dtype_stride_or_flag(device):
    q, k, v = _qkv(device)
    assert sdpa_unsupported_reason(q, k, v, enable_gqa=True) is None
    assert sdpa_unsupported_reason(q, k, v, enable_gqa=True) is None
    assert sdpa_unsupported_reason(q.half(), k.half(), v.half(), enable_gqa=True) == "dtype torch.float16"
    assert sdpa_unsupported_reason(q, _head_dim_strided(k), v, enable_gqa=True) == (
        "key head dim not contiguous (stride 2)")
    assert sdpa_unsupported_reason(q, k, v, enable_gqa=False) == "query heads 4 != key heads 2 without enable_gqa"
    assert sdpa_unsupported_reason(q, k, v, dropout_p=0.5, enable_gqa=True) == "dropout_p 0.5"
    # Flags of equal hash but other types are told apart: the reason names the value as given.
    assert sdpa_unsupported_reason(q, k, v, scale=-1, enable_gqa=True) == "scale -1"
    assert sdpa_unsupported_reason(q, k, v, scale=-1.0, enable_gqa=True) == "scale -1.0"
    # Flags a key cannot hold by value (a tensor scale) are checked uncached.
    scale = torch.tensor(0.5)
    assert sdpa_unsupported_reason(q, k, v, scale=scale, enable_gqa=True) == f"scale {scale!r}"
    assert sdpa_unsupported_reason(q, [k], v, enable_gqa=True) == "key is not a tensor"
    assert all(sig is not None for sig, _, _ in sdpa_module._reasons)


def test_mode_route_refuses_a_changed_signature_before_any_work(device, monkeypatch):
    q, k, v = _qkv(device)
    ran = []
    real = launch.attention_fwd_launch

    def spy(*args, **kwargs):
        ran.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(launch, "attention_fwd_launch", spy)
    with detkit.batch_invariant_mode(strict=True):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert ran == [torch.bfloat16]
        with pytest.raises(ModeNotRoutedError, match="dtype torch.float16"):
            F.scaled_dot_product_attention(q.half(), k.half(), v.half(), enable_gqa=True)
        with pytest.raises(ModeNotRoutedError, match="key head dim not contiguous"):
            F.scaled_dot_product_attention(q, _head_dim_strided(k), v, enable_gqa=True)
    assert ran == [torch.bfloat16]
