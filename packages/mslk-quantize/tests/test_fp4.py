"""MXFP4 / NVFP4 quantizers and FP4 helpers (spec Q-10, Q-11, Q-13, Q-16, Q-17, §7.5).

T0: the references against the formulas and the layout; errors; compile/export. T1 (CPU, interpreter) and
T2 (GPU): the Triton kernels against the references, bit for bit on the GPU.
"""

import math

import pytest
import torch

from mslk.core import formats, testing
from mslk.quantize.triton import fp4_quantize as fp4
from mslk.quantize.triton import fp4_utils as u

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------------- T0


def test_e2m1_round_to_nearest_even_and_saturation():
    values = torch.tensor(
        [0.0, 0.25, 0.26, 0.74, 0.75, 1.25, 1.26, 1.75, 2.5, 2.51, 3.5, 5.0, 5.01, 7.0, 1e9, -0.75, -6.0]
    )
    expect = [0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 1.5, 2.0, 2.0, 3.0, 4.0, 4.0, 6.0, 6.0, 6.0, -1.0, -6.0]
    assert u.fp4_to_float(u.e2m1_codes(values)).tolist() == expect
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(u.unpack_fp4(u.pack_fp4(codes)), codes)
    assert u.pack_fp4(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21, "even element in the low nibble"


def test_blocked_layout_matches_the_spec_formula():
    rows, cols = 300, 7
    scale = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols)
    flat = u.to_blocked(scale)
    col_blocks = math.ceil(cols / 4)
    assert flat.numel() == math.prod(formats.swizzled_scale_shape(rows, cols))
    for r, c in [(0, 0), (31, 3), (32, 0), (127, 6), (128, 1), (299, 6)]:
        offset = (r // 128) * 512 * col_blocks + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
        assert flat[offset] == scale[r, c]
    assert torch.equal(u.from_blocked(flat, rows, cols), scale)
    assert flat.numel() - rows * cols == (flat == 0).sum() - 1, "padding is zero (one real zero at (0, 0))"


@pytest.mark.parametrize(
    ("amax", "mode", "exponent"),
    [
        (1.0, u.RoundingMode.floor, -2),
        (1.0, u.RoundingMode.ceil, -2),
        (1.5, u.RoundingMode.floor, -2),
        (1.5, u.RoundingMode.ceil, -1),
        (1.4142, u.RoundingMode.nearest, -2),
        (1.4143, u.RoundingMode.nearest, -1),
        (1.75, u.RoundingMode.even, -2),
        (1.76, u.RoundingMode.even, -1),
        (0.0, u.RoundingMode.ceil, -127),
        (2.0**200, u.RoundingMode.ceil, 125),
    ],
)
def test_shared_exponent(amax, mode, exponent):
    assert u.mx_shared_exponent(torch.tensor([amax]), mode).item() == exponent


def test_stochastic_exponent_rounds_amax_to_two_significant_bits():
    # amax is rounded stochastically onto {1, 1.5, 2} x 2^e, then floored: 1.75 goes up half the time,
    # 1.25 never (it can only reach 1.5).
    e = u.mx_shared_exponent(torch.full((10000,), 1.75), u.RoundingMode.stochastic)
    assert set(e.unique().tolist()) == {-2, -1}
    assert 0.4 < (e == -1).float().mean().item() < 0.6
    assert (u.mx_shared_exponent(torch.full((1000,), 1.25), u.RoundingMode.stochastic) == -2).all()


def test_mx4_reference_round_trip_and_nan():
    x = testing.randn(6, 128, std=4.0)
    x[2, 40] = float("nan")
    xq, scale = u.quantize_mx4(x, 32, u.RoundingMode.ceil, "plain")
    assert xq.shape == (6, 64) and scale.shape == (6, 4) and scale.dtype == torch.uint8
    assert scale[2, 1] == 255 and (scale[2, [0, 2, 3]] != 255).all()
    back = u.dequantize_mx4(xq, scale)
    assert back[2, 32:64].isnan().all()
    ok = ~back.isnan()
    amax = x.unflatten(-1, (4, 32)).abs().amax(-1)
    step = torch.exp2(torch.ceil(torch.log2(amax)) - 2)[..., None].expand(-1, -1, 32).reshape(6, 128)
    assert ((back - x).abs()[ok] <= step[ok]).all(), "within one E2M1 step of the group scale"
    formats.MX(32, "plain").check(xq, scale)


def test_nvfp4_reference():
    x = testing.randn(130, 64, std=3.0)
    gs = u.global_scale_nvfp4(x)
    assert gs.item() == pytest.approx(448 * 6 / x.abs().max().item(), rel=1e-6)
    xq, scale = u.quantize_nvfp4(x, gs)
    formats.NVFP4().check(xq, scale)
    plain = u.from_blocked(scale.view(torch.uint8), 130, 4).view(torch.float8_e4m3fn)
    testing.assert_rel_close(u.dequantize_nvfp4(xq, plain, gs), x, 0.15)
    block_amax = x.unflatten(-1, (4, 16)).abs().amax(-1)
    assert torch.equal(plain, (block_amax / torch.tensor(6.0) * gs).to(torch.float8_e4m3fn))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: fp4.triton_quantize_mx4(torch.ones(2, 48)), "multiple of the group size 32"),
        (lambda: fp4.triton_quantize_mx4(torch.ones(2, 64, dtype=torch.int32)), "float32, float16 or bfloat16"),
        (lambda: fp4.triton_quantize_mx4_unpack(torch.ones(2, 64), group_size=64), "group_size must be 32"),
        (lambda: fp4.triton_quantize_mx4_unpack(torch.ones(2, 64), ebits=3), "only E2M1"),
        (lambda: fp4.triton_quantize_mx4_unpack(torch.ones(2, 64), rounding_mode=7), "rounding_mode must be one of"),
        (lambda: fp4.triton_quantize_nvfp4(torch.ones(2, 40)), "multiple of the group size 16"),
        (lambda: fp4.triton_quantize_nvfp4(torch.ones(2, 32), torch.ones(2)), "global_scale must be one float32"),
        (lambda: fp4.triton_quantize_nvfp4(torch.ones(2, 32), use_e8m0_scale=True), "MXFP4-16"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_compile_and_export():
    class Quantize(torch.nn.Module):
        def forward(self, x):
            return fp4.triton_quantize_mx4(x), fp4.triton_quantize_nvfp4(x)

    x = testing.randn(130, 64, dtype=torch.bfloat16)
    (q, s), (_, ns) = torch.compile(Quantize(), fullgraph=True, backend="aot_eager")(x)
    assert q.shape == (130, 32) and s.shape == (256 * 4,) and ns.dtype == torch.float8_e4m3fn
    graph = str(torch.export.export(Quantize(), (x,)).graph)
    assert "mslk.quantize_mx4" in graph and "mslk.quantize_nvfp4" in graph


# -------------------------------------------------------------------------- T1 (CPU) / T2 (GPU)

MX_CASES = [((5, 64), 32), ((2, 3, 96), 16), ((130, 32), 32), ((1, 2048), 32), ((0, 64), 32), ((3, 4160), 32)]


@pytest.mark.parametrize(("shape", "group"), MX_CASES, ids=str)
@pytest.mark.parametrize(
    ("mode", "layout"), [(4, "swizzled"), (4, "plain"), (0, "swizzled"), (1, "plain"), (2, "swizzled")]
)
def test_mx4_kernel_matches_reference(shape, group, mode, layout, monkeypatch):
    monkeypatch.setattr(formats, "platform_mx_layout", lambda: layout)
    x = testing.randn(*shape, dtype=torch.bfloat16, device=DEVICE, std=3.0)
    q, s = fp4.quantize_mx4_op.get_backend("triton").impl(x, group, mode)
    rq, rs = u.quantize_mx4(x.cpu(), group, mode, layout)
    assert torch.equal(s.cpu(), rs) and torch.equal(q.cpu(), rq)


def test_mx4_kernel_special_values_and_strides():
    x = testing.randn(64, 96, device=DEVICE, std=2.0)
    x[3, 5], x[10, 70], x[20, :32] = float("nan"), float("inf"), 0.0
    t = testing.randn(96, 64, device=DEVICE).t()
    for inp in (x, t, testing.padded_rows(testing.randn(40, 64, dtype=torch.float16, device=DEVICE))):
        q, s = fp4.quantize_mx4_op.get_backend("triton").impl(inp)
        rq, rs = u.quantize_mx4(inp.cpu(), 32, u.RoundingMode.ceil, "swizzled")
        assert torch.equal(s.cpu(), rs) and torch.equal(q.cpu(), rq)


def test_mx4_kernel_stochastic_modes():
    x = testing.randn(64, 128, device=DEVICE, std=3.0)
    impl = fp4.quantize_mx4_op.get_backend("triton").impl
    q1, s1 = impl(x, 32, u.RoundingMode.stochastic, False, 1234)
    q2, s2 = impl(x, 32, u.RoundingMode.stochastic, False, 1234)
    assert torch.equal(q1, q2) and torch.equal(s1, s2), "a seed makes it reproducible"
    floor_s = impl(x, 32, u.RoundingMode.floor)[1].int()
    assert ((s1.int() - floor_s) >= 0).all() and ((s1.int() - floor_s) <= 1).all()
    # Stochastic casting is unbiased: 400 copies of the same row (independent random numbers per element)
    # average to it. Ceil scales, so that no element saturates at 6.
    y = testing.randn(1, 32, device=DEVICE).abs() + 0.1
    q, s = impl(y.expand(400, 32).contiguous(), 32, u.RoundingMode.ceil, True, 7)
    mean = u.dequantize_mx4(q.cpu(), u.from_blocked(s.cpu(), 400, 1)).mean(dim=0, keepdim=True)
    testing.assert_rel_close(mean, y.cpu(), 0.02)


NV_CASES = [((130, 64), True), ((2, 3, 48), False), ((1, 4096), True), ((0, 32), True), ((257, 160), True)]


@pytest.mark.parametrize(("shape", "with_global"), NV_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_nvfp4_kernel_matches_reference(shape, with_global, dtype):
    x = testing.randn(*shape, dtype=dtype, device=DEVICE, std=2.0)
    gs = u.global_scale_nvfp4(x) if with_global and x.numel() else None
    q, s = fp4.quantize_nvfp4_op.get_backend("triton").impl(x, gs)
    rq, rs = u.quantize_nvfp4(x.cpu(), None if gs is None else gs.cpu())
    testing.assert_fp8_equal(s.cpu(), rs, what="scale")
    if testing.interpreting():  # the interpreter's e4m3 rounding moves some scales, and their elements with them
        rows, groups = math.prod(shape[:-1]), shape[-1] // 16
        plain_s = u.from_blocked(s.cpu().view(torch.uint8), rows, groups).view(torch.float8_e4m3fn)
        back = u.dequantize_nvfp4(q.cpu(), plain_s.reshape(*shape[:-1], groups), gs.cpu() if gs is not None else None)
        testing.assert_rel_close(back, x.cpu().float(), 0.15)
    else:
        assert torch.equal(q.cpu(), rq)
