"""mslk.attention.fmha (spec §2-§4): memory_efficient_attention, its masks (`attn_bias`), partial attention, and
the backends that serve them (one module each: `cutlass`, `flash`, `flash3`, `triton_splitk`, `ck`, ... and MSLK's
float64 `torch_reference`, the CPU path, `triton_flash`, MSLK's Triton flash attention, and `cudnn`, the cuDNN
kernels inside PyTorch).

`merge_attentions` combines partial attentions (`merge`; `merge_training` for their gradients).

`memory_efficient_attention(q, k, v)` computes softmax(scale · Q·Kᵀ + bias) · V per head, with dropout p, for
BMK [B, M, K], BMHK [B, M, H, K] or BMGHK [B, M, G, H, K] inputs (grouped-query attention: the caller expands
K/V over H, stride 0 is fine); the output has query's layout with value's last dim. `dispatch` picks the backend
(spec §4); autograd runs through `_fMHA`, which picks the backward in the forward, where the strides are known.
"""

from __future__ import annotations

import math

import torch

from mslk.attention.fmha import (  # noqa: F401  (modules users reach as fmha.<module>)
    attn_bias,
    attn_bias_utils,
    ck,
    ck_decoder,
    ck_splitk,
    cudnn,
    cute_blackwell,
    cute_hopper,
    cutlass,
    cutlass_blackwell,
    dispatch,
    flash,
    flash3,
    flash_mtia,
    flydsl,
    kv_cache,
    merge,
    merge_training,
    split_blocks_fairinternal,
    torch_reference,
    tree_attention,
    triton_flash,
    triton_splitk,
    unbind,
    utils,
)
from mslk.attention.fmha.attn_bias import (
    AttentionBias,
    BlockDiagonalCausalFromBottomRightMask,
    BlockDiagonalCausalLocalAttentionFromBottomRightMask,
    BlockDiagonalCausalLocalAttentionMask,
    BlockDiagonalCausalLocalAttentionPaddedKeysMask,
    BlockDiagonalCausalMask,
    BlockDiagonalCausalWithOffsetGappyKeysMask,
    BlockDiagonalCausalWithOffsetPaddedKeysMask,
    BlockDiagonalGappyKeysMask,
    BlockDiagonalLocalAttentionFromBottomRightGappyKeysMask,
    BlockDiagonalLocalAttentionPaddedKeysMask,
    BlockDiagonalMask,
    BlockDiagonalPaddedKeysMask,
    LocalAttentionFromBottomRightMask,
    LowerTriangularFromBottomRightLocalAttentionMask,
    LowerTriangularFromBottomRightMask,
    LowerTriangularMask,
    LowerTriangularMaskWithTensorBias,
    PagedBlockDiagonalCausalLocalPaddedKeysMask,
    PagedBlockDiagonalCausalWithOffsetGappyKeysMask,
    PagedBlockDiagonalCausalWithOffsetPaddedKeysMask,
    PagedBlockDiagonalGappyKeysMask,
    PagedBlockDiagonalPaddedKeysMask,
)
from mslk.attention.fmha.common import (
    AttentionBwOpBase,
    AttentionFwOpBase,
    AttentionOp,
    AttentionOpBase,
    Context,
    Gradients,
    Inputs,
    bmk2bmhk,
    kv_expanded,
    rocm_build,
    tensor_bias,
    varlen_lse_packed,
    varlen_num_sequences,
)
from mslk.attention.fmha.dispatch import (
    _dispatch_bw,
    _dispatch_fw,
    _ensure_op_supports_or_raise,
    _get_use_fa3,
    _set_use_fa3,
)
from mslk.attention.fmha.merge import merge_attentions
from mslk.core import registry, testing

