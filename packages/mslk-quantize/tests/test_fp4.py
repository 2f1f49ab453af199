"""MXFP4 / NVFP4 quantizers and FP4 helpers (spec Q-10, Q-11, Q-13, Q-16, Q-17, §7.5).

T0: the references against the formulas and the layout; errors; compile/export. T1 (CPU, interpreter) and
T2 (GPU): the Triton kernels against the references, bit for bit on the GPU.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mslk.core import formats, testing
from mslk.quantize.triton import fp4_quantize as fp4
from mslk.quantize.triton import fp4_utils as u

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------------- T0


def test_reference_module_names():
    """The reference's fp4_quantize names (spec Q-15, Q-17) and its exponent-bias helper."""
    assert fp4.get_mx4_exp_bias(2) == 1 and fp4.get_mx4_exp_bias(3) == 3 and fp4.get_mx4_exp_bias(5) == 15
    assert callable(fp4.triton_fake_quantize_nvfp4_per_tensor) and callable(fp4.cal_global_scale_mx4_as_nvfp4)
    assert fp4.unsigned_fp32_to_e8m0 is u.unsigned_fp32_to_e8m0


def test_e2m1_round_to_nearest_even_and_saturation():
    values = torch.tensor(
        [0.0, 0.25, 0.26, 0.74, 0.75, 1.25, 1.26, 1.75, 2.5, 2.51, 3.5, 5.0, 5.01, 7.0, 1e9, -0.75, -6.0]
    )
    expect = [0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 1.5, 2.0, 2.0, 3.0, 4.0, 4.0, 6.0, 6.0, 6.0, -1.0, -6.0]
    assert u.e2m1_values(u.e2m1_codes(values)).tolist() == expect
    special = u.e2m1_codes(torch.tensor([-0.0, -0.1, float("nan"), -float("inf")])).tolist()
    assert special == [8, 8, 7, 15], "the sign bit goes to bit 3 (E2M1 -0 included), NaN saturates"
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(u.unpack_fp4(u.pack_fp4(codes)), codes)
    assert u.pack_fp4(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21, "even element in the low nibble"


@settings(deadline=None, max_examples=200)
@given(st.floats(-10.0, 10.0, width=32))
def test_e2m1_code_is_the_nearest_value(v):
    x = torch.tensor([v])
    got = u.e2m1_values(u.e2m1_codes(x)).item()
    grid = sorted({s * e for e in u.E2M1_VALUES for s in (1, -1)})
    best = min(abs(g - max(min(v, 6.0), -6.0)) for g in grid)
    assert abs(got - max(min(v, 6.0), -6.0)) == best, "the nearest E2M1 value (clamped to ±6)"
    ties = [g for g in grid if abs(g - max(min(v, 6.0), -6.0)) == best]
    if len(ties) == 2:  # a tie goes to the even code (mantissa bit 0)
        assert int(u.e2m1_codes(x).item()) % 2 == 0


@settings(deadline=None, max_examples=40)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6), extra=st.integers(0, 3), cols=st.integers(1, 9))
def test_stacked_layout_round_trip(sizes, extra, cols):
    m_sizes = torch.tensor(sizes)
    rows = sum(sizes) + extra
    scale = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    flat = u.to_blocked_stacked(scale, m_sizes)
    assert flat.numel() == math.prod(formats.stacked_swizzled_scale_shape(rows, len(sizes), cols))
    assert torch.equal(u.from_blocked_stacked(flat, m_sizes, cols), scale[: sum(sizes)])
    assert (flat != 0).sum() == sum(sizes) * cols, "each scale of a segment row once, nothing else"


