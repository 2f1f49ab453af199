"""Plain-PyTorch references of the quantizers (spec §6-§7): the CPU kernels and the test oracles.

Scales are dequantization scales (`x ≈ xq · scale`, spec §7.2).
"""

from __future__ import annotations

import torch

# amax floor of quantize_fp8_row: the reference library's Triton path floors at 1/512 ("CUDA
# min_scaling_factor") and its PyTorch path at 1e-12, so the two disagreed on tiny rows; ours use one floor.
FP8_ROW_EPS = 1.0 / 512


def row_amax(a: torch.Tensor) -> torch.Tensor:
    """max |a| over the last dim in fp32, NaN-propagating; 0 for rows of length 0."""
    if a.shape[-1] == 0:
        return torch.zeros(a.shape[:-1], dtype=torch.float32, device=a.device)
    return a.abs().amax(dim=-1).float()


def jagged_rows_zeroed(a: torch.Tensor, zero_start_index_M: torch.Tensor) -> torch.Tensor:
    """`a` [..., M, K] with rows m >= zero_start_index_M[matrix] of each [M, K] matrix set to zero."""
    counts = zero_start_index_M.reshape(*a.shape[:-2], 1).to(a.device)
    rows = torch.arange(a.shape[-2], device=a.device)
    return torch.where((rows < counts)[..., None], a, torch.zeros((), dtype=a.dtype, device=a.device))


def quantize_fp8_row(
    a: torch.Tensor,
    scale_ub: torch.Tensor | None,
    zero_start_index_M: torch.Tensor | None,
    align_rows_to: int | None,
    eps: float,
    fp8_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise FP8: per row `amax = clamp(max|a|, eps, scale_ub)`, `scale = amax / FP8_MAX`,
    `xq = clamp(a · (FP8_MAX / amax), ±FP8_MAX)`; xq's last dim zero-padded up to a multiple of
    `align_rows_to`. Returns (xq [..., K'], scale fp32 [...])."""
    if zero_start_index_M is not None:
        a = jagged_rows_zeroed(a, zero_start_index_M)
    amax = row_amax(a).clamp(min=eps)
    if scale_ub is not None:
        amax = torch.minimum(amax, scale_ub.float().reshape(()).to(amax.device))
    # A tensor FP8_MAX keeps both divisions IEEE-rounded: `number / tensor` is computed as reciprocal times
    # number, and CUDA divides by a CPU scalar through its reciprocal, each a second rounding.
    fp8_max = amax.new_full((), torch.finfo(fp8_dtype).max)
    xq = (a.float() * (fp8_max / amax)[..., None]).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    k = a.shape[-1]
    padded_k = -(-k // align_rows_to) * align_rows_to if align_rows_to else k
    if padded_k != k:
        xq = torch.nn.functional.pad(xq.view(torch.uint8), (0, padded_k - k)).view(fp8_dtype)
    return xq, amax / fp8_max


def dequantize_fp8_row(xq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 `xq · scale[..., None]` (the inverse of quantize_fp8_row)."""
    return (xq.float() * scale.float()[..., None]).to(torch.bfloat16)
