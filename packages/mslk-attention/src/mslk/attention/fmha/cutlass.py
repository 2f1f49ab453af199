"""`cutlass`: the memory-efficient attention kernels that ship inside PyTorch (xFormers' CUTLASS kernels,
`aten::_efficient_attention_forward/_backward`), spec §2.3 rows `cutlassF-pt` / `cutlassB-pt`.

NVIDIA GPUs up to SM90 (newer ones are refused as "too new"), f32/f16/bf16, K != Kv, a dense tensor bias (with
its gradient), dropout, and the masks the kernel expresses through `custom_mask_type` (0 none, 1 causal from the
top left, 2 from the bottom right), `window_size` and `seqstart_q/k` + `seqlen_k` (varlen, B = 1). BMGHK runs one
kernel call per group. The varlen LSE is padded: [nseq, H, max Mq].
"""

from __future__ import annotations

import dataclasses

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
    check_not_expanded,
    queries_without_keys,
    tensor_bias,
    varlen_args,
)
from mslk.core import arch, launch

_CUSTOM_MASK_TYPE = {None: 0, "top-left": 1, "bottom-right": 2}
_LSE_ALIGNMENT = 32  # the forward pads the LSE to this many queries; the backward reads whole blocks
_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
_BIAS_HINT = (
    "HINT: To use an `attn_bias` with a sequence length that is not a multiple of 8, you need to ensure memory "
    "is aligned by slicing a bigger tensor. Example: use `attn_bias = torch.zeros([1, 1, 5, 8])[:,:,:,:5]` "
    "instead of `torch.zeros([1, 1, 5, 5])`"
)


def _gemm_alignment(inp: Inputs) -> int:
    """Elements per vector load of the tensor-core kernels: 128 bits, 4 fp32 on SM80+."""
    capability = arch.capability(inp.device)
    if inp.query.dtype in (torch.float16, torch.bfloat16) and capability >= (7, 0):
        return 8
    return 4 if capability >= (8, 0) else 1


def _kernel_reasons(d: Inputs, reasons: list[str]) -> list[str]:
    """The kernel's own limits (on a CUDA device): vector loads and the bias layout."""
    if d.device.type != "cuda":
        return reasons
    alignment = _gemm_alignment(d)
    for name, t in (("query", d.query), ("key", d.key), ("value", d.value)):
        check_lastdim_alignment_stride1(reasons, name, t, alignment)
        check_16_byte_aligned(reasons, name, t)
        # K/V heads broadcast with stride 0 (MQA) came out wrong for sequences of one query (a varlen one; Mq = 1
        # with a bias and K != Kv), right on contiguous copies of the same values (torch 2.11, the H200).
        check_not_expanded(reasons, name, t)
    # Rows that see no key come out of the kernels wrong (output from head dim 136 on, dQ in fp32 or from the
    # bottom right, the other rows too when queries outnumber keys from the bottom right; torch 2.11 on the H200).
    if queries_without_keys(d):
        reasons.append(
            "a query sees no key (a varlen sequence without keys, or more queries than keys causal from the bottom "
            "right): this kernel gets such inputs wrong"
        )
    elif isinstance(d.attn_bias, ab.VARLEN_BIASES) and capturing_cuda_graph(d):
        reasons.append(
            "varlen mask in a CUDA graph capture: in-place updates may leave a sequence without keys, which this "
            "kernel gets wrong"
        )
    bias = tensor_bias(d.attn_bias)
    if bias is not None:
        if bias.dtype != d.query.dtype:
            reasons.append(f"attn_bias.dtype ({bias.dtype}) != query.dtype ({d.query.dtype})")
        bias_alignment = 128 // torch.finfo(bias.dtype).bits
        if any(stride % bias_alignment for stride in bias.stride()[:-1]):
            reasons.append(f"attn_bias.stride(-2) % {bias_alignment} != 0 (attn_bias.stride() = {bias.stride()})")
            reasons.append(_BIAS_HINT)
        if bias.stride(-1) > 1:
            reasons.append(
                f"attn_bias.stride(-1) > 1 (attn_bias.stride() = {bias.stride()}) - you should call `.contiguous()` "
                "on the bias"
            )
    return reasons


