"""`fmha.kv_cache`: the quantized KV-cache formats `triton_splitk` reads (spec §7.7), written and read back in plain
PyTorch. Upstream keeps these quantizers in its tests; a cache writer needs them, so they are public here.

- int4: int32 [..., num_groups + D / 8]. For each group of D / num_groups elements an int32 holding the fp16 scale
  (max − min) / 15 in its low half and the fp16 shift (min) in its high half; then the codes
  round((x − shift) / scale) in [0, 15], element 8w + j in bits 4j of code word w. x = code · scale + shift.
- FP8 rows (`InputsFp8`): int32 [..., D / 4], element 4w + j in byte j of word w (the platform's e4m3 flavour),
  and one scale a row: int32 [...] packing the fp16 scale (low half) and shift (high half), x = fp8 · scale + shift;
  or, with `use_fp32_scales`, a float32 scale alone, x = fp8 · scale.

fp16 scales and shifts hold rows within fp16's range (|x| <= 65504: beyond it int4 rows come back inf and FP8 rows
NaN; FP8 rows can take fp32 scales instead), and a scale is at least fp16's smallest step, 2^-24, so that rows of
tiny values keep their codes. A NaN or inf in a row spoils its group (int4) or row (FP8).
"""

from __future__ import annotations

import torch

from mslk.core import arch

_SMALLEST_STEP = 2.0**-24  # fp16's smallest subnormal: a scale below it would round to 0 and lose the row's codes
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)  # the e4m3 flavours the kernels read


def _fp8(where: str, fp8_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """fp8_dtype, or the platform's e4m3 flavour where it is None."""
    if fp8_dtype is None:
        return arch.fp8_dtype(device)
    if fp8_dtype not in _FP8_DTYPES:
        raise ValueError(f"{where}: fp8_dtype must be one of {_FP8_DTYPES} (the FP8-row format), got {fp8_dtype}")
    return fp8_dtype


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as the int32 of the same bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _half_pair(scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """fp16 scale and shift as the int32 of their bits (scale in the low half)."""
    low, high = (t.view(torch.int16).to(torch.int64) & 0xFFFF for t in (scale, shift))
    return _as_int32(low | high << 16)


def _split_half_pair(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 values of the fp16 scale and shift packed in int32 (_half_pair's inverse)."""
    unsigned = packed.to(torch.int64) & 0xFFFFFFFF
    halves = [(unsigned >> s) & 0xFFFF for s in (0, 16)]
    scale, shift = (torch.where(h >= 2**15, h - 2**16, h).to(torch.int16).view(torch.float16).float() for h in halves)
    return scale, shift


def quantize_kv_int4(x: torch.Tensor, num_groups: int = 1) -> torch.Tensor:
    """x [..., D] (D a multiple of 8 · num_groups) in the int4 format, int32 [..., num_groups + D / 8];
    dequantize_kv_int4 inverts it to half a scale step (plus fp16 rounding)."""
    *lead, dim = x.shape
    if num_groups < 1 or dim == 0 or dim % (8 * num_groups):
        raise ValueError(
            f"quantize_kv_int4: the head dim {dim} must be a positive multiple of 8 · num_groups, num_groups >= 1 "
            f"(got {num_groups})"
        )
    groups = x.float().reshape(*lead, num_groups, dim // num_groups)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale, shift = ((high - low) / 15).clamp(min=_SMALLEST_STEP).to(torch.float16), low.to(torch.float16)
    steps = (groups - shift.float()) / scale.float()
    codes = steps.round().clamp(0, 15).to(torch.int64).reshape(*lead, dim // 8, 8)
    words = _as_int32((codes << (4 * torch.arange(8, device=x.device))).sum(-1))
    return torch.cat([_half_pair(scale, shift).squeeze(-1), words], dim=-1)


def dequantize_kv_int4(packed: torch.Tensor, num_groups: int = 1) -> torch.Tensor:
    """The fp32 [..., D] values of quantize_kv_int4's int32 [..., num_groups + D / 8]."""
    *lead, width = packed.shape
    dim = (width - num_groups) * 8
    if packed.dtype != torch.int32 or num_groups < 1 or dim <= 0 or dim % (8 * num_groups):
        raise ValueError(
            f"dequantize_kv_int4: expected quantize_kv_int4's int32 [..., num_groups + D / 8] with D a positive "
            f"multiple of 8 · num_groups, got {tuple(packed.shape)} {packed.dtype} and num_groups = {num_groups}"
        )
    scale, shift = _split_half_pair(packed[..., :num_groups])
    unsigned = packed[..., num_groups:].to(torch.int64) & 0xFFFFFFFF
    codes = (unsigned[..., None] >> (4 * torch.arange(8, device=packed.device))) & 0xF
    values = codes.reshape(*lead, num_groups, dim // num_groups).float()
    return (values * scale[..., None] + shift[..., None]).reshape(*lead, dim)


def quantize_kv_fp8(
    x: torch.Tensor, use_fp32_scales: bool = False, fp8_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (D a multiple of 4) as FP8 rows: (int32 [..., D / 4], scales [...]). Each row is centred on the
    midpoint of its range (the fp16 shift) and scaled so that its widest value is the FP8 maximum; with
    use_fp32_scales, not centred and the scale in float32. fp8_dtype: the platform's e4m3 flavour by default."""
    dim = x.shape[-1]
    if dim == 0 or dim % 4:
        raise ValueError(
            f"quantize_kv_fp8: the head dim {dim} must be a positive multiple of 4 (four FP8 values an int32)"
        )
    fp8_dtype = _fp8("quantize_kv_fp8", fp8_dtype, x.device)
    fp8_max = torch.finfo(fp8_dtype).max
    rows = x.float()
    if use_fp32_scales:
        shift = torch.zeros_like(rows[..., :1])
        scale = rows.abs().amax(-1, keepdim=True) / fp8_max
    else:
        low, high = rows.aminmax(dim=-1)
        shift = ((low + high) / 2).to(torch.float16)[..., None].float()
        scale = (rows - shift).abs().amax(-1, keepdim=True) / fp8_max
        scale = scale.clamp(min=_SMALLEST_STEP).to(torch.float16).float()
    codes = torch.where(scale > 0, (rows - shift) / scale, 0.0).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    packed = codes.contiguous().view(torch.int32)
    if use_fp32_scales:
        return packed, scale[..., 0]
    return packed, _half_pair(scale[..., 0].half(), shift[..., 0].half())


def dequantize_kv_fp8(packed: torch.Tensor, scales: torch.Tensor, fp8_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The fp32 [..., D] values of quantize_kv_fp8's (int32 [..., D / 4], scales [...]): fp16 scale-and-shift pairs
    in int32 scales, a float32 scale alone otherwise."""
    if (
        packed.dtype != torch.int32
        or scales.dtype not in (torch.float32, torch.int32)
        or scales.shape != packed.shape[:-1]
    ):
        raise ValueError(
            f"dequantize_kv_fp8: expected quantize_kv_fp8's int32 rows [..., D / 4] and their scales [...] (float32, "
            f"or int32 fp16 scale-and-shift pairs), got {tuple(packed.shape)} {packed.dtype} and "
            f"{tuple(scales.shape)} {scales.dtype}"
        )
    codes = packed.contiguous().view(_fp8("dequantize_kv_fp8", fp8_dtype, packed.device)).float()
    if scales.dtype == torch.float32:
        return codes * scales[..., None]
    scale, shift = _split_half_pair(scales)
    return codes * scale[..., None] + shift[..., None]
