"""NVFP4 fake quantization and the MX-as-NVFP4 global scale (spec Q-15, Q-17 `unsigned_fp32_to_e8m0`).

T0: the reference against hand-computed blocks and an error bound; scales; errors; compile/export; the E8M0
helpers. T1 (CPU, interpreter) and T2 (GPU): the Triton kernel against the reference, bit for bit. The
interpreter casts fp32 to bf16 by truncation (the GPU rounds to nearest even), so under it the kernel is
compared with the reference's fp32 values truncated to bf16: still exact.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

from mslk.core import testing
from mslk.quantize.triton import fp4_utils as u
from mslk.quantize.triton import nvfp4_fake_quantize as nf
from mslk.quantize.triton.nvfp4_fake_quantize import _round_to_e4m3

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Under the interpreter, numpy reports the overflows to inf the kernel relies on (a block whose e4m3 scale is
# 0 gets scale 2^126, and its elements saturate to 6 · 0).
quiet_numpy = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
bf16 = torch.bfloat16
INF, NAN = float("inf"), float("nan")


def _qdq(values, g):
    """Reference fake quantization of one row of values with the global amax g."""
    x = torch.tensor([values], dtype=bf16)
    return nf._reference(x, static_scales=torch.tensor([g]))[0][0].float().tolist()


def _bf16(v: float) -> float:
    return torch.tensor(v).to(bf16).item()


# ------------------------------------------------------------------------------------------- T0


def test_reference_on_the_e2m1_grid():
    # g = b = 6: two_level = 448, t = 448 = t8, so scale = inv_scale = 1: plain E2M1 rounding, ties to even,
    # saturation at 6, and sign(-0.0) = +1.
    values = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.0, 0.3, -2.9, 5.5, 1.0, 0.5, -6.0]
    expect = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 0.0, 0.5, -3.0, 6.0, 1.0, 0.5, -6.0]
    out = _qdq(values, 6.0)
    assert out == expect
    assert math.copysign(1.0, out[9]) == 1.0, "-0.0 comes out as +0.0"


def test_reference_block_scales():
    # b = 3, g = 6: t = 0.5 · 448 = 224 (an e4m3 value): unscale 0.5, scale 2.
    assert _qdq([3.0, 1.3, -0.2, 0.4] + [0.0] * 12, 6.0)[:4] == [3.0, 1.5, -0.25, 0.5]
    # b = 5, g = 6: t = fp32(5/6) · 448 = 373.3, e4m3 step 32 there -> 384; inv_scale = 384/448, and
    # 5 · scale = 5.83 -> 6, 2 · scale = 2.33 -> 2.
    inv = 384 / 448
    out = _qdq([5.0, 2.0] + [0.0] * 14, 6.0)
    assert out[:2] == [_bf16(6 * inv), _bf16(2 * inv)]
    # Saturation: b = 6 but g = 1 gives t = 6 · 448 -> 448; unscale = 1/6, so the block's top is g, not b
    # (0.125 · 6 = 0.75 -> 1 and 0.0625 · 6 = 0.375 -> 0.5).
    assert _qdq([6.0, 0.125, -0.0625] + [0.0] * 13, 1.0)[:3] == [_bf16(6 / 6), _bf16(1 / 6), _bf16(-0.5 / 6)]


def test_reference_invalid_blocks_and_special_elements():
    # Block 0: holds inf, so b = inf: invalid, scale 1 (plain E2M1; inf and NaN saturate to 6).
    # Block 1: all zero. Block 2: NaN does not count in b (= 3: scale 2), and comes out as 6 / 2.
    row = [INF, -INF, NAN, 0.3, -1.3, 100.0] + [0.0] * 10 + [0.0] * 16 + [NAN, 3.0, -NAN] + [1.0] * 13
    out = _qdq(row, 6.0)
    assert out[:6] == [6.0, -6.0, 6.0, 0.5, -1.5, 6.0]
    assert out[16:32] == [0.0] * 16
    assert out[32:36] == [3.0, 3.0, 3.0, 1.0]
    # An invalid global amax (0, inf or NaN) makes every block plain E2M1.
    for g in (0.0, INF, NAN):
        assert _qdq([0.3, 1.3, 1e-3, 50.0], g) == [0.5, 1.5, 0.0, 6.0]


def test_reference_partial_block_and_scales():
    x = testing.randn(3, 7, dtype=bf16, std=2.0)  # 21 elements: a block of 16 and one of 5
    out, scales = nf._reference(x)
    assert out.shape == x.shape and out.dtype == bf16 and scales.shape == (1,) and scales.dtype == torch.float32
    assert scales.item() == x.float().abs().max().item()
    tail = nf._reference(x.reshape(-1)[16:].reshape(1, 5), static_scales=scales)[0]
    assert torch.equal(out.reshape(-1)[16:], tail.reshape(-1)), "the 5-element block alone, same global amax"
    ub = torch.tensor([0.5])
    assert nf._reference(x, scale_ub=ub)[1].item() == 0.5
    assert nf._reference(x, static_scales=torch.tensor([9.0]), scale_ub=ub)[1].item() == 9.0, "ub bounds amax only"


def test_reference_error_bound_and_agreement_with_nvfp4():
    # The global amax is planted at 15.9375 = 255/16: with an amax of few mantissa bits (11.8125 = 189/16, 14.0)
    # many block scales and outputs are exact ties, which the two fp32 computations round apart (3.5% of random
    # draws then disagreed on 2-15% of the outputs); 255/16 leaves no exact tie.
    x = testing.randn(64, 256, dtype=bf16, std=3.0).clamp(-15, 15)
    x[5, 77] = -15.9375
    out, g = nf._reference(x)
    xf, of = x.float(), out.float()
    b = xf.reshape(-1, 16).abs().amax(-1, keepdim=True).expand(-1, 16).reshape(x.shape)
    # E2M1 rounds within a quarter of |v| above 1 and within 0.25 below; the scale's e4m3 rounding can push
    # the block top up to 6.4 (saturated to 6): |err| <= 0.25 |x| + 0.25 · b/6, with some slack.
    assert ((of - xf).abs() <= 0.26 * xf.abs() + b / 20).all()
    # The same NVFP4 grid as the quantizer with global scale 448 · 6 / g.
    gs = u.global_scale_nvfp4(x)
    xq, scale = u.quantize_nvfp4(x, gs)
    dense = u.dequantize_nvfp4(xq, scale, gs)
    assert torch.equal(out, dense)
    assert g.item() == 15.9375


def test_e4m3_rounding_of_torch_saturates():
    # The reference clamps before torch's fp8 cast, so saturation does not depend on the torch version.
    t = torch.tensor([447.0, 449.0, 464.0, 480.0, 1e9, 2.0**-10, 3 * 2.0**-11])
    assert t.clamp(max=448).to(torch.float8_e4m3fn).float().tolist() == [448, 448, 448, 448, 448, 0, 2.0**-9]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input": torch.ones(2, 16)}, "input must be bfloat16, got torch.float32"),
        ({"input": torch.ones(16, dtype=bf16)}, r"at least 2 dimensions and elements, got shape \(16,\)"),
        ({"input": torch.ones(0, 16, dtype=bf16)}, r"got shape \(0, 16\)"),
        ({"scale_ub": torch.ones(2)}, r"scale_ub must hold exactly one value, got shape \(2,\)"),
        ({"static_scales": torch.ones(1, 2)}, r"static_scales must hold exactly one value, got shape \(1, 2\)"),
        ({"static_scales": torch.ones(1, dtype=bf16)}, "static_scales .* must be float32, got torch.bfloat16"),
        ({"scale_ub": torch.ones(1, device="meta")}, "scale_ub is on meta, the input is on cpu"),
    ],
)
def test_bad_input(kwargs, message):
    kwargs = {"input": torch.ones(2, 16, dtype=bf16), **kwargs}
    with pytest.raises(ValueError, match=message):
        nf.triton_fake_quantize_nvfp4_per_tensor(**kwargs)
    with pytest.raises(ValueError, match=message):  # a pinned backend validates too
        nf.fake_quantize_nvfp4_op(**kwargs, backend="reference")


def test_compile_and_export():
    class FakeQuantize(torch.nn.Module):
        def forward(self, x):
            return nf.triton_fake_quantize_nvfp4_per_tensor(x)

    x = testing.randn(6, 40, dtype=bf16)
    out, scales = torch.compile(FakeQuantize(), fullgraph=True, backend="aot_eager")(x)
    assert out.shape == x.shape and scales.shape == (1,)
    assert "mslk.fake_quantize_nvfp4" in str(torch.export.export(FakeQuantize(), (x,)).graph)


def test_opcheck():
    testing.run_opcheck(nf.fake_quantize_nvfp4_op, DEVICE)


@pytest.mark.parametrize(
    ("mode", "values", "expect"),
    [
        # "even" with mbits=1: amax rounded to 2 significant bits (1.75 stays, anything above goes up).
        ("even", [1.0, 1.5, 1.75, 1.75 + 2.0**-23, 3.5, 3.6, 0.0], [1, 1, 1, 2, 2, 4, 2.0**-127]),
        ("ceil", [1.0, 1.0 + 2.0**-23, 0.75, 2.0**-130], [1, 2, 1, 2.0**-126]),
        ("floor", [1.99, 0.75, 2.0**-130, INF], [1, 0.5, 2.0**-127, INF]),
        # nv_round: up on any mantissa bit, except at exponent 254 and for subnormals up to half of 2^-126.
        ("nv_round", [1.0, 1.5, 1.5 * 2.0**127, 0.75 * 2.0**-126, 0.25 * 2.0**-126, 0.0],
         [1, 2, 2.0**127, 2.0**-126, 2.0**-127, 2.0**-127]),
    ],
)  # fmt: skip
def test_unsigned_fp32_to_e8m0(mode, values, expect):
    assert u.unsigned_fp32_to_e8m0(torch.tensor(values), 1, mode).tolist() == expect


def test_unsigned_fp32_to_e8m0_every_exponent():
    powers = torch.tensor([math.ldexp(1.0, e - 127) for e in range(1, 255)])
    assert torch.equal(u.unsigned_fp32_to_e8m0(powers, 1, "floor"), powers)
    with pytest.raises(ValueError, match="scale_round_mode must be"):
        u.unsigned_fp32_to_e8m0(powers, 1, "nearest")


@pytest.mark.parametrize(("amax", "scale"), [(8.0, 128.0), (7.0, 256.0), (7.5, 128.0), (1.0, 1024.0), (0.1, 16384.0)])
def test_cal_global_scale_mx4_as_nvfp4(amax, scale):
    # amax / 4 rounded "even" to a power of two: 2, 1.75 -> 1, 1.875 -> 2, 0.25, 0.025 = 1.6 · 2^-6 -> 2^-6.
    x = torch.tensor([[amax / 2, -amax], [0.0, amax / 4]], dtype=bf16)
    out = nf.cal_global_scale_mx4_as_nvfp4(x)
    assert out.dtype == torch.float32 and out.item() == scale


# -------------------------------------------------------------------------- T1 (CPU) / T2 (GPU)


def _expected(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The reference's values as this tier's kernel stores them (see the module docstring)."""
    v = nf._qdq_fp32(x.cpu(), g.cpu())
    if testing.interpreting():
        return (v.view(torch.int32) & ~0xFFFF).view(torch.float32).to(bf16)
    return v.to(bf16)


