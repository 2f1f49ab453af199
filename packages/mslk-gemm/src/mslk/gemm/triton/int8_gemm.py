"""INT8 GEMMs (spec G-22, G-23, G-57): i8i8bf16, i8i8bf16_dynamic.

    out[m, n] = bf16(float(Σ_k XQ[m, k] · WQ[n, k]) · scale)        XQ [M, K], WQ [N, K] int8, int32 sums

with one tensorwise dequantization scale: a Python float (i8i8bf16) or a one-element fp32 device tensor
(i8i8bf16_dynamic: read by the kernel, so CUDA graphs capture it). One Triton kernel, int8 tensor-core dots into
int32. `split_k` splits K over more programs, whose int32 partial sums a second kernel (a dependent launch on
Hopper) adds in int64 into bf16: integer sums are exact, so every split gives the same bits; split_k=1 lets the
kernel choose (it splits decode shapes). K past 2^16 is always split, at most 2^16 a part: the int32 sums of more
products of int8 could pass 2^31 (upstream's wrap there).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mslk.core import arch, formats, launch, registry, testing
from mslk.gemm.triton.fp8_gemm import k_contiguous, load_k_step, tile_coordinates
from mslk.gemm.triton.split_k import begin_as_dependent, splitk_reduce


def _validate(where: str, XQ, WQ, split_k) -> None:
    if XQ.dtype != torch.int8 or WQ.dtype != torch.int8 or XQ.dim() != 2 or WQ.dim() != 2:
        raise ValueError(
            f"{where}: expected int8 XQ [M, K] and WQ [N, K], got {tuple(XQ.shape)} {XQ.dtype} and "
            f"{tuple(WQ.shape)} {WQ.dtype}"
        )
    if XQ.shape[1] != WQ.shape[1]:
        raise ValueError(f"{where}: XQ and WQ disagree on K: {tuple(XQ.shape)} and {tuple(WQ.shape)}")
    if XQ.device != WQ.device:
        raise ValueError(f"{where}: XQ is on {XQ.device} but WQ is on {WQ.device}")
    if split_k < 1:
        raise ValueError(f"{where}: split_k must be positive, got {split_k}")


def _reference(XQ, WQ, scale) -> torch.Tensor:
    """float64 products (exact for int8 up to K = 2^38), times the scale, rounded once to bf16."""
    return (torch.matmul(XQ.double(), WQ.double().T) * scale).to(torch.bfloat16)


@triton.jit
def _i8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, scale_ptr, scale, M, N, K, steps_per_split, stride_am, stride_bn, stride_cs, stride_cm,
    SCALE_PTR: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """C = A · Bᵀ over one split of K (program ids: tile, split), int32 sums; SPLIT: C is the int32 workspace
    [splits, M, N], else bf16 of the sums times scale (and scale_ptr[0]). DEPENDENT_LAUNCH: launched as a dependent
    (`begin_as_dependent`)."""
    if DEPENDENT_LAUNCH:
        begin_as_dependent()
    tile, split = tl.program_id(0), tl.program_id(1)
    pid_m, pid_n = tile_coordinates(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    first = split * steps_per_split
    ks = tl.arange(0, BLOCK_K)
    # Out-of-range rows/cols read row 0 (in bounds); their results are never stored.
    a_ptrs = a_ptr + tl.where(rows < M, rows, 0).to(tl.int64)[:, None] * stride_am + first * BLOCK_K + ks[None, :]
    b_ptrs = b_ptr + tl.where(cols < N, cols, 0).to(tl.int64)[:, None] * stride_bn + first * BLOCK_K + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for step in range(first, tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))):
        a, b = load_k_step(a_ptrs, b_ptrs, ks, K - step * BLOCK_K, EVEN_K)
        acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + tl.cast(split, tl.int64) * stride_cs + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if SPLIT:
        tl.store(c_ptrs, acc, mask=mask)
    else:
        out = acc.to(tl.float32) * scale
        if SCALE_PTR:
            out *= tl.load(scale_ptr)
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask)


_EXACT_K = 2**16  # products of int8 (at most 2^14 in magnitude) one int32 sum holds exactly


@functools.cache
def _config(m: int, n: int, k: int, sms: int, split_k: int) -> dict:
    """Tiles by shape class for Hopper (timed: RESULTS.md's i8i8bf16 rows): decode (M <= 64) narrow tiles
    with K split until two programs per SM fill one wave (or split_k's splits); larger M 128 x 128 and 128 x 256
    tiles of 128-deep steps, (128 + 256) · 128 B per stage."""
    if m <= 64:
        cfg = {"BLOCK_M": max(16, launch.next_power_of_2(m)), "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1,
               "num_warps": 4, "num_stages": 5}  # fmt: skip
    elif m <= 256 or n <= 1024:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
    else:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
    steps = launch.cdiv(k, cfg["BLOCK_K"])
    tiles = launch.cdiv(m, cfg["BLOCK_M"]) * launch.cdiv(n, cfg["BLOCK_N"])
    splits = split_k if split_k > 1 else max(1, min((2 * sms) // tiles, steps // 8))
    per_split = min(launch.cdiv(steps, min(splits, steps)), _EXACT_K // cfg["BLOCK_K"])
    return {**cfg, "splits": launch.cdiv(steps, per_split), "steps_per_split": per_split}


def _run(XQ, WQ, scale: float, scale_tensor, split_k: int) -> torch.Tensor:
    (m, k), n = XQ.shape, WQ.shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16, device=XQ.device)
    if launch.no_products(out, k):
        return out
    a, b = k_contiguous(XQ), k_contiguous(WQ)
    cfg = dict(_config(m, n, k, arch.sm_count(XQ.device) if XQ.is_cuda else 4, split_k))
    splits, per_split = cfg.pop("splits"), cfg.pop("steps_per_split")
    split = splits > 1
    c = torch.empty((splits, m, n), dtype=torch.int32, device=XQ.device) if split else out
    grid = (launch.cdiv(m, cfg["BLOCK_M"]) * launch.cdiv(n, cfg["BLOCK_N"]), splits)
    dependent = launch.dependent_launch(XQ.device)
    launch.fast(_i8_gemm_kernel)[grid](
        a, b, c, scale_tensor, scale, m, n, k, per_split, a.stride(0), b.stride(0), c.stride(0) if split else 0,
        c.stride(-2), SCALE_PTR=scale_tensor is not None, SPLIT=split, EVEN_K=k % cfg["BLOCK_K"] == 0,
        DEPENDENT_LAUNCH=dependent, **launch.dependent_launch_options(dependent), **cfg,
    )  # fmt: skip
    if split:
        splitk_reduce(c, out, scalar=scale, scalar_tensor=scale_tensor)
    return out


def _samples(dynamic: bool):
    def samples(device):
        for m, n, k, split_k in ((37, 40, 200, 1), (5, 24, 512, 3)):
            xq, wq = random_int8(m, k, device=device), random_int8(n, k, device=device)
            scale = torch.rand((), device=device) * 1e-3 + 1e-4
            yield registry.Sample((xq, wq, scale if dynamic else scale.item(), split_k))

    return samples


# ------------------------------------------------------------------------------------------------ i8i8bf16


def _validate_static(XQ, WQ, scale, split_k=1):
    _validate("i8i8bf16", XQ, WQ, split_k)


i8i8bf16_op = registry.Op(
    "mslk::i8i8bf16(Tensor XQ, Tensor WQ, float scale, int split_k=1) -> Tensor",
    domain="gemm",
    reference=lambda XQ, WQ, scale, split_k=1: _reference(XQ, WQ, scale),
    fake=lambda XQ, WQ, *args, **kwargs: XQ.new_empty((XQ.shape[0], WQ.shape[0]), dtype=torch.bfloat16),
    samples=_samples(dynamic=False),
    validate=_validate_static,
    tolerance=1e-2,
)


@i8i8bf16_op.backend("triton", available=registry.triton_missing)
def _static_triton(XQ, WQ, scale, split_k=1):
    return _run(XQ, WQ, scale, None, split_k)


def i8i8bf16(XQ, WQ, scale: float, split_k: int = 1) -> torch.Tensor:
    """bf16 (XQ · WQᵀ) · scale (spec G-22): XQ [M, K] and WQ [N, K] int8, int32 sums; `split_k` splits K over more
    programs (1: the kernel chooses; every split gives the same result)."""
    return torch.ops.mslk.i8i8bf16(XQ, WQ, scale, split_k)


# ---------------------------------------------------------------------------------------- i8i8bf16_dynamic


def _validate_dynamic(XQ, WQ, scale, split_k=1):
    where = "i8i8bf16_dynamic"
    _validate(where, XQ, WQ, split_k)
    problems = formats.Tensorwise().problems(XQ, scale)
    if problems:
        raise formats.ScaleFormatError(
            f"{where}: scale must be one float32 value on XQ's device (a tensor, so that CUDA graphs capture it); "
            f"got {'; '.join(problems)}"
        )


i8i8bf16_dynamic_op = registry.Op(
    "mslk::i8i8bf16_dynamic(Tensor XQ, Tensor WQ, Tensor scale, int split_k=1) -> Tensor",
    domain="gemm",
    reference=lambda XQ, WQ, scale, split_k=1: _reference(XQ, WQ, scale.double().reshape(())),
    fake=lambda XQ, WQ, *args, **kwargs: XQ.new_empty((XQ.shape[0], WQ.shape[0]), dtype=torch.bfloat16),
    samples=_samples(dynamic=True),
    validate=_validate_dynamic,
    tolerance=1e-2,
)


@i8i8bf16_dynamic_op.backend("triton", available=registry.triton_missing)
def _dynamic_triton(XQ, WQ, scale, split_k=1):
    return _run(XQ, WQ, 1.0, scale.reshape(()), split_k)


def i8i8bf16_dynamic(XQ, WQ, scale: torch.Tensor, split_k: int = 1) -> torch.Tensor:
    """i8i8bf16 with the scale a one-element fp32 device tensor (spec G-23), read on the device."""
    return torch.ops.mslk.i8i8bf16_dynamic(XQ, WQ, scale, split_k)


def i8i8bf16_triton(XQ, WQ, scale: float, split_k: int = 1) -> torch.Tensor:
    """The reference library's Triton entry (spec G-57): i8i8bf16."""
    return i8i8bf16(XQ, WQ, scale, split_k)


def i8i8bf16_dynamic_triton(XQ, WQ, scale: torch.Tensor, split_k: int = 1) -> torch.Tensor:
    """The reference library's Triton entry (spec G-57): i8i8bf16_dynamic."""
    return i8i8bf16_dynamic(XQ, WQ, scale, split_k)


def random_int8(*shape: int, device="cpu") -> torch.Tensor:
    """Random int8 values over the whole range (samples, tests and benches)."""
    return testing.randn(*shape, device=device, std=60.0).round().clamp(-128, 127).to(torch.int8)
