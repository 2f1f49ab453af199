"""Bench specs of mslk.attention (`mslk bench --op attention_fwd`, ...).

Two MSLK rows per shape family: `memory_efficient_attention` as the user calls it (the dispatcher picks), and
MSLK's own Triton flash kernel pinned (`triton_flash_*`). Baselines in the same run and on the same memory
(SDPA takes the BMHK tensors as [B, H, M, K] views): SDPA with each of its CUDA backends (cuDNN first, the
ratio's baseline) and FlexAttention with the same mask, compiled once per mask. On the masks cuDNN cannot take
(varlen block-diagonal, sliding window, a tensor bias) FlexAttention is the only baseline; the `*_sparse_graph`
specs time the varlen shapes in CUDA graphs as well, where the host time of a call would otherwise hide the
kernels. FLOPs follow PERF.md: forward 4·B·H·Mq·Mkv·K, halved for causal, scaled by the visible fraction for
windows and varlen; forward+backward 3.5x.
"""

from __future__ import annotations

import functools

import torch

from mslk.attention import fmha
from mslk.attention.fmha import attn_bias as ab
from mslk.attention.fmha import triton_flash
from mslk.core import bench, testing

DENSE = [
    {"B": 4, "M": 4096, "H": 16, "K": 128, "mask": "causal"},
    {"B": 4, "M": 4096, "H": 16, "K": 128, "mask": "none"},
    {"B": 1, "M": 16384, "H": 16, "K": 128, "mask": "causal"},
    {"B": 8, "M": 4096, "H": 16, "K": 64, "mask": "causal"},
    {"B": 2, "M": 4096, "H": 16, "K": 256, "mask": "causal"},
    {"B": 16, "M": 1024, "H": 16, "K": 128, "mask": "none"},
    {"B": 1, "M": 32768, "H": 16, "K": 128, "mask": "causal"},
]
# Masks cuDNN cannot take: FlexAttention with the same mask is the comparison (PERF.md); "bias" adds a tensor
# [B, H, M, M] to the scores (a score_mod for FlexAttention).
SPARSE = [
    {"B": 1, "M": 16384, "H": 16, "K": 128, "mask": "window", "window": 4096},
    {"B": 2, "M": 4096, "H": 16, "K": 128, "mask": "bias"},
    {"B": 1, "M": 16384, "H": 16, "K": 128, "mask": "varlen", "seqlen": 512},
    {"B": 1, "M": 16384, "H": 16, "K": 128, "mask": "varlen", "seqlen": 2048},
]
# Many short sequences, where the GPU waits for the host (a call's host time passes its kernels' on the H200
# machine's host, FlexAttention's too: RESULTS.md): timed in CUDA graphs as well, which compare the kernels.
GRAPHED = [s for s in SPARSE if s["mask"] == "varlen"]


def _visible_fraction(s: dict) -> float:
    """Fraction of the M x M score matrix a mask keeps (diagonal counted half, as PERF.md halves causal)."""
    m = s["M"]
    if s["mask"] in ("none", "bias"):
        return 1.0
    if s["mask"] == "causal":
        return 0.5
    if s["mask"] == "window":
        w = s["window"]
        return (w * m - w * w / 2) / (m * m)
    return 0.5 * s["seqlen"] / m  # varlen: causal within each sequence


def _fwd_flops(s: dict) -> float:
    return 4 * s["B"] * s["H"] * s["M"] * s["M"] * s["K"] * _visible_fraction(s)


