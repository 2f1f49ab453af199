"""SwiGLU of the experts (spec M-07, M-08): `silu_mul(x0, x1) = x0 · sigmoid(x0) · x1`, and `silu_mul_quant`,
the same followed by rowwise FP8 quantization (quantize_fp8_row).

The references compose the plain-PyTorch SwiGLU with mslk.quantize's rowwise quantizer. The GPU runs one fused
Triton kernel for both ops (`_silu_mul_kernel`): it reads x0 and x1 once and writes the output once (for the
quant op rows longer than 16384 are read twice, an amax pass then a quantize pass, as quantize_fp8_row does).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mslk.core import arch, launch, registry, testing
from mslk.moe.common import check_valid_token_count, row_quant_tiles, valid_rows
from mslk.quantize.triton.common import FLOAT_INPUTS, check_float_input, check_scale_ub, max_nan
from mslk.quantize.triton.fp8_quantize import quantize_fp8_row, row_factor_and_scale, to_levels


def _check_inputs(where, x0, x1, valid_token_count):
    if x0.shape != x1.shape or x0.dim() != 2 or x0.dtype != x1.dtype or not x0.dtype.is_floating_point:
        raise ValueError(
            f"{where}: x0 and x1 must be floating-point [T, D] of one shape and dtype, got {tuple(x0.shape)} "
            f"{x0.dtype} and {tuple(x1.shape)} {x1.dtype}"
        )
    check_valid_token_count(where, valid_token_count)
    registry.check_devices(where, x0=x0, x1=x1, valid_token_count=valid_token_count)


def _validate(x0, x1, valid_token_count=None):
    _check_inputs("silu_mul", x0, x1, valid_token_count)


def _silu_mul(x0, x1, valid_token_count=None):
    a = x0.float()
    out = a * torch.sigmoid(a) * x1.float()
    valid = valid_rows(x0.shape[0], valid_token_count, x0.device)
    if valid is not None:  # rows at or past the count are zero, +0 even where x0 or x1 hold NaN or inf
        out = torch.where(valid[:, None], out, 0.0)
    return out.to(x0.dtype).contiguous()  # (the kernel's layout, whatever x0's: `to` keeps an fp32 view as it is)


def _samples(device):
    x0, x1 = (testing.randn(33, 80, dtype=torch.bfloat16, device=device) for _ in range(2))
    yield registry.Sample((x0, x1))
    yield registry.Sample((x0.float(), x1.float(), torch.tensor([17], device=device)))


silu_mul_op = registry.Op(
    "mslk::silu_mul(Tensor x0, Tensor x1, Tensor? valid_token_count=None) -> Tensor",
    domain="moe",
    reference=_silu_mul,
    fake=lambda x0, x1, valid_token_count=None: x0.new_empty(x0.shape),
    samples=_samples,
    validate=_validate,
    reference_devices=("cpu", "cuda"),
)


def silu_mul(x0: torch.Tensor, x1: torch.Tensor, valid_token_count: torch.Tensor | None = None) -> torch.Tensor:
    """`x0 · sigmoid(x0) · x1` in fp32, in x0's dtype (spec M-07); rows at or past valid_token_count are zero."""
    return torch.ops.mslk.silu_mul(x0, x1, valid_token_count)


def _validate_quant(x0, x1, scale_ub=None, valid_token_count=None):
    _check_inputs("silu_mul_quant", x0, x1, valid_token_count)
    check_float_input("silu_mul_quant", "x0", x0)  # (what the quantizer takes)
    check_scale_ub("silu_mul_quant", scale_ub, x0)


def _silu_mul_quant(x0, x1, scale_ub=None, valid_token_count=None):
    return quantize_fp8_row(_silu_mul(x0, x1, valid_token_count), scale_ub, eps_opt=arch.FP8_EPS)


def _quant_samples(device):
    yield from (registry.Sample((*sample.args[:2], None, *sample.args[2:])) for sample in _samples(device))
    x0, x1 = (testing.randn(5, 200, dtype=torch.float16, device=device, std=3.0) for _ in range(2))
    yield registry.Sample((x0, x1, torch.tensor([2.0], device=device)))


silu_mul_quant_op = registry.Op(
    "mslk::silu_mul_quant(Tensor x0, Tensor x1, Tensor? scale_ub=None, Tensor? valid_token_count=None) "
    "-> (Tensor, Tensor)",
    domain="moe",
    reference=_silu_mul_quant,
    fake=lambda x0, *args: (
        x0.new_empty(x0.shape, dtype=arch.fp8_dtype(x0.device)),
        x0.new_empty(x0.shape[:-1], dtype=torch.float32),
    ),
    samples=_quant_samples,
    validate=_validate_quant,
    reference_devices=("cpu", "cuda"),
)


