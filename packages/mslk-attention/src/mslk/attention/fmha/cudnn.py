"""`cudnn`: cuDNN's fused attention as it ships inside PyTorch (`aten::_scaled_dot_product_cudnn_attention` and
its backward), MSLK backends `cudnnF-pt` / `cudnnB-pt`.

On Hopper it is the fastest kernel PyTorch has for dense attention (RESULTS.md: about 1.7x FlashAttention-2 on
B=4 M=4096 H=16 K=128, forward and backward), so the dispatcher tries it before `flash` for the inputs it takes:
NVIDIA SM90+, f16/bf16, K == Kv a multiple of 8 up to 128 (up to 256 on Hopper, where cuDNN 9 has such kernels:
B=2 M=4096 H=16 K=256 causal forward 0.49 ms against FlashAttention-2's 0.97, RESULTS.md, forty-ninth session), no
mask or a causal one with as many keys as queries (where top-left and bottom-right causality agree), no dropout,
BMHK or BMGHK with mergeable heads. The kernels take [B, H, M, K] views of the BMHK tensors, so nothing is copied;
LSE is [B, H, Mq]. K/V expanded over the query heads with stride 0 (MQA/GQA) reach the forward with one head a
group (cuDNN's own GQA, which reads each K/V head once: H100, K/V of 8 heads under 32 query heads, decoding 16 x
8192 keys 0.171 ms against FlashAttention-2's 0.176, prefill B=4 M=4096 1.86 ms against 3.25; RESULTS.md,
sixty-ninth session); so do they to the backward where autograd sums their heads' gradients anyway
(`Inputs.kv_grads_summed`), which returns dK/dV a K/V head; otherwise it takes no stride-0 K/V.
"""

from __future__ import annotations

import torch

from mslk.attention.fmha.common import (
    AttentionBwOpBase,
    AttentionFwOpBase,
    Context,
    Gradients,
    Inputs,
    aligned,
    bias_types,
    check_16_byte_aligned,
    check_lastdim_alignment_stride1,
    check_not_expanded,
    kv_expanded,
    kv_heads,
)
from mslk.attention.fmha.flash import _mergeable_heads
from mslk.core import arch

_DTYPES = frozenset({torch.float16, torch.bfloat16})
_MAX_K_BEYOND_HOPPER = 128  # head dims past it measured on Hopper only

if arch.cuda_version() is None:
    _NOT_BUILT_REASON = "needs a PyTorch built for CUDA (its cuDNN attention)"
elif not torch.backends.cudnn.is_available():
    _NOT_BUILT_REASON = "this PyTorch was built without cuDNN"
else:
    _NOT_BUILT_REASON = None


def _kernel_reasons(d: Inputs, reasons: list[str], gqa: bool = False) -> list[str]:
    """cuDNN's limits beyond the class attributes: head dims over 128 on Hopper only, 16-byte aligned operands with
    8-element aligned rows, square causal masks, real K/V rows (gqa: but K/V expanded over the heads, which pass
    with one head a group, kv_heads)."""
    if d.query.shape[-1] > _MAX_K_BEYOND_HOPPER and not arch.on_hopper(d.query):  # (the device asked only then)
        reasons.append(f"query.shape[-1] > {_MAX_K_BEYOND_HOPPER} needs Hopper (SM90) here")
    shared = gqa and kv_expanded(d)  # (checked as they are: views of one head a call cost 12 us of host time)
    for name, t in (("query", d.query), ("key", d.key), ("value", d.value)):
        check_lastdim_alignment_stride1(reasons, name, t, 8)
        check_16_byte_aligned(reasons, name, t)
        one_head = shared and name != "query"  # (one head a group is mergeable)
        expanded = check_not_expanded(reasons, name, t, heads_shared=one_head)
        if not expanded and not one_head and t.dim() == 5 and not _mergeable_heads(t):
            reasons.append(f"{name}.stride(2) != {name}.shape[3] * {name}.stride(3): BMGHK needs mergeable heads")
    if d.attn_bias is not None and d.query.shape[1] != d.key.shape[1]:
        reasons.append("Only support causal masks if equal number of keys and queries")
    if d.query.numel() == 0 or d.key.numel() == 0:
        reasons.append("empty query or key")
    return reasons


def _bhmk(t: torch.Tensor) -> torch.Tensor:
    """[B, M, (G,) H, K] as the [B, G·H, M, K] view the kernels take."""
    return (t.flatten(2, 3) if t.dim() == 5 else t).transpose(1, 2)