def test_blocked_layout_matches_the_spec_formula():
    rows, cols = 300, 7
    scale = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols)
    flat = u.to_blocked(scale)
    col_blocks = math.ceil(cols / 4)
    assert flat.numel() == math.prod(formats.swizzled_scale_shape(rows, cols))
    for r, c in [(0, 0), (31, 3), (32, 0), (127, 6), (128, 1), (299, 6)]:
        offset = (r // 128) * 512 * col_blocks + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
        assert flat[offset] == scale[r, c]
    assert torch.equal(u.from_blocked(flat, (rows, cols)), scale)
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


def test_reference_stochastic_rounding_follows_the_seed():
    """The reference (CPU) path draws its stochastic exponents from a generator seeded with `seed`: the same seed
    gives the same scales, as the kernel's do (it drew from the global generator)."""
    x = testing.randn(16, 64, std=3.0)
    mode = u.RoundingMode.stochastic
    first, again, other = (fp4.triton_quantize_mx4(x, rounding_mode=mode, seed=s)[1] for s in (5, 5, 6))
    assert torch.equal(first, again) and not torch.equal(first, other)
    sizes = torch.tensor([9, 7])
    stacked = [fp4.quantize_mx4_stacked(sizes, x, rounding_mode=mode, seed=5)[1] for _ in range(2)]
    assert torch.equal(*stacked)


def test_all_zero_amax_is_plus_zero():
    """abs_max of zeros is +0.0 (it was -0.0), so the NVFP4 global scale of zeros is +inf, not -inf."""
    zeros = torch.zeros(2, 32)
    assert math.copysign(1.0, u.abs_max(zeros).item()) == 1.0
    assert (torch.copysign(torch.ones(2), u.abs_max(zeros, dim=-1)) == 1).all()
    assert u.global_scale_nvfp4(zeros).item() == math.inf


def test_mx4_reference_round_trip_and_nan():
    x = testing.randn(6, 128, std=4.0)
    x[2, 40] = float("nan")
    xq, scale = u.quantize_mx4(x, 32, u.RoundingMode.ceil, "plain")
    assert xq.shape == (6, 64) and scale.shape == (6, 4) and scale.dtype == torch.uint8
    assert scale[2, 1] == 255 and (scale[2, [0, 2, 3]] != 255).all()
    back = u.dequantize_mx4(xq, scale)
    assert back.dtype == torch.bfloat16 and back[2, 32:64].isnan().all()
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
    assert scale.shape == (256, 4) and gs.shape == ()  # the padded matrix of the blocked layout (spec Q-13)
    formats.NVFP4().check(xq, scale)
    plain = u.from_blocked(scale.view(torch.uint8), (130, 4)).view(torch.float8_e4m3fn)
    testing.assert_rel_close(u.dequantize_nvfp4(xq, scale, gs), x, 0.15)
    block_amax = x.unflatten(-1, (4, 16)).abs().amax(-1)
    assert torch.equal(plain, (block_amax / torch.tensor(6.0) * gs).to(torch.float8_e4m3fn))


def test_reference_helpers_keep_their_contracts():
    """fp4_utils as the reference library's (spec Q-16, Q-17): fp4_to_float unpacks bytes (low nibble first),
    global_scale_nvfp4 is 0-dim, scale_nvfp4 applies block scales over the global scale to dequantized values,
    dequantize_nvfp4 / dequantize_mx4 take the quantizers' outputs (blocked scales, flat or 2-D) and give bf16;
    fp4_quantize has _to_blocked(x) and _from_blocked(x, (rows, cols))."""
    packed = torch.tensor([[0x21, 0xF7]], dtype=torch.uint8)
    assert u.fp4_to_float(packed).tolist() == [[0.5, 1.0, 6.0, -6.0]]
    if hasattr(torch, "float4_e2m1fn_x2"):
        assert torch.equal(u.fp4_to_float(packed.view(torch.float4_e2m1fn_x2)), u.fp4_to_float(packed))
    x = testing.randn(3, 130, 64, dtype=torch.bfloat16, std=3.0)
    gs = u.global_scale_nvfp4(x)
    assert gs.shape == () and gs.dtype == torch.float32
    xq, scale = fp4.triton_quantize_nvfp4(x, gs)
    assert xq.shape == (3, 130, 32) and scale.shape == (512, 4)  # M = 390 rows
    for blocked in (scale, scale.reshape(-1)):
        back = u.dequantize_nvfp4(xq, blocked, gs)
        assert back.dtype == torch.bfloat16 and back.shape == x.shape
        testing.assert_rel_close(back, x, 0.15)
    plain = fp4._from_blocked(scale, (390, 4))
    values = u.fp4_to_float(xq.reshape(390, 32))
    expected = values.unflatten(-1, (4, 16)) * (plain.float() / gs)[..., None]
    torch.testing.assert_close(u.scale_nvfp4(values, plain, gs), expected.flatten(-2), rtol=0, atol=0)
    wider = torch.cat([plain.view(torch.uint8), torch.zeros(390, 4, dtype=torch.uint8)], 1)  # columns past K/16
    torch.testing.assert_close(u.scale_nvfp4(values, wider, gs), expected.flatten(-2), rtol=0, atol=0)
    assert torch.equal(fp4._to_blocked(plain.view(torch.uint8)), scale.view(torch.uint8).reshape(-1))
    xm = testing.randn(130, 64, dtype=torch.bfloat16, std=3.0)
    mq, ms = u.quantize_mx4(xm, 32, u.RoundingMode.ceil, "swizzled")
    _, plain_ms = u.quantize_mx4(xm, 32, u.RoundingMode.ceil, "plain")
    for scales in (ms, ms.view(torch.int8), plain_ms):
        back = u.dequantize_mx4(mq, scales)
        assert back.dtype == torch.bfloat16
        testing.assert_rel_close(back, xm, 0.2)
    assert torch.equal(u.dequantize_mx4(mq, ms), u.dequantize_mx4(mq, plain_ms))


@pytest.mark.parametrize("shape", [(130, 64), (5, 48), (0, 32), (2, 3, 160)], ids=str)
def test_nvfp4_e8m0_block_scales(shape):
    """use_e8m0_scale (MXFP4 mimicked by NVFP4, spec Q-13): block scales are the powers of two of the reference
    library's E8M0 "even" rounding of amax / 4 · gs (its unsigned_fp32_to_e8m0), 1 for exponents 0 and 255, at
    most 448; the Triton kernel (interpreted on a CPU) gives the reference's bits; with
    cal_global_scale_mx4_as_nvfp4 the values come back at MXFP4 accuracy."""
    x = testing.randn(*shape, dtype=torch.bfloat16, device=DEVICE, std=3.0)
    rows, groups = math.prod(shape[:-1]), shape[-1] // 16
    if rows > 2:
        x.view(rows, -1)[1, :16] = 0.0  # a zero block: exponent 0, scale 1
    gs = fp4.cal_global_scale_mx4_as_nvfp4(x) if x.numel() else torch.ones((), device=DEVICE)
    rq, rs = u.quantize_nvfp4(x.cpu(), gs.cpu(), use_e8m0_scale=True)
    amax = x.cpu().float().reshape(rows, groups, 16).abs().amax(-1)
    e8m0 = u.unsigned_fp32_to_e8m0(amax / torch.tensor(4.0) * gs.cpu(), 1, "even")
    ones = (e8m0 == 2.0**-127) | (e8m0 == float("inf"))
    expected = torch.where(ones, 1.0, e8m0).clamp(max=448.0).to(torch.float8_e4m3fn)
    assert rs.shape == formats.swizzled_scale_shape(rows, groups)
    assert torch.equal(u.from_blocked(rs.view(torch.uint8), (rows, groups)), expected.view(torch.uint8))
    q, s = fp4.quantize_nvfp4_op.get_backend("triton").impl(x, gs, True)
    assert torch.equal(s.cpu().view(torch.uint8), rs.view(torch.uint8)) and torch.equal(q.cpu(), rq)
    if x.numel():
        testing.assert_rel_close(u.dequantize_nvfp4(rq, rs, gs.cpu()).reshape(x.shape), x.cpu(), 0.2)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: fp4.triton_quantize_mx4(torch.ones(2, 48)), "multiple of the group size 32"),
        (lambda: fp4.triton_quantize_mx4(torch.ones(2, 64, dtype=torch.int32)), "float32, float16 or bfloat16"),
        (lambda: fp4.triton_quantize_mx4_unpack(torch.ones(2, 64), group_size=64), "group_size must be 32"),
        (lambda: fp4.triton_quantize_mx4_unpack(torch.ones(2, 64), ebits=3), "only E2M1"),
        (lambda: fp4.triton_quantize_mx4_unpack(torch.ones(2, 64), rounding_mode=7), "rounding_mode must be one of"),
        (lambda: fp4.triton_quantize_nvfp4(torch.ones(2, 40)), "multiple of the group size 16"),
        (lambda: fp4.triton_quantize_nvfp4(torch.ones(2, 0)), "positive multiple of the group size 16"),
        (lambda: fp4.triton_quantize_nvfp4(torch.ones(2, 32), torch.ones(2)), "global_scale must be one float32"),
        (  # 7 scale bytes for [4, 32] data (one group a row): a reshape error before
            lambda: u.dequantize_mx4(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(7, dtype=torch.uint8)),
            r"dequantize_mx4: expected scales of shape \(128, 4\) or \(512,\) or \(4, 2\)",
        ),
        (
            lambda: u.dequantize_nvfp4(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(512, dtype=torch.uint8)),
            r"dequantize_nvfp4: .* in torch.float8_e4m3fn .* got \(512,\) torch.uint8",
        ),
        (lambda: u.dequantize_mx4(torch.zeros(4, 32), torch.zeros(8)), "expected packed FP4 uint8"),
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
    assert q.shape == (130, 32) and s.shape == (256 * 4,) and s.dtype == torch.int8
    assert ns.shape == (256, 4) and ns.dtype == torch.float8_e4m3fn
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
    assert s.dtype == (torch.int8 if layout == "swizzled" else torch.uint8)  # the reference library's (spec Q-10)
    assert torch.equal(s.cpu().view(torch.uint8), rs) and torch.equal(q.cpu(), rq)


