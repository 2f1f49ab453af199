"""Grouped GEMMs for MoE (spec G-06, G-12): one persistent Triton kernel for all the groups of a stacked input.

    out[rows of group g] = X[rows of group g] · W[g]ᵀ        (bf16 / fp16)
    out[rows of group g] = (XQ · WQ[g]ᵀ) · x_scale[row] · w_scale[g, col]        (FP8 rowwise)

X [ΣM, K] holds the groups' rows back to back (M_sizes [G] rows each), W [G, N, K]. The programs (one per SM)
walk the groups in order and take every P-th output tile of the concatenated tile list, reading M_sizes on the
device: no host sync (CUDA graphs record it), no launch per group, and empty groups or groups smaller than a
tile cost nothing but their scalar load. Rows past ΣM_sizes come out zero (the same programs write them).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mslk.core import arch, formats, launch, registry, testing
from mslk.gemm.triton.fp8_gemm import load_k_step, quantize_rows


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, out_ptr, m_sizes_ptr, x_scale_ptr, w_scale_ptr, G, TOTAL_M, N, K,
    stride_xm, stride_wg, stride_wn, stride_om, stride_wsg,
    FP8_ROWWISE: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid, programs = tl.program_id(0), tl.num_programs(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    first_row = 0  # of the current group in X and out
    first_tile = 0  # of the current group in the concatenated tile list
    for g in range(G + 1):  # the groups, then the rows past their sum (zeros)
        if g < G:  # clamped, so that sizes summing past X's rows never read outside it
            m = tl.minimum(tl.maximum(tl.load(m_sizes_ptr + g).to(tl.int32), 0), TOTAL_M - first_row)
        else:
            m = TOTAL_M - first_row
        tiles = tl.cdiv(m, BLOCK_M) * tiles_n
        # This program's first tile of the group: the next index >= first_tile that is pid modulo P.
        tile = (pid - first_tile % programs + programs) % programs
        while tile < tiles:
            pid_m, pid_n = tile // tiles_n, tile % tiles_n
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            # Out-of-range rows/cols read the group's first row / W's row 0; their results are never stored.
            x_rows = first_row + tl.where(rows < m, rows, 0)
            x_ptrs = x_ptr + x_rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
            w_rows = tl.where(cols < N, cols, 0).to(tl.int64)
            w_ptrs = w_ptr + tl.cast(g, tl.int64) * stride_wg + w_rows[:, None] * stride_wn + ks[None, :]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            k_steps = tl.cdiv(K, BLOCK_K) * (g < G)
            for k in range(k_steps):
                a, b = load_k_step(x_ptrs, w_ptrs, ks, K - k * BLOCK_K, EVEN_K)
                if UPCAST:  # the Triton interpreter multiplies bf16 operands as raw integers
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc = tl.dot(a, b.T, acc)
                x_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
            if FP8_ROWWISE:
                if g < G:
                    acc *= tl.load(x_scale_ptr + x_rows)[:, None]
                    acc *= tl.load(w_scale_ptr + g * stride_wsg + tl.where(cols < N, cols, 0))[None, :]
            out_ptrs = out_ptr + (first_row + rows).to(tl.int64)[:, None] * stride_om + cols[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < m)[:, None] & (cols < N)[None, :])
            tile += programs
        first_row += m
        first_tile += tiles


@functools.cache
def _grouped_config(fp8: bool) -> dict:
    # 128 x 128 tiles, 128-byte-deep K steps: (128 + 128) · 128 B per stage for FP8, twice that for 16-bit.
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128 if fp8 else 64, "num_stages": 4, "num_warps": 8}


def _run_grouped(x, w, m_sizes, out, x_scale=None, w_scale=None, num_sms=None):
    """out [ΣM, N] of x [ΣM, K] and w [G, N, K] (K-contiguous rows), with rowwise FP8 scales when given."""
    n, k = w.shape[1], w.shape[2]
    if out.numel() == 0:
        return out
    cfg = _grouped_config(x_scale is not None)
    tiles_upper_bound = launch.cdiv(x.shape[0], cfg["BLOCK_M"]) + w.shape[0] + 1  # tile rows, the tail included
    programs = num_sms or (arch.sm_count(x.device) if x.is_cuda else 4)
    programs = max(1, min(programs, tiles_upper_bound * launch.cdiv(n, cfg["BLOCK_N"])))
    _grouped_gemm_kernel[(programs,)](
        x, w, out, m_sizes, x_scale, w_scale, w.shape[0], x.shape[0], n, k, x.stride(0), w.stride(0), w.stride(1),
        out.stride(0), 0 if w_scale is None else w_scale.stride(0), FP8_ROWWISE=x_scale is not None,
        EVEN_K=k % cfg["BLOCK_K"] == 0, UPCAST=x.dtype == torch.bfloat16 and not x.is_cuda, **cfg,
    )  # fmt: skip
    return out


def _k_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_stacked(where: str, x, w, m_sizes) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(
            f"{where}: expected X [ΣM, K] and W [G, N, K] with the same K, got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    if m_sizes.dim() != 1 or m_sizes.dtype not in (torch.int32, torch.int64) or m_sizes.shape[0] != w.shape[0]:
        raise ValueError(
            f"{where}: M_sizes must be int32/int64 [G] = [{w.shape[0]}], got {tuple(m_sizes.shape)} {m_sizes.dtype}"
        )
    if len({t.device for t in (x, w, m_sizes)}) > 1:
        raise ValueError(
            f"{where}: X, W and M_sizes must be on one device, got {x.device}, {w.device}, {m_sizes.device}"
        )


def _reference(x, w, m_sizes, x_scale=None, w_scale=None):
    """fp32 per-group matmuls (reads M_sizes on the host); rows past ΣM_sizes stay zero."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for g, m in enumerate(m_sizes.tolist()):
        part = x[start : start + m].float() @ w[g].float().T
        if x_scale is not None:
            part = part * x_scale[start : start + m, None].float() * w_scale[g][None, :].float()
        out[start : start + m] = part
        start += m
    return out


