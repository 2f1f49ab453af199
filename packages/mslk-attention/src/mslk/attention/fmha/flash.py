"""`flash`: FlashAttention-2 as it ships inside PyTorch (`aten::_flash_attention_forward/_backward`), spec
§2.3 rows `fa2F@<version>-pt` / `fa2B@<version>-pt`.

NVIDIA SM80+, f16/bf16, head dim <= 256 and K == Kv, dropout. Causal attention is bottom-right aligned in
FlashAttention-2, so top-left causal masks (B01, B07, B09) are served only where each block has as many keys as
queries; local masks become `window_size_left/right`; varlen batches (B = 1) run as [ΣM, H, K] with
`cum_seq_q/k` (+ `seqused_k` for padded and gappy keys). BMGHK merges G and H into one head dim (GQA natively
when K/V are expanded over H with stride 0). LSE: [B, (G,) H, Mq], varlen packed [1, (G,) H, ΣMq].
"""

from __future__ import annotations

import torch

from mslk.attention.fmha import attn_bias as ab
from mslk.attention.fmha.common import (
    AttentionBwOpBase,
    AttentionFwOpBase,
    Context,
    Gradients,
    Inputs,
    aligned,
    bias_types,
    capturing_cuda_graph,
    causal_window,
    check_16_byte_aligned,
    check_lastdim_alignment_stride1,
    kv_expanded,
    kv_heads,
    varlen_args,
)
from mslk.core import arch


def _flash_version() -> str:
    get = getattr(torch.nn.attention, "_get_flash_version", None)
    return get() if get is not None else "2"


FLASH_VERSION = _flash_version()
_DTYPES = frozenset({torch.float16, torch.bfloat16})


# The kernels exist in CUDA builds of PyTorch made with FlashAttention (checked once: a build question).
if arch.cuda_version() is None:
    _NOT_BUILT_REASON = "needs a PyTorch built for CUDA (its FlashAttention-2 kernels)"
elif not torch.backends.cuda.is_flash_attention_available():
    _NOT_BUILT_REASON = "this PyTorch was built without FlashAttention"
else:
    _NOT_BUILT_REASON = None


def _mergeable_heads(t: torch.Tensor) -> bool:
    """Whether [B, M, G, H, K] views as [B, M, G·H, K] without a copy."""
    return t.shape[3] == 1 or t.stride(2) == t.shape[3] * t.stride(3)


def _kernel_reasons(d: Inputs, reasons: list[str], one_head_a_group: bool) -> list[str]:
    """The kernel's own limits: 8-element loads from 16-byte aligned operands, bottom-right causality, BMGHK head
    merging (one_head_a_group: K/V expanded over H pass as one head a group, kv_heads)."""
    for name, t in (("query", d.query), ("key", d.key), ("value", d.value)):
        check_lastdim_alignment_stride1(reasons, name, t, 8)
        check_16_byte_aligned(reasons, name, t)
    bias = d.attn_bias
    if isinstance(bias, ab.BlockDiagonalCausalMask):
        if bias.q_seqinfo.seqstart_py != bias.k_seqinfo.seqstart_py:
            reasons.append("Only support BlockDiagonalCausalMask if equal numbers of keys and queries")
        elif bias.q_seqinfo is not bias.k_seqinfo and capturing_cuda_graph(d):
            # A replay after in-place updates that make the lengths differ would run bottom-right causality.
            reasons.append(
                "BlockDiagonalCausalMask in a CUDA graph capture: its query and key lengths, equal now, are separate "
                "metadata that in-place updates may make unequal (build it with kv_seqlen=None to share one)"
            )
    elif isinstance(bias, ab.LowerTriangularMask) and d.query.shape[1] != d.key.shape[1]:
        reasons.append("Only support LowerTriangularMask if equal number of keys and queries")
    if d.query.dim() == 5:
        shared = one_head_a_group and kv_expanded(d)
        merged = (("query", d.query),) if shared else (("query", d.query), ("key", d.key), ("value", d.value))
        for name, t in merged:
            if not _mergeable_heads(t):
                reasons.append(
                    f"{name}.stride(2) != {name}.shape[3] * {name}.stride(3) ({name}.stride() = {t.stride()}): BMGHK "
                    "needs G and H mergeable into one head dim (or K/V expanded over H with stride 0, in a backward "
                    "where autograd sums their heads' gradients)"
                )
    return reasons