MemoryEfficientAttentionCutlassOp = (cutlass.FwOp, cutlass.BwOp)
MemoryEfficientAttentionCutlassBlackwellOp = (cutlass_blackwell.FwOp, cutlass_blackwell.BwOp)
MemoryEfficientAttentionCutlassFwdFlashBwOp = (cutlass.FwOp, flash.BwOp)
MemoryEfficientAttentionFlashAttentionOp = (flash.FwOp, flash.BwOp)
MemoryEfficientAttentionFlashMtiaAttentionOp = (flash_mtia.FwOp, flash_mtia.BwOp)
MemoryEfficientAttentionCkOp = (ck.FwOp, ck.BwOp)
MemoryEfficientAttentionCkDecoderOp = (ck_decoder.FwOp, ck.BwOp)
MemoryEfficientAttentionSplitKCkOp = (ck_splitk.FwOp, ck.BwOp)
MemoryEfficientAttentionFlyDSLOp = (flydsl.FwOp, flydsl.BwOp)
MemoryEfficientAttentionCuteFlashAttentionOp = (cute_blackwell.FwOp, cute_blackwell.BwOp)
MemoryEfficientAttentionReferenceOp = (torch_reference.FwOp, torch_reference.BwOp)
MemoryEfficientAttentionMslkTritonOp = (triton_flash.FwOp, triton_flash.BwOp)
MemoryEfficientAttentionCudnnOp = (cudnn.FwOp, cudnn.BwOp)

ALL_FW_OPS: list[type[AttentionFwOpBase]] = [
    ck.FwOp if rocm_build() else cutlass.FwOp,
    cutlass_blackwell.FwOp,
    cudnn.FwOp,
    flash.FwOp,
    flash_mtia.FwOp,
    flash3.FwOp,
    flydsl.FwOp,
    triton_splitk.FwOp,
    triton_flash.FwOp,
    torch_reference.FwOp,
]
ALL_BW_OPS: list[type[AttentionBwOpBase]] = [
    ck.BwOp if rocm_build() else cutlass.BwOp,
    cutlass_blackwell.BwOp,
    cudnn.BwOp,
    flash.BwOp,
    flash_mtia.BwOp,
    flash3.BwOp,
    *([flydsl.BwOp] if rocm_build() else []),
    triton_flash.BwOp,
    torch_reference.BwOp,
]

# --------------------------------------------------------------------------------------------- forward


def _fw_op(inp: Inputs, op: type[AttentionFwOpBase] | None, needs_gradient: bool) -> type[AttentionFwOpBase]:
    """The dispatched forward operator, or the pinned one after checking that it fits (ValueError if not)."""
    if op is None:
        return _dispatch_fw(inp, needs_gradient)
    _check_op_class("a forward", op, AttentionFwOpBase)
    _ensure_op_supports_or_raise(ValueError, "memory_efficient_attention", op, inp)
    return op


def _check_op_class(what: str, op, base: type) -> None:
    """A pinned operator is an operator class of its kind; memory_efficient_attention pins (forward, backward)."""
    if not (isinstance(op, type) and issubclass(op, base)):
        raise TypeError(
            f"op: expected {what} operator class ({base.__name__}, e.g. fmha.cutlass.FwOp / BwOp) or None, got "
            f"{op!r}; memory_efficient_attention takes op=(FwOp, BwOp), the forward-only calls an FwOp"
        )


def _apply_fw(op: type[AttentionFwOpBase], inp: Inputs, needs_gradient: bool) -> tuple[torch.Tensor, Context | None]:
    """op.apply, except without any key (an empty chunk of partial attention): output 0 and LSE −inf, the values
    merge_attentions expects, whatever a kernel would do with an empty loop."""
    if inp.key.shape[1] != 0 or varlen_num_sequences(inp.attn_bias) is not None:
        return op.apply(inp, needs_gradient)
    q = inp.query
    dtype = inp.get_output_dtype() if op.SUPPORTS_OUTPUT_DTYPE else q.dtype
    out = q.new_zeros((*q.shape[:-1], inp.value_head_dim), dtype=dtype)
    lse = torch.full((q.shape[0], *q.shape[2:-1], q.shape[1]), -math.inf, dtype=torch.float32, device=q.device)
    return out, Context(lse=lse, out=out) if needs_gradient else None


def _memory_efficient_attention_forward(inp: Inputs, op: type[AttentionFwOpBase] | None = None) -> torch.Tensor:
    """Forward only (no LSE) on prepared Inputs, e.g. InputsFp8 for backends that take quantized K/V."""
    inp.validate_inputs()
    output_shape = inp.normalize_bmhk()
    out, _ = _apply_fw(_fw_op(inp, op, needs_gradient=False), inp, needs_gradient=False)
    return out.reshape(output_shape)


