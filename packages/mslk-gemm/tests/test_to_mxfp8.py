"""to_mxfp8 (spec Q-26 / G-52): exact RCEIL scales and e4m3fn data, round trip, shapes, strides and errors."""

from __future__ import annotations

import pytest
import torch

from mslk.core import formats
from mslk.core.testing import assert_fp8_equal, assert_rel_close, padded_rows, randn
from mslk.gemm.triton.fp8_gemm import to_mxfp8

E4M3_MAX = 448.0
DTYPES = [torch.bfloat16, torch.float32]
SHAPES = [(1, 32), (7, 64), (5, 96), (3, 5, 128), (64,), (33, 256), (0, 64)]


def ref_mxfp8(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent reference in float64 (finite inputs): exponent from frexp of amax / 448, data x / 2^e.
    amax / 448 in float64 is exactly 2^k when amax = 448 · 2^k and strictly above it otherwise, so
    ceil(log2) = ex - 1 when the frexp mantissa is exactly 0.5, else ex."""
    blocks = x.double().unflatten(-1, (x.shape[-1] // block_size, block_size))
    mantissa, ex = torch.frexp(blocks.abs().amax(-1) / E4M3_MAX)
    e = torch.where(mantissa == 0.5, ex - 1, ex)
    e = torch.where(mantissa == 0, -127, e).clamp(min=-127)  # zero blocks (frexp gives 0, 0): the smallest scale
    data = (blocks / torch.exp2(e.double()).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    # data is x/2^e of fp32 x, exact in fp32, so the fp8 cast rounds once.
    return (e + 127).to(torch.uint8), data.float().to(torch.float8_e4m3fn).flatten(-2)


def dequant(scale: torch.Tensor, data: torch.Tensor, block_size: int) -> torch.Tensor:
    return data.double() * scale.double().repeat_interleave(block_size, dim=-1)


def check_against_ref(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale, data = to_mxfp8(x, block_size)
    assert scale.dtype == torch.float8_e8m0fnu and data.dtype == torch.float8_e4m3fn
    assert scale.shape == (*x.shape[:-1], x.shape[-1] // block_size) and data.shape == x.shape
    assert scale.is_contiguous() and data.is_contiguous() and scale.device == data.device == x.device
    ref_scale, ref_data = ref_mxfp8(x.cpu(), block_size)
    assert torch.equal(scale.view(torch.uint8).cpu(), ref_scale)
    assert_fp8_equal(data.cpu(), ref_data, what="data")
    return scale, data


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_random(shape, dtype, block_size):
    # Elements of very different magnitudes, so the scales span many exponents and blocks hold tiny values.
    x = (randn(*shape) * torch.exp2(torch.randint(-30, 30, shape).float())).to(dtype)
    scale, data = check_against_ref(x, block_size)
    if x.dim() >= 2:
        formats.MX(block_size, "plain", "fp8").check(data, scale)

    # Round trip: e4m3 keeps 3 mantissa bits, so a normal value is off by at most half an ulp, 2^-4 · |x|;
    # below e4m3's normals (2^-6 · scale) the step is fixed, 2^-9 · scale, so at most 2^-10 · scale off.
    x64, s64 = x.double(), scale.double().repeat_interleave(block_size, dim=-1)
    err = (dequant(scale, data, block_size) - x64).abs()
    bound = 2**-4 * x64.abs() + 2**-10 * s64
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    if x.numel():
        assert_rel_close(dequant(scale, data, block_size), x64, tol=2**-4)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_properties(dtype, block_size):
    x = (randn(9, 8 * block_size) * torch.exp2(torch.randint(-20, 20, (9, 1)).float())).to(dtype)
    scale, data = to_mxfp8(x, block_size)
    # Powers of two: e8m0 decodes to exactly 2^(byte - 127), and byte 255 (NaN) never appears here.
    byte = scale.view(torch.uint8).int()
    assert (byte < 255).all()
    assert torch.equal(scale.double(), torch.exp2(byte.double() - 127))
    # Each block's largest |data| is in [224, 448] (224.x rounds to 224 in e4m3, so 224 is reachable).
    block_max = data.float().abs().unflatten(-1, (-1, block_size)).amax(-1)
    assert ((block_max >= 224) & (block_max <= E4M3_MAX)).all(), block_max


def _bytes(scale: torch.Tensor) -> list[int]:
    return scale.view(torch.uint8).flatten().tolist()


def test_hand_computed_blocks():
    bs = 32
    at = 448.0 * 2**3
    above = torch.nextafter(torch.tensor(at), torch.tensor(float("inf"))).item()
    below = torch.nextafter(torch.tensor(at), torch.tensor(0.0)).item()
    x = randn(6, bs).clamp(-1, 1)  # |x| <= 1 everywhere, so the planted values are each block's amax
    x[0, 5] = at  # exactly 448 · 2^3: scale 2^3, data exactly 448
    x[1, 7] = -above  # just above: scale 2^4, data 224.0001 rounds to 224
    x[2, 0] = below  # just below: scale 2^3, 447.9999 rounds to 448
    x[3] = 0.0  # zero block: smallest scale, zero data, no NaN
    x[4, 9] = torch.finfo(torch.float32).max  # largest fp32: ceil(log2(1.99·2^127 / 448)) = 120
    x[5] = x[5] * 2.0**-140  # amax far below 448 · 2^-127: scale clamps to 2^-127, data x · 2^127
    scale, data = check_against_ref(x, bs)
    assert _bytes(scale) == [127 + 3, 127 + 4, 127 + 3, 0, 127 + 120, 0]
    d = data.float()
    assert d[0, 5] == 448 and d[1, 7] == -224 and d[2, 0] == 448 and d[4, 9] == 256
    assert torch.equal(d[3], torch.zeros(bs)) and not d.isnan().any()
    assert torch.equal(d[5], (x[5].double() * 2.0**127).float().to(torch.float8_e4m3fn).float())
    assert d[5].abs().max() < 224  # the clamped scale is larger than RCEIL's, so the block stays small


def test_saturating_rounding():
    # Values just under 448 · scale round up to 448 exactly and never beyond (no NaN, no overflow).
    x = torch.full((1, 32), 447.99, dtype=torch.float32)
    x[0, 1::2] = -447.99
    scale, data = to_mxfp8(x)
    assert _bytes(scale) == [127]
    assert torch.equal(data.float().abs(), torch.full((1, 32), 448.0))


def test_nan_and_inf_blocks():
    x = randn(2, 96)
    x[0, 40] = float("nan")
    x[1, 70] = float("-inf")
    scale, data = to_mxfp8(x)
    assert _bytes(scale)[1] == 255 and _bytes(scale)[5] == 255
    d = data.float()
    assert d[0, 32:64].isnan().all() and d[1, 64:96].isnan().all()
    # The other blocks are untouched by them.
    clean = [(0, slice(0, 32), [0]), (0, slice(64, 96), [2]), (1, slice(0, 64), [0, 1])]
    for row, cols, blocks in clean:
        ref_scale, ref_data = to_mxfp8(x[row, cols].contiguous())
        assert _bytes(scale[row, blocks]) == _bytes(ref_scale)
        assert_fp8_equal(data[row, cols], ref_data, what="data")
        assert not d[row, cols].isnan().any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous(dtype):
    x = randn(12, 64, dtype=dtype)
    ref_scale, ref_data = to_mxfp8(x)
    # Padded rows, column-major, and a last-dim stride of 2.
    for view in (padded_rows(x), x.t().contiguous().t(), torch.stack([x, -x], dim=-1)[..., 0]):
        assert not view.is_contiguous() and torch.equal(view, x)
        scale, data = to_mxfp8(view)
        assert scale.is_contiguous() and data.is_contiguous()
        assert torch.equal(scale.view(torch.uint8), ref_scale.view(torch.uint8))
        assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))


def test_fp16_and_grad():
    x = randn(4, 64, dtype=torch.float16).requires_grad_()
    check_against_ref(x.detach(), 32)
    scale, data = to_mxfp8(x)
    assert not scale.requires_grad and not data.requires_grad and data.shape == x.shape


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.ones(4, 32, dtype=torch.int32),), "data_hp must be bfloat16, float32 or float16, got torch.int32"),
        ((torch.ones(4, 32).to(torch.float8_e4m3fn),), "data_hp must be .* got torch.float8_e4m3fn"),
        ((torch.ones(4, 32).numpy(),), "data_hp must be a torch.Tensor, got ndarray"),
        ((torch.ones(4, 48), 32), r"data_hp must be .* with K divisible by block_size=32, got shape \(4, 48\)"),
        ((torch.tensor(1.0),), r"data_hp must be .* with K divisible by block_size=32, got shape \(\)"),
        ((torch.ones(4, 32), 0), "block_size must be a positive int, got 0"),
        ((torch.ones(4, 32), -32), "block_size must be a positive int, got -32"),
        ((torch.ones(4, 32), 32.0), "block_size must be a positive int, got 32.0"),
    ],
)
def test_errors(args, match):
    with pytest.raises(ValueError, match=f"to_mxfp8: {match}"):
        to_mxfp8(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_matches_cpu(dtype):
    x = (randn(129, 512) * torch.exp2(torch.randint(-30, 30, (129, 512)).float())).to(dtype)
    x[3, :32] = 0.0
    scale, data = check_against_ref(x.cuda(), 32)
    cpu_scale, cpu_data = to_mxfp8(x)
    assert torch.equal(scale.view(torch.uint8).cpu(), cpu_scale.view(torch.uint8))
    assert torch.equal(data.view(torch.uint8).cpu(), cpu_data.view(torch.uint8))
