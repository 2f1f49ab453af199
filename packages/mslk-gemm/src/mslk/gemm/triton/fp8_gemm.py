"""FP8 GEMM module of mslk.gemm (the FP8 GEMM kernels land here).

For now it holds only the MXFP8 quantizer `to_mxfp8` (spec Q-26 / G-52), which lives in this module
because the reference library puts it here; it imports nothing from mslk.quantize, so mslk-gemm works alone.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
_INPUT_DTYPES = (torch.bfloat16, torch.float32, torch.float16)
# fp32 mantissa bits of 1.75 (448 = 1.75 · 2^8): an amax whose mantissa is above it needs one more exponent.
_MANTISSA_1_75 = 0x600000
_E8M0_NAN = 255


def to_mxfp8(data_hp: torch.Tensor, block_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to MXFP8: OCP e4m3fn elements with one E8M0 scale per `block_size` elements along the last dim.

    Args:
        data_hp: bf16 or fp32 (fp16 also works) tensor [..., K], K divisible by `block_size`; any strides.
        block_size: elements per scale block (positive; MX uses 32).

    Returns:
        `(scale, data)`, in that order (unlike the other quantizers): `scale` float8_e8m0fnu [..., K/block_size]
        (the plain layout, `mslk.core.formats.MX(block_size, "plain", "fp8")` for 2-D+ data and blocks 16/32)
        and `data` float8_e4m3fn of data_hp's shape (OCP e4m3fn on every platform, ROCm gfx942 included),
        with `data_hp ≈ data · scale` blockwise.

    Per block: amax = max |x|; scale = 2^ceil(log2(amax / 448)) ("RCEIL"), derived exactly from the fp32 bits of
    amax (no division or log2 to round), clamped below to 2^-127, the smallest E8M0 value; data =
    clamp(x / scale, -448, 448) rounded to nearest even. The largest |data| of a block is thus in [224, 448]
    unless the scale is clamped. An all-zero block gets scale 2^-127 and zero data. A block holding NaN or
    ±Inf gets the NaN scale (0xFF) and NaN data throughout; other blocks are unaffected.
    """
    if not isinstance(data_hp, torch.Tensor):
        raise ValueError(f"to_mxfp8: data_hp must be a torch.Tensor, got {type(data_hp).__name__}")
    if data_hp.dtype not in _INPUT_DTYPES:
        raise ValueError(f"to_mxfp8: data_hp must be bfloat16, float32 or float16, got {data_hp.dtype}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"to_mxfp8: block_size must be a positive int, got {block_size!r}")
    if data_hp.dim() < 1 or data_hp.shape[-1] % block_size:
        raise ValueError(
            f"to_mxfp8: data_hp must be [..., K] with K divisible by block_size={block_size}, "
            f"got shape {tuple(data_hp.shape)}"
        )

    # Contiguous first so that both outputs come out contiguous; widening to fp32 is exact. Detached since
    # the dtype views below refuse tensors that require grad.
    x = data_hp.detach().contiguous().float()
    blocks = x.unflatten(-1, (x.shape[-1] // block_size, block_size))
    amax = blocks.abs().amax(dim=-1)  # NaN propagates

    # amax = 1.m · 2^E, so amax / 448 = (1.m / 1.75) · 2^(E-8) and ceil(log2) = E - 8 + (1.m > 1.75).
    # In biased terms the E8M0 byte is the biased fp32 exponent minus 8, plus that carry; zero and fp32
    # subnormal amax (biased exponent 0) land below 0 and clamp to 0 (2^-127).
    bits = amax.view(torch.int32)
    biased = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > _MANTISSA_1_75).to(torch.int32)
    finite = amax.isfinite()
    scale_byte = torch.where(finite, biased.clamp(min=0), _E8M0_NAN)

    # 2^-e built from bits: biased fp32 exponent 127 - e = 254 - byte, at least 254 - 247 = 7 for finite fp32,
    # so always a normal fp32 and multiplying by it is exact (a division by a power of two).
    inv_scale = ((254 - scale_byte.clamp(max=254)) << 23).view(torch.float32)
    inv_scale = torch.where(finite, inv_scale, torch.nan)
    data = (blocks * inv_scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)

    scale = scale_byte.to(torch.uint8).view(torch.float8_e8m0fnu)
    return scale, data.flatten(-2)