def _memory_efficient_attention_forward_requires_grad(
    inp: Inputs, op: type[AttentionFwOpBase] | None = None
) -> tuple[torch.Tensor, Context]:
    """Forward with the context a backward needs (output and LSE)."""
    inp.validate_inputs()
    output_shape = inp.normalize_bmhk()
    out, ctx = _apply_fw(_fw_op(inp, op, needs_gradient=True), inp, needs_gradient=True)
    return out.reshape(output_shape), ctx


# -------------------------------------------------------------------------------------------- backward


def _memory_efficient_attention_backward(
    ctx: Context, inp: Inputs, grad: torch.Tensor, op: type[AttentionBwOpBase] | None = None
) -> Gradients:
    """Gradients from the forward's output and LSE (`ctx`); `grad` and `ctx.out` in the inputs' layout."""
    inp.validate_inputs()
    if grad.dim() != inp.query.dim() or ctx.out.dim() != inp.query.dim():
        raise ValueError(
            "All tensors should be either in BMK (ndim=3), BMHK (ndim=4) or BMGHK (ndim=5) format.\n"
            f"  grad.shape : {grad.shape}\n  out.shape  : {ctx.out.shape}\n  query.shape: {inp.query.shape}"
        )
    registry.check_devices("memory_efficient_attention_backward", query=inp.query, grad=grad, out=ctx.out, lse=ctx.lse)
    if not all(t.is_floating_point() for t in (ctx.lse, grad, ctx.out)):
        raise ValueError(
            f"memory_efficient_attention_backward: lse (the forward's, float32), grad and out must be floating "
            f"point, got lse {ctx.lse.dtype}, grad {grad.dtype}, out {ctx.out.dtype}"
        )
    out_shape = (*inp.query.shape[:-1], inp.value.shape[-1])
    for name, t in (("grad", grad), ("out", ctx.out)):
        if t.shape != out_shape:
            raise ValueError(f"{name}.shape {tuple(t.shape)} should be the output's {out_shape} (query's, value's K)")
    shapes = [t.shape for t in (inp.query, inp.key, inp.value)]
    inp.normalize_bmhk()
    grad, ctx.out = bmk2bmhk(grad, 1), bmk2bmhk(ctx.out, 1)
    grads = _backward_normalized(ctx, inp, grad, op)
    grads.dq, grads.dk, grads.dv = (g.reshape(s) for g, s in zip((grads.dq, grads.dk, grads.dv), shapes, strict=True))
    return grads


def _backward_normalized(
    ctx: Context, inp: Inputs, grad: torch.Tensor, op: type[AttentionBwOpBase] | None
) -> Gradients:
    """The backward of validated BMHK or BMGHK inputs: the dispatched operator's, or the pinned one's once it is
    checked to fit."""
    packed = varlen_lse_packed(ctx.lse, inp)
    if op is None:
        op = _dispatch_bw(inp, packed)
    else:
        _check_op_class("a backward", op, AttentionBwOpBase)
        _ensure_op_supports_or_raise(ValueError, "memory_efficient_attention_backward", op, inp)
        if packed is not None and op.VARLEN_LSE_PACKED is not None and op.VARLEN_LSE_PACKED != packed:
            raise ValueError(
                f"Wrong LSE format for {op.NAME} in variable seqlen case. Double-check that the BW operator "
                f"{op.NAME} is compatible with the operator used in the FW pass."
            )
    return op.apply(ctx, inp, grad)