def _ragged_sizes(total: int, groups: int, device) -> torch.Tensor:
    """Random group sizes summing to total, with empty groups among them (int64)."""
    cuts = torch.sort(torch.randint(0, total + 1, (groups - 1,))).values
    sizes = torch.diff(torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([total])]))
    return sizes.to(device)


# ------------------------------------------------------------------------------------------------- bf16


def _validate_bf16(X, W, M_sizes, out=None, num_sms=None):
    where = "bf16bf16bf16_grouped_stacked"
    _check_stacked(where, X, W, M_sizes)
    if X.dtype not in (torch.bfloat16, torch.float16) or W.dtype != X.dtype:
        raise ValueError(f"{where}: X and W must both be bfloat16 or float16, got {X.dtype} and {W.dtype}")
    expected = (X.shape[0], W.shape[1])
    if out is not None and (tuple(out.shape) != expected or out.dtype != X.dtype or out.device != X.device):
        raise ValueError(
            f"{where}: out must be {X.dtype} {expected} on {X.device}, got {tuple(out.shape)} {out.dtype} on "
            f"{out.device}"
        )
    if num_sms is not None and num_sms < 1:
        raise ValueError(f"{where}: num_sms must be positive, got {num_sms}")


def _bf16_reference(X, W, M_sizes, out=None, num_sms=None):
    result = _reference(X, W, M_sizes).to(X.dtype)
    return result if out is None else out.copy_(result)


def _bf16_samples(device):
    for total, groups, n, k in ((37, 4, 24, 64), (5, 3, 130, 48)):
        x = testing.randn(total, k, dtype=torch.bfloat16, device=device)
        w = testing.randn(groups, n, k, dtype=torch.bfloat16, device=device)
        yield registry.Sample((x, w, _ragged_sizes(total, groups, device)))


bf16bf16bf16_grouped_stacked_op = registry.Op(
    "mslk::bf16bf16bf16_grouped_stacked(Tensor X, Tensor W, Tensor M_sizes, Tensor(a!)? out=None, "
    "int? num_sms=None) -> Tensor",
    domain="gemm",
    reference=_bf16_reference,
    fake=lambda X, W, *args, **kwargs: X.new_empty((X.shape[0], W.shape[1])),
    samples=_bf16_samples,
    validate=_validate_bf16,
    tolerance=1e-2,
)