def _wide_range(*shape):
    """bf16 values whose rows span 2^-40..2^40: block amaxes far below the global one give e4m3-subnormal and
    zero block scales, and every part of the e4m3 grid is hit."""
    rows = torch.exp2(torch.randint(-40, 41, (shape[0],) + (1,) * (len(shape) - 1)).float())
    return (testing.randn(*shape, device=DEVICE) * rows.to(DEVICE)).to(bf16)


@pytest.mark.parametrize("shape", [(64, 96), (7, 13), (2, 3, 40), (1, 16), (3, 4099), (33, 257)], ids=str)
@pytest.mark.parametrize("data", ["randn", "wide"])
@quiet_numpy
def test_kernel_matches_reference(shape, data):
    x = testing.randn(*shape, dtype=bf16, device=DEVICE, std=3.0) if data == "randn" else _wide_range(*shape)
    g = nf._global_amax(x)
    out = testing.empty_poisoned(*shape, dtype=bf16, device=DEVICE)
    nf._launch(x, out, g)
    assert torch.equal(out.cpu(), _expected(x, g))


@quiet_numpy
def test_kernel_special_values():
    x = testing.randn(8, 64, dtype=bf16, device=DEVICE, std=2.0)
    x[0, 3], x[1, 20], x[2, 40], x[3, :16], x[4, 5] = INF, -INF, NAN, 0.0, -0.0
    x[5, 16:32] = torch.tensor(1e-40, dtype=bf16)  # bf16 subnormals
    x[6, :] = x[6, :] * 2.0**-60
    for g in torch.tensor([[6.0], [0.0], [NAN], [1e-30], [3e38]]):
        out = testing.empty_poisoned(8, 64, dtype=bf16, device=DEVICE)
        nf._launch(x, out, g.to(DEVICE))
        assert torch.equal(out.cpu(), _expected(x, g)), f"global amax {g.item()}"


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"scale_ub": 0.5}, {"static_scales": 5.0}, {"static_scales": 40.0, "scale_ub": 0.1}],
    ids=["amax", "scale_ub", "static", "static+ub"],
)
def test_backend_scales_paths(kwargs):
    x = testing.randn(2, 5, 24, dtype=bf16, device=DEVICE)[:, :, :20]  # non-contiguous, 200 elements
    kw = {name: torch.tensor([value], device=DEVICE) for name, value in kwargs.items()}
    out, scales = nf.fake_quantize_nvfp4_op.get_backend("triton").impl(x, **kw)
    ref_scales = nf._reference(x.cpu(), **{name: t.cpu() for name, t in kw.items()})[1]
    assert torch.equal(scales.cpu(), ref_scales)
    assert out.is_contiguous() and torch.equal(out.cpu(), _expected(x.contiguous(), ref_scales))
    if "static_scales" in kw:
        assert scales.data_ptr() != kw["static_scales"].data_ptr(), "a new tensor, not the input"


