"""The FP8 (E4M3) quantizers against their pure-torch references, bit for bit: the FP32 -> E4M3 rounding
(every code, every tie, saturation, subnormals, NaN), the power-of-two scales, row-wise, column-wise and
128x128 weight blocks, per-row batch invariance, the dequantization error bound, the risk monitor, and
every refusal. Runs on the GPU too with DETKIT_TEST_DEVICE=cuda (the hardware conversion path)."""

import pytest
import torch
import triton
import triton.language as tl

from detkit.kernels.moe.fp8.quant import (
    E4M3_MAX, FP8_DTYPE, QBLOCK, e4m3_ref, pow2_scale, pow2_scale_ref, quant_risk_rowwise, quant_risk_weight,
    quantize_colwise, quantize_colwise_ref, quantize_rowwise, quantize_rowwise_ref, quantize_weight,
    quantize_weight_ref, to_e4m3,
)
from detkit.toolkit.contract import compare_bits


@triton.jit
def _convert_kernel(x_ptr, q_ptr, s_ptr, N: tl.constexpr, INTERPRETED: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(q_ptr + offs, to_e4m3(x, INTERPRETED))
    tl.store(s_ptr + offs, pow2_scale(tl.abs(x))[0])


def _convert(x: torch.Tensor):
    n = x.numel()
    q = torch.empty(n, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(n, dtype=torch.float32, device=x.device)
    _convert_kernel[(1,)](x, q, s, n, INTERPRETED=x.device.type == "cpu")
    return q, s


def _assert_bits(got, want, what):
    res = compare_bits(got, want)
    assert res.equal, (what, res)


def test_every_code_tie_and_special_value_rounds_like_the_reference(device):
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    finite = codes[torch.isfinite(codes)].unique()  # 253 values: +-0 collapse, NaNs dropped
    mids = (finite[1:] + finite[:-1]) / 2  # exact ties: nearest-even must pick the even code
    special = torch.tensor([E4M3_MAX + 1, E4M3_MAX + 16, 480.0, 1e30, float("inf"), -float("inf"), -0.0,
                            2.0**-10, 3 * 2.0**-11, 2.0**-9 * 7.5, 2.0**-6 * (1 - 2.0**-5), 1e-30, -1e-30])
    gen = torch.Generator().manual_seed(0)
    noise = torch.cat([torch.randn(1000, generator=gen) * 100, torch.randn(1000, generator=gen) * 2.0**-7])
    x = torch.cat([finite, mids, special, noise])
    x = torch.cat([x, torch.zeros(4096 - x.numel())]).to(device)
    q, s = _convert(x)
    _assert_bits(q, e4m3_ref(x), "e4m3")
    _assert_bits(s, pow2_scale_ref(x.abs()), "pow2 scale")
    # Saturation, not NaN (torch's own cast gives NaN past 464), and nearest-even at a tie.
    assert q[x == 1e30].float().item() == E4M3_MAX and q[x == -float("inf")].float().item() == -E4M3_MAX
    one_tie = torch.tensor([1.0625, 1.1875], device=device)  # between 1, 1.125 and 1.125, 1.25
    tie = _convert(torch.cat([one_tie, torch.zeros(2, device=device)]))[0][:2].float().tolist()
    assert tie == [1.0, 1.25]


def test_nan_stays_nan(device):
    x = torch.zeros(16, device=device)
    x[3] = float("nan")
    q, _ = _convert(x)
    assert torch.isnan(q.float()[3]) and (q.float()[torch.arange(16, device=device) != 3] == 0).all()


def test_pow2_scale_definition(device):
    amax = torch.tensor([0.0, E4M3_MAX, E4M3_MAX * (1 + 2.0**-23), 224.0, 1.0, 2.0**-140, 3e38, 1.75, 1.7500001],
                        device=device)
    amax = torch.cat([amax, torch.rand(119, generator=torch.Generator().manual_seed(1)).to(device) * 1e3])
    _, s = _convert(amax)
    _assert_bits(s, pow2_scale_ref(amax), "scale")
    assert ((s.view(torch.int32) & 0x7FFFFF) == 0).all()  # powers of two: no mantissa bits
    live = (amax > 2.0**-118) & (amax < 1e37)
    ratio = amax.double()[live] / s.double()[live]
    assert (ratio <= E4M3_MAX).all() and (ratio > E4M3_MAX / 2).all()  # the smallest such power of two
    assert s[0] == 1.0 and s[1] == 1.0 and s[2] == 2.0


def _rows(m: int, n: int, seed: int, device) -> torch.Tensor:
    """Rows and blocks spanning 2**-20 .. 2**12 so the scales differ from block to block."""
    gen = torch.Generator().manual_seed(seed)
    mags = 2.0 ** torch.randint(-20, 12, (m, n // QBLOCK), generator=gen).float()
    x = torch.randn(m, n, generator=gen) * mags.repeat_interleave(QBLOCK, 1)
    return x.to(torch.bfloat16).to(device)


@pytest.mark.parametrize("m", [1, 7, 129])
def test_rowwise_matches_reference_bitwise(m, device):
    x = _rows(m, 2 * QBLOCK, m, device)
    q, s = quantize_rowwise(x)
    qr, sr = quantize_rowwise_ref(x)
    _assert_bits(q, qr, "q")
    _assert_bits(s, sr, "scale")
    assert q.shape == (m, 2 * QBLOCK) and s.shape == (m, 2) and q.is_contiguous()


def test_rowwise_fp32_and_strided_input(device):
    base = _rows(40, 3 * QBLOCK, 2, device).t().contiguous().t()  # [40, 384], strides (1, 40)
    assert base.stride() == (1, 40)
    for x in (base, base.float()):
        q, s = quantize_rowwise(x)
        qr, sr = quantize_rowwise_ref(x)
        _assert_bits(q, qr, x.dtype)
        _assert_bits(s, sr, x.dtype)


def test_rowwise_is_batch_invariant_per_row(device):
    x = _rows(37, QBLOCK, 3, device)
    q, s = quantize_rowwise(x)
    for i in (0, 18, 36):
        qi, si = quantize_rowwise(x[i:i + 1])
        _assert_bits(qi, q[i:i + 1], f"row {i}")
        _assert_bits(si, s[i:i + 1], f"row {i}")
    qp, sp = quantize_rowwise(x.flip(0))
    _assert_bits(qp, q.flip(0), "permuted")


def test_colwise_matches_reference_and_is_k_major(device):
    x = _rows(24, 2 * QBLOCK, 4, device).t()  # [256, 24] view: 128x1 blocks down each column
    q_t, s = quantize_colwise(x)
    qr, sr = quantize_colwise_ref(x)
    _assert_bits(q_t, qr, "q_t")
    _assert_bits(s, sr, "scale")
    assert q_t.shape == (24, 2 * QBLOCK) and q_t.is_contiguous() and s.shape == (24, 2)


def test_weight_blocks_match_reference_in_both_orientations(device):
    gen = torch.Generator().manual_seed(5)
    mags = 2.0 ** torch.randint(-8, 8, (3, 2, 1, 1, 1), generator=gen).float()
    w = (torch.randn(3, 2, QBLOCK, 1, QBLOCK, generator=gen) * mags).reshape(3, 2 * QBLOCK, QBLOCK)
    w = w.to(torch.bfloat16).to(device)
    for view in (w, w.transpose(1, 2).contiguous().transpose(1, 2)):  # strided: an nn.Linear-style stack
        fw = quantize_weight(view)
        ref = quantize_weight_ref(view)
        _assert_bits(fw.q, ref.q, "q")
        _assert_bits(fw.q_t, ref.q_t, "q_t")
        _assert_bits(fw.scale, ref.scale, "scale")
        _assert_bits(fw.q_t.transpose(1, 2).contiguous(), fw.q, "same values in both orientations")
        assert fw.scale.shape == (3, 2, 1)


def test_a_weight_quantized_into_existing_buffers_has_the_fresh_bits_at_the_same_addresses(device):
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(2, QBLOCK, 2 * QBLOCK, generator=gen).to(torch.bfloat16).to(device)
    fw = quantize_weight(torch.zeros_like(w))
    addresses = [t.data_ptr() for t in (fw.q, fw.q_t, fw.scale)]
    assert quantize_weight(w, out=fw) is fw
    assert [t.data_ptr() for t in (fw.q, fw.q_t, fw.scale)] == addresses
    want = quantize_weight(w)
    for name in ("q", "q_t", "scale"):
        _assert_bits(getattr(fw, name), getattr(want, name), name)
    with pytest.raises(ValueError, match=r"out.q must be a contiguous torch.float8_e4m3fn \(2, 256, 128\)"):
        quantize_weight(w.transpose(1, 2), out=fw)


def test_weight_blocks_with_zero_infinite_and_extreme_values_match_reference(device):
    # The kernel takes a block's amax in the input dtype (BF16 or FP32) before scaling in FP32: a zero block (scale
    # 1), an infinity (its block saturates), the largest finite values, in both input dtypes.
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(2, 2 * QBLOCK, 2 * QBLOCK, generator=gen) * 0.02
    base[0, :QBLOCK, :QBLOCK] = 0.0
    base[0, 5, QBLOCK + 7] = float("inf")
    base[1, QBLOCK + 3, 9] = -3.0e38
    base[1, 200, 200] = 1.0e-30
    for w in (base.to(torch.bfloat16).to(device), base.to(device)):
        fw, ref = quantize_weight(w), quantize_weight_ref(w)
        _assert_bits(fw.q, ref.q, f"q ({w.dtype})")
        _assert_bits(fw.q_t, ref.q_t, f"q_t ({w.dtype})")
        _assert_bits(fw.scale, ref.scale, f"scale ({w.dtype})")


def test_dequantization_error_bound(device):
    # Derived: a normal E4M3 value is within 2**-4 relative (half of 3 mantissa bits' spacing); below the
    # smallest normal (2**-6 * scale) the spacing is 2**-9 * scale, so the error is <= 2**-10 * scale.
    x = _rows(64, 2 * QBLOCK, 6, device).float()
    q, s = quantize_rowwise(x)
    scale = s.repeat_interleave(QBLOCK, 1)
    err = (q.float() * scale - x).abs()
    assert (err <= torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * scale)).all()
    assert float(err.max()) > 0  # quantization did round


def test_quant_risk_monitor_counts_flushes_and_ranges(device):
    x = torch.ones(2, 2 * QBLOCK, device=device)
    x[0, QBLOCK:] = 2.0**-10  # row 0: second block 10 binades below the row's amax
    x[1, 5] = 64.0  # row 1, first block: amax 64, scale 2**-2: values 1 -> 4 survive
    x[1, 6] = 2.0**-12  # ... 2**-12 / 2**-2 = 2**-10 is below E4M3's smallest subnormal: flushed
    risk = quant_risk_rowwise(x.bfloat16())
    assert risk["log2_group_over_block_amax_max"] == 10.0
    assert risk["flushed_fraction"] == 1 / x.numel()
    w = torch.ones(1, QBLOCK, 2 * QBLOCK, device=device)
    w[0, :, QBLOCK:] = 0.25
    risk_w = quant_risk_weight(w.bfloat16())
    assert risk_w["log2_group_over_block_amax_max"] == 2.0 and risk_w["flushed_fraction"] == 0.0


@pytest.mark.parametrize(("fn", "arg", "exc"), [
    (quantize_rowwise, torch.zeros(4, 100, dtype=torch.bfloat16), ValueError),  # N not a multiple of 128
    (quantize_rowwise, torch.zeros(4, 128, dtype=torch.float16), TypeError),
    (quantize_rowwise, torch.zeros(128, dtype=torch.bfloat16), ValueError),
    (quantize_rowwise, torch.zeros(0, 128, dtype=torch.bfloat16), ValueError),
    (quantize_rowwise, [[0.0] * 128], TypeError),
    (quantize_colwise, torch.zeros(100, 128, dtype=torch.bfloat16), ValueError),  # M not a multiple of 128
    (quantize_weight, torch.zeros(2, 128, 100, dtype=torch.bfloat16), ValueError),
    (quantize_weight, torch.zeros(128, 128, dtype=torch.bfloat16), ValueError),
    (quantize_weight, torch.zeros(1, 128, 128, dtype=FP8_DTYPE), TypeError),
])
def test_rejects_before_any_work(fn, arg, exc, device):
    if isinstance(arg, torch.Tensor):
        arg = arg.to(device)
    with pytest.raises(exc):
        fn(arg)