def _mask_args(inp: Inputs) -> tuple[int, dict]:
    """(custom_mask_type, keyword arguments: scale, window_size, seqlen_k)."""
    causal, window_left, _ = causal_window(inp.attn_bias)
    kwargs = {"scale": inp.scale_float}
    if window_left >= 0:  # a causal window of window_left + 1 keys
        kwargs["window_size"] = window_left + 1
    varlen = varlen_args(inp.attn_bias)
    if varlen is not None and varlen.seqlen_k is not None:
        kwargs["seqlen_k"] = varlen.seqlen_k
    return _CUSTOM_MASK_TYPE[causal], kwargs


def _sequences(inp: Inputs) -> tuple[torch.Tensor | None, torch.Tensor | None, int, int]:
    """(seqstart_q, seqstart_k, max_seqlen_q, max_seqlen_k): the varlen metadata, or the whole tensors."""
    varlen = varlen_args(inp.attn_bias)
    if varlen is None:
        return None, None, inp.query.shape[1], inp.key.shape[1]
    return varlen.seqstart_q, varlen.seqstart_k, varlen.max_seqlen_q, varlen.max_seqlen_k


def _group(inp: Inputs, g: int) -> Inputs:
    """Group g of BMGHK inputs as BMHK inputs."""
    bias = inp.attn_bias
    if isinstance(bias, torch.Tensor):
        bias = bias[:, g]
    elif tensor_bias(bias) is not None:
        bias = type(bias)(bias._bias[:, g])
    q, k, v = (t[:, :, g] for t in (inp.query, inp.key, inp.value))
    return dataclasses.replace(inp, query=q, key=k, value=v, attn_bias=bias)


# The kernels exist in CUDA builds of PyTorch (checked once: a build question, not a hardware one).
_BUILT = arch.cuda_version() is not None
_NOT_BUILT_REASON = "needs a PyTorch built for CUDA (its memory-efficient attention kernels)"


@torch.library.custom_op("mslk_cutlass::fmha_bwd", mutates_args=(), device_types="cuda")
def _backward_kernel(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    seqstart_q: torch.Tensor | None,
    seqstart_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    lse: torch.Tensor,
    dropout_p: float,
    seed: torch.Tensor,
    offset: torch.Tensor,
    custom_mask_type: int,
    bias_requires_grad: bool,
    scale: float,
    window_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """aten::_efficient_attention_backward -> (dq, dk, dv, dbias, empty unless bias_requires_grad). Wrapped because
    PyTorch's meta kernel of the ATen op lacks `out` and `window_size` (torch.compile would fail tracing it)."""
    dq, dk, dv, db = torch.ops.aten._efficient_attention_backward(
        grad, query, key, value, bias, out, seqstart_q, seqstart_k, max_seqlen_q, max_seqlen_k, lse, dropout_p,
        seed, offset, custom_mask_type, bias_requires_grad, scale=scale, window_size=window_size,
    )  # fmt: skip
    return dq, dk, dv, db if bias_requires_grad else grad.new_empty(0)


@_backward_kernel.register_fake
def _backward_kernel_fake(grad, query, key, value, bias, *args):
    bias_requires_grad = args[10]
    db = grad.new_empty(0)
    if bias_requires_grad:  # the kernel's rows of 16-element multiples, cut to Mk (PyTorch's meta kernel's layout)
        keys = bias.shape[-1]
        db = bias.new_empty((*bias.shape[:-1], launch.cdiv(keys, 16) * 16))[..., :keys]
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), db


