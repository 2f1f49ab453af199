"""`f8f8bf16_cublas`: the FP8 GEMM of cuBLASLt, with tensorwise or (on sm_90) rowwise scales.

    out [..., M, N] = bf16((A · Bᵀ) · Ainvs · Binvs)        A [..., M, K], B [N, K]: this platform's FP8 e4m3

The schema is FBGEMM's (`f8f8bf16_cublas(Tensor A, Tensor B, Tensor? Ainvs=None, Tensor? Binvs=None, bool
use_fast_accum=True, Tensor(a!)? output=None) -> Tensor`), so its callers work unchanged. `Ainvs` and `Binvs` are
dequantization scales (`x ≈ xq · scale`): one fp32 value (tensorwise, `quantize_fp8_tensor`), one per row of A or
of B (rowwise, `quantize_fp8_row`), or None for 1. Rowwise scales run on sm_90 only, where cuBLASLt scales by an
outer vector; other GPUs take tensorwise scales (f8f8bf16_rowwise serves rowwise ones everywhere).

cuBLASLt's FP8 kernels need K and N to be multiples of 16: other sizes are zero-padded (a copy of A and B).
"""

from __future__ import annotations

import ctypes
import math

import torch

from mslk.core import arch, formats, registry, testing
from mslk.gemm.native import library
from mslk.gemm.triton import fp8_gemm

_WHERE = "f8f8bf16_cublas"
_PRODUCERS = "quantize_fp8_tensor or quantize_fp8_row"

_gemm = library.Function(
    "mslk_f8f8bf16_cublas",
    *(ctypes.c_void_p,) * 3,  # xq, wq, out
    *(ctypes.c_int64,) * 3,  # m, n, k
    *(ctypes.c_void_p,) * 2,  # x_scale, w_scale
    ctypes.c_int,  # rowwise
    ctypes.c_int,  # use_fast_accum
)


def _check_scale(role: str, data: torch.Tensor, scale: torch.Tensor | None) -> None:
    if scale is None or formats.Tensorwise().matches(data, scale):
        return
    try:
        fp8_gemm.ROWWISE_SCALES.check(data, scale, role=f"{_WHERE}: {role}")
    except formats.ScaleFormatError as exc:
        raise formats.ScaleFormatError(f"{exc} (a tensorwise scale, one fp32 value, is accepted too)") from None


def _validate(A, B, Ainvs=None, Binvs=None, use_fast_accum=True, output=None):
    formats.check_fp8_data(A, role=f"{_WHERE}: A", producer=_PRODUCERS)
    formats.check_fp8_data(B, role=f"{_WHERE}: B", producer=_PRODUCERS)
    if A.dim() < 2 or B.dim() != 2 or A.shape[-1] != B.shape[-1]:
        raise ValueError(
            f"{_WHERE}: expected A [..., M, K] and B [N, K] with the same K, got {tuple(A.shape)} and {tuple(B.shape)}"
        )
    # Devices first: a tensor on the wrong device is the cause to name, not the scale check it would also fail.
    registry.check_devices(_WHERE, A=A, B=B, Ainvs=Ainvs, Binvs=Binvs, output=output)
    _check_scale("Ainvs", A, Ainvs)
    _check_scale("Binvs", B, Binvs)
    expected = (*A.shape[:-1], B.shape[0])
    if output is not None and (tuple(output.shape) != expected or output.dtype != torch.bfloat16):
        raise ValueError(f"{_WHERE}: output must be bfloat16 {expected}, got {tuple(output.shape)} {output.dtype}")