def _round_kernel_values():
    """e4m3fn values, the midpoints between neighbours (ties) and one fp32 ulp either side of them, values
    beyond 448, fp32 subnormals and zero, both signs."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mid = (grid[1:] + grid[:-1]) / 2
    t = torch.cat([grid, mid, mid.nextafter(torch.tensor(0.0)), mid.nextafter(torch.tensor(INF))])
    t = torch.cat([t, torch.tensor([449.0, 464.0, 480.0, 1e30, INF, 1e-42, 2.0**-10])])
    return torch.cat([t, -t])


@triton.jit
def _round_kernel(t_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    t = tl.load(t_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, _round_to_e4m3(t), mask=offsets < n)


def test_round_to_e4m3_matches_torch():
    t = _round_kernel_values().to(DEVICE)
    out = testing.empty_poisoned(t.numel(), dtype=torch.float32, device=DEVICE)
    _round_kernel[(1,)](t, out, t.numel(), BLOCK=triton.next_power_of_2(t.numel()))
    expect = t.cpu().clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(out.cpu(), expect)


@pytest.mark.gpu
def test_kernel_large_on_gpu():
    x = testing.randn(4096, 5000, dtype=bf16, device=DEVICE, std=3.0)
    out, scales = nf.triton_fake_quantize_nvfp4_per_tensor(x)
    ref, ref_scales = nf._reference(x)  # the reference on the GPU too (reference_devices)
    assert torch.equal(scales, ref_scales) and torch.equal(out, ref)
    assert torch.equal(out.cpu(), nf._reference(x.cpu())[0])