def silu_mul_quant(
    x0: torch.Tensor,
    x1: torch.Tensor,
    scale_ub: torch.Tensor | None = None,
    valid_token_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_mul then rowwise FP8 (spec M-08): (xq [T, D] in this platform's FP8, dequantization scale fp32 [T]
    = amax / FP8_MAX, amax bounded by scale_ub and floored at 1e-12 as the reference's MoE kernels do, not at
    quantize_fp8_row's 1/512); rows past valid_token_count are zero."""
    return torch.ops.mslk.silu_mul_quant(x0, x1, scale_ub, valid_token_count)


# ------------------------------------------------------------------------------------------- Triton


@triton.jit
def _silu_mul_tile(x0_rows, x1_rows, cols, mask, LIBDEVICE: tl.constexpr, RCP_RN: tl.constexpr):
    """x0 · sigmoid(x0) · x1 of a [BLOCK_M, BLOCK_D] tile in fp32, rounded to x0's dtype, as the reference:
    torch's sigmoid is `1 / (1 + expf(-x))` with the platform's expf (libdevice's) and an IEEE division. On
    NVIDIA GPUs the correctly rounded reciprocal (rcp_rn) gives the division's bits, faster (0.74x of a copy's
    speed against 0.63x for silu_mul_quant of 16384 x 8192 on the H200); ROCm's libdevice has no rcp_rn."""
    x0 = tl.load(x0_rows + cols, mask=mask, other=0.0)
    a = x0.to(tl.float32)
    b = tl.load(x1_rows + cols, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE:
        e = libdevice.exp(-a)
    else:  # the interpreter (T1) has no libdevice: numpy's exp
        e = tl.exp(-a)
    if RCP_RN:
        sigmoid = libdevice.rcp_rn(1.0 + e)
    else:
        sigmoid = tl.div_rn(1.0, 1.0 + e)
    return (a * sigmoid * b).to(x0.dtype)


@triton.jit
def _silu_mul_kernel(
    x0_ptr, x1_ptr, out_ptr, scale_ptr, scale_ub_ptr, count_ptr,
    T, D, stride_x0, stride_x1, stride_out, eps,
    QUANT: tl.constexpr, QMAX: tl.constexpr, HAS_UB: tl.constexpr, HAS_COUNT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, SINGLE_PASS: tl.constexpr,
    LIBDEVICE: tl.constexpr, RCP_RN: tl.constexpr,
):  # fmt: skip
    """silu_mul: program (i, j) writes tile j of row block i of out (x0's dtype). QUANT (silu_mul_quant):
    program i writes whole rows of out (FP8 levels) and their scales, from registers when SINGLE_PASS, else
    reading the rows twice (amax, then quantize)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    in_range = rows < T
    readable = in_range
    if HAS_COUNT:  # rows at or past the count read as zeros: a zero row's result, and no read
        readable = in_range & (rows < tl.load(count_ptr))
    x0_rows = x0_ptr + rows.to(tl.int64)[:, None] * stride_x0  # [BLOCK_M, 1]
    x1_rows = x1_ptr + rows.to(tl.int64)[:, None] * stride_x1
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_out
    cols = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]

    if not QUANT:
        cols = tl.program_id(1) * BLOCK_D + cols
        y = _silu_mul_tile(x0_rows, x1_rows, cols, readable[:, None] & (cols < D), LIBDEVICE, RCP_RN)
        tl.store(out_rows + cols, y, mask=in_range[:, None] & (cols < D))
    elif SINGLE_PASS:
        y = _silu_mul_tile(x0_rows, x1_rows, cols, readable[:, None] & (cols < D), LIBDEVICE, RCP_RN).to(tl.float32)
        factor, scale = row_factor_and_scale(tl.reduce(tl.abs(y), 1, max_nan), eps, scale_ub_ptr, QMAX, HAS_UB)
        tl.store(scale_ptr + rows, scale, mask=in_range)
        q = to_levels(y, factor[:, None], QMAX)
        tl.store(out_rows + cols, q.to(out_ptr.dtype.element_ty), mask=in_range[:, None] & (cols < D))
    else:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            y = _silu_mul_tile(x0_rows, x1_rows, d0 + cols, readable[:, None] & (d0 + cols < D), LIBDEVICE, RCP_RN)
            amax = max_nan(amax, tl.reduce(tl.abs(y.to(tl.float32)), 1, max_nan))
        factor, scale = row_factor_and_scale(amax, eps, scale_ub_ptr, QMAX, HAS_UB)
        tl.store(scale_ptr + rows, scale, mask=in_range)
        for d0 in range(0, D, BLOCK_D):
            y = _silu_mul_tile(x0_rows, x1_rows, d0 + cols, readable[:, None] & (d0 + cols < D), LIBDEVICE, RCP_RN)
            q = to_levels(y.to(tl.float32), factor[:, None], QMAX)
            tl.store(out_rows + d0 + cols, q.to(out_ptr.dtype.element_ty), mask=in_range[:, None] & (d0 + cols < D))


@functools.cache
def _launch_config(d: int, quant: bool) -> dict:
    """Tiles measured on the H200 (bf16, T = 8192-16384 tokens, D = 1536-16384). silu_mul: 512-wide pieces of
    8 rows on 8 warps, 0.94-0.95x the speed of a copy of its bytes. silu_mul_quant: whole rows of up to 16384
    (one row per program from 2048 on), 16 elements per thread (4 warps for 2048, 16 for 8192, 32 for 16384);
    two passes over rows of 14336-16384 ran 1.3-1.45x slower than one."""
    if not quant:
        block_d = min(launch.next_power_of_2(max(d, 1)), 512)
        block_m = max(1, min(64, 4096 // block_d))
        single_pass = True  # (unused) every program writes one tile
    else:
        block_d, single_pass = row_quant_tiles(d)
        block_m = max(1, min(64, 2048 // block_d))
    warps = max(1, min(32 if quant else 8, block_m * block_d // 512))
    return {"BLOCK_M": block_m, "BLOCK_D": block_d, "SINGLE_PASS": single_pass, "num_warps": warps}


def _run_kernel(x0, x1, out, scale=None, scale_ub=None, valid_token_count=None):
    """out = silu_mul(x0, x1) (scale None), or out, scale = silu_mul_quant(x0, x1, scale_ub) (FP8 out)."""
    t, d = x0.shape
    quant = scale is not None
    config = _launch_config(d, quant)
    grid = (launch.cdiv(t, config["BLOCK_M"]), 1 if quant else launch.cdiv(d, config["BLOCK_D"]))
    count = None if valid_token_count is None else valid_token_count.to(x0.device)
    compiled = not testing.interpreting()
    launch.fast(_silu_mul_kernel)[grid](
        x0, x1, out, scale, scale_ub, count, t, d, x0.stride(0), x1.stride(0), out.stride(0), arch.FP8_EPS,
        QUANT=quant, QMAX=float(torch.finfo(out.dtype).max), HAS_UB=scale_ub is not None,
        HAS_COUNT=count is not None, LIBDEVICE=compiled, RCP_RN=compiled and arch.is_cuda(), **config,
    )  # fmt: skip


def _triton_supports(x0, x1, *args, **kwargs):
    reasons = []
    if x0.dtype not in FLOAT_INPUTS:
        reasons.append(f"dtype={x0.dtype} (the Triton kernel takes float32, float16 and bfloat16)")
    if x0.shape[1] > 1 and (x0.stride(1) != 1 or x1.stride(1) != 1):
        reasons.append(
            f"x0.stride()={x0.stride()}, x1.stride()={x1.stride()}: the Triton kernel needs a contiguous last dim"
        )
    return reasons


@silu_mul_op.backend("triton", available=registry.triton_missing, supports=_triton_supports)
def triton_silu_mul(x0, x1, valid_token_count=None):
    """The fused Triton kernel behind silu_mul (spec M-07); same arguments and result."""
    out = torch.empty(x0.shape, dtype=x0.dtype, device=x0.device)
    if out.numel():
        _run_kernel(x0, x1, out, valid_token_count=valid_token_count)
    return out


@silu_mul_quant_op.backend(
    "triton", available=registry.triton_missing, supports=_triton_supports, requires=arch.fp8_e4m3_missing
)
def triton_silu_mul_quant(x0, x1, scale_ub=None, valid_token_count=None):
    """The fused Triton kernel behind silu_mul_quant (spec M-08): one read of x0 and x1 (rows up to 16384), one
    write of xq; same arguments and results."""
    xq = torch.empty(x0.shape, dtype=arch.fp8_dtype(x0.device), device=x0.device)
    scale = torch.empty(x0.shape[0], dtype=torch.float32, device=x0.device)
    if x0.shape[0]:
        _run_kernel(x0, x1, xq, scale, scale_ub, valid_token_count)
    return xq, scale