def _backward_op(
    inp: Inputs, op_fw: type[AttentionFwOpBase], op_bw: type[AttentionBwOpBase] | None, ctx: Context
) -> type[AttentionBwOpBase]:
    """The backward operator, chosen in the forward (strides are only inspectable there)."""
    if op_bw is not None:
        _check_op_class("a backward", op_bw, AttentionBwOpBase)
    if ctx.op_bw is not None:  # the forward's dropout randomness only its own backward replays
        if op_bw is not None and op_bw is not ctx.op_bw:
            raise ValueError(
                f"Specified op_bw={op_bw.NAME}, but forward op can only run with op_bw={ctx.op_bw.NAME}. "
                "Please set op_bw=None."
            )
        return ctx.op_bw
    packed = varlen_lse_packed(ctx.lse, inp)
    if op_bw is None:
        return _dispatch_bw(inp, packed)
    if packed is not None and op_bw.VARLEN_LSE_PACKED is not None and op_bw.VARLEN_LSE_PACKED != packed:
        raise ValueError(
            f"Specified op_bw={op_bw.NAME} is not compatible with the op_fw={op_fw.NAME}, because they use "
            "different format of logsumexp."
        )
    # Checked as the dispatcher checks its choice, on these inputs (output_dtype included, which the backward's
    # Inputs lack): a pinned backward that cannot serve them once failed inside its kernel.
    _ensure_op_supports_or_raise(ValueError, "memory_efficient_attention_backward", op_bw, inp)
    return op_bw


class _fMHA(torch.autograd.Function):
    """Autograd of memory_efficient_attention: (out, lse) from normalized inputs. The backends' backward takes
    no LSE gradient, so one that arrives (a partial's LSE fed to a differentiable merge) raises instead of being
    dropped: fmha.merge_training gives partials correct gradients."""

    @staticmethod
    def forward(ctx, op_fw, op_bw, query, key, value, mask, dense_bias, p, scale, output_dtype, is_partial,
                kv_grads_summed):  # fmt: skip
        # The bias as two inputs (_bias_inputs), so that autograd sees the tensor of a tensor bias and of a
        # LowerTriangularMaskWithTensorBias alike: it gets the bias gradient.
        attn_bias = dense_bias if mask is None else mask
        ctx.set_materialize_grads(False)  # an unused LSE gives grad_lse None, not zeros
        ctx.kv_grads_summed = kv_grads_summed
        kv = _kv_over_heads(query, key, value, kv_grads_summed)
        inp = Inputs(query, *kv, attn_bias, p, scale, output_dtype, is_partial, kv_grads_summed=kv_grads_summed)
        op_fw = _fw_op(inp, op_fw, needs_gradient=True)
        out, op_ctx = _apply_fw(op_fw, inp, needs_gradient=True)
        ctx.op_bw = _backward_op(inp, op_fw, op_bw, op_ctx)
        # A backward the dispatcher chose, or a pinned one _backward_op checked, fits these inputs: the backward need
        # not check it again (host time). The one a forward's dropout forces is checked there.
        ctx.op_bw_checked = op_ctx.op_bw is None
        bias_t = attn_bias if isinstance(attn_bias, torch.Tensor) else None
        ctx.save_for_backward(query, key, value, op_ctx.out, op_ctx.lse, bias_t)
        ctx.attn_bias = None if bias_t is not None else attn_bias
        ctx.rng_state, ctx.p, ctx.scale = op_ctx.rng_state, p, scale
        return out, op_ctx.lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, grad_lse):
        # (torch.compile traces the backward with zero gradients for every output, so it cannot tell: the partial
        # with a backward is refused there, and a full attention's LSE is no output of the public API.)
        if grad_lse is not None and not torch.compiler.is_compiling():
            raise NotImplementedError(
                "memory_efficient_attention_partial: the LSE of a partial got a gradient (from merge_attentions?), "
                "which the attention backward cannot take; use fmha.merge_training "
                "(memory_efficient_attention_partial_autograd and merge_attentions_autograd) to train through partials"
            )
        query, key, value, out, lse, bias_t = ctx.saved_tensors
        kv = _kv_over_heads(query, key, value, ctx.kv_grads_summed)
        bias = bias_t if bias_t is not None else ctx.attn_bias
        inp = Inputs(query, *kv, bias, ctx.p, ctx.scale, kv_grads_summed=ctx.kv_grads_summed)
        op_ctx = Context(lse=lse, out=out, rng_state=ctx.rng_state)
        # (the forward validated and normalized the inputs: grad has the shape of its output)
        if ctx.op_bw_checked:
            grads = ctx.op_bw.apply(op_ctx, inp, grad)
        else:
            grads = _backward_normalized(op_ctx, inp, grad, ctx.op_bw)
        dk, dv = grads.dk, grads.dv
        if ctx.kv_grads_summed and dk.shape[-2] != 1:  # a backward that gave the heads' gradients: summed here
            dk, dv = dk.sum(-2, keepdim=True), dv.sum(-2, keepdim=True)
        return None, None, grads.dq, dk, dv, None, grads.db, None, None, None, None, None


