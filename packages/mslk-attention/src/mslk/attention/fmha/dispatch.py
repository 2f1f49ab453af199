"""Which backend serves an attention call (spec §4): the first of a priority list that supports the inputs.

Forward, NVIDIA: [flash3 (while FA3 is on), cudnn, flash, cutlass, triton_splitk]; ROCm: [ck, flydsl,
triton_splitk]. `cudnn` (MSLK's addition to the spec's lists) takes only dense attention, where it is measured
fastest on Hopper, except attention over up to 256 (batch x head) pairs of 4096 rows or more with a causal mask, up
to 128 without one, where MSLK's Gluon forward comes before it (triton_flash.gluon_forward_before_cudnn),
and causal attention of 2^30 to 2^33 scores, where MSLK's Gluon backward comes before cuDNN's
(triton_flash.gluon_backward_before_cudnn).
Decoding with heads expanded over K/V (MQA/GQA, stride 0), few queries and many keys moves triton_splitk first
(on NVIDIA at any parallelism where sequences have 2 to 32 queries or are packed: _is_mqa_decoding), and on NVIDIA
with one query a sequence puts cudnn (up to head dim 128) and flash before it unless the mask packs the sequences
(varlen, paged). Backward, NVIDIA: [flash3, cudnn, flash, cutlass]; ROCm: [ck]. MTIA kernels come next where they
exist, then MSLK's Triton flash attention (`triton_flash`: any GPU Triton runs on, fp32 included, so that GPUs the
kernels above do not cover, Blackwell's fp32 among them, and deterministic backward passes get a GPU kernel; on
Hopper it comes before cutlass where measured faster), then MSLK's reference, which serves any device (the CPU path)
and so comes last. When nothing fits, NotImplementedError lists the inputs and every backend's reasons; a pinned
backend that does not fit raises ValueError with its reasons.
"""

from __future__ import annotations

import logging

import torch

from mslk.attention.fmha import (
    ck,
    cudnn,
    cutlass,
    flash,
    flash3,
    flash_mtia,
    flydsl,
    torch_reference,
    triton_flash,
    triton_splitk,
)
from mslk.attention.fmha.common import (
    AttentionBwOpBase,
    AttentionFwOpBase,
    AttentionOpBase,
    Inputs,
    bias_type,
    rocm_build,
)
from mslk.core import arch, env
from mslk.core.registry import dispatch_logging, format_not_supported

log = logging.getLogger("mslk.dispatch")

FMHA_LOG_DISPATCH = env.declare(
    "MSLK_FMHA_LOG_DISPATCH",
    "0",
    "1: log (logger `mslk.dispatch`, level INFO) which operator each memory_efficient_attention call picks.",
)

_USE_FLASH_ATTENTION_3 = True


def _set_use_fa3(use_flash_attention3: bool) -> None:
    """Whether the priority lists try flash3 first (on by default)."""
    global _USE_FLASH_ATTENTION_3
    _USE_FLASH_ATTENTION_3 = use_flash_attention3


def _get_use_fa3() -> bool:
    return _USE_FLASH_ATTENTION_3


def fa3_available() -> bool:
    """FlashAttention-3 can run here: its package is usable and the GPU is an SM90 NVIDIA one."""
    return flash3.FwOp.is_available() and arch.is_cuda() and arch.capability() >= (9, 0)


def _inputs_description(inp: Inputs) -> dict:
    return {"query": inp.query, "key": inp.key, "value": inp.value, "attn_bias": bias_type(inp.attn_bias), "p": inp.p}


def _not_supported_message(headline: str, inp: Inputs, reasons: dict[str, list[str]], next_step=None) -> str:
    return format_not_supported(headline, _inputs_description(inp), reasons, next_step=next_step, detailed=False)


def _ensure_op_supports_or_raise(exc_type: type[Exception], name: str, op: type[AttentionOpBase], inp: Inputs):
    """Raise `exc_type` with the op's reasons when the (pinned) op cannot serve the inputs."""
    reasons = op.not_supported_reasons(inp)
    if reasons:
        raise exc_type(_not_supported_message(f"Operator `{name}` does not support inputs:", inp, {op.NAME: reasons}))


