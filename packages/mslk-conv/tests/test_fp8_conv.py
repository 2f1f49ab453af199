"""FP8 3-D convolution (spec C-01): f8f8bf16_conv.

T0: the reference against a direct sum over the taps, errors before any kernel, the fake kernel's shapes and
layouts, compile. T1 (CPU, interpreter; small shapes) and T2 (GPU; larger): the Triton kernel against the float64
convolution with odd sizes, padding, strides and dilations, 1 x 1 x 1 filters, fewer channels than a block, more
output channels than a tile, NCDHW / KCTRS inputs in channels_last_3d memory, strided inputs, poisoned allocations,
empty batches.
"""

import pytest
import torch

import mslk.conv  # noqa: F401  (registers the op)
from mslk.conv.triton import fp8_conv as fc
from mslk.core import formats, testing

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 output: its rounding alone is about 0.0017 here; the interpreter's FP8 products add about as much again
TOL = 1e-2


def kernel(*args):
    """The op's Triton backend itself (on a CPU it runs under the interpreter)."""
    return fc.f8f8bf16_conv_op.get_backend("triton").impl(*args)


def direct(x, w, scale, padding, stride, dilation):
    """float64 NDHWC output of NDHWC x and KTRSC w as the sum over taps of strided slices of the zero-padded input
    (no convolution routine: the check of the reference)."""
    x, w = x.double(), w.double()
    (pd, ph, pw), (sd, sh, sw), (dd, dh, dw) = padding, stride, dilation
    xp = torch.nn.functional.pad(x, (0, 0, pw, pw, ph, ph, pd, pd))
    t_, r_, s_ = w.shape[1:4]
    z_, p_, q_ = (
        (size + 2 * pad - (taps - 1) * dil - 1) // st + 1
        for size, pad, taps, dil, st in zip(x.shape[1:4], padding, (t_, r_, s_), dilation, stride, strict=True)
    )
    out = torch.zeros(x.shape[0], z_, p_, q_, w.shape[0], dtype=torch.float64, device=x.device)
    for t in range(t_):
        for r in range(r_):
            for s in range(s_):
                window = xp[
                    :,
                    t * dd : t * dd + (z_ - 1) * sd + 1 : sd,
                    r * dh : r * dh + (p_ - 1) * sh + 1 : sh,
                    s * dw : s * dw + (q_ - 1) * sw + 1 : sw,
                ]
                out += torch.einsum("nzpqc,kc->nzpqk", window, w[:, t, r, s])
    return out * float(scale)


def inputs(n, d, h, w, c, k, taps, device=DEVICE):
    x, f = fc.random_fp8(n, d, h, w, c, device=device), fc.random_fp8(k, *taps, c, device=device)
    return x, f, torch.rand((), device=device) * 1e-2 + 1e-3


# (N, D, H, W, C, K, taps, padding, stride, dilation)
CASES = [
    (2, 5, 6, 7, 24, 20, (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1)),
    (1, 4, 9, 6, 40, 36, (2, 3, 1), (0, 2, 1), (2, 1, 3), (1, 2, 1)),
    (3, 2, 3, 3, 70, 17, (1, 1, 1), (0, 0, 0), (1, 1, 1), (1, 1, 1)),  # pointwise; C past one 64-block
    (1, 3, 5, 11, 3, 8, (1, 2, 2), (0, 1, 0), (1, 2, 2), (1, 1, 1)),  # 3 channels (an RGB patch embedding)
    (1, 6, 5, 5, 16, 140, (3, 1, 3), (2, 0, 1), (1, 1, 2), (2, 1, 1)),  # two channel tiles; taps past the input
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_is_the_direct_sum(case):
    n, d, h, w, c, k, taps, padding, stride, dilation = case
    x, f, scale = inputs(n, d, h, w, c, k, taps, device="cpu")
    out = fc.f8f8bf16_conv_op.reference(x, f, scale, list(padding), list(stride), list(dilation))
    assert out.dtype == torch.bfloat16
    testing.assert_rel_close(out, direct(x, f, scale, padding, stride, dilation), 4e-3)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel(case, monkeypatch):
    n, d, h, w, c, k, taps, padding, stride, dilation = case
    x, f, scale = inputs(n, d, h, w, c, k, taps)
    empty = torch.empty  # allocations come poisoned (NaN): an unwritten element shows
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: testing.poison_(empty(*args, **kwargs)))
    out = kernel(x, f, scale, list(padding), list(stride), list(dilation))
    monkeypatch.undo()
    expected = direct(x, f, scale, padding, stride, dilation)
    assert out.shape == expected.shape and out.is_contiguous()
    testing.assert_rel_close(out, expected, TOL)


