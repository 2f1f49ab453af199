"""FP8 quantizers (spec §6 Q-01, Q-02, Q-09; scale contract §7.1-7.3).

`quantize_fp8_row(a)` -> (xq, scale): one dequantization scale per row, `a ≈ xq · scale[..., None]`.
Registered as `torch.ops.triton.quantize_fp8_row` (the reference's name, used by torch.compile/export code),
with a fake kernel; the Triton kernel reads the input once and writes xq and the scales once.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mslk.core import arch, formats, launch, registry, testing
from mslk.quantize import reference
from mslk.quantize.triton.common import check_float_input, check_scale_ub, max_nan, to_output_device

# Rows up to this many elements are quantized from registers in one pass; longer rows are read twice
# (amax pass, then quantize pass, the second mostly from L2). On the H200 a 16384-wide single pass ran at
# 2100-2950 GB/s against 3400+ for two passes of 4096-8192 (RESULTS.md).
_SINGLE_PASS_MAX_K = 8192


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
    check_float_input(where, "a", a)
    if not 1 <= a.dim() <= 4:
        raise ValueError(f"{where}: a must have 1 to 4 dimensions, got shape {tuple(a.shape)}")
    check_scale_ub(where, scale_ub, a)
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
    if eps_opt is not None and not 0 < eps_opt < math.inf:  # an infinite floor quantizes every row to 0
        raise ValueError(f"{where}: eps_opt must be > 0 and finite, got {eps_opt}")


def _row_reference(*args, **kwargs):
    a, scale_ub, zero_start_index_M, _, output_device, align_rows_to, eps_opt = RowArgs(*args, **kwargs)
    xq, scale = reference.quantize_fp8_row(
        a, scale_ub, zero_start_index_M, align_rows_to, _eps(eps_opt), arch.fp8_dtype(a.device)
    )
    return to_output_device(output_device, xq, scale)


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
    "bool use_triton=True, Device? output_device=None, SymInt? align_rows_to=None, "
    "float? eps_opt=0.001953125) -> (Tensor, Tensor)",
    domain="quantize",
    reference=_row_reference,
    fake=_row_fake,
    samples=_row_samples,
    validate=_validate_row,
    reference_devices=("cpu", "cuda"),
)


@triton.jit
def row_factor_and_scale(amax, eps, scale_ub_ptr, QMAX: tl.constexpr, HAS_UB: tl.constexpr):
    """Rowwise quantization constants from each row's max |x| (NaN kept): amax floored at eps and bounded by
    *scale_ub_ptr when HAS_UB, then (factor = QMAX / amax, to_levels' multiplier; scale = amax / QMAX, the
    dequantization scale). Both divisions are IEEE-rounded (Triton's `/` is approximate on GPUs), so that they
    equal the reference's."""
    amax = max_nan(amax, eps)
    if HAS_UB:
        amax = tl.minimum(amax, tl.load(scale_ub_ptr), propagate_nan=tl.PropagateNan.ALL)
    return tl.div_rn(QMAX, amax), tl.div_rn(amax, QMAX)


@triton.jit
def to_levels(x, factor, QMAX: tl.constexpr):
    """x · factor clamped to ±QMAX, NaN kept, ready for the cast to xq's dtype: for an integer xq (int8) rounded
    half to even (adding 1.5 · 2^23 rounds to an integer below 2^22) and NaN made 0."""
    q = tl.clamp(x * factor, -QMAX, QMAX, propagate_nan=tl.PropagateNan.ALL)
    if QMAX == 127.0:
        q = tl.where(q == q, (q + 12582912.0) - 12582912.0, 0.0)
    return q


@triton.jit
def _quantize_row_kernel(
    a_ptr, xq_ptr, scale_ptr, scale_ub_ptr, counts_ptr,
    n_rows, K, K_OUT, rows_per_matrix, stride_a_row, stride_a_k, stride_xq_row, eps,
    QMAX: tl.constexpr, HAS_UB: tl.constexpr, JAGGED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE_PASS: tl.constexpr,
):  # fmt: skip
    """Rowwise quantization to FP8 (QMAX = FP8_MAX) or INT8 (QMAX = 127), the dtype of xq."""
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
        x = tl.load(a_rows + cols.to(tl.int64) * stride_a_k, mask=readable[:, None] & (cols < K), other=0.0).to(
            tl.float32
        )
        amax = tl.reduce(tl.abs(x), 1, max_nan)  # [BLOCK_M]
    else:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(
                a_rows + (k0 + cols).to(tl.int64) * stride_a_k, mask=readable[:, None] & (k0 + cols < K), other=0.0
            )
            amax = max_nan(amax, tl.reduce(tl.abs(x.to(tl.float32)), 1, max_nan))
    factor, scale = row_factor_and_scale(amax, eps, scale_ub_ptr, QMAX, HAS_UB)
    tl.store(scale_ptr + rows, scale, mask=in_range)
    factor = factor[:, None]  # [BLOCK_M, 1]

    if SINGLE_PASS:
        q = tl.where(cols < K, to_levels(x, factor, QMAX), 0.0)  # alignment padding is zero even in a NaN row
        tl.store(xq_rows + cols, q.to(xq_ptr.dtype.element_ty), mask=in_range[:, None] & (cols < K_OUT))
    else:
        for k0 in range(0, K_OUT, BLOCK_K):
            x = tl.load(
                a_rows + (k0 + cols).to(tl.int64) * stride_a_k, mask=readable[:, None] & (k0 + cols < K), other=0.0
            )
            q = tl.where(k0 + cols < K, to_levels(x.to(tl.float32), factor, QMAX), 0.0)
            tl.store(xq_rows + k0 + cols, q.to(xq_ptr.dtype.element_ty), mask=in_range[:, None] & (k0 + cols < K_OUT))


@functools.cache
def _row_launch_config(k_out: int) -> dict:
    """Tile sizes: a whole row per pass when it fits, several short rows per program otherwise."""
    block_k = min(launch.next_power_of_2(max(k_out, 1)), _SINGLE_PASS_MAX_K)
    block_m = max(1, min(64, 4096 // block_k))
    # 4 warps measured best or within 1.5% of best for rows of 5120-8192 on the H200 (8 and 16 were slower).
    return {"BLOCK_M": block_m, "BLOCK_K": block_k, "SINGLE_PASS": k_out <= block_k, "num_warps": 4}


def _triton_row_supports(*args, **kwargs):
    return [] if RowArgs(*args, **kwargs).use_triton else ["use_triton=False"]


@quantize_fp8_row_op.backend(
    "triton", available=registry.triton_missing, supports=_triton_row_supports, requires=arch.fp8_e4m3_missing
)
def _triton_row(*args, **kwargs):
    a, scale_ub, zero_start_index_M, _, output_device, align_rows_to, eps_opt = RowArgs(*args, **kwargs)
    xq, scale = run_row_kernel(
        a, arch.fp8_dtype(a.device), scale_ub, zero_start_index_M, _padded_k(a.shape[-1], align_rows_to), _eps(eps_opt)
    )
    return to_output_device(output_device, xq, scale)


def triton_quantize_fp8_row(
    a, scale_ub=None, zero_start_index_M=None, align_rows_to=None, eps_opt=reference.FP8_ROW_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel behind quantize_fp8_row, called directly (spec Q-02: its own argument order, without
    use_triton and output_device); the same checks first."""
    args = RowArgs(a, scale_ub, zero_start_index_M, True, None, align_rows_to, eps_opt)
    _validate_row(*args)
    return _triton_row(*args)


def run_row_kernel(a, dtype, scale_ub, zero_start_index_M, k_out, eps):
    """Rowwise quantization of a [..., K] to `dtype` (the platform FP8 or int8): (xq [..., k_out], scale)."""
    k = a.shape[-1]
    rows = a.reshape(math.prod(a.shape[:-1]), k)  # a view whenever the strides allow it
    xq = torch.empty((*a.shape[:-1], k_out), dtype=dtype, device=a.device)
    scale = torch.empty(a.shape[:-1], dtype=torch.float32, device=a.device)
    n_rows = rows.shape[0]
    if n_rows:
        config = _row_launch_config(k_out)
        qmax = float(torch.iinfo(dtype).max if dtype == torch.int8 else torch.finfo(dtype).max)
        launch.fast(_quantize_row_kernel)[(launch.cdiv(n_rows, config["BLOCK_M"]),)](
            rows, xq, scale, scale_ub, None if zero_start_index_M is None else zero_start_index_M.contiguous(),
            n_rows, k, k_out, a.shape[-2] if a.dim() > 1 else 1, rows.stride(0), rows.stride(1), k_out,
            eps, QMAX=qmax, HAS_UB=scale_ub is not None, JAGGED=zero_start_index_M is not None, **config,
        )  # fmt: skip
    return xq, scale


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


# ------------------------------------------------------------------------------ blockwise and groupwise


class BlockArgs(NamedTuple):
    """The arguments of triton::quantize_fp8_block with their defaults (spec Q-03)."""

    x: torch.Tensor
    block_m: int = 256
    block_k: int = 256
    scale_ub: torch.Tensor | None = None
    use_triton: bool = True
    output_device: torch.device | None = None
    k_major: bool = True


def _validate_block(*args, **kwargs):
    x, block_m, block_k, scale_ub, *_ = BlockArgs(*args, **kwargs)
    where = "quantize_fp8_block"
    check_float_input(where, "x", x)
    if x.dim() < 1:
        raise ValueError(f"{where}: x must have at least one dimension, got a 0-dim tensor")
    if block_m < 1 or block_k < 1:
        raise ValueError(f"{where}: block_m and block_k must be positive, got {block_m} x {block_k}")
    check_scale_ub(where, scale_ub, x)


def _block_reference(*args, **kwargs):
    x, block_m, block_k, scale_ub, _, output_device, k_major = BlockArgs(*args, **kwargs)
    xq, scale = reference.quantize_fp8_block(
        x, block_m, block_k, scale_ub, k_major, arch.FP8_EPS, arch.fp8_dtype(x.device)
    )
    return to_output_device(output_device, xq, scale)


def _block_scale_shape(x: torch.Tensor, block_m: int, block_k: int, k_major: bool) -> tuple[int, int]:
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    blocks = (-(-m // block_m), -(-k // block_k))
    return blocks if k_major else blocks[::-1]


def _block_fake(*args, **kwargs):
    x, block_m, block_k, _, _, output_device, k_major = BlockArgs(*args, **kwargs)
    device = output_device or x.device
    xq = x.new_empty(x.shape, dtype=arch.fp8_dtype(x.device), device=device)
    return xq, x.new_empty(_block_scale_shape(x, block_m, block_k, k_major), dtype=torch.float32, device=device)


def _block_samples(device):
    bf16 = torch.bfloat16
    # The small one first: the CPU tier runs the first sample's layouts through the kernel under the interpreter.
    yield registry.Sample((testing.randn(5, 70, device=device, std=50.0), 1, 32), {"k_major": False})
    yield registry.Sample((testing.randn(300, 520, dtype=bf16, device=device), 128, 128))
    yield registry.Sample(
        (testing.randn(2, 40, 33, dtype=bf16, device=device),), {"scale_ub": torch.tensor([2.0], device=device)}
    )


quantize_fp8_block_op = registry.Op(
    "triton::quantize_fp8_block(Tensor x, SymInt block_m=256, SymInt block_k=256, Tensor? scale_ub=None, "
    "bool use_triton=True, Device? output_device=None, bool k_major=True) -> (Tensor, Tensor)",
    domain="quantize",
    reference=_block_reference,
    fake=_block_fake,
    samples=_block_samples,
    validate=_validate_block,
    reference_devices=("cpu", "cuda"),
)

# Scale blocks of up to this many elements are quantized from registers (several small blocks per program);
# larger blocks get one program each that reads the block twice (amax, then quantize) in chunks this size.
_BLOCK_TILE = 16384
_MAX_BLOCK_K = 2**20  # a tile's elements at most (Triton's TRITON_MAX_TENSOR_NUMEL)


@triton.jit
def _quantize_fp8_block_kernel(
    x_ptr, xq_ptr, scale_ptr, scale_ub_ptr,
    M, K, stride_xm, stride_xk, stride_qm, stride_sm, stride_sk, eps,
    FP8_MAX: tl.constexpr, HAS_UB: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    TILE_M: tl.constexpr, TILE_K: tl.constexpr, WHOLE_BLOCKS: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    if WHOLE_BLOCKS:
        # The tile holds (TILE_M/BM) x (TILE_K/BK) whole scale blocks: one load, amax per block, one store.
        rows = pid_m * TILE_M + tl.arange(0, TILE_M)[:, None]  # [TILE_M, 1]
        cols = pid_k * TILE_K + tl.arange(0, TILE_K)[None, :]  # [1, TILE_K]
        mask = (rows < M) & (cols < K)
        x = tl.load(x_ptr + rows.to(tl.int64) * stride_xm + cols.to(tl.int64) * stride_xk, mask=mask, other=0.0).to(
            tl.float32
        )
        x4 = tl.reshape(x, [TILE_M // BM, BM, TILE_K // BK, BK])
        amax = tl.reduce(tl.reduce(tl.abs(x4), 3, max_nan), 1, max_nan)  # [TILE_M // BM, TILE_K // BK]
        amax = max_nan(amax, eps)
        if HAS_UB:
            amax = tl.minimum(amax, tl.load(scale_ub_ptr), propagate_nan=tl.PropagateNan.ALL)
        block_rows = pid_m * (TILE_M // BM) + tl.arange(0, TILE_M // BM)[:, None]
        block_cols = pid_k * (TILE_K // BK) + tl.arange(0, TILE_K // BK)[None, :]
        block_mask = (block_rows * BM < M) & (block_cols * BK < K)
        tl.store(scale_ptr + block_rows * stride_sm + block_cols * stride_sk, tl.div_rn(amax, FP8_MAX), mask=block_mask)
        factor = tl.reshape(tl.div_rn(FP8_MAX, amax), [TILE_M // BM, 1, TILE_K // BK, 1])
        q = tl.reshape(x4 * factor, [TILE_M, TILE_K])
        q = tl.clamp(q, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(xq_ptr + rows.to(tl.int64) * stride_qm + cols, q.to(xq_ptr.dtype.element_ty), mask=mask)
    else:
        # One scale block per program, walked in [TILE_M, BK] chunks twice.
        cols = pid_k * BK + tl.arange(0, BK)[None, :]  # [1, BK]
        amax = tl.zeros([TILE_M], dtype=tl.float32)
        for m0 in range(pid_m * BM, tl.minimum(pid_m * BM + BM, M), TILE_M):
            rows = m0 + tl.arange(0, TILE_M)[:, None]
            mask = (rows < M) & (rows < pid_m * BM + BM) & (cols < K)
            x = tl.load(x_ptr + rows.to(tl.int64) * stride_xm + cols.to(tl.int64) * stride_xk, mask=mask, other=0.0)
            amax = max_nan(amax, tl.reduce(tl.abs(x.to(tl.float32)), 1, max_nan))
        amax = max_nan(tl.reduce(amax, 0, max_nan), eps)
        if HAS_UB:
            amax = tl.minimum(amax, tl.load(scale_ub_ptr), propagate_nan=tl.PropagateNan.ALL)
        tl.store(scale_ptr + pid_m * stride_sm + pid_k * stride_sk, tl.div_rn(amax, FP8_MAX))
        factor = tl.div_rn(FP8_MAX, amax)
        for m0 in range(pid_m * BM, tl.minimum(pid_m * BM + BM, M), TILE_M):
            rows = m0 + tl.arange(0, TILE_M)[:, None]
            mask = (rows < M) & (rows < pid_m * BM + BM) & (cols < K)
            x = tl.load(x_ptr + rows.to(tl.int64) * stride_xm + cols.to(tl.int64) * stride_xk, mask=mask, other=0.0)
            q = tl.clamp(x.to(tl.float32) * factor, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
            tl.store(xq_ptr + rows.to(tl.int64) * stride_qm + cols, q.to(xq_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _block_launch_config(block_m: int, block_k: int, m: int, k: int) -> dict:
    """Tile shape: whole blocks per program when they fit, else one program per block, walked in chunks.
    Measured on the H200 (RESULTS.md): rows of up to 8192 per tile, 16 warps for 128x128 blocks."""
    if block_m * block_k <= _BLOCK_TILE:
        tile_k = max(block_k, min(launch.next_power_of_2(k), 8192 // block_m))
        tile_m = max(block_m, min(8192 // tile_k, launch.next_power_of_2(m)))
        warps = 16 if tile_m * tile_k > 8192 else 4
        return {"TILE_M": tile_m, "TILE_K": tile_k, "WHOLE_BLOCKS": True, "num_warps": warps}
    return {"TILE_M": max(1, _BLOCK_TILE // block_k), "TILE_K": block_k, "WHOLE_BLOCKS": False, "num_warps": 8}


def _kernel_blocks(x: torch.Tensor, block_m: int, block_k: int) -> tuple[int, int]:
    """The kernel's block sizes: one longer than both a tile (_BLOCK_TILE) and the data is cut to the data's next
    power of two, the same single block of it all (a block_k of 2^30 would be a tile of 2^30 lanes)."""

    def cut(block: int, size: int) -> int:
        return min(block, launch.next_power_of_2(max(size, 1))) if block > _BLOCK_TILE else block

    return cut(block_m, math.prod(x.shape[:-1])), cut(block_k, x.shape[-1])


def _triton_block_supports(*args, **kwargs):
    x, block_m, block_k, _, use_triton, *_ = BlockArgs(*args, **kwargs)
    reasons = [] if use_triton else ["use_triton=False"]
    if block_m & (block_m - 1) or block_k & (block_k - 1):
        reasons.append(f"block_m={block_m}, block_k={block_k}: the Triton kernel needs powers of two")
    elif _kernel_blocks(x, block_m, block_k)[1] > _MAX_BLOCK_K:
        reasons.append(f"block_k={block_k} over a row of {x.shape[-1]}: the kernel's tiles hold {_MAX_BLOCK_K} at most")
    return reasons


@quantize_fp8_block_op.backend(
    "triton", available=registry.triton_missing, supports=_triton_block_supports, requires=arch.fp8_e4m3_missing
)
def _triton_block(*args, **kwargs):
    x, block_m, block_k, scale_ub, _, output_device, k_major = BlockArgs(*args, **kwargs)
    k = x.shape[-1]
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    m = x2.shape[0]
    fp8 = arch.fp8_dtype(x.device)
    xq = torch.empty(x.shape, dtype=fp8, device=x.device)
    scale = torch.empty(_block_scale_shape(x, block_m, block_k, k_major), dtype=torch.float32, device=x.device)
    if xq.numel():
        block_m, block_k = _kernel_blocks(x, block_m, block_k)
        config = _block_launch_config(block_m, block_k, m, k)
        grid_m = launch.cdiv(m, config["TILE_M"]) if config["WHOLE_BLOCKS"] else launch.cdiv(m, block_m)
        grid = (grid_m, launch.cdiv(k, config["TILE_K"]))
        stride_sm, stride_sk = scale.stride() if k_major else scale.stride()[::-1]
        launch.fast(_quantize_fp8_block_kernel)[grid](
            x2, xq, scale, scale_ub, m, k, x2.stride(0), x2.stride(1), k, stride_sm, stride_sk, arch.FP8_EPS,
            FP8_MAX=torch.finfo(fp8).max, HAS_UB=scale_ub is not None, BM=block_m, BK=block_k, **config,
        )  # fmt: skip
    return to_output_device(output_device, xq, scale)


def triton_quantize_fp8_block(
    x, block_m=256, block_k=256, scale_ub=None, k_major=True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel behind quantize_fp8_block, called directly (spec Q-04: its own argument order, without
    use_triton and output_device); the same checks first."""
    args = (x, block_m, block_k, scale_ub, True, None, k_major)
    _validate_block(*args)
    reasons = _triton_block_supports(*args)
    if reasons:
        raise ValueError(f"triton_quantize_fp8_block: {'; '.join(reasons)}")
    return _triton_block(*args)


def quantize_fp8_block(
    x: torch.Tensor,
    block_m: int = 256,
    block_k: int = 256,
    scale_ub: torch.Tensor | None = None,
    use_triton: bool = True,
    output_device: torch.device | None = None,
    k_major: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FP8 (spec Q-03): x [..., K] viewed as [M, K] -> (xq like x, scale fp32).

    One dequantization scale per block_m x block_k tile: `amax = clamp(max|tile|, 1e-12, scale_ub)`,
    `scale = amax / FP8_MAX`, shape [⌈M/bm⌉, ⌈K/bk⌉] (k_major) or [⌈K/bk⌉, ⌈M/bm⌉]. The defaults are the
    reference's 256; `f8f8bf16_blockwise` wants 128 (pass it explicitly).
    """
    return torch.ops.triton.quantize_fp8_block(x, block_m, block_k, scale_ub, use_triton, output_device, k_major)


def quantize_fp8_group(
    x: torch.Tensor,
    group_size: int = 128,
    scale_ub: torch.Tensor | None = None,
    m_sizes: torch.Tensor | None = None,
    k_major: bool = True,
    use_triton: bool = True,
    output_device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Groupwise FP8 (spec Q-05): one scale per 1 x group_size group along K of x [..., K] (as [M, K]).

    Scale [M, ⌈K/gs⌉] (k_major), [⌈K/gs⌉, M] (k_major=False; the layout f8f8bf16_groupwise consumes), or with
    `m_sizes` [G] the per-expert M-major layout: expert e's [⌈K/gs⌉, M_e] block lies flat at offset
    (Σ M_<e)·⌈K/gs⌉ of an [M, ⌈K/gs⌉] buffer. Same kernel as quantize_fp8_block with block_m = 1.
    """
    check_float_input("quantize_fp8_group", "x", x)
    if group_size < 1:
        raise ValueError(f"quantize_fp8_group: group_size must be positive, got {group_size}")
    if m_sizes is not None and (m_sizes.dim() != 1 or m_sizes.dtype.is_floating_point):
        raise ValueError(
            f"quantize_fp8_group: m_sizes must be a 1-D integer tensor, got {tuple(m_sizes.shape)} {m_sizes.dtype}"
        )
    registry.check_devices("quantize_fp8_group", x=x, m_sizes=m_sizes)
    xq, scale = quantize_fp8_block(
        x, 1, group_size, scale_ub, use_triton, output_device, k_major or m_sizes is not None
    )
    if m_sizes is not None:
        return xq, reference.m_major_group_scales(scale, m_sizes)
    return xq, scale


def triton_quantize_fp8_group(x, group_size=128, scale_ub=None, m_sizes=None, k_major=True):
    """quantize_fp8_group on its Triton kernel wherever it runs (spec Q-06's entry, without use_triton and
    output_device)."""
    return quantize_fp8_group(x, group_size, scale_ub, m_sizes, k_major)


def dequantize_fp8_block(
    xq: torch.Tensor, x_scale: torch.Tensor, block_m: int = 256, block_k: int = 256
) -> torch.Tensor:
    """bf16 `xq · scale` per block_m x block_k tile (spec Q-09), checking the blockwise scale layout first."""
    formats.Blockwise(block_m, block_k).check(xq, x_scale, role="x_scale")
    return reference.dequantize_fp8_block(xq, x_scale, block_m, block_k)


def scale_fp8_row(a: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """`a · x_scale[:, None] · w_scale[None, :]` (spec Q-09): the rowwise GEMM epilogue applied to a [M, N]."""
    if a.dim() != 2 or x_scale.shape != (a.shape[0],) or w_scale.shape != (a.shape[1],):
        raise ValueError(
            f"scale_fp8_row: expected a [M, N], x_scale [M], w_scale [N]; got {tuple(a.shape)}, "
            f"{tuple(x_scale.shape)}, {tuple(w_scale.shape)}"
        )
    return a * x_scale[:, None] * w_scale[None, :]


# ---------------------------------------------------------------------------------------------- tensorwise


def _validate_tensor(a, use_triton=True):
    check_float_input("quantize_fp8_tensor", "a", a)


def _tensor_output(a: torch.Tensor) -> torch.Tensor:
    """quantize_fp8_tensor's xq, uninitialized: a's memory format where a's elements fill it (`_dense_in_memory`:
    contiguous or channels_last(_3d)), else contiguous."""
    fp8 = arch.fp8_dtype(a.device)
    return torch.empty_like(a, dtype=fp8) if _dense_in_memory(a) else a.new_empty(a.shape, dtype=fp8)


def _tensor_reference(a, use_triton=True):
    xq, scale = reference.quantize_fp8_tensor(a, arch.FP8_EPS, arch.fp8_dtype(a.device))
    return _tensor_output(a).copy_(xq), scale


def _tensor_fake(a, use_triton=True):
    return _tensor_output(a), a.new_empty((), dtype=torch.float32)


def _tensor_samples(device):
    yield registry.Sample((testing.randn(7, 33, dtype=torch.bfloat16, device=device),))
    yield registry.Sample((testing.randn(2, 3, 4, 5, 6, device=device, std=30.0),))


quantize_fp8_tensor_op = registry.Op(
    "triton::quantize_fp8_tensor(Tensor a, bool use_triton=True) -> (Tensor, Tensor)",
    domain="quantize",
    reference=_tensor_reference,
    fake=_tensor_fake,
    samples=_tensor_samples,
    validate=_validate_tensor,
    reference_devices=("cpu", "cuda"),
)

_TENSOR_BLOCK = 4096  # elements per program and loop step
_TENSOR_MAX_PROGRAMS = 1024  # partial maxima the quantize pass reduces (one load per program)


@triton.jit
def _amax_partial_kernel(a_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    """partial[p] = max |a| over the elements p*BLOCK + i*P*BLOCK + [0, BLOCK) (grid-stride, P programs)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(a_ptr + offs, mask=offs < n, other=0.0)
        acc = max_nan(acc, tl.abs(x.to(tl.float32)))
    tl.store(partial_ptr + pid, tl.reduce(acc, 0, max_nan))


@triton.jit
def _quantize_fp8_tensor_kernel(
    a_ptr, xq_ptr, partial_ptr, scale_ptr, n, n_partials, eps,
    FP8_MAX: tl.constexpr, BLOCK: tl.constexpr, PARTIALS: tl.constexpr,
):  # fmt: skip
    # Every program reduces the (at most 1024, L2-resident) partial maxima itself: no second grid sync.
    p = tl.arange(0, PARTIALS)
    amax = tl.reduce(tl.load(partial_ptr + p, mask=p < n_partials, other=0.0), 0, max_nan)
    amax = max_nan(amax, eps)
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(scale_ptr, tl.div_rn(amax, FP8_MAX))
    factor = tl.div_rn(FP8_MAX, amax)
    # Walk the grid-stride steps backwards: the amax pass read the end of the input last, so that part is
    # still in L2 (an input larger than L2 is otherwise read twice from memory).
    step = tl.num_programs(0) * BLOCK
    last = (n - 1 - pid * BLOCK) // step
    for i in range(0, last + 1):
        offs = pid * BLOCK + (last - i) * step + tl.arange(0, BLOCK)
        x = tl.load(a_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        q = tl.clamp(x * factor, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(xq_ptr + offs, q.to(xq_ptr.dtype.element_ty), mask=offs < n)


def _dense_in_memory(a: torch.Tensor) -> bool:
    """True when a's elements fill its storage span without gaps (contiguous in some memory format)."""
    formats_ = [torch.contiguous_format]
    if a.dim() == 4:
        formats_.append(torch.channels_last)
    if a.dim() == 5:
        formats_.append(torch.channels_last_3d)
    return any(a.is_contiguous(memory_format=f) for f in formats_)


def _triton_tensor_supports(a, use_triton=True):
    return [] if use_triton else ["use_triton=False"]


@quantize_fp8_tensor_op.backend(
    "triton", available=registry.triton_missing, supports=_triton_tensor_supports, requires=arch.fp8_e4m3_missing
)
def triton_quantize_fp8_tensor(a, use_triton=True):
    """The Triton kernels behind quantize_fp8_tensor (spec Q-08): a partial-amax pass, then a quantize pass."""
    if not _dense_in_memory(a):
        a = a.contiguous()
    fp8 = arch.fp8_dtype(a.device)
    xq = _tensor_output(a)  # a's memory format, so that flat storage order matches
    scale = torch.empty((), dtype=torch.float32, device=a.device)
    n = a.numel()
    sms = arch.sm_count(a.device) if a.is_cuda else 2  # a CPU tensor: the interpreter (T1)
    programs = max(1, min(launch.cdiv(n, _TENSOR_BLOCK), _TENSOR_MAX_PROGRAMS, 4 * sms))
    partial = torch.empty(programs, dtype=torch.float32, device=a.device)
    flat = a.as_strided((n,), (1,))
    launch.fast(_amax_partial_kernel)[(programs,)](flat, partial, n, BLOCK=_TENSOR_BLOCK, num_warps=8)
    launch.fast(_quantize_fp8_tensor_kernel)[(programs,)](
        flat, xq.as_strided((n,), (1,)), partial, scale, n, programs, arch.FP8_EPS,
        FP8_MAX=torch.finfo(fp8).max, BLOCK=_TENSOR_BLOCK, PARTIALS=launch.next_power_of_2(programs), num_warps=8,
    )  # fmt: skip
    return xq, scale


def quantize_fp8_tensor(a: torch.Tensor, use_triton: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise FP8 (spec Q-07): one 0-dim fp32 scale `max(max|a|, 1e-12) / FP8_MAX`; xq has a's shape
    and memory format (channels_last(_3d) kept)."""
    return torch.ops.triton.quantize_fp8_tensor(a, use_triton)