class FwOp(AttentionFwOpBase):
    """PyTorch's memory-efficient attention forward (CUTLASS)."""

    OPERATOR = torch.ops.aten._efficient_attention_forward if _BUILT else None
    NOT_BUILT_REASON = _NOT_BUILT_REASON
    NAME = "cutlassF-pt"
    SUPPORTED_DEVICES = frozenset({"cuda"})
    CUDA_MAXIMUM_COMPUTE_CAPABILITY = (9, 0)
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MAX_K = 65536
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None T B01 B02 B03 B04 B06 B07 B08 B09 B10 B12")
    SUPPORTS_DROPOUT = True
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_DIFFERENT_VALUE_EMBED = True
    SUPPORTS_BMGHK = True
    VARLEN_LSE_PACKED = False

    @classmethod
    def not_supported_reasons(cls, d: Inputs) -> list[str]:
        return _kernel_reasons(d, super().not_supported_reasons(d))

    @classmethod
    def apply(cls, inp: Inputs, needs_gradient: bool) -> tuple[torch.Tensor, Context | None]:
        if inp.query.dim() == 5:  # the kernel takes BMHK: one call per group
            results = [cls._apply_bmhk(_group(inp, g), needs_gradient) for g in range(inp.query.shape[2])]
            out = torch.stack([out for out, _ in results], dim=2)
            if not needs_gradient:
                return out, None
            return out, Context(lse=torch.stack([ctx.lse for _, ctx in results], dim=1), out=out)
        return cls._apply_bmhk(inp, needs_gradient)

    @classmethod
    def _apply_bmhk(cls, inp: Inputs, needs_gradient: bool) -> tuple[torch.Tensor, Context | None]:
        seqstart_q, seqstart_k, max_q, max_k = _sequences(inp)
        mask_type, kwargs = _mask_args(inp)
        out, lse, seed, offset, _, _ = cls.OPERATOR(
            inp.query, inp.key, inp.value, tensor_bias(inp.attn_bias), seqstart_q, seqstart_k, max_q, max_k,
            inp.p, mask_type, needs_gradient, **kwargs,
        )  # fmt: skip
        if not needs_gradient:
            return out, None
        ctx = Context(lse=lse[:, :, :max_q], out=out)  # LSE [B or nseq, H, max Mq]
        if inp.p != 0.0:  # only this backend's backward replays its dropout mask
            ctx.op_bw, ctx.rng_state = BwOp, (seed, offset)
        return out, ctx


class BwOp(AttentionBwOpBase):
    """PyTorch's memory-efficient attention backward (CUTLASS), with the tensor bias gradient."""

    OPERATOR = _backward_kernel if _BUILT else None
    NOT_BUILT_REASON = _NOT_BUILT_REASON
    NAME = "cutlassB-pt"
    SUPPORTED_DEVICES = FwOp.SUPPORTED_DEVICES
    CUDA_MAXIMUM_COMPUTE_CAPABILITY = FwOp.CUDA_MAXIMUM_COMPUTE_CAPABILITY
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MAX_K = FwOp.SUPPORTED_MAX_K
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None T B01 B03 B06 B07 B08 B09")
    SUPPORTS_ATTN_BIAS_GRAD = True
    SUPPORTS_DROPOUT = True
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_DIFFERENT_VALUE_EMBED = True
    VARLEN_LSE_PACKED = False

    @classmethod
    def not_supported_reasons(cls, d: Inputs) -> list[str]:
        return _kernel_reasons(d, super().not_supported_reasons(d))

    @classmethod
    def apply(cls, ctx: Context, inp: Inputs, grad: torch.Tensor) -> Gradients:
        seqstart_q, seqstart_k, max_q, max_k = _sequences(inp)
        mask_type, kwargs = _mask_args(inp)
        if ctx.rng_state is not None:
            seed, offset = ctx.rng_state
        else:  # no dropout: the kernel reads neither
            seed = offset = torch.empty((), dtype=torch.int64, device=inp.device)
        bias = tensor_bias(inp.attn_bias)
        bias_requires_grad = bias is not None and bias.requires_grad
        # The kernel reads out and grad as query's dtype (a merged partial's are fp32), 16-byte aligned.
        out, grad = aligned(ctx.out.to(inp.query.dtype)), aligned(grad.to(inp.query.dtype))
        dq, dk, dv, db = _backward_kernel(
            grad, inp.query, inp.key, inp.value, bias, out, seqstart_q, seqstart_k, max_q, max_k,
            ctx.get_padded_lse(_LSE_ALIGNMENT), inp.p, seed, offset, mask_type, bias_requires_grad, kwargs["scale"],
            kwargs.get("window_size"),
        )  # fmt: skip
        return Gradients(dq, dk, dv, db if bias_requires_grad else None)