def _rowwise_scale(scale: torch.Tensor | None, rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Any accepted scale as the rowwise one of data with `rows` leading dims (None: ones)."""
    if scale is None:
        return torch.ones(rows, device=device)
    return scale.reshape(()).expand(rows) if scale.numel() == 1 else scale


def _reference(A, B, Ainvs=None, Binvs=None, use_fast_accum=True, output=None):
    """The rowwise GEMM's reference with each scale made rowwise (fp32 product, scales, then bf16)."""
    x_scale = _rowwise_scale(Ainvs, A.shape[:-1], A.device)
    w_scale = _rowwise_scale(Binvs, B.shape[:-1], B.device)
    out = fp8_gemm._rowwise_reference(A, B, x_scale, w_scale, None, torch.bfloat16)
    return out if output is None else output.copy_(out)


def quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x in this platform's FP8 with one fp32 dequantization scale (amax / FP8_MAX, 0-dim): tensorwise inputs of
    the samples, tests and benches (mslk-gemm works without mslk.quantize's quantize_fp8_tensor)."""
    xq, scale = fp8_gemm.quantize_rows(x.reshape(1, -1))
    return xq.view(x.shape), scale.reshape(())


def _samples(device):
    xq, x_scale = quantize_tensor(testing.randn(37, 64, device=device))
    wq, w_scale = quantize_tensor(testing.randn(24, 64, device=device, std=0.5))
    yield registry.Sample((xq, wq, x_scale, w_scale))  # N = 24: padded to 32 for cuBLASLt
    yield registry.Sample((xq, wq))
    if device.type == "cpu" or arch.on_hopper(xq):
        x3, x3_scale = fp8_gemm.quantize_rows(testing.randn(2, 5, 48, device=device))
        w3, w3_scale = fp8_gemm.quantize_rows(testing.randn(40, 48, device=device))
        yield registry.Sample((x3, w3, x3_scale, w3_scale, False))
        yield registry.Sample((x3, w3, x3_scale, w_scale))  # rowwise A, tensorwise B


f8f8bf16_cublas_op = registry.Op(
    "mslk::f8f8bf16_cublas(Tensor A, Tensor B, Tensor? Ainvs=None, Tensor? Binvs=None, bool use_fast_accum=True, "
    "Tensor(a!)? output=None) -> Tensor",
    out_arg="output",
    domain="gemm",
    reference=_reference,
    fake=lambda A, B, *args, **kwargs: A.new_empty((*A.shape[:-1], B.shape[0]), dtype=torch.bfloat16),
    samples=_samples,
    validate=_validate,
    tolerance=1e-2,
)


def _is_rowwise(scale: torch.Tensor | None) -> bool:
    return scale is not None and scale.numel() > 1


def _supports(A, B, Ainvs=None, Binvs=None, use_fast_accum=True, output=None):
    major, minor = arch.capability(A.device)
    if _is_rowwise(Ainvs) or _is_rowwise(Binvs):
        if (major, minor) != (9, 0):
            return [
                f"rowwise scales: cuBLASLt scales FP8 by rows (outer vectors) on sm_90 only, this GPU is "
                f"sm_{major}{minor}; pass tensorwise scales, or call f8f8bf16_rowwise"
            ]
    elif (major, minor) < (8, 9):
        return [f"cuBLASLt's FP8 GEMMs need sm_89 or newer, this GPU is sm_{major}{minor}"]
    return []


def _scale_vector(scale: torch.Tensor | None, length: int, device: torch.device) -> torch.Tensor:
    """A scale as the contiguous, aligned fp32 vector of `length` that outer-vector scaling reads (a tensorwise
    scale repeated; padding rows past a rowwise scale get 1, their outputs are cut off)."""
    flat = None if scale is None else scale.reshape(-1)
    if flat is not None and flat.numel() == length and flat.is_contiguous() and flat.data_ptr() % 16 == 0:
        return flat
    vector = torch.ones(length, dtype=torch.float32, device=device)
    if flat is not None:
        vector[: flat.numel() if flat.numel() > 1 else length] = flat
    return vector


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@f8f8bf16_cublas_op.backend("cublas", available=_gemm.available, supports=_supports)
def _cublas(A, B, Ainvs=None, Binvs=None, use_fast_accum=True, output=None):
    x = A.reshape(math.prod(A.shape[:-1]), A.shape[-1])
    m, n, np_ = x.shape[0], B.shape[0], library.pad16(B.shape[0])
    direct = output is not None and np_ == n and output.is_contiguous() and output.data_ptr() % 16 == 0
    out = output.view(m, n) if direct else torch.empty((m, np_), dtype=torch.bfloat16, device=A.device)
    rowwise = _is_rowwise(Ainvs) or _is_rowwise(Binvs)
    # Locals, so that the scale vectors outlive the launch that reads them.
    x_scale, w_scale = (
        (_scale_vector(Ainvs, m, A.device), _scale_vector(Binvs, np_, A.device)) if rowwise else (Ainvs, Binvs)
    )
    library.tn_gemm(_gemm, x, B, out, _pointer(x_scale), _pointer(w_scale), int(rowwise), int(use_fast_accum))
    if direct:
        return output
    result = (out if np_ == n else out[:, :n].contiguous()).view(*A.shape[:-1], n)
    return result if output is None else output.copy_(result)


def f8f8bf16_cublas(A, B, Ainvs=None, Binvs=None, use_fast_accum=True, output=None) -> torch.Tensor:
    """`bf16((A · Bᵀ) · Ainvs · Binvs)` on cuBLASLt: A [..., M, K] and B [N, K] FP8 e4m3, scales tensorwise (one
    fp32 value), rowwise (sm_90) or None; into `output` (bf16 [..., M, N]) when given."""
    return torch.ops.mslk.f8f8bf16_cublas(A, B, Ainvs, Binvs, use_fast_accum, output)