def test_mx4_kernel_special_values_and_strides():
    x = testing.randn(64, 96, device=DEVICE, std=2.0)
    x[3, 5], x[10, 70], x[20, :32] = float("nan"), float("inf"), 0.0
    t = testing.randn(96, 64, device=DEVICE).t()
    for inp in (x, t, testing.padded_rows(testing.randn(40, 64, dtype=torch.float16, device=DEVICE))):
        q, s = fp4.quantize_mx4_op.get_backend("triton").impl(inp)
        rq, rs = u.quantize_mx4(inp.cpu(), 32, u.RoundingMode.ceil, "swizzled")
        assert torch.equal(s.cpu().view(torch.uint8), rs) and torch.equal(q.cpu(), rq)


def _ties_and_neighbours() -> torch.Tensor:
    """|values| at every E2M1 rounding boundary, one fp32 ulp either side, the codes themselves, both signs."""
    points = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, *u.E2M1_VALUES])
    near = torch.cat([points, torch.nextafter(points, points + 1), torch.nextafter(points, points - 1)])
    return torch.cat([near, -near, torch.tensor([-0.0, 0.0])])


def test_fp4_kernels_round_exact_ties_like_the_reference():
    # MXFP4 (floor) of groups with amax 12.5 scales by 2^-1, so 2·value lands exactly on each boundary;
    # NVFP4 with gs = 1 and amax 6 gets s_b = e4m3(6/6) = 1.
    values = _ties_and_neighbours()
    body = torch.zeros(math.ceil(values.numel() / 31) * 31)
    body[: values.numel()] = values
    body = body.reshape(-1, 31)
    x = torch.cat([torch.full((body.shape[0], 1), 6.0), body], dim=1)
    mx = torch.cat([torch.full((body.shape[0], 1), 12.5), 2 * body], dim=1)
    q, s = fp4.quantize_mx4_op.get_backend("triton").impl(mx.to(DEVICE), 32, u.RoundingMode.floor)
    rq, rs = u.quantize_mx4(mx, 32, u.RoundingMode.floor, formats.platform_mx_layout())
    assert set(u.unpack_fp4(rq)[:, 1:].flatten().tolist()) == set(range(16)), "every code is reached"
    assert torch.equal(s.cpu().view(torch.uint8), rs) and torch.equal(q.cpu(), rq)
    q, _ = fp4.quantize_nvfp4_op.get_backend("triton").impl(x.to(DEVICE))
    assert torch.equal(q.cpu(), u.quantize_nvfp4(x)[0])


