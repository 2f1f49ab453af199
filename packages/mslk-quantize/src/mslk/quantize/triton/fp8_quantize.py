"""FP8 quantizers (spec §6 Q-01, Q-02, Q-09; scale contract §7.1-7.3).

`quantize_fp8_row(a)` -> (xq, scale): one dequantization scale per row, `a ≈ xq · scale[..., None]`.
Registered as `torch.ops.triton.quantize_fp8_row` (the reference's name, used by torch.compile/export code),
with a fake kernel; the Triton kernel reads the input once and writes xq and the scales once.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mslk.core import arch, formats, registry, testing
from mslk.quantize import reference

_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)
# Rows up to this many elements are quantized from registers in one pass; longer rows are read twice
# (amax pass, then quantize pass, the second mostly from L2).
_SINGLE_PASS_MAX_K = 16384


def _padded_k(k: int, align_rows_to: int | None) -> int:
    return -(-k // align_rows_to) * align_rows_to if align_rows_to else k


def _eps(eps_opt: float | None) -> float:
    return arch.FP8_EPS if eps_opt is None else eps_opt


class RowArgs(NamedTuple):
    """The arguments of triton::quantize_fp8_row with their defaults; binds a call's *args/**kwargs once for
    the validator, reference, fake and backend check."""

    a: torch.Tensor
    scale_ub: torch.Tensor | None = None
    zero_start_index_M: torch.Tensor | None = None
    use_triton: bool = True
    output_device: torch.device | None = None
    align_rows_to: int | None = None
    eps_opt: float | None = reference.FP8_ROW_EPS


def _validate_row(*args, **kwargs):
    a, scale_ub, zero_start_index_M, _, _, align_rows_to, eps_opt = RowArgs(*args, **kwargs)
    where = "quantize_fp8_row"
    if a.dtype not in _FLOAT_INPUTS:
        raise ValueError(f"{where}: a must be float32, float16 or bfloat16, got {a.dtype}")
    if not 1 <= a.dim() <= 4:
        raise ValueError(f"{where}: a must have 1 to 4 dimensions, got shape {tuple(a.shape)}")
    if scale_ub is not None:
        if scale_ub.numel() != 1 or scale_ub.dtype != torch.float32:
            raise ValueError(
                f"{where}: scale_ub must be one float32 value (an upper bound on each row's amax), "
                f"got shape {tuple(scale_ub.shape)} {scale_ub.dtype}"
            )
        if scale_ub.device != a.device:
            raise ValueError(f"{where}: scale_ub is on {scale_ub.device}, a is on {a.device}")
    if zero_start_index_M is not None:
        matrices = math.prod(a.shape[:-2])
        if a.dim() < 2 or zero_start_index_M.dtype.is_floating_point or zero_start_index_M.numel() != matrices:
            raise ValueError(
                f"{where}: zero_start_index_M must hold one integer row count per [M, K] matrix of a "
                f"({matrices} for shape {tuple(a.shape)}), got shape {tuple(zero_start_index_M.shape)} "
                f"{zero_start_index_M.dtype}"
            )
        if zero_start_index_M.device != a.device:
            raise ValueError(f"{where}: zero_start_index_M is on {zero_start_index_M.device}, a is on {a.device}")
    if align_rows_to is not None and align_rows_to < 1:
        raise ValueError(f"{where}: align_rows_to must be a positive integer, got {align_rows_to}")
    if eps_opt is not None and not eps_opt > 0:
        raise ValueError(f"{where}: eps_opt must be > 0, got {eps_opt}")


def _row_reference(*args, **kwargs):
    a, scale_ub, zero_start_index_M, _, output_device, align_rows_to, eps_opt = RowArgs(*args, **kwargs)
    xq, scale = reference.quantize_fp8_row(
        a, scale_ub, zero_start_index_M, align_rows_to, _eps(eps_opt), arch.fp8_dtype(a.device)
    )
    device = output_device or a.device
    return xq.to(device), scale.to(device)


def _row_fake(*args, **kwargs):
    a, _, _, _, output_device, align_rows_to, _ = RowArgs(*args, **kwargs)
    device = output_device or a.device
    xq = a.new_empty(
        (*a.shape[:-1], _padded_k(a.shape[-1], align_rows_to)), dtype=arch.fp8_dtype(a.device), device=device
    )
    return xq, a.new_empty(a.shape[:-1], dtype=torch.float32, device=device)


def _row_samples(device):
    bf16, f16 = torch.bfloat16, torch.float16
    yield registry.Sample((testing.randn(3, 5, dtype=bf16, device=device),))
    yield registry.Sample((testing.randn(2, 3, 130, dtype=f16, device=device), torch.tensor([1.5], device=device)))
    yield registry.Sample((testing.randn(2, 2, 3, 7, device=device, std=100.0),), {"align_rows_to": 16})
    yield registry.Sample(
        (testing.randn(3, 4, 33, dtype=bf16, device=device), None, torch.tensor([4, 0, 2], device=device))
    )


quantize_fp8_row_op = registry.Op(
    "triton::quantize_fp8_row(Tensor a, Tensor? scale_ub=None, Tensor? zero_start_index_M=None, "
    "bool use_triton=True, Device? output_device=None, int? align_rows_to=None, "
    "float? eps_opt=0.001953125) -> (Tensor, Tensor)",
    domain="quantize",
    reference=_row_reference,
    fake=_row_fake,
    samples=_row_samples,
    validate=_validate_row,
    reference_devices=("cpu", "cuda"),
)


@triton.jit
def _max_nan(a, b):
    # NaN-propagating max: a row holding NaN gets a NaN scale instead of silently dropping the NaN.
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantize_fp8_row_kernel(
    a_ptr, xq_ptr, scale_ptr, scale_ub_ptr, counts_ptr,
    n_rows, K, K_OUT, rows_per_matrix, stride_a_row, stride_a_k, stride_xq_row, eps,
    FP8_MAX: tl.constexpr, HAS_UB: tl.constexpr, JAGGED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE_PASS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    in_range = rows < n_rows
    readable = in_range
    if JAGGED:  # rows past their matrix's count read as zeros
        count = tl.load(counts_ptr + rows // rows_per_matrix, mask=in_range, other=0)
        readable = in_range & (rows % rows_per_matrix < count)
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_a_row  # [BLOCK_M, 1]
    xq_rows = xq_ptr + rows.to(tl.int64)[:, None] * stride_xq_row
    cols = tl.arange(0, BLOCK_K)[None, :]  # [1, BLOCK_K]

    if SINGLE_PASS:
        x = tl.load(a_rows + cols * stride_a_k, mask=readable[:, None] & (cols < K), other=0.0).to(tl.float32)
        amax = tl.reduce(tl.abs(x), 1, _max_nan)  # [BLOCK_M]
    else:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(a_rows + (k0 + cols) * stride_a_k, mask=readable[:, None] & (k0 + cols < K), other=0.0)
            amax = _max_nan(amax, tl.reduce(tl.abs(x.to(tl.float32)), 1, _max_nan))
    amax = _max_nan(amax, eps)
    if HAS_UB:
        amax = tl.minimum(amax, tl.load(scale_ub_ptr), propagate_nan=tl.PropagateNan.ALL)
    # IEEE-rounded divisions (Triton's `/` is approximate on GPUs), so the results equal the reference's.
    factor = tl.div_rn(FP8_MAX, amax)[:, None]  # [BLOCK_M, 1]
    tl.store(scale_ptr + rows, tl.div_rn(amax, FP8_MAX), mask=in_range)

    if SINGLE_PASS:
        q = tl.clamp(x * factor, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        q = tl.where(cols < K, q, 0.0)  # alignment padding is zero even in a NaN row
        tl.store(xq_rows + cols, q.to(xq_ptr.dtype.element_ty), mask=in_range[:, None] & (cols < K_OUT))
    else:
        for k0 in range(0, K_OUT, BLOCK_K):
            x = tl.load(a_rows + (k0 + cols) * stride_a_k, mask=readable[:, None] & (k0 + cols < K), other=0.0)
            q = tl.clamp(x.to(tl.float32) * factor, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
            q = tl.where(k0 + cols < K, q, 0.0)
            tl.store(xq_rows + k0 + cols, q.to(xq_ptr.dtype.element_ty), mask=in_range[:, None] & (k0 + cols < K_OUT))


def _row_launch_config(k_out: int) -> dict:
    """Tile sizes: a whole row per pass when it fits, several short rows per program otherwise."""
    block_k = min(triton.next_power_of_2(max(k_out, 1)), _SINGLE_PASS_MAX_K)
    block_m = max(1, min(64, 4096 // block_k))
    tile = block_m * block_k
    return {
        "BLOCK_M": block_m,
        "BLOCK_K": block_k,
        "SINGLE_PASS": k_out <= block_k,
        "num_warps": 4 if tile <= 2048 else 8 if tile <= 8192 else 16,
    }


def _triton_row_supports(*args, **kwargs):
    return [] if RowArgs(*args, **kwargs).use_triton else ["use_triton=False"]


@quantize_fp8_row_op.backend("triton", available=registry.triton_missing, supports=_triton_row_supports)
def triton_quantize_fp8_row(
    a,
    scale_ub=None,
    zero_start_index_M=None,
    use_triton=True,
    output_device=None,
    align_rows_to=None,
    eps_opt=reference.FP8_ROW_EPS,
):
    """The Triton kernel behind quantize_fp8_row (spec Q-02); same arguments and results."""
    k = a.shape[-1]
    k_out = _padded_k(k, align_rows_to)
    fp8 = arch.fp8_dtype(a.device)
    rows = a.reshape(math.prod(a.shape[:-1]), k)  # a view whenever the strides allow it
    xq = torch.empty((*a.shape[:-1], k_out), dtype=fp8, device=a.device)
    scale = torch.empty(a.shape[:-1], dtype=torch.float32, device=a.device)
    n_rows = rows.shape[0]
    if n_rows:
        config = _row_launch_config(k_out)
        _quantize_fp8_row_kernel[(triton.cdiv(n_rows, config["BLOCK_M"]),)](
            rows, xq, scale, scale_ub, zero_start_index_M,
            n_rows, k, k_out, a.shape[-2] if a.dim() > 1 else 1, rows.stride(0), rows.stride(1), k_out,
            _eps(eps_opt), FP8_MAX=torch.finfo(fp8).max, HAS_UB=scale_ub is not None,
            JAGGED=zero_start_index_M is not None, **config,
        )  # fmt: skip
    device = output_device or a.device
    return xq.to(device), scale.to(device)


def quantize_fp8_row(
    a: torch.Tensor,
    scale_ub: torch.Tensor | None = None,
    zero_start_index_M: torch.Tensor | None = None,
    use_triton: bool = True,
    output_device: torch.device | None = None,
    align_rows_to: int | None = None,
    eps_opt: float | None = reference.FP8_ROW_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise FP8 quantization (spec Q-01): a [..., K] (1-4 dims, fp32/fp16/bf16) -> (xq, scale).

    Per row: `amax = clamp(max|a|, eps_opt, scale_ub)`, `scale = amax / FP8_MAX` (fp32, shape a.shape[:-1]),
    `xq = clamp(a · FP8_MAX / amax, ±FP8_MAX)` in the platform FP8 dtype, last dim zero-padded up to a multiple
    of `align_rows_to`. `zero_start_index_M` (one count per [M, K] matrix) quantizes rows past the count
    as zeros. `eps_opt=None` floors amax at 1e-12. Rows with NaN get a NaN scale. The GPU runs the Triton
    kernel unless `use_triton=False`; the CPU runs the reference, with the same eps.
    """
    return torch.ops.triton.quantize_fp8_row(
        a, scale_ub, zero_start_index_M, use_triton, output_device, align_rows_to, eps_opt
    )


def dequantize_fp8_row(xq: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """bf16 `xq · x_scale[..., None]` (spec Q-09), checking the rowwise scale layout first."""
    formats.Rowwise().check(xq, x_scale, role="x_scale")
    return reference.dequantize_fp8_row(xq, x_scale)