def test_channels_last_3d_layouts():
    """NCDHW / KCTRS tensors in channels_last_3d memory (as torch.nn.Conv3d keeps them) are the same bytes read as
    NDHWC / KTRSC; the output comes as the activation did. Mixed conventions work too."""
    x, f, scale = inputs(2, 3, 5, 4, 24, 12, (3, 2, 3))
    args = ([1, 0, 1], [1, 2, 1], [1, 1, 1])
    expected = kernel(x, f, scale, *args)
    x_ncdhw, f_kctrs = x.permute(0, 4, 1, 2, 3), f.permute(0, 4, 1, 2, 3)
    assert x_ncdhw.is_contiguous(memory_format=torch.channels_last_3d)
    out = kernel(x_ncdhw, f_kctrs, scale, *args)
    assert out.shape == (2, 12, *expected.shape[1:4]) and out.is_contiguous(memory_format=torch.channels_last_3d)
    assert torch.equal(out.permute(0, 2, 3, 4, 1), expected)
    assert torch.equal(kernel(x, f_kctrs, scale, *args), expected)
    reference = fc.f8f8bf16_conv_op.reference(x_ncdhw, f_kctrs, scale, *args)
    assert reference.shape == out.shape and reference.stride() == out.stride()


def test_pointwise_filter_of_conv3d():
    """A pointwise filter as torch.nn.Conv3d keeps it, [K, C, 1, 1, 1] (contiguous, and channels_last_3d as well):
    read as KCTRS, whichever convention the activation takes."""
    x, f, scale = inputs(2, 3, 4, 5, 40, 24, (1, 1, 1))
    weight = f.permute(0, 4, 1, 2, 3).contiguous()  # [K, C, 1, 1, 1]
    assert weight.is_contiguous() and weight.is_contiguous(memory_format=torch.channels_last_3d)
    args = ([0, 0, 0], [1, 1, 1], [1, 1, 1])
    expected = direct(x, f, scale, *args)
    testing.assert_rel_close(kernel(x, weight, scale, *args), expected, TOL)
    out = kernel(x.permute(0, 4, 1, 2, 3), weight, scale, *args)
    testing.assert_rel_close(out.permute(0, 2, 3, 4, 1), expected, TOL)
    reference = fc.f8f8bf16_conv_op.reference(x.permute(0, 4, 1, 2, 3), weight, scale, *args)
    assert reference.shape == out.shape == (2, 24, 3, 4, 5)


def test_single_channel_ncdhw():
    """One channel: an NCDHW activation and a KCTRS filter (channels_last_3d memory) fit both readings each. The
    activation read as NCDHW reads the filter as KCTRS: its taps (1, 2, 1) once came as KTRSC's (1, 1, 2), a wrong
    output shape and values (or a refused input, where those taps did not fit the padded input)."""
    x, f, scale = inputs(1, 3, 4, 5, 1, 19, (1, 2, 1))
    args = ([2, 1, 2], [1, 1, 1], [1, 1, 1])
    expected = direct(x, f, scale, *args)
    x_ncdhw, f_kctrs = x.permute(0, 4, 1, 2, 3), f.permute(0, 4, 1, 2, 3)
    assert all(t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d) for t in (x_ncdhw, f_kctrs))
    for call in (kernel, fc.f8f8bf16_conv_op.reference):
        out = call(x_ncdhw, f_kctrs, scale, *args)
        assert out.shape == (1, 19, *expected.shape[1:4])
        testing.assert_rel_close(out.permute(0, 2, 3, 4, 1), expected, TOL)


def test_strided_inputs():
    """Views with gaps between rows and channels (a slice of a wider tensor, every other channel)."""
    wide = fc.random_fp8(2, 4, 5, 9, 64, device=DEVICE)
    x = wide[:, :, :, 1:8, ::2]  # [2, 4, 5, 7, 32], channel stride 2
    f = fc.random_fp8(10, 3, 3, 3, 48, device=DEVICE)[..., 8:40]
    scale = torch.full((), 3e-3, device=DEVICE)
    args = ([1, 1, 1], [1, 1, 1], [1, 1, 1])
    out = kernel(x, f, scale, *args)
    testing.assert_rel_close(out, direct(x, f, scale, *args), TOL)
    assert torch.equal(out, kernel(x.contiguous(), f.contiguous(), scale, *args))


@pytest.mark.parametrize("impl", [kernel, fc.f8f8bf16_conv_op.reference], ids=["kernel", "reference"])
def test_empty(impl):
    """No batch or no filters: an empty output without a launch; no channels: zeros (the empty sum). The reference
    alike (conv3d refuses all three)."""
    for n, c, k, empty in ((0, 32, 8, True), (1, 32, 0, True), (1, 0, 8, False)):
        x, f, scale = inputs(n, 3, 4, 4, c, k, (1, 1, 1))
        out = impl(x, f, scale, [0, 0, 0], [1, 1, 1], [1, 1, 1])
        assert out.shape == (n, 3, 4, 4, k) and out.dtype == torch.bfloat16
        assert (out.numel() == 0) == empty and not out.any()


