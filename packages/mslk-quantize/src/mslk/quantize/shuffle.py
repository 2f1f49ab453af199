"""INT4 weight quantization, packing and the preshuffled layout (spec Q-18..Q-21, G-32; formats §7.4).

Weights w [N, K] are quantized per group of `group_size` elements along K (the last group may be shorter
when K is not a multiple: for a power-of-two size whose group count does not divide K, since the GEMMs read
a count that divides K as groups of K / count) into signed 4-bit values in [-8, 7]; the scales (and zero points) come
transposed, [⌈K/gs⌉, N] contiguous, as the INT4 GEMMs read them.

The preshuffled layout (MSLK's, made for its Triton INT4 GEMMs; `preshuffle_i4` produces it):
int8 [..., N, K/2] like pack_int4's output, with K a multiple of 128. Row n holds row n's weights, so slicing
N (tensor-parallel sharding) keeps it valid. Within each run of 128 consecutive k (64 bytes of the row), byte
j holds k = j in its low nibble and k = j + 64 in its high nibble (two's-complement nibbles). A GEMM loads
[BLOCK_N, 64] bytes per 128 k and gets the halves [k, k+64) and [k+64, k+128) with two shifts,
`(b << 4) >> 4` and `b >> 4`, then runs one dot per half: no register shuffles to interleave nibbles.
(The reference library's layout is CUTLASS's; its values are not interchangeable with this one.)
"""

from __future__ import annotations

import math

import torch

from mslk.core import formats, registry, testing
from mslk.quantize.triton.fp8_quantize import quantize_fp8_row

# Smallest scale: a group of equal values (or zeros) must not divide by zero.
MIN_INT4_SCALE = 1e-6
# k per preshuffled run: byte j of a run holds k = j and k = j + PRESHUFFLE_RUN / 2.
PRESHUFFLE_RUN = 128