@bf16bf16bf16_grouped_stacked_op.backend("triton", available=registry.triton_missing)
def _bf16_triton(X, W, M_sizes, out=None, num_sms=None):
    result = torch.empty((X.shape[0], W.shape[1]), dtype=X.dtype, device=X.device)
    _run_grouped(_k_contiguous(X), _k_contiguous(W), M_sizes.contiguous(), result, num_sms=num_sms)
    return result if out is None else out.copy_(result)


def bf16bf16bf16_grouped_stacked(X, W, M_sizes, out=None, num_sms=None) -> torch.Tensor:
    """Grouped GEMM of stacked groups (spec G-12): X [ΣM, K] bf16/fp16, W [G, N, K], M_sizes [G] int64 (or
    int32) rows per group -> [ΣM, N] with out[rows of g] = X[rows of g] · W[g]ᵀ (fp32 sums), into `out` when
    given; `num_sms` caps the persistent programs."""
    return torch.ops.mslk.bf16bf16bf16_grouped_stacked(X, W, M_sizes, out, num_sms)


# ------------------------------------------------------------------------------------------ FP8 rowwise


def _validate_fp8(XQ, WQ, x_scale, w_scale, M_sizes):
    where = "f8f8bf16_rowwise_grouped_stacked"
    formats.check_fp8_data(XQ, role=f"{where}: XQ", producer="quantize_fp8_row")
    formats.check_fp8_data(WQ, role=f"{where}: WQ", producer="quantize_fp8_row")
    _check_stacked(where, XQ, WQ, M_sizes)
    formats.Rowwise().check(XQ, x_scale, role=f"{where}: x_scale")
    formats.Rowwise().check(WQ, w_scale, role=f"{where}: w_scale")


def _fp8_samples(device):
    for total, groups, n, k in ((37, 4, 24, 64), (5, 3, 130, 96)):
        xq, xs = quantize_rows(testing.randn(total, k, device=device))
        wq, ws = quantize_rows(testing.randn(groups, n, k, device=device))
        yield registry.Sample((xq, wq, xs, ws, _ragged_sizes(total, groups, device)))


f8f8bf16_rowwise_grouped_stacked_op = registry.Op(
    "mslk::f8f8bf16_rowwise_grouped_stacked(Tensor XQ, Tensor WQ, Tensor x_scale, Tensor w_scale, Tensor M_sizes) "
    "-> Tensor",
    domain="gemm",
    reference=lambda XQ, WQ, x_scale, w_scale, M_sizes: _reference(XQ, WQ, M_sizes, x_scale, w_scale).to(
        torch.bfloat16
    ),
    fake=lambda XQ, WQ, *args: XQ.new_empty((XQ.shape[0], WQ.shape[1]), dtype=torch.bfloat16),
    samples=_fp8_samples,
    validate=_validate_fp8,
    tolerance=1e-2,
)


@f8f8bf16_rowwise_grouped_stacked_op.backend("triton", available=registry.triton_missing)
def _fp8_triton(XQ, WQ, x_scale, w_scale, M_sizes):
    out = torch.empty((XQ.shape[0], WQ.shape[1]), dtype=torch.bfloat16, device=XQ.device)
    return _run_grouped(
        _k_contiguous(XQ), _k_contiguous(WQ), M_sizes.contiguous(), out, x_scale.reshape(-1).contiguous(),
        w_scale.reshape(WQ.shape[0], -1).contiguous(),
    )  # fmt: skip


def f8f8bf16_rowwise_grouped_stacked(XQ, WQ, x_scale, w_scale, M_sizes) -> torch.Tensor:
    """Grouped rowwise FP8 GEMM (spec G-06): XQ [ΣM, K], WQ [G, N, K] FP8, x_scale [ΣM] and w_scale [G, N] fp32
    (quantize_fp8_row), M_sizes [G] -> bf16 [ΣM, N] = (XQ[rows of g] · WQ[g]ᵀ) · x_scale · w_scale[g]."""
    return torch.ops.mslk.f8f8bf16_rowwise_grouped_stacked(XQ, WQ, x_scale, w_scale, M_sizes)