def _kv_grads_summable(inp: Inputs) -> bool:
    """Whether autograd may take one head of K and V (their gradients summed over the heads they are expanded over,
    which a backward with its own GQA computes without dK/dV a head: cuDNN's, MSLK's). Both must be expanded over
    the head dim with stride 0 and neither a leaf that gets a gradient: a leaf's .grad is a gradient a head, the
    reference's; any other tensor passes its gradient on to what it was made from, which the expansion's backward
    sums to."""
    return kv_expanded(inp) and not any(t.is_leaf and t.requires_grad for t in (inp.key, inp.value))


def _one_head(t: torch.Tensor) -> torch.Tensor:
    """One head of K or V expanded over the heads, for autograd: the tensor it is a view of, viewed as one head, where
    that tensor holds just those elements in that order (`proj(x).view(B, M, G, 1, K).expand(...)`: no backward op
    but a view's), else a slice, whose backward fills the heads' gradient with zeros for the expansion's sum (H100, K
    and V of 16 x 1024 rows, 8 heads under 32, K=128: 0.17 ms each, against 1.56 for attention's forward and
    backward)."""
    head = t[..., :1, :]
    base = None if torch.compiler.is_compiling() else t._base  # (Dynamo cannot trace data pointers)
    if (
        base is not None
        and base.requires_grad == t.requires_grad
        and base.is_contiguous()
        and head.is_contiguous()
        and base.numel() == head.numel()
        and base.data_ptr() == head.data_ptr()
    ):
        return base.view(head.shape)
    return head