def _attn_bias(s: dict, device: torch.device):
    if s["mask"] == "bias":
        return testing.randn(s["B"], s["H"], s["M"], s["M"], dtype=torch.bfloat16, device=device)
    if s["mask"] == "causal":
        return ab.LowerTriangularMask()
    if s["mask"] == "window":
        return ab.LowerTriangularFromBottomRightLocalAttentionMask(s["window"])
    if s["mask"] == "varlen":
        return ab.BlockDiagonalCausalMask.from_seqlens([s["seqlen"]] * (s["M"] // s["seqlen"]), device=device)
    return None


def _mask_mod(s: dict):
    """FlexAttention's mask_mod for the same mask (None for none and a tensor bias; causal is top-left here as
    Mq == Mkv)."""
    if s["mask"] in ("none", "bias"):
        return None
    if s["mask"] == "causal":
        return lambda b, h, q, k: q >= k
    if s["mask"] == "window":
        w = s["window"]
        return lambda b, h, q, k: (q >= k) & (q - k < w)
    n = s["seqlen"]
    return lambda b, h, q, k: (q >= k) & (q // n == k // n)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _inputs(s: dict, device: torch.device, requires_grad: bool):
    """q, k, v [B, M, H, K] bf16, the MSLK mask, FlexAttention's keyword arguments for the same mask (block_mask,
    or score_mod adding the tensor bias), and the output gradient."""
    from torch.nn.attention.flex_attention import create_block_mask

    shape = (s["B"], s["M"], s["H"], s["K"])
    q, k, v = (testing.randn(*shape, dtype=torch.bfloat16, device=device).requires_grad_(requires_grad) for _ in "qkv")
    bias = _attn_bias(s, device)
    mod = _mask_mod(s)
    flex_kwargs = {}
    if mod is not None:
        flex_kwargs["block_mask"] = create_block_mask(mod, None, None, s["M"], s["M"], device=device)
    if isinstance(bias, torch.Tensor):
        flex_kwargs["score_mod"] = lambda score, b, h, q_idx, kv_idx: score + bias[b, h, q_idx, kv_idx]
    grad = testing.randn(*shape, dtype=torch.bfloat16, device=device)
    return q, k, v, bias, flex_kwargs, grad


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def call(i):
        q, k, v, bias, _, _ = i
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=bias is not None
            )
        return out.transpose(1, 2)

    return call


def _flex(i):
    q, k, v, _, flex_kwargs, _ = i
    out = _compiled_flex()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **flex_kwargs)
    return out.transpose(1, 2)


def _backward(forward):
    """forward + backward of `forward` (inputs carry requires_grad); gradients are dropped after each call."""

    def call(i):
        q, k, v, _, _, grad = i
        out = forward(i)
        torch.autograd.backward(out, grad)
        q.grad = k.grad = v.grad = None

    return call


def _mslk_forward(fw_op):
    def call(i):
        q, k, v, bias, _, _ = i
        return fmha.memory_efficient_attention_forward(q, k, v, attn_bias=bias, op=fw_op)

    return call


def _mslk(ops):
    def call(i):
        q, k, v, bias, _, _ = i
        return fmha.memory_efficient_attention(q, k, v, attn_bias=bias, op=ops)

    return call


def _baselines(sdpa_can_serve: bool) -> dict:
    from torch.nn.attention import SDPBackend

    if not sdpa_can_serve:
        return {"flex_attention": _flex}
    return {
        "SDPA cuDNN": _sdpa(SDPBackend.CUDNN_ATTENTION),
        "SDPA flash": _sdpa(SDPBackend.FLASH_ATTENTION),
        "SDPA efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "flex_attention": _flex,
    }


def _register():
    # attention_*: what the dispatcher picks; triton_flash_*: MSLK's own kernel, pinned.
    impls = {
        ("attention", "fwd"): _mslk_forward(None),
        ("attention", "fwd_bwd"): _backward(_mslk(None)),
        ("triton_flash", "fwd"): _mslk_forward(triton_flash.FwOp),
        ("triton_flash", "fwd_bwd"): _backward(_mslk(fmha.MemoryEfficientAttentionMslkTritonOp)),
    }
    for shapes, suffix, graph in ((DENSE, "", False), (SPARSE, "_sparse", False), (GRAPHED, "_sparse_graph", True)):
        baselines = _baselines(shapes is DENSE)
        for (prefix, kind), run in impls.items():
            backward = kind == "fwd_bwd"
            bench.register(
                bench.BenchSpec(
                    name=f"{prefix}_{kind}{suffix}",
                    op="mslk::memory_efficient_attention_forward",
                    shapes=shapes,
                    make_inputs=lambda s, device, backward=backward: _inputs(s, device, backward),
                    run=run,
                    baselines={name: _backward(fn) if backward else fn for name, fn in baselines.items()},
                    flops=(lambda s: 3.5 * _fwd_flops(s)) if backward else _fwd_flops,
                    cuda_graph=graph,
                    domain="attention",
                )
            )


_register()