def _run_priority_list(
    name: str,
    priority_list: list[type[AttentionOpBase]],
    inp: Inputs,
    extra_reasons: dict[type[AttentionOpBase], list[str]] | None = None,
) -> type[AttentionOpBase]:
    """The first operator of the list that supports the inputs; NotImplementedError with every reason if none.

    Operators not built here or not for the inputs' device never fit: the search skips them, as every check
    costs host time on each call (6.5 us for flash3 on the CPU machine, RESULTS.md), and their reasons are
    gathered only for the error."""
    extra_reasons = extra_reasons or {}

    def reasons(op: type[AttentionOpBase]) -> list[str]:
        return op.not_supported_reasons(inp) + extra_reasons.get(op, [])

    device_type = inp.device.type
    for op in priority_list:
        if op.is_available() and device_type in op.SUPPORTED_DEVICES and not reasons(op):
            if dispatch_logging(FMHA_LOG_DISPATCH):
                log.info("%s -> %s", name, op.NAME)
            return op
    raise NotImplementedError(
        _not_supported_message(
            f"No operator found for `{name}` with inputs:",
            inp,
            {op.NAME: reasons(op) for op in priority_list},
            next_step="make the inputs fit one operator above as its reasons say (dtype, head dim, mask, layout), "
            "or pin one with `op=` to see only its reasons.",
        )
    )


def _is_mqa_decoding(inp: Inputs) -> bool:
    """Few queries against many keys shared by several heads (K expanded over heads with stride 0), with little
    parallelism over batch × heads (batch × groups in BMGHK): splitting the keys pays (spec §4). On NVIDIA GPUs
    also at any parallelism where sequences have 2 to 32 queries (16 past head dim 128), or are packed (varlen or
    paged masks): triton_splitk's programs take the queries of all the heads that share a K/V head as the rows of
    one tile, where cuDNN and FlashAttention-2 read K/V once a query head (H100, K/V of 8 heads under 32, K=128,
    16 x 8192 keys: 4 queries split-K 0.182 ms, cuDNN 0.422, FlashAttention-2 0.802; one query a sequence, keys
    padded (B12), split-K 0.175, FlashAttention-2 0.818; RESULTS.md, sixty-ninth session)."""
    key, query = inp.key, inp.query
    if key.dim() <= 3 or key.stride(-2) != 0 or key.shape[-2] <= 1 or query.device.type == "mtia":
        return False
    parallelism = query.shape[0] * query.shape[2]  # B·H, or B·G for BMGHK
    queries, keys = _a_sequence(inp)
    if rocm_build() or (queries == 1 and not _packed(inp)):
        return query.shape[1] <= 32 and key.shape[1] >= 256 and 0 < parallelism < 64
    return keys >= 256 and queries <= (32 if query.shape[-1] <= 128 else 16) and parallelism > 0


def _packed(inp: Inputs) -> bool:
    """Whether the mask packs the sequences into one batch element (varlen and paged masks)."""
    return hasattr(inp.attn_bias, "q_seqinfo")


def _a_sequence(inp: Inputs) -> tuple[int, int]:
    """The most queries and keys a sequence has: Mq and Mk, or a packing mask's longest sequences."""
    if _packed(inp):
        return inp.attn_bias.q_seqinfo.max_seqlen, inp.attn_bias.k_seqinfo.max_seqlen
    return inp.query.shape[1], inp.key.shape[1]


def _dispatch_fw_priority_list(inp: Inputs, needs_gradient: bool) -> list[type[AttentionFwOpBase]]:
    if rocm_build():
        ops = [ck.FwOp, flydsl.FwOp, triton_splitk.FwOp]
    else:
        ops = [flash3.FwOp] if _get_use_fa3() else []
        ops += [cudnn.FwOp, flash.FwOp, cutlass.FwOp, triton_splitk.FwOp]
    if not needs_gradient and _is_mqa_decoding(inp):
        ops = [triton_splitk.FwOp] + [op for op in ops if op is not triton_splitk.FwOp]
        if not rocm_build() and not _packed(inp) and inp.query.shape[1] == 1:
            # One query a sequence, unpacked: cuDNN's GQA (up to head dim 128), then FlashAttention-2's, are faster
            # (H100, 32 query heads over 8, K=128: 1 x 8192 keys cuDNN 12.0 us, split-K 13.7, FlashAttention-2 20.6;
            # at K=256 16 x 8192 keys 100.5, 94.9 and 97.3; RESULTS.md, sixty-ninth session).
            lead = [cudnn.FwOp, flash.FwOp] if inp.query.shape[-1] <= 128 else [flash.FwOp]
            ops = lead + [op for op in ops if op not in (*lead, flash3.FwOp)]
    if flash_mtia.FwOp.is_available():
        ops.append(flash_mtia.FwOp)
    first = _triton_flash_first(inp, needs_gradient)
    ops = _with_triton_flash(ops, triton_flash.FwOp, cutlass.FwOp, inp.device.type, first)
    if first and cudnn.FwOp in ops and triton_flash.gluon_forward_before_cudnn(inp):
        _move_before(ops, triton_flash.FwOp, cudnn.FwOp)
    elif _triton_flash_before_flash(ops, triton_flash.FwOp, flash.FwOp, inp, needs_gradient):
        _move_before(ops, triton_flash.FwOp, flash.FwOp)
    return [*ops, torch_reference.FwOp]