def _check(where: str, x: torch.Tensor, group_size: int, scale_dtype: torch.dtype, scale_dtypes: tuple) -> None:
    if not x.dtype.is_floating_point:
        raise ValueError(f"{where}: x must be a floating-point tensor, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{where}: x must be 2-D [N, K], got shape {tuple(x.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{where}: group_size must be a positive int, got {group_size!r}")
    if scale_dtype not in scale_dtypes:
        raise ValueError(f"{where}: scale_dtype must be one of {list(scale_dtypes)}, got {scale_dtype}")
    k = x.shape[1]
    groups = -(-k // group_size)
    read = formats.int4_group_size(k, groups)
    if groups > 1 and read != group_size:
        raise ValueError(
            f"{where}: group_size {group_size} does not divide K = {k}, and the INT4 GEMMs would read its {groups} "
            f"scale rows as {f'groups of {read}' if read else 'no group size'} (K / groups where that divides, the "
            f"spec's rule, else a power of two with a shorter last group): use a group size that divides K"
        )


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [N, K] as [N, ⌈K/gs⌉, gs] in fp32; the missing tail of the last group repeats its first element,
    which changes neither its max nor its min."""
    n, k = x.shape
    g = -(-k // group_size)
    padded = x.float()
    if g * group_size != k:
        tail = x[:, (g - 1) * group_size : (g - 1) * group_size + 1].float().expand(n, g * group_size - k)
        padded = torch.cat([padded, tail], dim=1)
    return padded.view(n, g, group_size)


def _stored(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scales or zeros as they will be stored (rounded to `dtype`), back in fp32, so that q is computed
    against the stored values."""
    return values.to(dtype).float()


def int4_row_quantize_zp(
    x: torch.Tensor, group_size: int = 128, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric INT4: per group `scale = max((max − min) / 15, 1e-6)`, `q = clamp(round((x − min) / scale),
    0, 15) − 8`, `zero = min + 8 · scale`, so `x ≈ q · scale + zero`. Returns (q int8 [N, K], scales
    [⌈K/gs⌉, N], zeros [⌈K/gs⌉, N]) in `scale_dtype`; when that is not fp32, scale and zero are rounded to
    it first and q computed against them (min replaced by zero − 8 · scale)."""
    _check("int4_row_quantize_zp", x, group_size, scale_dtype, formats.INT4_SCALE_DTYPES)
    k = x.shape[1]
    groups = _groups(x, group_size)
    lo, hi = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    scale = _stored(((hi - lo) / 15).clamp(min=MIN_INT4_SCALE), scale_dtype)
    zero = _stored(lo + 8 * scale, scale_dtype)
    if scale_dtype != torch.float32:
        lo = zero - 8 * scale
    q = (torch.round((groups - lo) / scale).clamp(0, 15) - 8).to(torch.int8).flatten(-2)[:, :k]
    return q.contiguous(), *(t[..., 0].t().contiguous().to(scale_dtype) for t in (scale, zero))


def int4_row_quantize(
    x: torch.Tensor, group_size: int = 128, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4: per group `scale = max(amax / 8, 1e-6)` rounded to `scale_dtype` (at least 2^-9 for
    float8_e4m3fn, whose smallest step that is), `q = clamp(round(x / scale), −8, 7)`, so `x ≈ q · scale`.
    Returns (q int8 [N, K], scales [⌈K/gs⌉, N] in `scale_dtype`)."""
    _check("int4_row_quantize", x, group_size, scale_dtype, (*formats.INT4_SCALE_DTYPES, torch.float8_e4m3fn))
    k = x.shape[1]
    groups = _groups(x, group_size)
    floor = 2.0**-9 if scale_dtype == torch.float8_e4m3fn else MIN_INT4_SCALE
    scale = _stored((groups.abs().amax(dim=-1, keepdim=True) / 8).clamp(min=floor), scale_dtype)
    q = torch.round(groups / scale).clamp(-8, 7).to(torch.int8).flatten(-2)[:, :k]
    return q.contiguous(), scale[..., 0].t().contiguous().to(scale_dtype)


def pack_int4(x: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], [..., K] (K even) -> int8 [..., K/2]: byte = (x[2k] & 0xF) | (x[2k+1] << 4),
    the even element in the low nibble, each nibble two's complement."""
    if x.dtype != torch.int8 or x.shape[-1] % 2:
        raise ValueError(f"pack_int4: expected int8 [..., K] with K even, got {tuple(x.shape)} {x.dtype}")
    if x.numel():  # (weights are packed once: the sync is affordable; a nibble would wrap 9 to -7)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError("pack_int4: checks its values' range on the host; call it outside CUDA graph capture")
        low, high = torch.stack(torch.aminmax(x)).tolist()  # one sync for both
        if low < -8 or high > 7:
            raise ValueError(f"pack_int4: values must be int4, in [-8, 7], got [{low}, {high}]")
    return _pack_nibbles(x)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """pack_int4 of values known to be int4 (the quantizers' own), with no host check."""
    return (q[..., ::2] & 0xF) | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: int8 [..., K/2] -> int8 [..., K] in [-8, 7] (`signed = (nibble ^ 8) − 8`)."""
    if packed.dtype != torch.int8:
        raise ValueError(f"unpack_int4: expected packed int4 int8 [..., K/2] (pack_int4), got {packed.dtype}")
    nibbles = torch.stack((packed & 0xF, (packed >> 4) & 0xF), dim=-1).flatten(-2)
    return (nibbles ^ 8) - 8


def _check_preshuffle(wq: torch.Tensor, where: str = "preshuffle_i4") -> None:
    if wq.dtype != torch.int8 or wq.dim() < 2 or (2 * wq.shape[-1]) % PRESHUFFLE_RUN:
        raise ValueError(
            f"{where}: expected packed int4 weights int8 [..., N, K/2] (pack_int4) with K a multiple of "
            f"{PRESHUFFLE_RUN}, got shape {tuple(wq.shape)} {wq.dtype}"
        )


def _validate_preshuffle(wq, w_scale):
    _check_preshuffle(wq)
    registry.check_devices("preshuffle_i4", WQ=wq, w_scale=w_scale)
    groups_ok = (
        w_scale.dim() == wq.dim()
        and w_scale.shape[-1] == wq.shape[-2]
        and w_scale.shape[:-2] == wq.shape[:-2]
        and formats.int4_group_size(2 * wq.shape[-1], w_scale.shape[-2]) is not None  # (K/gs groups the GEMMs read)
    )
    if w_scale.dtype not in (torch.float8_e4m3fn, torch.bfloat16) or not groups_ok:
        raise ValueError(
            "preshuffle_i4: w_scale must be the group scales [..., K/group_size, N] in float8_e4m3fn (FP8 "
            f"activations) or bfloat16 (BF16 activations) for wq {tuple(wq.shape)}, got shape "
            f"{tuple(w_scale.shape)} {w_scale.dtype}"
        )


def _preshuffle_reference(wq: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = PRESHUFFLE_RUN // 2
    q = unpack_int4(wq).unflatten(-1, (-1, 2, half))  # [..., N, K/128, (low k, high k), 64]
    # Contiguous outputs whatever the inputs' layouts (the fake kernel's).
    shuffled = ((q[..., 0, :] & 0xF) | (q[..., 1, :] << 4)).flatten(-2).contiguous()
    if w_scale.dtype == torch.bfloat16:  # a new tensor: an op's outputs must not alias its inputs
        return shuffled, w_scale.clone(memory_format=torch.contiguous_format)
    magnitudes = torch.arange(1, 9, dtype=torch.float32, device=w_scale.device)
    lut = (w_scale.float().unsqueeze(-2) * magnitudes[:, None]).to(torch.float8_e4m3fn)  # [..., K/gs, 8, N]
    return shuffled, lut.contiguous()


def _preshuffle_fake(wq, w_scale):
    lut = w_scale.new_empty((*w_scale.shape[:-1], 8, w_scale.shape[-1]))
    return wq.new_empty(wq.shape), w_scale.new_empty(w_scale.shape) if w_scale.dtype == torch.bfloat16 else lut


def _preshuffle_samples(device):
    q = torch.randint(-8, 8, (2, 3, 256), dtype=torch.int8, device=device)
    scale = testing.randn(2, 2, 3, device=device).abs()
    yield registry.Sample((pack_int4(q), scale.to(torch.bfloat16)))
    yield registry.Sample((pack_int4(q[0]), scale[0].to(torch.float8_e4m3fn)))


preshuffle_i4_op = registry.Op(
    "mslk::preshuffle_i4(Tensor WQ, Tensor w_scale) -> (Tensor, Tensor)",
    domain="quantize",
    reference=_preshuffle_reference,
    fake=_preshuffle_fake,
    samples=_preshuffle_samples,
    validate=_validate_preshuffle,
    reference_devices=("cpu", "cuda"),
)


def preshuffle_i4(wq: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed int4 weights [..., N, K/2] (pack_int4) -> (the preshuffled layout of this module's docstring, a
    new tensor; the scales as the shuffled GEMMs take them): bfloat16 group scales [..., K/gs, N] come back
    as they are (a copy); float8_e4m3fn ones as the 8-entry table [..., K/gs, 8, N] of e4m3(m · scale) for
    m = 1..8, the magnitudes of q · scale (entry 0 is the scale itself). Spec G-32, without the reference's
    in-place aliasing."""
    return torch.ops.mslk.preshuffle_i4(wq, w_scale)


def unshuffle_i4(wq: torch.Tensor) -> torch.Tensor:
    """The int4 values int8 [..., N, K] in [-8, 7] of preshuffled weights [..., N, K/2] (inverse layout)."""
    _check_preshuffle(wq, "unshuffle_i4")
    low, high = (wq << 4) >> 4, wq >> 4  # arithmetic shifts sign-extend each nibble
    return torch.stack((low.unflatten(-1, (-1, PRESHUFFLE_RUN // 2)), high.unflatten(-1, (-1, 64))), -2).flatten(-3)


def quantize_int4_preshuffle(
    w: torch.Tensor, group_size: int = 128, dtype: str = "fp8", use_zp: bool = True
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """INT4 weights for the shuffled GEMMs (spec Q-21): w [..., N, K] (K a multiple of 128) ->
    (preshuffled int8 [..., N, K/2], scales):

    - dtype="fp8" (for f8i4bf16_shuffled): w -> rowwise FP8 (row_scale fp32 [..., N]) -> symmetric int4 of the
      FP8 values per group, against e4m3 group scales; returns (wq, (the e4m3 table [..., K/gs, 8, N] of
      preshuffle_i4, row_scale)), so `w ≈ q · group_scale · row_scale`.
    - dtype="bf16" (for bf16i4bf16_shuffled): asymmetric int4 with bf16 scale and zero [..., K/gs, N] (zero = 0
      and symmetric int4 when use_zp=False), so `w ≈ q · scale + zero`; returns (wq, (scale, zero)).
    """
    if dtype not in ("fp8", "bf16"):
        raise ValueError(f'quantize_int4_preshuffle: dtype must be "fp8" or "bf16", got {dtype!r}')
    if not w.dtype.is_floating_point or w.dim() < 2 or w.shape[-1] % PRESHUFFLE_RUN or not w.shape[-1]:
        raise ValueError(
            f"quantize_int4_preshuffle: w must be floating-point [..., N, K] with K a positive multiple of "
            f"{PRESHUFFLE_RUN}, got shape {tuple(w.shape)} {w.dtype}"
        )
    if group_size < 1 or w.shape[-1] % group_size:
        raise ValueError(
            f"quantize_int4_preshuffle: K must be a multiple of the group size {group_size} (the shuffled GEMMs "
            f"take whole groups), got shape {tuple(w.shape)}"
        )
    lead, (n, k) = w.shape[:-2], w.shape[-2:]
    rows = w.flatten(0, -2)  # (reshape(-1, K) is ambiguous without rows)

    def per_matrix(scale: torch.Tensor) -> torch.Tensor:  # [K/gs, B·N] -> [..., K/gs, N], as the GEMMs read
        return scale.unflatten(1, (math.prod(lead), n)).movedim(1, 0).reshape(*lead, scale.shape[0], n).contiguous()

    if dtype == "fp8":
        w_fp8, row_scale = quantize_fp8_row(rows.float() if rows.dtype == torch.float64 else rows)  # (its dtypes)
        q, group_scale = int4_row_quantize(w_fp8.float(), group_size, torch.float8_e4m3fn)
        wq, table = preshuffle_i4(_pack_nibbles(q).reshape(*lead, n, k // 2), per_matrix(group_scale))
        return wq, (table, row_scale.reshape(*lead, n))
    if use_zp:
        q, scale, zero = int4_row_quantize_zp(rows, group_size, torch.bfloat16)
    else:
        q, scale = int4_row_quantize(rows, group_size, torch.bfloat16)
        zero = torch.zeros_like(scale)
    wq, scale = preshuffle_i4(_pack_nibbles(q).reshape(*lead, n, k // 2), per_matrix(scale))
    return wq, (scale, per_matrix(zero))


# ------------------------------------------------------------------- ROCm MFMA B-operand layout (spec Q-22)
# The reference library's layouts for its ROCm FP8 GEMMs (CK's rowwise preshuffle, FlyDSL's groupwise grouped):
# pure data movement, so they are here for its users although those GEMMs are not MSLK's.
_MFMA_K_PACK = 16  # k per lane of an MFMA B operand
_MFMA_WAVE = 64  # lanes of a wave: n_lane along N times 64 / n_lane along K


def _mfma_b_layout(where: str, src: torch.Tensor, n_lane: int) -> torch.Tensor:
    """src [..., N, K] with each [n_lane, 64 / n_lane · 16] tile of the last two dims stored lane by lane:
    (N0, n_lane, K0, k_lane, 16) -> (N0, K0, k_lane, n_lane, 16), the same shape."""
    if n_lane < 1 or _MFMA_WAVE % n_lane:
        raise ValueError(f"{where}: the N lanes must divide a wave of {_MFMA_WAVE}, got {n_lane}")
    k_lane = _MFMA_WAVE // n_lane
    if src.dim() < 2 or src.shape[-2] % n_lane or src.shape[-1] % (k_lane * _MFMA_K_PACK):
        raise ValueError(
            f"{where}: src must be [..., N, K] with N a multiple of {n_lane} and K of {k_lane * _MFMA_K_PACK}, got "
            f"shape {tuple(src.shape)}"
        )
    *lead, n, k = src.shape
    tiles = src.reshape(*lead, n // n_lane, n_lane, k // (k_lane * _MFMA_K_PACK), k_lane, _MFMA_K_PACK)
    d = len(lead)
    return tiles.permute(*range(d), d, d + 2, d + 3, d + 1, d + 4).contiguous().reshape(src.shape)


def ck_preshuffle(src: torch.Tensor, NXdl: int = 16) -> torch.Tensor:
    """FP8 weights [N, K] (float8_e4m3fnuz, the CK GEMMs') shuffled for f8f8bf16_rowwise_preshuffle (spec Q-22):
    NXdl lanes along N, 64 / NXdl along K, 16 k each (see _mfma_b_layout)."""
    if src.dtype != torch.float8_e4m3fnuz:
        raise TypeError(f"ck_preshuffle: src must be float8_e4m3fnuz, got {src.dtype}")
    if src.dim() != 2:
        raise ValueError(f"ck_preshuffle: src must be 2-D [N, K], got shape {tuple(src.shape)}")
    return _mfma_b_layout("ck_preshuffle", src, NXdl)


def preshuffle_b_mfma(src: torch.Tensor) -> torch.Tensor:
    """Weights [..., N, K] (any dtype) in the MFMA B-operand layout of f8f8bf16_groupwise_grouped_preshuffle
    (spec Q-22): 16 lanes along N, 4 along K, 16 k each (see _mfma_b_layout)."""
    return _mfma_b_layout("preshuffle_b_mfma", src, 16)