def test_mx4_kernel_stochastic_modes():
    x = testing.randn(64, 128, device=DEVICE, std=3.0)
    impl = fp4.quantize_mx4_op.get_backend("triton").impl
    q1, s1 = impl(x, 32, u.RoundingMode.stochastic, False, 1234)
    q2, s2 = impl(x, 32, u.RoundingMode.stochastic, False, 1234)
    assert torch.equal(q1, q2) and torch.equal(s1, s2), "a seed makes it reproducible"
    floor_s = impl(x, 32, u.RoundingMode.floor)[1].view(torch.uint8).int()
    step = s1.view(torch.uint8).int() - floor_s
    assert ((step >= 0) & (step <= 1)).all()
    # Stochastic casting is unbiased: 400 copies of the same row (independent random numbers per element)
    # average to it. Ceil scales, so that no element saturates at 6.
    y = testing.randn(1, 32, device=DEVICE).abs() + 0.1
    q, s = impl(y.expand(400, 32).contiguous(), 32, u.RoundingMode.ceil, True, 7)
    mean = u.dequantize_mx4(q.cpu(), s.cpu()).float().mean(dim=0, keepdim=True)
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
    if testing.interpreting():  # the interpreter's e4m3 rounding moves some scales: the elements of the scales given
        rows, groups = math.prod(shape[:-1]), shape[-1] // 16
        plain_s = u.from_blocked(s.cpu().view(torch.uint8), (rows, groups)).view(torch.float8_e4m3fn)
        gs_cpu = torch.ones(()) if gs is None else gs.cpu().reshape(())
        rq = u.pack_fp4(u.nvfp4_elements(x.cpu().reshape(rows, shape[-1]), plain_s, gs_cpu).reshape(shape))
    assert torch.equal(q.cpu(), rq)