def _triton_flash_before_flash(ops: list, op: type[AttentionOpBase], flash_op: type[AttentionOpBase], inp: Inputs,
                               needs_gradient: bool) -> bool:  # fmt: skip
    """Whether MSLK's Triton kernel `op` moves before FlashAttention-2's `flash_op` in ops (both there, after
    cuDNN's): where it is measured faster (triton_flash.before_flash) than FlashAttention-2 serving these inputs
    (what it declines keeps the order the lists give, where `cutlass` may come before MSLK's kernel)."""
    return op in ops and flash_op in ops and triton_flash.before_flash(inp, needs_gradient) and flash_op.supports(inp)


def _move_before(ops: list, op: type[AttentionOpBase], other: type[AttentionOpBase]) -> None:
    """Moves op (in ops) right before other."""
    ops.remove(op)
    ops.insert(ops.index(other), op)


def _dispatch_fw(inp: Inputs, needs_gradient: bool) -> type[AttentionFwOpBase]:
    """The forward operator for these (validated, BMHK or BMGHK) inputs."""
    return _run_priority_list(
        "memory_efficient_attention_forward", _dispatch_fw_priority_list(inp, needs_gradient), inp
    )


def _triton_flash_first(inp: Inputs, needs_gradient: bool) -> bool:
    """Whether MSLK's Triton kernels come before PyTorch's memory-efficient ones (`cutlass`): where they are
    measured faster (H200, RESULTS.md, thirty-fifth session), on Hopper and 16-bit inputs, forwards alone (1.06x to
    3.5x: tensor biases, Kv != K, varlen) and forward + backward from head dim 128 (1.3x to 3.3x; at head dims 40
    and 64 PyTorch's backward is faster). fp32 stays with PyTorch's kernels (4-7x faster than our IEEE products).
    torch.compile'd code too: the Triton launches are torch ops it does not trace into."""
    return (
        arch.on_hopper(inp.query)
        and inp.query.dtype in (torch.float16, torch.bfloat16)
        and (not needs_gradient or inp.query.shape[-1] >= 128)
    )


def _with_triton_flash(ops: list, op: type[AttentionOpBase], cutlass_op: type[AttentionOpBase], device_type: str,
                       first: bool) -> list:  # fmt: skip
    """ops with MSLK's Triton kernel `op` for GPU inputs (its CPU device is the interpreter, for tests): before
    PyTorch's memory-efficient kernels when `first`, else after all the others, where it serves what they do not."""
    if device_type != "cuda":
        return ops
    if first:
        place = ops.index(cutlass_op)
        return [*ops[:place], op, *ops[place:]]
    return [*ops, op]


def _dispatch_bw_priority_list(device_type: str = "cuda", triton_first: bool = False) -> list[type[AttentionBwOpBase]]:
    if rocm_build():
        ops = [ck.BwOp]  # flydsl.BwOp is left out on purpose (tests pin it)
    else:
        ops = [flash3.BwOp] if _get_use_fa3() else []
        ops += [cudnn.BwOp, flash.BwOp, cutlass.BwOp]
    if flash_mtia.BwOp.is_available():
        ops.append(flash_mtia.BwOp)
    return [*_with_triton_flash(ops, triton_flash.BwOp, cutlass.BwOp, device_type, triton_first), torch_reference.BwOp]


def _dispatch_bw(inp: Inputs, varlen_lse_packed: bool | None) -> type[AttentionBwOpBase]:
    """The backward operator for these inputs, given the layout of the forward's varlen LSE (None: not varlen or
    one sequence, where the layouts agree)."""
    first = _triton_flash_first(inp, needs_gradient=True)
    ops = _dispatch_bw_priority_list(inp.device.type, first)
    if first and cudnn.BwOp in ops and triton_flash.gluon_backward_before_cudnn(inp):
        _move_before(ops, triton_flash.BwOp, cudnn.BwOp)
    elif _triton_flash_before_flash(ops, triton_flash.BwOp, flash.BwOp, inp, needs_gradient=True):
        _move_before(ops, triton_flash.BwOp, flash.BwOp)
    extra_reasons = {}
    if varlen_lse_packed is not None:
        layout = "packed" if varlen_lse_packed else "padded"
        extra_reasons = {
            op: [f"LSE is in {layout} format"]
            for op in ops
            if op.VARLEN_LSE_PACKED is not None and op.VARLEN_LSE_PACKED != varlen_lse_packed
        }
    return _run_priority_list("memory_efficient_attention_backward", ops, inp, extra_reasons)