def _bmhk(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The kernels' [B, G·H, M, K] back as `like`'s [B, M, (G,) H, K]."""
    t = t.transpose(1, 2)
    return t.unflatten(2, like.shape[2:4]) if like.dim() == 5 else t


class FwOp(AttentionFwOpBase):
    """PyTorch's cuDNN attention forward."""

    OPERATOR = torch.ops.aten._scaled_dot_product_cudnn_attention if _NOT_BUILT_REASON is None else None
    NOT_BUILT_REASON = _NOT_BUILT_REASON or ""
    NAME = "cudnnF-pt"
    SUPPORTED_DEVICES = frozenset({"cuda"})
    CUDA_MINIMUM_COMPUTE_CAPABILITY = (9, 0)
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MAX_K = 256  # on Hopper (_kernel_reasons)
    SUPPORTED_MIN_K = 8
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B01 B03")
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_BMGHK = True

    @classmethod
    def not_supported_reasons(cls, d: Inputs) -> list[str]:
        return _kernel_reasons(d, super().not_supported_reasons(d), gqa=True)

    @classmethod
    def apply(cls, inp: Inputs, needs_gradient: bool) -> tuple[torch.Tensor, Context | None]:
        q, k, v = (_bhmk(t) for t in (inp.query, *kv_heads(inp)))
        out, lse, *_ = cls.OPERATOR(
            q, k, v, None, needs_gradient, 0.0, inp.attn_bias is not None, False, scale=inp.scale_float
        )
        out = _bmhk(out, inp.query)
        if not needs_gradient:
            return out, None
        lse = lse[..., 0]
        if inp.query.dim() == 5:
            lse = lse.unflatten(1, inp.query.shape[2:4])
        return out, Context(lse=lse, out=out)


class BwOp(AttentionBwOpBase):
    """PyTorch's cuDNN attention backward, from any forward's output and LSE."""

    OPERATOR = torch.ops.aten._scaled_dot_product_cudnn_attention_backward if _NOT_BUILT_REASON is None else None
    NOT_BUILT_REASON = _NOT_BUILT_REASON or ""
    NAME = "cudnnB-pt"
    SUPPORTED_DEVICES = FwOp.SUPPORTED_DEVICES
    CUDA_MINIMUM_COMPUTE_CAPABILITY = FwOp.CUDA_MINIMUM_COMPUTE_CAPABILITY
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MAX_K = FwOp.SUPPORTED_MAX_K
    SUPPORTED_MIN_K = FwOp.SUPPORTED_MIN_K
    SUPPORTED_ATTN_BIAS_TYPES = FwOp.SUPPORTED_ATTN_BIAS_TYPES
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_BMGHK = True
    IS_DETERMINISTIC = False

    @classmethod
    def not_supported_reasons(cls, d: Inputs) -> list[str]:
        reasons = _kernel_reasons(d, super().not_supported_reasons(d), gqa=d.kv_grads_summed)
        if d.query.shape[1] == d.key.shape[1] == 1:  # (cuDNN frontend's words: it raised them as a RuntimeError)
            reasons.append("s_q = s_kv = 1 is not supported")
        return reasons

    @classmethod
    def apply(cls, ctx: Context, inp: Inputs, grad: torch.Tensor) -> Gradients:
        key, value = kv_heads(inp) if inp.kv_grads_summed else (inp.key, inp.value)
        q, k, v = (_bhmk(t) for t in (inp.query, key, value))
        # The kernel reads out and grad in one layout, in query's dtype (a merged partial's are fp32), 16-byte aligned.
        out, grad = (_bhmk(aligned(t.to(inp.query.dtype).contiguous())) for t in (ctx.out, grad))
        lse = (ctx.lse.flatten(1, 2) if ctx.lse.dim() == 4 else ctx.lse)[..., : q.shape[2], None].float()
        seed = offset = torch.zeros((), dtype=torch.int64, device=inp.device)  # read only with dropout
        mq, mk = q.shape[2], k.shape[2]
        dq, dk, dv = cls.OPERATOR(
            grad, q, k, v, out, lse.contiguous(), seed, offset, None, None, None, mq, mk, 0.0,
            inp.attn_bias is not None, scale=inp.scale_float,
        )  # fmt: skip
        return Gradients(_bmhk(dq, inp.query), _bmhk(dk, key), _bmhk(dv, value))
