"""NVFP4 fake quantization (spec Q-15): bf16 -> NVFP4 -> bf16 in one pass, to train or evaluate with NVFP4's
rounding noise, bit-identical to the reference library; and `cal_global_scale_mx4_as_nvfp4`.

Registered as `torch.ops.mslk.fake_quantize_nvfp4` (the reference below is the CPU kernel and the oracle);
`triton_fake_quantize_nvfp4_per_tensor` calls it. The flat input is cut into blocks of 16 elements (the
last may be partial). With block amax b and global amax g, a block is invalid when b or g is 0, inf or NaN
(scale = inv_scale = 1); otherwise, in fp64 where marked:

    two_level = 448 · fp32(6 / g)                         (fp64)
    t8        = e4m3(fp32(fp32(b / 6) · two_level))       (round to nearest even, saturating at 448)
    inv_scale = fp32(t8 / two_level)                      (the quotient in fp64)
    scale     = fp32(1 / (t8 / two_level + FLT_MIN))      (fp64)

and each element becomes `sign(x) · E2M1(|x| · scale) · inv_scale` (E2M1 rounds to nearest even, saturating
at 6; an inf or NaN element counts as 6; sign(x) = −1 only for x < 0), stored as bf16. NaN elements do not
count in b (the GPU's max drops NaN), but a NaN anywhere makes the computed g NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mslk.core import launch, registry, testing
from mslk.quantize.reference import abs_max
from mslk.quantize.triton import fp4_utils
from mslk.quantize.triton.common import e2m1_codes

FLT_MIN = 1.175494350822287508e-38  # C's FLT_MIN, 2^-126: keeps 1 / unscale finite when t8 is 0
_FLT_MIN = tl.constexpr(FLT_MIN)  # the same, readable in kernels
# 16-element blocks per program, with 4 warps (one block per thread): the best of 15 tiles measured on the
# H200 (2830 GB/s in + out at 16384², the copy runs at 4150; 256 blocks: 2340, 512: 1370).
_BLOCKS = 128


def _validate(input, static_scales=None, scale_ub=None):
    where = "fake_quantize_nvfp4"
    if input.dtype != torch.bfloat16:
        raise ValueError(f"{where}: input must be bfloat16, got {input.dtype}")
    if input.dim() < 2 or input.numel() == 0:
        raise ValueError(f"{where}: input must have at least 2 dimensions and elements, got shape {tuple(input.shape)}")
    for name, t in (("static_scales", static_scales), ("scale_ub", scale_ub)):
        if t is None:
            continue
        if t.numel() != 1:
            raise ValueError(f"{where}: {name} must hold exactly one value, got shape {tuple(t.shape)}")
        if t.device != input.device:
            raise ValueError(f"{where}: {name} is on {t.device}, the input is on {input.device}")
    if static_scales is not None and static_scales.dtype != torch.float32:
        raise ValueError(f"{where}: static_scales (the global amax) must be float32, got {static_scales.dtype}")


def _global_amax(x, static_scales=None, scale_ub=None) -> torch.Tensor:
    """The `scales` output, fp32 [1]: static_scales, else amax(|x|) bounded by scale_ub (kept on the device:
    no host sync, CUDA-graph safe). Like the reference library, scale_ub does not bound static_scales."""
    if static_scales is not None:
        return static_scales.reshape(1).clone()  # a new tensor: an op's outputs must not alias its inputs
    amax = abs_max(x).reshape(1)
    if scale_ub is not None:
        amax = torch.minimum(amax, scale_ub.reshape(1).float())  # NaN-propagating, as torch.min
    return amax


def _qdq_fp32(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The fake-quantized values of bf16 x before their rounding to bf16 (fp32, x's shape); g: fp32 [1]."""
    flat = x.reshape(-1).float()
    blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % 16)).reshape(-1, 16)  # zeros change no amax
    a = blocks.abs()
    b = torch.where(a.isnan(), 0.0, a).amax(dim=1)
    invalid = (b == 0) | ~b.isfinite() | (g == 0) | ~g.isfinite()
    # Tensor divisors: torch divides by a Python number through its reciprocal (a second rounding).
    local_unscale = b / torch.full_like(b, fp4_utils.FP4_E2M1_MAX)
    two_level = (torch.full_like(g, fp4_utils.FP4_E2M1_MAX) / g).double() * fp4_utils.FP8_E4M3_MAX
    t = (local_unscale.double() * two_level).float()
    t8 = t.clamp(-fp4_utils.FP8_E4M3_MAX, fp4_utils.FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
    unscale_q = t8.double() / two_level
    scale = torch.where(invalid, 1.0, (torch.ones_like(unscale_q) / (unscale_q + FLT_MIN)).float())
    inv_scale = torch.where(invalid, 1.0, unscale_q.float())
    scaled = torch.where(a.isfinite(), a * scale[:, None], fp4_utils.FP4_E2M1_MAX)
    magnitude = fp4_utils.e2m1_values(fp4_utils.e2m1_codes(scaled) & 7)  # scaled >= 0: magnitudes only
    out = torch.where(blocks < 0, -1.0, 1.0) * magnitude * inv_scale[:, None]
    return out.reshape(-1)[: flat.numel()].reshape(x.shape)


def _reference(input, static_scales=None, scale_ub=None):
    g = _global_amax(input, static_scales, scale_ub)
    return _qdq_fp32(input, g).to(torch.bfloat16), g


def _fake(input, static_scales=None, scale_ub=None):
    return input.new_empty(input.shape), input.new_empty(1, dtype=torch.float32)


def _samples(device):
    bf16 = torch.bfloat16
    x = testing.randn(64, 96, dtype=bf16, device=device, std=3.0)
    yield registry.Sample((x,))
    yield registry.Sample((testing.randn(7, 13, dtype=bf16, device=device),), name="partial last block")
    small = testing.randn(2, 3, 40, dtype=bf16, device=device, std=0.01)
    # Tensors go positionally: the conformance check moves args, not kwargs, to the CPU for the reference.
    yield registry.Sample((small, None, torch.full((1,), 0.02, device=device)), name="scale_ub")
    yield registry.Sample((x, torch.full((1,), 5.0, device=device)), name="static_scales")


fake_quantize_nvfp4_op = registry.Op(
    "mslk::fake_quantize_nvfp4(Tensor input, Tensor? static_scales=None, Tensor? scale_ub=None) -> (Tensor, Tensor)",
    domain="quantize",
    reference=_reference,
    fake=_fake,
    samples=_samples,
    validate=_validate,
    reference_devices=("cpu", "cuda"),
)


@triton.jit
def _valid(v):
    return (v != 0.0) & (tl.abs(v) < float("inf"))  # False for 0, ±inf and NaN


@triton.jit
def _round_to_e4m3(t):
    """fp32 values rounded to the nearest e4m3fn value (ties to even, saturating at ±448), as fp32. Done on
    the fp32 bits, because the interpreter's fp8 cast misrounds (DESIGN.md §4): with e = max(exponent of |t|,
    −6), e4m3's step at |t| is 2^(e−3), which is the ulp of |t| + 2^(e+20); adding that constant rounds."""
    m = tl.minimum(tl.abs(t), 448.0)
    e = tl.maximum(m.to(tl.int32, bitcast=True) >> 23, 121)  # biased; 121 = 127 − 6, the subnormal step
    c = ((e + 20) << 23).to(tl.float32, bitcast=True)
    r = (m + c) - c
    return tl.where(t < 0, -r, r)


@triton.jit
def _e2m1_magnitude(m):
    """m >= 0 (finite) rounded to the nearest E2M1 magnitude, ties to even, saturating at 6."""
    code = (e2m1_codes(m, False, 0, 0) & 7).to(tl.float32)  # 0, 0.5, 1, 1.5, 2, 3, 4, 6
    return tl.where(code < 4.0, code * 0.5, tl.where(code < 7.0, code - 2.0, 6.0))


@triton.jit
def _fake_quantize_nvfp4_kernel(x_ptr, y_ptr, amax_ptr, numel, BLOCKS: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * (BLOCKS * 16)
    offsets = start + tl.arange(0, BLOCKS)[:, None] * 16 + tl.arange(0, 16)[None, :]  # [BLOCKS, 16]
    mask = offsets < numel
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    a = tl.abs(x)
    b = tl.max(tl.where(a == a, a, 0.0), axis=1)  # [BLOCKS]; NaN dropped, as the GPU's max does
    g = tl.load(amax_ptr + tl.zeros([BLOCKS], tl.int32))  # [BLOCKS] copies: the interpreter can't `&` a scalar
    valid = _valid(b) & _valid(g)

    two_level = tl.div_rn(6.0, g).to(tl.float64) * 448.0
    t = (tl.div_rn(b, 6.0).to(tl.float64) * two_level).to(tl.float32)
    unscale_q = _round_to_e4m3(t).to(tl.float64) / two_level  # [BLOCKS], fp64 (IEEE division)
    scale = tl.where(valid, (1.0 / (unscale_q + _FLT_MIN)).to(tl.float32), 1.0)
    inv_scale = tl.where(valid, unscale_q.to(tl.float32), 1.0)

    scaled = tl.where(a < float("inf"), a * scale[:, None], 6.0)  # inf and NaN elements saturate
    y = tl.where(x < 0.0, -1.0, 1.0) * _e2m1_magnitude(scaled) * inv_scale[:, None]
    tl.store(y_ptr + offsets, y.to(tl.bfloat16), mask=mask)


def _launch(x: torch.Tensor, out: torch.Tensor, amax: torch.Tensor) -> None:
    """Fake-quantize contiguous bf16 x into contiguous out, reading the global amax (fp32 [1]) on the device."""
    grid = (launch.cdiv(x.numel(), _BLOCKS * 16),)
    launch.fast(_fake_quantize_nvfp4_kernel)[grid](x, out, amax, x.numel(), BLOCKS=_BLOCKS, num_warps=4)


@fake_quantize_nvfp4_op.backend("triton", available=registry.triton_missing)
def _fake_quantize_nvfp4_triton(input, static_scales=None, scale_ub=None):
    x = input.contiguous()
    amax = _global_amax(x, static_scales, scale_ub)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, out, amax)
    return out, amax


def triton_fake_quantize_nvfp4_per_tensor(
    input: torch.Tensor, static_scales: torch.Tensor | None = None, scale_ub: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 fake quantization (spec Q-15): bf16 input (>= 2-D) -> (bf16 values after an NVFP4 round trip,
    same shape; the global amax, fp32 [1]). The global amax is `static_scales` (float32, one value) if given,
    else amax(|input|) bounded by `scale_ub`; it stays on the device. Blocks of 16 consecutive elements in
    row-major order; see the module docstring for the exact arithmetic."""
    return torch.ops.mslk.fake_quantize_nvfp4(input, static_scales, scale_ub)


def cal_global_scale_mx4_as_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """The NVFP4 global scale with which native NVFP4 mimics MXFP4 (spec Q-15): `256 / e8m0(amax(|x|) / 4)`,
    i.e. 448 / e8m0(amax / 4) floored to a power of two, the E8M0 value rounded "even" (fp32, 0-dim)."""
    amax = abs_max(x)
    return 256.0 / fp4_utils.unsigned_fp32_to_e8m0(amax / 4.0, mbits=1, scale_round_mode="even")