def _kv_over_heads(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, one_head: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as the kernels take them: one head's slices (`_kv_grads_summable`) expanded over query's heads again,
    out of autograd's sight, or as they are."""
    if not one_head:
        return key, value
    key, value = (t.expand(*t.shape[:-2], query.shape[-2], t.shape[-1]) for t in (key, value))
    return key, value


def _requires_grad(inp: Inputs) -> bool:
    """Whether autograd must see the call: a gradient may flow to query, key, value or a tensor bias."""
    tensors = (inp.query, inp.key, inp.value, tensor_bias(inp.attn_bias))
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _bias_inputs(attn_bias) -> tuple:
    """(mask, dense bias) of _fMHA: (None, the tensor) for a tensor bias, (the mask, its tensor or None) otherwise."""
    return None if isinstance(attn_bias, torch.Tensor) else attn_bias, tensor_bias(attn_bias)


def _with_autograd(inp: Inputs, op: AttentionOp | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) through _fMHA, in the inputs' layout."""
    op_fw, op_bw = op if op is not None else (None, None)
    inp.validate_inputs()
    output_shape = inp.normalize_bmhk()
    key, value, summed = inp.key, inp.value, _kv_grads_summable(inp)
    if summed:  # autograd sees one head: the backward's sum over the heads lands there, where the expansion's would
        key, value = _one_head(key), _one_head(value)
    out, lse = _fMHA.apply(
        op_fw, op_bw, inp.query, key, value, *_bias_inputs(inp.attn_bias), inp.p, inp.scale, inp.output_dtype,
        inp.is_partial, summed,
    )  # fmt: skip
    return out.reshape(output_shape), lse


# ------------------------------------------------------------------------------------------ public API


def memory_efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | AttentionBias | None = None,
    p: float = 0.0,
    scale: float | None = None,
    *,
    op: AttentionOp | None = None,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """softmax(scale · Q·Kᵀ + attn_bias), dropout p, times V, per head (spec A-01); scale defaults to K**-0.5.

    query [B, Mq, (G, H,) K], key [B, Mkv, (G, H,) K], value [B, Mkv, (G, H,) Kv] (BMK, BMHK or BMGHK; no
    broadcasting: expand K/V over heads yourself, stride 0 is fine); returns [B, Mq, (G, H,) Kv]. attn_bias is a
    mask of `attn_bias`, or a tensor [B, (G, H,) Mq, Mkv] added to the scores. `op` pins a (forward, backward)
    pair of operators (either may be None). Differentiable in query, key, value and a tensor bias. K/V expanded over
    the heads from tensors that are not leaves (GQA training): autograd gets one head of them, so the backward makes
    dK/dV a K/V head (cuDNN's and MSLK's own GQA) and what they were expanded from gets its gradient as ever; a gradient
    retained on the expanded K/V holds the heads' sum in the first head. Expanded leaves get a gradient a head.
    """
    return _memory_efficient_attention(Inputs(query, key, value, attn_bias, p, scale, output_dtype), op)


def _memory_efficient_attention(inp: Inputs, op: AttentionOp | None = None) -> torch.Tensor:
    """memory_efficient_attention on Inputs: forward only (no LSE) unless autograd needs the backward."""
    if op is not None and not (isinstance(op, tuple) and len(op) == 2):
        raise TypeError(f"memory_efficient_attention: op must be a pair (FwOp, BwOp) or None, got {op!r}")
    if not _requires_grad(inp):
        return _memory_efficient_attention_forward(inp, op[0] if op is not None else None)
    return _with_autograd(inp, op)[0]


def memory_efficient_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | AttentionBias | None = None,
    p: float = 0.0,
    scale: float | None = None,
    *,
    op: type[AttentionFwOpBase] | None = None,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """memory_efficient_attention's forward alone (spec A-02): no LSE is computed."""
    return _memory_efficient_attention_forward(Inputs(query, key, value, attn_bias, p, scale, output_dtype), op)


def _no_dropout(p: float) -> None:
    if p != 0.0:
        raise NotImplementedError(
            "dropout is not supported on the non-autograd API. If you want to use dropout, please call "
            "`memory_efficient_attention` directly"
        )


def memory_efficient_attention_forward_requires_grad(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | AttentionBias | None = None,
    p: float = 0.0,
    scale: float | None = None,
    *,
    op: type[AttentionFwOpBase] | None = None,
    output_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) for a later memory_efficient_attention_backward (spec A-03); lse [B, (G,) H, Mq] (varlen: the
    operator's layout), natural log, scale included."""
    _no_dropout(p)
    out, ctx = _memory_efficient_attention_forward_requires_grad(
        Inputs(query, key, value, attn_bias, p, scale, output_dtype), op
    )
    return out, ctx.lse


def memory_efficient_attention_backward(
    grad: torch.Tensor,
    output: torch.Tensor,
    lse: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | AttentionBias | None = None,
    p: float = 0.0,
    scale: float | None = None,
    *,
    op: type[AttentionBwOpBase] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the output and LSE of the forward (spec A-04); a varlen LSE may be packed or padded and
    must suit the operator."""
    _no_dropout(p)
    grads = _memory_efficient_attention_backward(
        Context(out=output, lse=lse), Inputs(query, key, value, attn_bias, p, scale), grad, op
    )
    return grads.dq, grads.dk, grads.dv


def memory_efficient_attention_partial(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | AttentionBias | None = None,
    p: float = 0.0,
    scale: float | None = None,
    *,
    op: AttentionOp | type[AttentionFwOpBase] | None = None,
    output_dtype: torch.dtype | None = None,
    _allow_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the attention over one chunk of the keys, for merge_attentions (spec A-05): out in float32
    unless output_dtype says otherwise (backends without SUPPORTS_OUTPUT_DTYPE give query's dtype), lse
    [B, (G,) H, Mq]; a chunk without keys gives out 0 and lse −inf."""
    if p != 0.0:
        raise NotImplementedError("dropout is not supported.")
    op_fw, op_bw = op if isinstance(op, tuple) else (op, None)
    inp = Inputs(query, key, value, attn_bias, p, scale, output_dtype, is_partial=True)
    if not (_allow_backward and _requires_grad(inp)):
        out, ctx = _memory_efficient_attention_forward_requires_grad(inp, op_fw)
        return out, ctx.lse
    if query.dim() == 5:
        raise ValueError("gradients not supported for 5D tensors")
    if torch.compiler.is_compiling():
        # A compiled backward gets a gradient for every output, zeros for those unused: it could not tell an LSE that
        # merge_attentions differentiates (which the backends cannot take) from an unused one, and would drop it.
        raise NotImplementedError(
            "memory_efficient_attention_partial(_allow_backward=True) under torch.compile: its backward cannot tell "
            "whether the LSE gets a gradient; use fmha.merge_training (memory_efficient_attention_partial_autograd "
            "and merge_attentions_autograd) to train through partials"
        )
    return _with_autograd(inp, (op_fw, op_bw))


# ------------------------------------------------------------------------ torch ops (spec)


def _torch_op_inputs(q, k, v, b, p, scale) -> Inputs:
    return Inputs(q, k, v, b, 0.0 if p is None else p, scale)


def _torch_op_validate(q, k, v, b=None, p=0.0, scale=None) -> None:
    _torch_op_inputs(q, k, v, b, p, scale).validate_inputs()


def _torch_op_reference(q, k, v, b=None, p=0.0, scale=None) -> torch.Tensor:
    return _memory_efficient_attention_forward(_torch_op_inputs(q, k, v, b, p, scale), torch_reference.FwOp)


def _torch_op_dispatched(q, k, v, b=None, p=0.0, scale=None) -> torch.Tensor:
    return _memory_efficient_attention_forward(_torch_op_inputs(q, k, v, b, p, scale))


def _torch_op_triton(q, k, v, b=None, p=0.0, scale=None) -> torch.Tensor:
    return _memory_efficient_attention_forward(_torch_op_inputs(q, k, v, b, p, scale), triton_flash.FwOp)


def _torch_op_triton_supports(q, k, v, b=None, p=0.0, scale=None) -> list[str]:
    return triton_flash.FwOp.not_supported_reasons(_torch_op_inputs(q, k, v, b, p, scale))


def _torch_op_fake(q, k, v, b=None, p=0.0, scale=None) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))  # value's head dim, which may differ from query's


def _torch_op_samples(device, with_bias: bool):
    q = testing.randn(2, 9, 3, 32, dtype=torch.float16, device=device)
    k = testing.randn(2, 16, 3, 32, dtype=torch.float16, device=device)
    v = testing.randn(2, 16, 3, 16, dtype=torch.float16, device=device)
    bias = testing.randn(2, 3, 9, 16, dtype=torch.float16, device=device)
    if with_bias:
        yield registry.Sample((q, k, v, bias))
        yield registry.Sample((q, k, v, bias[:1, :1].expand(2, 3, 9, 16)), {"scale": 0.2}, name="bias broadcast")
    else:
        yield registry.Sample((q, k, v))
        yield registry.Sample((q, k, v, bias), {"scale": 0.2}, name="bias")
        yield registry.Sample((q.double(), k.double(), v.double()), name="float64 (the reference backend's)")


def _register_torch_op(schema: str, with_bias: bool) -> registry.Op:
    op = registry.Op(
        schema,
        domain="attention",
        reference=_torch_op_reference,
        fake=_torch_op_fake,
        samples=lambda device: _torch_op_samples(device, with_bias),
        validate=_torch_op_validate,
        reference_devices=("cpu", "cuda"),
        backward=_torch_op_backward,
        setup_context=_torch_op_setup,
    )
    op.backend("fmha", devices=("cuda",))(_torch_op_dispatched)
    # MSLK's Triton kernel alone, to pin (`backend="triton"`), and what the conformance tests run under the
    # Triton interpreter on CPU (the fmha dispatcher runs the reference there).
    op.backend("triton", available=registry.triton_missing, supports=_torch_op_triton_supports)(_torch_op_triton)
    return op


def _torch_op_setup(ctx, inputs, output) -> None:
    q, k, v, b, ctx.p, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, b)


