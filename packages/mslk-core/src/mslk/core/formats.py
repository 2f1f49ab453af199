"""Scale formats (spec §7): the contract between a quantizer and the GEMM that consumes its output.

Every quantizer returns the *dequantization* scale, `x ≈ data · scale` (spec §7.2). A format says which
scale tensor goes with a data tensor: its shape, dtype and layout. Quantizers build their scales from
these types and GEMMs validate what they are handed with `check`; a mismatch raises ScaleFormatError
naming the expected granularity, the quantizer that produces it, and the granularity that was passed.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from mslk.core import arch, launch


class ScaleFormatError(ValueError):
    """A scale tensor does not have the layout the consumer needs."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


@dataclass(frozen=True)
class ScaleFormat:
    """Base of all formats. Subclasses define `name`, `producer`, `scale_dtypes` and `expected_shape`."""

    scale_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)

    @property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def producer(self) -> str:
        """The quantizer call that produces scales of this format."""
        raise NotImplementedError

    def expected_shape(self, data_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Scale shape for data of `data_shape` (logical element shape, see `logical_shape`)."""
        raise NotImplementedError

    def logical_shape(self, data: torch.Tensor) -> tuple[int, ...]:
        """Element shape of the data (packed formats store several elements per byte)."""
        return tuple(data.shape)

    def _shape_matches(self, data: torch.Tensor, scale: torch.Tensor) -> bool:
        return tuple(scale.shape) == self.expected_shape(self.logical_shape(data))

    def problems(self, data: torch.Tensor, scale: torch.Tensor) -> list[str]:
        """What is wrong with `scale` as this format's scale of `data` (empty: nothing)."""
        for name, value in (("data", data), ("scale", scale)):
            if not isinstance(value, torch.Tensor):
                return [f"{name} {value!r} (expected a tensor)"]
        try:
            expected = self.expected_shape(self.logical_shape(data))
        except ScaleFormatError as exc:
            return [str(exc)]
        found = []
        if not self._shape_matches(data, scale):
            found.append(f"shape {tuple(scale.shape)} (expected {expected})")
        if scale.dtype not in self.scale_dtypes:
            names = " or ".join(str(d) for d in self.scale_dtypes)
            found.append(f"dtype {scale.dtype} (expected {names})")
        if scale.device != data.device:
            found.append(f"device {scale.device} (the data is on {data.device})")
        if not scale.is_contiguous():
            found.append(f"strides {tuple(scale.stride())} (expected contiguous, call .contiguous())")
        return found

    def matches(self, data: torch.Tensor, scale: torch.Tensor) -> bool:
        return not self.problems(data, scale)

    def check(self, data: torch.Tensor, scale: torch.Tensor, *, role: str = "scale") -> None:
        """Raise ScaleFormatError unless `scale` is this format's scale of `data`."""
        problems = self.problems(data, scale)
        if not problems:
            return
        message = (
            f"{role}: expected a {self.name} scale for data of shape {tuple(data.shape)}, as produced by "
            f"{self.producer}; got {'; '.join(problems)}."
        )
        passed = identify(data, scale)
        if passed is not None and passed != self:
            message += f" The scale passed is a {passed.name} scale (from {passed.producer})."
        raise ScaleFormatError(message)


@dataclass(frozen=True)
class Tensorwise(ScaleFormat):
    """One scale for the whole tensor: a 0-dim or [1] fp32 tensor."""

    @property
    def name(self) -> str:
        return "tensorwise"

    @property
    def producer(self) -> str:
        return "quantize_fp8_tensor"

    def expected_shape(self, data_shape):
        return ()

    def _shape_matches(self, data, scale):
        return scale.numel() == 1 and scale.dim() <= 1


@dataclass(frozen=True)
class Rowwise(ScaleFormat):
    """One scale per row (last dim reduced): shape `data.shape[:-1]`; a flat [numel] view is accepted. With
    `any_shape`, so is any shape of as many elements (the dense FP8 GEMMs read the scale as the flat vector its
    memory holds, as upstream's do: torchao passes keepdim scales [..., 1], of inputs it flattened to 2-D)."""

    any_shape: bool = False

    @property
    def name(self) -> str:
        return "rowwise"

    @property
    def producer(self) -> str:
        return "quantize_fp8_row"

    def expected_shape(self, data_shape):
        if len(data_shape) < 1:
            raise ScaleFormatError("rowwise scales need data with at least one dimension")
        return tuple(data_shape[:-1])

    def _shape_matches(self, data, scale):
        rows = self.expected_shape(tuple(data.shape))
        if self.any_shape:
            return scale.numel() == math.prod(rows)
        return tuple(scale.shape) in (rows, (math.prod(rows),))


@dataclass(frozen=True)
class Blockwise(ScaleFormat):
    """One scale per `block_m x block_k` tile of 2-D data [M, K]: [⌈M/bm⌉, ⌈K/bk⌉] row-major (k_major),
    or its transpose [⌈K/bk⌉, ⌈M/bm⌉] when `k_major=False`."""

    block_m: int
    block_k: int
    k_major: bool = True

    def __post_init__(self):
        _set_positive_int(self, "block_m", "blockwise")
        _set_positive_int(self, "block_k", "blockwise")

    @property
    def name(self) -> str:
        layout = "" if self.k_major else ", k_major=False"
        return f"blockwise({self.block_m}, {self.block_k}{layout})"

    @property
    def producer(self) -> str:
        layout = "" if self.k_major else ", k_major=False"
        return f"quantize_fp8_block(x, {self.block_m}, {self.block_k}{layout})"

    def expected_shape(self, data_shape):
        if len(data_shape) != 2:
            raise ScaleFormatError(f"{self.name} scales need 2-D data [M, K], got shape {data_shape}")
        m, k = data_shape
        blocks = (_ceil_div(m, self.block_m), _ceil_div(k, self.block_k))
        return blocks if self.k_major else blocks[::-1]


@dataclass(frozen=True)
class Groupwise(ScaleFormat):
    """One scale per `group_size` elements along K of 2-D data [M, K] (K % group_size == 0):
    [K/g, M] (M-major, the default that groupwise GEMMs consume) or [M, K/g] when `k_major=True`."""

    group_size: int
    k_major: bool = False

    def __post_init__(self):
        _set_positive_int(self, "group_size", "groupwise")

    @property
    def name(self) -> str:
        return f"groupwise({self.group_size}{', k_major=True' if self.k_major else ''})"

    @property
    def producer(self) -> str:
        return f"quantize_fp8_group(x, {self.group_size}, k_major={self.k_major})"

    def expected_shape(self, data_shape):
        if len(data_shape) != 2:
            raise ScaleFormatError(f"{self.name} scales need 2-D data [M, K], got shape {data_shape}")
        m, k = data_shape
        if k % self.group_size:
            raise ScaleFormatError(f"{self.name} needs K divisible by {self.group_size}, got K={k}")
        return (m, k // self.group_size) if self.k_major else (k // self.group_size, m)


def _set_positive_int(fmt: ScaleFormat, field: str, name: str) -> None:
    """fmt's size `field` as a Python int (a NumPy integer or a one-element tensor given), positive: a float is
    refused, not truncated."""
    value = getattr(fmt, field)
    try:
        size = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        size = None
    if size is None or size < 1:
        raise ScaleFormatError(f"{name} scales need a positive integer {field}, got {value!r}")
    object.__setattr__(fmt, field, size)  # (a frozen dataclass)


def int4_group_size(k: int, groups: int) -> int | None:
    """The group size of INT4 weights with K = k and `groups` scale rows: K / groups, the spec's rule (for one
    group, the power of two covering K: the same grouping, in a size the kernels tile); where groups does not
    divide K, the power of two g with ⌈K / g⌉ = groups (MSLK's extension: the last group is shorter); None when
    neither fits (any size for k = groups = 0). The INT4 quantizers refuse group sizes this would read otherwise."""
    if k == 0 or groups < 1:
        return 1 if k == groups == 0 else None
    if groups == 1:
        return launch.next_power_of_2(k)
    if k % groups == 0:
        return k // groups
    size = launch.next_power_of_2(_ceil_div(k, groups))
    return size if _ceil_div(k, size) == groups else None


INT4_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT4_TABLE_ENTRIES = 8  # preshuffle_i4's FP8 tables: e4m3(m · scale) for m = 1..8


@dataclass(frozen=True)
class Int4Groupwise(ScaleFormat):
    """Scales of int4 weights packed two per byte [..., N, K/2]: one per `group_size` k and column,
    [..., ⌈K/gs⌉, N] fp32/bf16/fp16, or with `table` preshuffle_i4's FP8 tables [..., ⌈K/gs⌉, 8, N]."""

    group_size: int
    table: bool = False

    def __post_init__(self):
        _set_positive_int(self, "group_size", "int4 groupwise")

    @property
    def scale_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float8_e4m3fn,) if self.table else INT4_SCALE_DTYPES

    @property
    def name(self) -> str:
        return f"int4 groupwise({self.group_size}{', FP8 table' if self.table else ''})"

    @property
    def producer(self) -> str:
        if self.table:
            return f'quantize_int4_preshuffle(w, {self.group_size}, dtype="fp8")'
        return f'int4_row_quantize_zp(w, {self.group_size}) or quantize_int4_preshuffle(w, {self.group_size}, "bf16")'

    def logical_shape(self, data):
        return (*data.shape[:-1], 2 * data.shape[-1]) if data.dim() else ()

    def expected_shape(self, data_shape):
        if len(data_shape) < 2:
            raise ScaleFormatError(f"{self.name} scales need weights [..., N, K/2], got shape {data_shape}")
        *lead, n, k = data_shape
        return (*lead, _ceil_div(k, self.group_size), *((INT4_TABLE_ENTRIES,) if self.table else ()), n)


MXLayout = Literal["swizzled", "plain"]
E8M0_DTYPES = (torch.uint8, torch.int8, torch.float8_e8m0fnu)
E8M0_NAN = 255


def e8m0_rceil(amax: torch.Tensor, element_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX block scales for blocks whose largest magnitude is `amax` (fp32) and elements whose largest value is
    element_max: 2^ceil(log2(amax / element_max)) ("RCEIL"), derived exactly from amax's fp32 bits (a division and
    a log2 in fp32 round, and then missed the power of two by one for about half the amaxes just past one),
    clamped to [2^-127, 2^127]. Returns (the E8M0 bytes, int32; E8M0_NAN for a block holding NaN or ±Inf; the
    inverse scales 2^-e, fp32, exact, NaN for those blocks)."""
    fraction, exponent = math.frexp(element_max)  # element_max = (2 · fraction) · 2^(exponent - 1)
    mantissa = int((2 * fraction - 1) * 2**23)  # the mantissa bits of element_max's 1.f
    bits = amax.float().view(torch.int32)
    # amax = 1.m · 2^E: ceil(log2(amax / element_max)) = E - (exponent - 1) + (1.m > 1.f), in biased terms too
    biased = (bits >> 23) - (exponent - 1) + ((bits & 0x7FFFFF) > mantissa).to(torch.int32)
    finite = amax.isfinite()
    scale_byte = torch.where(finite, biased.clamp(0, 254), E8M0_NAN)
    # 2^-e from bits: biased fp32 exponent 254 - byte (a normal fp32 for element maxima of 2 or more)
    inverse = ((254 - scale_byte.clamp(max=254)) << 23).view(torch.float32)
    return scale_byte, torch.where(finite, inverse, torch.nan)


# Elements per stored unit of the packed data of each element type: fp4 packs two per byte,
# fp6 four per three bytes, fp8 one per byte.
_ELEMENTS_PER_BYTE = {"fp4": 2, "fp6": 4 / 3, "fp8": 1}


def platform_mx_layout() -> MXLayout:
    """MX scale layout of this platform's GEMMs: swizzled (blocked) on CUDA, plain row-major on ROCm."""
    return "plain" if arch.is_rocm() else "swizzled"


def swizzled_scale_shape(rows: int, scale_cols: int) -> tuple[int, int]:
    """The padded [⌈rows/128⌉·128, ⌈cols/4⌉·4] matrix whose 128x4 tiles the blocked layout stores."""
    return _round_up(rows, 128), _round_up(scale_cols, 4)


def stacked_swizzled_scale_shape(rows: int, segments: int, scale_cols: int) -> tuple[int, int]:
    """Scale matrix of a stacked (MoE) input of `rows` rows in `segments` segments: each segment's scales in
    the blocked layout from a 128-row boundary, so at most rows + 127 · segments rows, a bound known without
    reading the segment sizes (CUDA-graph safe)."""
    return rows + 127 * segments, _round_up(scale_cols, 4)


@dataclass(frozen=True)
class _BlockScaled(ScaleFormat):
    """Scales of one block of `block_size` elements along K, stored plain [M, ⌈K/bs⌉] or swizzled: the
    CUDA blocked layout of 128x4 tiles of the padded matrix, flattened (1-D) or kept 2-D."""

    block_size: int = 32
    layout: MXLayout = "swizzled"
    element: str = "fp4"

    def logical_shape(self, data):
        shape = tuple(data.shape)
        return (*shape[:-1], round(shape[-1] * _ELEMENTS_PER_BYTE[self.element])) if shape else ()

    def expected_shape(self, data_shape):
        if len(data_shape) < 2:
            raise ScaleFormatError(f"{self.name} scales need data [.., M, K], got shape {data_shape}")
        rows, k = math.prod(data_shape[:-1]), data_shape[-1]
        if self.layout == "plain":
            return (*data_shape[:-1], _ceil_div(k, self.block_size))
        return swizzled_scale_shape(rows, _ceil_div(k, self.block_size))

    def _shape_matches(self, data, scale):
        expected = self.expected_shape(self.logical_shape(data))
        if self.layout == "swizzled":
            return tuple(scale.shape) in (expected, (math.prod(expected),))
        return tuple(scale.shape) == expected


@dataclass(frozen=True)
class MX(_BlockScaled):
    """OCP microscaling: E8M0 block exponents (uint8/int8/float8_e8m0fnu), block 32 (or 16 for MXFP4-16)."""

    scale_dtypes: ClassVar[tuple[torch.dtype, ...]] = E8M0_DTYPES

    def __post_init__(self):
        if self.block_size not in (16, 32):
            raise ValueError(f"MX block size must be 32 or 16, got {self.block_size}")
        if self.element not in _ELEMENTS_PER_BYTE:
            raise ValueError(f"MX element must be one of {sorted(_ELEMENTS_PER_BYTE)}, got {self.element!r}")
        if self.layout not in ("swizzled", "plain"):
            raise ValueError(f"MX layout must be 'swizzled' or 'plain', got {self.layout!r}")

    @property
    def name(self) -> str:
        return f"MX{self.element.upper()}(block {self.block_size}, {self.layout})"

    @property
    def producer(self) -> str:
        return {
            "fp4": f"triton_quantize_mx4_unpack(x, group_size={self.block_size})",
            "fp8": "to_mxfp8(x)",
            "fp6": "quantize_bf16_to_mx6_e2m3(x)",
        }[self.element]


@dataclass(frozen=True)
class NVFP4(_BlockScaled):
    """NVFP4: E2M1 elements, float8_e4m3fn scales per 16 elements in the swizzled layout, plus one fp32
    global scale (`check_global_scale`)."""

    scale_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float8_e4m3fn,)
    block_size: int = 16
    layout: MXLayout = "swizzled"
    element: str = "fp4"

    def __post_init__(self):
        if (self.block_size, self.layout, self.element) != (16, "swizzled", "fp4"):
            raise ValueError("NVFP4 is fixed: fp4 elements, block 16, swizzled e4m3 scales")

    @property
    def name(self) -> str:
        return "NVFP4(block 16, swizzled)"

    @property
    def producer(self) -> str:
        return "triton_quantize_nvfp4(x, global_scale)"

    @staticmethod
    def check_global_scale(global_scale: torch.Tensor, *, role: str = "global_scale") -> None:
        if not isinstance(global_scale, torch.Tensor):
            raise ScaleFormatError(f"{role}: expected one fp32 value in a tensor, got {global_scale!r}")
        if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
            raise ScaleFormatError(
                f"{role}: expected one fp32 value (1 / (gs_x · gs_w), see global_scale_nvfp4), got shape "
                f"{tuple(global_scale.shape)} {global_scale.dtype}"
            )


# Formats `identify` tries when naming what a caller passed instead of the expected format.
_COMMON_FORMATS: tuple[ScaleFormat, ...] = (
    Tensorwise(),
    Rowwise(),
    Blockwise(128, 128),
    Groupwise(128),
    Groupwise(128, k_major=True),
    Blockwise(1, 128),
    Blockwise(256, 256),
)


def identify(data: torch.Tensor, scale: torch.Tensor) -> ScaleFormat | None:
    """The common FP8 format whose scale `scale` is for `data`, if any (for error messages)."""
    for fmt in _COMMON_FORMATS:
        if fmt.matches(data, scale):
            return fmt
    return None


def check_fp8_data(data: torch.Tensor, *, role: str, producer: str) -> None:
    """Raise unless `data` holds this platform's FP8 flavour (e4m3fn on CUDA/gfx950, e4m3fnuz on gfx942)."""
    if not isinstance(data, torch.Tensor):
        raise ScaleFormatError(f"{role}: expected FP8 data in a tensor, got {data!r}")
    expected = arch.fp8_dtype(data.device)
    if data.dtype != expected:
        raise ScaleFormatError(
            f"{role}: expected {expected} data (this platform's FP8), got {data.dtype}; quantize it with "
            f"{producer} on this device."
        )