# ----------------------------------------------------------------------------- stacked (MoE) FP4

STACKS = [[5, 0, 130, 1], [3], [0, 0], [128, 129, 7], [1] * 9]


def test_stacked_blocked_layout():
    m_sizes = torch.tensor([5, 0, 130, 1])
    scale = torch.arange(1, 136 * 3 + 1, dtype=torch.int32).reshape(136, 3)
    flat = u.to_blocked_stacked(scale, m_sizes)
    assert flat.shape == (math.prod(formats.stacked_swizzled_scale_shape(136, 4, 3)),) == ((136 + 4 * 127) * 4,)
    # Segment starts (rows 0, 128, 384 of the padded matrix): each segment is blocked on its own.
    for start, padded_start, size in ((0, 0, 5), (5, 128, 130), (135, 384, 1)):
        block = u.to_blocked(scale[start : start + size])
        assert torch.equal(flat[padded_start * 4 : padded_start * 4 + block.numel()], block)
    assert (flat != 0).sum() == scale.numel(), "every scale once, zeros elsewhere"
    assert torch.equal(u.from_blocked_stacked(flat, m_sizes, 3), scale)
    assert u.row_segments(m_sizes, 138).tolist() == [0] * 5 + [2] * 130 + [3] + [4, 4]


@pytest.mark.parametrize("sizes", STACKS, ids=str)
def test_calculate_group_max(sizes):
    m_sizes = torch.tensor(sizes, device=DEVICE)
    x = testing.randn(sum(sizes) + 2, 48, dtype=torch.bfloat16, device=DEVICE, std=3.0)  # 2 rows past the end
    if sum(sizes) > 1:
        x[1] = 0.0
    if sizes[0] == 1 and sum(sizes) > 1:
        x[0] = 1e-37  # an amax below 1e-8 counts 1e-8: 2688 / 1e-37 overflowed to inf
    global_scale, segment = fp4.calculate_group_max(x, m_sizes)
    reference = u.calculate_group_max(x.cpu(), m_sizes.cpu())
    assert torch.equal(global_scale.cpu(), reference[0]) and torch.equal(segment.cpu(), reference[1])
    assert segment.dtype == torch.int64 and segment.tolist() == u.row_segments(m_sizes.cpu(), x.shape[0]).tolist()
    start = 0
    for g, size in enumerate(sizes):
        amax = x[start : start + size].float().abs().max().item() if size else None
        expect = torch.finfo(torch.float32).max if size == 0 else 2688.0 / max(amax, 1e-8)
        assert global_scale[g].item() == pytest.approx(expect, rel=1e-6)
        start += size