def _torch_op_backward(ctx, grad):
    """Gradients of q, k, v and the tensor bias. The op returns no LSE, so this runs the forward again for it (and
    cannot replay dropout, whose random state the op keeps neither): memory_efficient_attention keeps both."""
    if ctx.p:
        raise NotImplementedError(
            "mslk::memory_efficient_attention_forward: no gradient with dropout (the op keeps no random state); "
            "use fmha.memory_efficient_attention"
        )
    q, k, v, b = ctx.saved_tensors
    # (Inputs apiece: the forward normalizes its own in place. With grad mode on, the BMK layout's [B, 1, Mq, Mk]
    # view of the bias keeps its requires_grad, which asks the backward operators for its gradient.)
    with torch.enable_grad():
        out, fw_ctx = _memory_efficient_attention_forward_requires_grad(_torch_op_inputs(q, k, v, b, 0.0, ctx.scale))
        fw_ctx.out = out  # in the inputs' layout, as the backward takes it
        grads = _memory_efficient_attention_backward(fw_ctx, _torch_op_inputs(q, k, v, b, 0.0, ctx.scale), grad)
    db = None if grads.db is None else grads.db.reshape(b.shape)  # (a BMK call's [B, Mq, Mk] bias came back 4-D)
    return grads.dq, grads.dk, grads.dv, db, None, None


