"""`triton_flash`: MSLK's own flash-attention forward in Triton (NAME `mslkF-triton`).

One program computes a block of BLOCK_M queries of one (sequence, group, head) with the online softmax in fp32
(exp2 of scores pre-multiplied by scale · log2 e), walking only the key blocks its mask can reach: causal and
sliding-window masks (top-left or bottom-right aligned) bound the key range of the block, so no tile is spent on
masked keys. Varlen batches (block-diagonal masks, padded or gappy keys) read their sequences' bounds from the
mask's seqstart / seqlen tensors on the device. BMGHK and stride-0 expanded K/V (grouped-query attention) are
read through their strides, never copied. fp32 inputs use IEEE fp32 products (no TF32), which the backends
inside PyTorch do not offer on every GPU. Output in the query's dtype or `output_dtype`; LSE [B, (G,) H, Mq]
natural log, varlen packed [1, (G,) H, ΣMq].

Not in the automatic priority list yet (pin it with `op=`): its speed on the GPU machine is still to be
measured. No backward here: after it, the dispatcher picks a backward that reads its LSE layout.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mslk.attention.fmha.common import (
    AttentionFwOpBase,
    Context,
    Inputs,
    bias_types,
    causal_window,
    varlen_args,
)
from mslk.core import launch, registry

_LOG2E = 1.4426950408889634
_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})


@triton.jit
def _flash_forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seqstart_q_ptr, seqstart_k_ptr, seqlen_k_ptr,
    G, H, Mq, Mk, K, Kv, qk_scale, window_left, window_right,
    stride_qb, stride_qm, stride_qg, stride_qh,
    stride_kb, stride_km, stride_kg, stride_kh,
    stride_vb, stride_vm, stride_vg, stride_vh,
    stride_ob, stride_om, stride_og, stride_oh,
    stride_lb, stride_lg, stride_lh,
    VARLEN: tl.constexpr, HAS_SEQLEN_K: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_KV: tl.constexpr,
):  # fmt: skip
    pid_m, pid_bgh = tl.program_id(0), tl.program_id(1)
    b, g, h = pid_bgh // (G * H), (pid_bgh // H) % G, pid_bgh % H
    if VARLEN:  # sequence b: query rows [q_start, q_start + q_len), key rows [k_start, k_start + k_len)
        q_start = tl.load(seqstart_q_ptr + b)
        q_len = tl.load(seqstart_q_ptr + b + 1) - q_start
        k_start = tl.load(seqstart_k_ptr + b)
        if HAS_SEQLEN_K:
            k_len = tl.load(seqlen_k_ptr + b)
        else:
            k_len = tl.load(seqstart_k_ptr + b + 1) - k_start
        batch = 0
    else:
        q_start, q_len, k_start, k_len, batch = 0, Mq, 0, Mk, b
    if pid_m * BLOCK_M < q_len:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # positions in the sequence
        dk = tl.arange(0, BLOCK_K)
        dv = tl.arange(0, BLOCK_KV)
        q_base = q_ptr + tl.cast(batch, tl.int64) * stride_qb + g * stride_qg + h * stride_qh
        q = tl.load(
            q_base + (q_start + rows).to(tl.int64)[:, None] * stride_qm + dk[None, :],
            mask=(rows < q_len)[:, None] & (dk < K)[None, :], other=0.0,
        )  # fmt: skip
        if UPCAST:  # the Triton interpreter multiplies bf16 dot operands as raw integers
            q = q.to(tl.float32)
        k_base = k_ptr + tl.cast(batch, tl.int64) * stride_kb + g * stride_kg + h * stride_kh
        v_base = v_ptr + tl.cast(batch, tl.int64) * stride_vb + g * stride_vg + h * stride_vh

        # Keys j that query i may see: i + shift - window_left <= j <= i + shift + window_right (-1: unbounded).
        shift = k_len - q_len if BOTTOM_RIGHT else 0
        first_row = pid_m * BLOCK_M
        last_row = tl.minimum(first_row + BLOCK_M, q_len) - 1
        lo = tl.where(window_left >= 0, tl.maximum(first_row + shift - window_left, 0) // BLOCK_N * BLOCK_N, 0)
        hi = tl.where(window_right >= 0, tl.minimum(last_row + shift + window_right + 1, k_len), k_len)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_KV], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            k = tl.load(
                k_base + (k_start + cols).to(tl.int64)[:, None] * stride_km + dk[None, :],
                mask=(cols < k_len)[:, None] & (dk < K)[None, :], other=0.0,
            )  # fmt: skip
            v = tl.load(
                v_base + (k_start + cols).to(tl.int64)[:, None] * stride_vm + dv[None, :],
                mask=(cols < k_len)[:, None] & (dv < Kv)[None, :], other=0.0,
            )  # fmt: skip
            if UPCAST:
                k, v = k.to(tl.float32), v.to(tl.float32)
            if IEEE:
                s = tl.dot(q, k.T, input_precision="ieee")
            else:
                s = tl.dot(q, k.T)
            s = s * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
            d = cols[None, :] - rows[:, None] - shift
            visible = (cols < k_len)[None, :] & ((d >= -window_left) | (window_left < 0))
            visible &= (d <= window_right) | (window_right < 0)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row without keys so far stays at zero
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        has_keys = l_i > 0.0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        out_base = out_ptr + tl.cast(batch, tl.int64) * stride_ob + g * stride_og + h * stride_oh
        tl.store(
            out_base + (q_start + rows).to(tl.int64)[:, None] * stride_om + dv[None, :],
            out.to(out_ptr.dtype.element_ty), mask=(rows < q_len)[:, None] & (dv < Kv)[None, :],
        )  # fmt: skip
        lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
        lse_base = lse_ptr + tl.cast(batch, tl.int64) * stride_lb + g * stride_lg + h * stride_lh
        tl.store(lse_base + q_start + rows, lse, mask=rows < q_len)


def _block_m(q: torch.Tensor, head_block: int) -> int:
    """Square BLOCK_M x BLOCK_N tiles that fit in registers without spilling when compiled for SM90 (checked
    offline with the compiler; their speed is still to be measured): 64 for 16-bit inputs up to head dim 128,
    32 above, 16 for the IEEE fp32 products; 16 under the interpreter, which is slow per program."""
    if not q.is_cuda or q.dtype == torch.float32:
        return 16
    return 64 if head_block <= 128 else 32


def _bmghk(t: torch.Tensor) -> torch.Tensor:
    """A [B, M, H, K] tensor as [B, M, 1, H, K] (a view)."""
    return t if t.dim() == 5 else t.unsqueeze(2)


class FwOp(AttentionFwOpBase):
    """MSLK's Triton flash-attention forward (see the module docstring)."""

    OPERATOR = _flash_forward_kernel if registry.triton_missing() is None else None
    NOT_BUILT_REASON = registry.triton_missing() or ""
    NAME = "mslkF-triton"
    SUPPORTED_DEVICES = frozenset({"cuda", "cpu"})  # cpu: the Triton interpreter (tests)
    CUDA_MINIMUM_COMPUTE_CAPABILITY = (8, 0)
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MAX_K = 256
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B01 B03-B14 B18-B20")
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_DIFFERENT_VALUE_EMBED = True
    SUPPORTS_OUTPUT_DTYPE = True
    SUPPORTS_PARTIAL = True
    SUPPORTS_BMGHK = True
    VARLEN_LSE_PACKED = True

    @classmethod
    def apply(cls, inp: Inputs, needs_gradient: bool) -> tuple[torch.Tensor, Context | None]:
        q, k, v = (_bmghk(t) for t in (inp.query, inp.key, inp.value))
        batch, mq, groups, heads, dim = q.shape
        mk, dim_v = k.shape[1], v.shape[-1]
        out = torch.empty((batch, mq, groups, heads, dim_v), dtype=inp.get_output_dtype(), device=q.device)
        varlen = varlen_args(inp.attn_bias)
        sequences = batch if varlen is None else varlen.seqstart_q.numel() - 1
        max_q = mq if varlen is None else varlen.max_seqlen_q
        lse = torch.empty((batch, groups, heads, mq), dtype=torch.float32, device=q.device)
        alignment, window_left, window_right = causal_window(inp.attn_bias)
        if alignment is None and (window_left >= 0 or window_right >= 0):
            alignment = "bottom-right"  # a local window without causality is aligned like FlashAttention's
        if out.numel() and max_q:
            block_k, block_kv = launch.next_power_of_2(max(dim, 16)), launch.next_power_of_2(max(dim_v, 16))
            block_m = _block_m(q, max(block_k, block_kv))
            seqlen_k = None if varlen is None else varlen.seqlen_k
            grid = (launch.cdiv(max_q, block_m), sequences * groups * heads)
            _flash_forward_kernel[grid](
                q, k, v, out, lse,
                *(None, None) if varlen is None else (varlen.seqstart_q, varlen.seqstart_k), seqlen_k,
                groups, heads, mq, mk, dim, dim_v, inp.scale_float * _LOG2E, window_left, window_right,
                *(q.stride(i) for i in range(4)), *(k.stride(i) for i in range(4)), *(v.stride(i) for i in range(4)),
                *(out.stride(i) for i in range(4)), *lse.stride()[:3],
                VARLEN=varlen is not None, HAS_SEQLEN_K=seqlen_k is not None,
                BOTTOM_RIGHT=alignment == "bottom-right", IEEE=q.dtype == torch.float32,
                UPCAST=q.dtype == torch.bfloat16 and not q.is_cuda,
                BLOCK_M=block_m, BLOCK_N=block_m, BLOCK_K=block_k, BLOCK_KV=block_kv,
                num_warps=4, num_stages=2,
            )  # fmt: skip
        elif out.numel():
            out.zero_()
        if max_q == 0 or out.numel() == 0:
            lse.fill_(-math.inf)
        if inp.query.dim() == 4:
            out, lse = out[:, :, 0], lse[:, 0]
        return out, Context(lse=lse, out=out) if needs_gradient else None