@pytest.mark.parametrize("sizes", STACKS, ids=str)
@pytest.mark.parametrize("m_dtype", [torch.int64, torch.int32], ids=str)
def test_mx4_stacked_kernel_matches_reference(sizes, m_dtype):
    m_sizes = torch.tensor(sizes, dtype=m_dtype, device=DEVICE)
    x = testing.randn(sum(sizes) + 1, 96, dtype=torch.bfloat16, device=DEVICE, std=3.0)
    for group in (32, 16):
        q, s = fp4.quantize_mx4_stacked_op.get_backend("triton").impl(m_sizes, x, group)
        rq, rs = fp4._mx4_stacked_reference(m_sizes.cpu(), x.cpu(), group)
        assert torch.equal(q.cpu(), rq) and torch.equal(s.cpu(), rs)
        # Each segment's scales are those of quantizing the segment alone.
        plain = u.from_blocked_stacked(s.cpu(), m_sizes.cpu(), 96 // group)
        dense = u.quantize_mx4(x[: sum(sizes)].cpu(), group, u.RoundingMode.ceil, "plain")[1]
        assert torch.equal(plain, dense)


def test_mx4_stacked_sizes_past_int32():
    """An int64 size of 2^31 or more is summed as the reference sums it (the kernel once cut it to 32 bits:
    2^32 + 2 rows became 2)."""
    m_sizes = torch.tensor([3, 2**32 + 2, 4], device=DEVICE)
    x = testing.randn(9, 64, dtype=torch.bfloat16, device=DEVICE, std=3.0)
    q, s = fp4.quantize_mx4_stacked_op.get_backend("triton").impl(m_sizes, x, 32)
    rq, rs = fp4._mx4_stacked_reference(m_sizes.cpu(), x.cpu(), 32)
    assert torch.equal(q.cpu(), rq) and torch.equal(s.cpu(), rs)


@pytest.mark.parametrize("sizes", STACKS, ids=str)
@pytest.mark.parametrize("mode", ["none", "per segment", "per token"])
def test_nvfp4_stacked_kernel_matches_reference(sizes, mode):
    m_sizes = torch.tensor(sizes, device=DEVICE)
    x = testing.randn(sum(sizes), 64, dtype=torch.bfloat16, device=DEVICE, std=2.0)
    if mode == "per token":
        q, s, inv = fp4.quantize_nvfp4_stacked_token_scale_op.get_backend("triton").impl(m_sizes, x)
        rq, rs, rinv = fp4._token_reference(m_sizes.cpu(), x.cpu())
        assert torch.equal(inv.cpu(), rinv)
    else:
        args = (m_sizes, x) if mode == "none" else (m_sizes, x, fp4.calculate_group_max(x, m_sizes)[0])
        q, s = fp4.quantize_nvfp4_stacked_op.get_backend("triton").impl(*args)
        rq, rs = u.quantize_nvfp4_stacked(*(a.cpu() for a in args))
    testing.assert_fp8_equal(s.cpu(), rs, what="scale")
    if not testing.interpreting():  # the interpreter's e4m3 rounding moves some scales and their elements
        assert torch.equal(q.cpu(), rq)
    if mode == "per segment" and not testing.interpreting():  # segment g equals dense NVFP4 with gs[g]
        start = 0
        for g, size in enumerate(sizes):
            dq, _ = fp4.quantize_nvfp4_op.get_backend("triton").impl(x[start : start + size], args[2][g : g + 1])
            assert torch.equal(q[start : start + size], dq)
            start += size


@pytest.mark.parametrize("shape", [(5, 3000), (130, 64), (1, 16), (0, 32)], ids=str)
def test_row_abs_max_kernel(shape):
    x = testing.randn(*shape, dtype=torch.bfloat16, device=DEVICE, std=5.0)
    if shape[0] > 2:
        x[1, 7], x[2] = float("nan"), 0.0
    for inp in (x, x[:, ::2]):
        got = fp4._row_abs_max(inp)
        torch.testing.assert_close(
            got.cpu(), inp.cpu().float().abs().amax(-1) if inp.numel() else got.cpu(), rtol=0, atol=0, equal_nan=True
        )


def test_stacked_strided_metadata():
    sizes = torch.tensor([[5, 1], [0, 1], [130, 1], [1, 1]], device=DEVICE)[:, 0]  # a strided m_sizes view
    x = testing.randn(136, 64, dtype=torch.bfloat16, device=DEVICE)
    gs = torch.stack([fp4.calculate_group_max(x, sizes)[0]] * 2, 1)[:, 0]  # and a strided global scale
    q, s = fp4.quantize_nvfp4_stacked_op.get_backend("triton").impl(sizes, x, gs)
    rq, rs = fp4.quantize_nvfp4_stacked_op.get_backend("triton").impl(sizes.contiguous(), x, gs.contiguous())
    assert torch.equal(q, rq) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8))


