"""The cuBLAS backend of `bf16x9_gemm` (spec G-42; the op, its reference and the Triton backend are in
mslk.gemm.triton.bf16x9_gemm): out [M, N] fp32 = A [M, K] · B [N, K]ᵀ with CUBLAS_COMPUTE_32F_EMULATED_16BFX9.

cuBLAS emulates FP32 with nine BF16 tensor-core products on Blackwell data-center GPUs (sm_100, sm_103) only;
elsewhere the same call would run a plain FP32 GEMM, so the backend declines there and the Triton backend serves.
Where cuBLAS emulates it comes first: it is the spec's implementation, tuned by NVIDIA for those GPUs.
"""

from __future__ import annotations

import ctypes

import torch

from mslk.core import arch
from mslk.gemm.native import library
from mslk.gemm.triton.bf16x9_gemm import bf16x9_gemm_op

_gemm = library.Function(
    "mslk_bf16x9_gemm_cublas",
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,  # a, lda, a_column_major
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,  # b, ldb, b_column_major
    ctypes.c_void_p, ctypes.c_int64,  # out, ldc
    *(ctypes.c_int64,) * 3,  # m, n, k
    creator="mslk_cublas_create",
)  # fmt: skip


def _available() -> str | None:
    missing = _gemm.available()
    if missing is not None or not arch.is_cuda():
        return missing
    major, minor = arch.capability()
    if major != 10:
        return f"cuBLAS emulates FP32 with BF16x9 on sm_100/sm_103 only, this GPU is sm_{major}{minor}"
    return None


def _blas_operand(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(t or a row-major copy, column-major?, leading dimension): row-major and column-major (transposed) views
    go to cuBLAS as they are."""
    rows, cols = t.shape
    if t.stride(1) == 1 and t.stride(0) >= max(cols, 1):
        return t, 0, t.stride(0)
    if t.stride(0) == 1 and t.stride(1) >= max(rows, 1):
        return t, 1, t.stride(1)
    return t.contiguous(), 0, max(cols, 1)


def _shares_memory(t: torch.Tensor, *others: torch.Tensor) -> bool:
    return any(t.untyped_storage().data_ptr() == o.untyped_storage().data_ptr() for o in others)


@bf16x9_gemm_op.backend("cublas", available=_available, before="triton")
def _cublas(A, B, output=None):
    (m, k), n = A.shape, B.shape[0]
    # cuBLAS writes rows of a row-major output; an output that is another layout, or overlaps A or B, gets a copy.
    direct = output is not None and output.stride(1) == 1 and output.stride(0) >= max(n, 1)
    direct = direct and not _shares_memory(output, A, B)
    out = output if direct else torch.empty((m, n), dtype=torch.float32, device=A.device)
    if m and n and not k:
        out.zero_()
    elif m and n:
        a, a_column_major, lda = _blas_operand(A)
        b, b_column_major, ldb = _blas_operand(B)
        _gemm(
            A.device, a.data_ptr(), lda, a_column_major, b.data_ptr(), ldb, b_column_major, out.data_ptr(),
            out.stride(0), m, n, k,
        )  # fmt: skip
    return out if output is None or direct else output.copy_(out)