def test_fake_kernel_matches():
    x, f, scale = inputs(1, 4, 9, 6, 40, 36, (2, 3, 1))
    args = ([0, 2, 1], [2, 1, 3], [1, 2, 1])
    for a, b in ((x, f), (x.permute(0, 4, 1, 2, 3), f)):
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fakes = (mode.from_tensor(t) for t in (a, b, scale))
            faked = torch.ops.mslk.f8f8bf16_conv(*fakes, *args)
        out = kernel(a, b, scale, *args)
        assert faked.shape == out.shape and faked.stride() == out.stride() and faked.dtype == out.dtype


def test_compiles():
    x, f, scale = inputs(1, 3, 4, 5, 32, 16, (3, 3, 3))
    args = ([1, 1, 1], [1, 1, 1], [1, 1, 1])
    compiled = torch.compile(lambda a, b, s: fc.f8f8bf16_conv(a, b, s, *args), fullgraph=True, backend="eager")
    assert torch.equal(compiled(x, f, scale), fc.f8f8bf16_conv(x, f, scale, *args))


def _bad_inputs():
    x, f, scale = inputs(1, 4, 4, 4, 32, 8, (3, 3, 3), device="cpu")
    ok = ([1, 1, 1], [1, 1, 1], [1, 1, 1])
    bf16 = x.to(torch.bfloat16)
    return [
        ("bf16 activation", (bf16, f, scale, *ok), formats.ScaleFormatError, "expected torch.float8_e4m3fn"),
        ("4-D filter", (x, f[0], scale, *ok), ValueError, "expected a 5-D activation"),
        ("channels", (x, f[..., :16], scale, *ok), ValueError, "the activation has 32 channels and the filter 16"),
        ("padding", (x, f, scale, [1, 1], [1, 1, 1], [1, 1, 1]), ValueError, r"padding must be 3 ints"),
        ("stride 0", (x, f, scale, [1, 1, 1], [1, 0, 1], [1, 1, 1]), ValueError, r"stride must be 3 ints"),
        ("negative padding", (x, f, scale, [-1, 0, 0], [1, 1, 1], [1, 1, 1]), ValueError, "padding must"),
        ("too small", (x, f, scale, [0, 0, 0], [1, 1, 1], [1, 3, 1]), ValueError, r"no positions \(\[Z, P, Q\]"),
        ("scale [2]", (x, f, torch.ones(2), *ok), formats.ScaleFormatError, "scale must be one float32 value"),
        ("bf16 scale", (x, f, scale.bfloat16(), *ok), formats.ScaleFormatError, "scale must be one float32"),
        ("devices", (x, f.to("meta"), scale, *ok), ValueError, "all tensors must be on one device"),
    ]


@pytest.mark.parametrize(("what", "args", "error", "match"), _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_errors(what, args, error, match):
    with pytest.raises(error, match=match):
        fc.f8f8bf16_conv(*args)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [
        (2, 8, 28, 28, 128, 192, (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1)),
        (1, 9, 30, 31, 96, 64, (3, 3, 3), (1, 1, 1), (2, 2, 2), (1, 1, 1)),
        (2, 8, 14, 14, 512, 512, (1, 1, 1), (0, 0, 0), (1, 1, 1), (1, 1, 1)),
        (1, 8, 64, 64, 3, 256, (2, 8, 8), (0, 0, 0), (2, 8, 8), (1, 1, 1)),
        (1, 7, 17, 19, 40, 72, (3, 3, 3), (2, 2, 2), (1, 1, 1), (2, 2, 2)),
    ],
    ids=str,
)
def test_kernel_gpu(case):
    """Larger convolutions on the GPU against the float64 one (cuDNN's double convolution)."""
    n, d, h, w, c, k, taps, padding, stride, dilation = case
    x, f, scale = inputs(n, d, h, w, c, k, taps, device="cuda")
    out = kernel(x, f, scale, list(padding), list(stride), list(dilation))
    testing.assert_rel_close(out, fc._reference(x, f, scale, list(padding), list(stride), list(dilation)), TOL)


def test_quantized_pipeline():
    """bf16 tensors quantized tensorwise (`quantize_fp8_tensor`), convolved with the product of their scales: the
    bf16 convolution, up to FP8's rounding."""
    quantize = pytest.importorskip("mslk.quantize.triton.fp8_quantize")
    x = testing.randn(1, 4, 6, 5, 48, dtype=torch.bfloat16, device=DEVICE)
    w = testing.randn(24, 3, 3, 3, 48, dtype=torch.bfloat16, device=DEVICE)
    (xq, x_scale), (wq, w_scale) = quantize.quantize_fp8_tensor(x), quantize.quantize_fp8_tensor(w)
    out = kernel(xq, wq, x_scale * w_scale, [1, 1, 1], [1, 1, 1], [1, 1, 1])
    expected = torch.nn.functional.conv3d(
        x.double().permute(0, 4, 1, 2, 3), w.double().permute(0, 4, 1, 2, 3), padding=1
    )
    testing.assert_rel_close(out, expected.permute(0, 2, 3, 4, 1), 0.08)