# torch.compile-friendly forms of memory_efficient_attention_forward with a dense tensor bias.
memory_efficient_attention_forward_op = _register_torch_op(
    "mslk::memory_efficient_attention_forward(Tensor q, Tensor k, Tensor v, Tensor? b=None, float? p=0.0, "
    "float? scale=None) -> Tensor",
    with_bias=False,
)
memory_efficient_attention_forward_with_bias_op = _register_torch_op(
    "mslk::memory_efficient_attention_forward_with_bias(Tensor q, Tensor k, Tensor v, Tensor b, float? p=0.0, "
    "float? scale=None) -> Tensor",
    with_bias=True,
)


__all__ = [
    "ALL_BW_OPS",
    "ALL_FW_OPS",
    "AttentionBias",
    "AttentionOp",
    "AttentionOpBase",
    "BlockDiagonalCausalFromBottomRightMask",
    "BlockDiagonalCausalLocalAttentionFromBottomRightMask",
    "BlockDiagonalCausalLocalAttentionMask",
    "BlockDiagonalCausalLocalAttentionPaddedKeysMask",
    "BlockDiagonalCausalMask",
    "BlockDiagonalCausalWithOffsetGappyKeysMask",
    "BlockDiagonalCausalWithOffsetPaddedKeysMask",
    "BlockDiagonalGappyKeysMask",
    "BlockDiagonalLocalAttentionFromBottomRightGappyKeysMask",
    "BlockDiagonalLocalAttentionPaddedKeysMask",
    "BlockDiagonalMask",
    "BlockDiagonalPaddedKeysMask",
    "LocalAttentionFromBottomRightMask",
    "LowerTriangularFromBottomRightLocalAttentionMask",
    "LowerTriangularFromBottomRightMask",
    "LowerTriangularMask",
    "LowerTriangularMaskWithTensorBias",
    "MemoryEfficientAttentionCkDecoderOp",
    "MemoryEfficientAttentionCkOp",
    "MemoryEfficientAttentionCudnnOp",
    "MemoryEfficientAttentionCutlassFwdFlashBwOp",
    "MemoryEfficientAttentionCutlassOp",
    "MemoryEfficientAttentionFlashAttentionOp",
    "MemoryEfficientAttentionFlashMtiaAttentionOp",
    "MemoryEfficientAttentionFlyDSLOp",
    "PagedBlockDiagonalCausalLocalPaddedKeysMask",
    "PagedBlockDiagonalCausalWithOffsetGappyKeysMask",
    "PagedBlockDiagonalCausalWithOffsetPaddedKeysMask",
    "PagedBlockDiagonalGappyKeysMask",
    "PagedBlockDiagonalPaddedKeysMask",
    "_get_use_fa3",
    "_set_use_fa3",
    "attn_bias",
    "cute_hopper",
    "dispatch",
    "memory_efficient_attention",
    "memory_efficient_attention_backward",
    "memory_efficient_attention_forward",
    "memory_efficient_attention_forward_requires_grad",
    "memory_efficient_attention_partial",
    "merge_attentions",
]