def test_nvfp4_token_scale_round_trip():
    m_sizes = torch.tensor([70, 0, 58], device=DEVICE)
    x = testing.randn(128, 64, dtype=torch.bfloat16, device=DEVICE) * torch.logspace(-3, 3, 128, device=DEVICE)[:, None]
    q, s, inv = fp4.nvfp4_quantize_stacked_with_token_scale(m_sizes, x)
    expect = x.float().abs().amax(-1).clamp(min=1e-8) / 2688.0
    assert inv.shape == (128,) and torch.allclose(inv, expect, rtol=1e-6, atol=0)
    assert torch.equal(inv, u.token_scale_inv_nvfp4(x)), "the kernel's row amax equals the reference's"
    plain = u.from_blocked_stacked(s.view(torch.uint8).cpu(), m_sizes.cpu(), 4).view(torch.float8_e4m3fn)
    back = u.scale_nvfp4(u.fp4_to_float(q.cpu()), plain) * inv.cpu()[:, None]  # gs = 1, then per row
    testing.assert_rel_close(back, x.cpu().float(), 0.15)  # rows spanning 6 decades, each at NVFP4 accuracy


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: fp4.quantize_mx4_stacked(torch.ones(2, 2, dtype=torch.int64), torch.ones(4, 32)), "1-D int64"),
        (lambda: fp4.quantize_mx4_stacked(torch.ones(2), torch.ones(4, 32)), "1-D int64"),
        (  # its own name (the plain stacked op's was given)
            lambda: fp4.nvfp4_quantize_stacked_with_token_scale(torch.ones(2), torch.ones(4, 32)),
            "quantize_nvfp4_stacked_token_scale: m_sizes must be a 1-D int64",
        ),
        (lambda: fp4.quantize_mx4_stacked(torch.tensor([4]), torch.ones(4, 40)), "multiple of the group size 32"),
        (
            lambda: fp4.nvfp4_quantize_stacked(torch.tensor([2, 2]), torch.ones(4, 32), torch.ones(3)),
            r"global_scale must be float32 \[G\], one value per segment \(2,",
        ),
        (
            lambda: fp4.nvfp4_quantize_stacked(torch.tensor([2, 2]), torch.ones(4, 32), torch.ones(1, 2)),
            r"global_scale must be float32 \[G\]",
        ),
        (lambda: fp4.quantize_mx4_stacked(torch.tensor([4]), torch.ones(4, 32), 0), "group_size must be 32"),
        (lambda: fp4.triton_quantize_mx4_unpack(torch.ones(4, 32), group_size=0), "group_size must be 32"),
        (lambda: fp4.calculate_group_max(torch.ones(4, 32), torch.tensor([[4]])), "1-D int64"),
    ],
)
def test_stacked_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_stacked_compile_and_export():
    class Quantize(torch.nn.Module):
        def forward(self, m_sizes, x):
            return fp4.quantize_mx4_stacked(m_sizes, x), fp4.nvfp4_quantize_stacked_with_token_scale(m_sizes, x)

    args = (torch.tensor([3, 0, 5]), testing.randn(8, 64, dtype=torch.bfloat16))
    (q, s), (_, ns, _inv) = torch.compile(Quantize(), fullgraph=True, backend="aot_eager")(*args)
    assert q.shape == (8, 32) and s.shape == ((8 + 3 * 127) * 4,) and ns.shape == ((8 + 3 * 127) * 4,)
    graph = str(torch.export.export(Quantize(), args).graph)
    assert "mslk.quantize_mx4_stacked" in graph and "mslk.quantize_nvfp4_stacked_token_scale" in graph


def test_reference_module_paths():
    from mslk.quantize.triton.quantize_kernels import mx4, mx4_stacked, nvfp4

    x = testing.randn(4, 64)
    (q, s), (rq, rs) = mx4.quantize_mx4(x, 16), fp4.triton_quantize_mx4_unpack(x, 16)
    assert torch.equal(q, rq) and torch.equal(s, rs)
    assert mx4_stacked.quantize_mx4_stacked is fp4.quantize_mx4_stacked
    assert nvfp4.quantize_nvfp4 is fp4.triton_quantize_nvfp4