def _merged_heads(query: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """BMGHK tensors with G and H merged into one head dim (as FlashAttention-2 takes them), BMHK ones as they are."""
    return [t.flatten(2, 3) for t in tensors] if query.dim() == 5 else list(tensors)


def _split_heads(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A kernel's [B, M, G·H, K] result back as `like`'s BMGHK [B, M, G, H, K] (BMHK as it is)."""
    return t.unflatten(2, like.shape[2:4]) if like.dim() == 5 else t


def _kernel_layout(inp: Inputs, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """[B, M, H, K] tensors as the kernel takes them: [ΣM, H, K] for varlen batches (B = 1)."""
    return [t[0] for t in tensors] if varlen_args(inp.attn_bias) is not None else list(tensors)


def _call_args(inp: Inputs) -> tuple[tuple, dict]:
    """(cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal) and the keyword arguments of both kernels."""
    causal, window_left, window_right = causal_window(inp.attn_bias)
    kwargs = {"scale": inp.scale_float, "window_size_left": window_left, "window_size_right": window_right}
    varlen = varlen_args(inp.attn_bias)
    if varlen is None:
        sequences = (None, None, inp.query.shape[1], inp.key.shape[1])
    else:
        sequences = (varlen.seqstart_q, varlen.seqstart_k, varlen.max_seqlen_q, varlen.max_seqlen_k)
    return (*sequences, inp.p, causal is not None), kwargs


class FwOp(AttentionFwOpBase):
    """PyTorch's FlashAttention-2 forward."""

    OPERATOR = torch.ops.aten._flash_attention_forward if _NOT_BUILT_REASON is None else None
    NOT_BUILT_REASON = _NOT_BUILT_REASON or ""
    NAME = f"fa2F@{FLASH_VERSION}-pt"
    SUPPORTED_DEVICES = frozenset({"cuda"})
    CUDA_MINIMUM_COMPUTE_CAPABILITY = (8, 0)
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MAX_K = 256
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B01 B03 B04 B05 B06-B14 B18 B19")
    SUPPORTS_DROPOUT = True
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_BMGHK = True
    SUPPORTS_PARTIAL = True

    @classmethod
    def not_supported_reasons(cls, d: Inputs) -> list[str]:
        return _kernel_reasons(d, super().not_supported_reasons(d), one_head_a_group=True)

    @classmethod
    def apply(cls, inp: Inputs, needs_gradient: bool) -> tuple[torch.Tensor, Context | None]:
        args, kwargs = _call_args(inp)
        varlen = varlen_args(inp.attn_bias)
        if varlen is not None and varlen.seqlen_k is not None:
            kwargs["seqused_k"] = varlen.seqlen_k
        qkv = _merged_heads(inp.query, inp.query, *kv_heads(inp))
        out, lse, rng_state, unused, _ = cls.OPERATOR(*_kernel_layout(inp, *qkv), *args, False, **kwargs)
        if varlen is not None:  # [ΣM, heads, Kv] and LSE [heads, ΣM]
            out, lse = out[None], lse[None]
        out = _split_heads(out, inp.query)
        if inp.query.dim() == 5:
            lse = lse.unflatten(1, inp.query.shape[2:4])
        if not needs_gradient:
            return out, None
        ctx = Context(lse=lse, out=out)
        if inp.p != 0.0:  # only this backend's backward replays its dropout mask
            ctx.op_bw, ctx.rng_state = BwOp, (rng_state, unused)
        return out, ctx


class BwOp(AttentionBwOpBase):
    """PyTorch's FlashAttention-2 backward (non-deterministic: dQ is accumulated with atomics). K/V expanded over the
    query heads with stride 0 reach it with one head a group where autograd sums their heads' gradients anyway
    (`Inputs.kv_grads_summed`): its own GQA returns dK/dV a K/V head. Otherwise it gives them a gradient a query head
    (BMHK; BMGHK needs mergeable heads)."""

    OPERATOR = torch.ops.aten._flash_attention_backward if _NOT_BUILT_REASON is None else None
    NOT_BUILT_REASON = _NOT_BUILT_REASON or ""
    NAME = f"fa2B@{FLASH_VERSION}-pt"
    SUPPORTED_DEVICES = FwOp.SUPPORTED_DEVICES
    CUDA_MINIMUM_COMPUTE_CAPABILITY = FwOp.CUDA_MINIMUM_COMPUTE_CAPABILITY
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MAX_K = FwOp.SUPPORTED_MAX_K
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B01 B03-B10")
    SUPPORTS_DROPOUT = True
    SUPPORTS_CUSTOM_SCALE = True
    IS_DETERMINISTIC = False
    SUPPORTS_BMGHK = True

    @classmethod
    def not_supported_reasons(cls, d: Inputs) -> list[str]:
        reasons = _kernel_reasons(d, super().not_supported_reasons(d), one_head_a_group=d.kv_grads_summed)
        if d.device.type == "cuda" and d.p != 0.0 and d.query.shape[-1] > 224:
            if arch.capability(d.device) not in ((8, 0), (9, 0)):
                reasons.append(
                    "requires a GPU with compute capability 8.0 (A100) or 9.0 (H100) for dropout with "
                    "query.shape[-1] > 224"
                )
        return reasons

    @classmethod
    def apply(cls, ctx: Context, inp: Inputs, grad: torch.Tensor) -> Gradients:
        args, kwargs = _call_args(inp)
        if ctx.rng_state is not None:
            rng_state, unused = ctx.rng_state
        else:  # no dropout: the kernel reads neither
            rng_state = torch.empty(2, dtype=torch.int64, device=inp.device)
            unused = torch.empty((), dtype=torch.int64, device=inp.device)
        lse = ctx.lse.flatten(1, 2) if inp.query.dim() == 5 else ctx.lse
        lse = lse[0] if varlen_args(inp.attn_bias) is not None else lse
        key, value = kv_heads(inp) if inp.kv_grads_summed else (inp.key, inp.value)
        # The kernel takes out and grad in query's dtype (a merged partial's are fp32).
        out, grad = (aligned(t.to(inp.query.dtype)) for t in (ctx.out, grad))
        tensors = _merged_heads(inp.query, inp.query, key, value, out, grad)
        q, k, v, out, grad = _kernel_layout(inp, *tensors)
        dq, dk, dv = cls.OPERATOR(grad, q, k, v, out, lse.contiguous(), *args, rng_state, unused, **kwargs)
        if varlen_args(inp.attn_bias) is not None:
            dq, dk, dv = dq[None], dk[None], dv[None]
        return Gradients(_split_heads(dq, inp.query), _split_heads(dk, key), _split_heads(dv, value))
