"""Bench specs of mslk.attention (`mslk bench --op attention_fwd`, ...).

Two MSLK rows per shape family: `memory_efficient_attention` as the user calls it (the dispatcher picks), and
MSLK's own Triton flash kernel pinned (`triton_flash_*`). Baselines in the same run and on the same memory
(SDPA takes the BMHK tensors as [B, H, M, K] views): SDPA with each of its CUDA backends (cuDNN first, the
ratio's baseline) and FlexAttention with the same mask, compiled once per mask. On the masks cuDNN cannot take
(varlen block-diagonal, sliding window, a tensor bias) FlexAttention is the only baseline; the `*_sparse_graph`
specs time the varlen shapes in CUDA graphs as well, where the host time of a call would otherwise hide the
kernels. FLOPs follow PERF.md: forward 4·B·H·Mq·Mkv·K, halved for causal, scaled by the visible fraction for
windows and varlen; forward+backward 3.5x. `mla_decode` and `mla_prefill` time MLA over a paged latent cache
against SDPA on the same keys gathered beforehand (see MLA_DECODE); `attention_decode` and `triton_splitk_decode`
decoding over a dense or paged KV cache (see DECODE).
"""

from __future__ import annotations

import functools

import torch

from mslk.attention import fmha, mla
from mslk.attention.fmha import attn_bias as ab
from mslk.attention.fmha import kv_cache, triton_flash, triton_splitk
from mslk.attention.fmha.common import Inputs, InputsFp8
from mslk.core import arch, bench, testing

DENSE = [
    {"B": 4, "M": 4096, "H": 16, "K": 128, "mask": "causal"},
    {"B": 4, "M": 4096, "H": 16, "K": 128, "mask": "none"},
    {"B": 1, "M": 16384, "H": 16, "K": 128, "mask": "causal"},
    {"B": 8, "M": 4096, "H": 16, "K": 64, "mask": "causal"},
    {"B": 2, "M": 4096, "H": 16, "K": 256, "mask": "causal"},
    {"B": 16, "M": 1024, "H": 16, "K": 128, "mask": "none"},
    {"B": 1, "M": 32768, "H": 16, "K": 128, "mask": "causal"},
    # GQA (Llama-3 70B's 64 query heads over 8 K/V heads, a shard of two): K/V [B, M, Hkv, K], expanded over the
    # query heads for MSLK (BMGHK), SDPA's and FlexAttention's enable_gqa for the baselines.
    {"B": 4, "M": 4096, "H": 32, "Hkv": 8, "K": 128, "mask": "causal"},
]
# Masks cuDNN cannot take: FlexAttention with the same mask is the comparison (PERF.md); "bias" adds a tensor
# [B, H, M, M] to the scores (a score_mod for FlexAttention).
SPARSE = [
    {"B": 1, "M": 16384, "H": 16, "K": 128, "mask": "window", "window": 4096},
    {"B": 1, "M": 16384, "H": 32, "Hkv": 8, "K": 128, "mask": "window", "window": 4096},  # Mistral-7B's GQA window
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
    """q [B, M, H, K], k, v [B, M, Hkv, K] bf16 (Hkv = H unless the shape says), the MSLK mask, FlexAttention's
    keyword arguments for the same mask (block_mask, or score_mod adding the tensor bias), and the output gradient."""
    from torch.nn.attention.flex_attention import create_block_mask

    shape = (s["B"], s["M"], s["H"], s["K"])
    kv_heads = s.get("Hkv", s["H"])
    q, k, v = (
        testing.randn(*shape[:2], heads, s["K"], dtype=torch.bfloat16, device=device).requires_grad_(requires_grad)
        for heads in (s["H"], kv_heads, kv_heads)
    )
    bias = _attn_bias(s, device)
    mod = _mask_mod(s)
    flex_kwargs = {}
    if mod is not None:
        flex_kwargs["block_mask"] = create_block_mask(mod, None, None, s["M"], s["M"], device=device)
    if isinstance(bias, torch.Tensor):
        flex_kwargs["score_mod"] = lambda score, b, h, q_idx, kv_idx: score + bias[b, h, q_idx, kv_idx]
    if "Hkv" in s:
        flex_kwargs["enable_gqa"] = True
    grad = testing.randn(*shape, dtype=torch.bfloat16, device=device)
    return q, k, v, bias, flex_kwargs, grad


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def call(i):
        q, k, v, bias, _, _ = i
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=bias is not None,
                enable_gqa=k.shape[2] != q.shape[2],
            )  # fmt: skip
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


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, M, H, K] and K/V of fewer heads as MSLK takes GQA: BMGHK, K/V's G heads expanded over H / G each."""
    if k.shape[2] == q.shape[2]:
        return q, k, v
    q = q.unflatten(2, (k.shape[2], -1))
    return q, *(t.unsqueeze(3).expand(*q.shape[:-1], t.shape[-1]) for t in (k, v))


def _mslk_forward(fw_op):
    def call(i):
        q, k, v, bias, _, _ = i
        return fmha.memory_efficient_attention_forward(*_grouped(q, k, v), attn_bias=bias, op=fw_op).flatten(2, -2)

    return call


def _mslk(ops):
    def call(i):
        q, k, v, bias, _, _ = i
        return fmha.memory_efficient_attention(*_grouped(q, k, v), attn_bias=bias, op=ops).flatten(2, -2)

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


# MLA over a paged latent cache (DeepSeek-V3: 576 / 512 dims; pages of 64 rows): decode steps of B sequences of L
# keys, and prefills of Q new tokens a sequence after L − Q keys of context, with H query heads (128: DeepSeek-V3
# unsharded; 16: a shard of eight-way tensor parallelism); bf16 queries, the cache bf16 or FP8. Baseline: PyTorch's
# SDPA over the same keys gathered into a contiguous tensor beforehand (not timed), each sequence's tokens' heads as
# the query rows of its one KV head (MQA folded, as MLA kernels do).
MLA_DECODE = [
    {"B": 32, "Q": 1, "L": 4096, "H": 128, "cache": "bf16"},
    {"B": 128, "Q": 1, "L": 4096, "H": 128, "cache": "bf16"},
    {"B": 64, "Q": 1, "L": 8192, "H": 128, "cache": "fp8"},
    {"B": 4, "Q": 2, "L": 16384, "H": 128, "cache": "bf16"},  # speculative steps of two tokens
    {"B": 128, "Q": 1, "L": 8192, "H": 16, "cache": "bf16"},
]
MLA_PREFILL = [
    {"B": 2, "Q": 1024, "L": 4096, "H": 128, "cache": "bf16"},
    {"B": 1, "Q": 4096, "L": 4096, "H": 128, "cache": "bf16"},
]


def _mla_inputs(s: dict, device: torch.device):
    """(the op's arguments, the baseline's: query rows [B, 1, Q·H, 576], keys [B, 1, L, 576], the causal mask)."""
    heads, dims = s["H"], mla.MLA_QK_HEAD_DIM
    cache = arch.fp8_dtype(device) if s["cache"] == "fp8" else torch.bfloat16
    kv, tables, used = mla.random_cache([s["L"]] * s["B"], 64, cache, device)
    query = testing.randn(s["B"] * s["Q"], heads, dims, dtype=torch.bfloat16, device=device)
    starts = torch.arange(0, s["B"] * s["Q"] + 1, s["Q"], dtype=torch.int32, device=device)
    keys = kv[tables.long()].reshape(s["B"], -1, dims)[:, None, : s["L"]].to(torch.bfloat16)
    rows = query.view(s["B"], 1, s["Q"] * heads, dims)
    position = torch.arange(s["L"] - s["Q"], s["L"], device=device).repeat_interleave(heads)
    mask = torch.arange(s["L"], device=device)[None, :] <= position[:, None] if s["Q"] > 1 else None
    return (query, kv, tables, starts, used), (rows, keys, mask)


def _mla_sdpa(i):
    rows, keys, mask = i[1]
    return torch.nn.functional.scaled_dot_product_attention(
        rows, keys, keys[..., : mla.MLA_V_HEAD_DIM], attn_mask=mask, scale=mla.MLA_QK_HEAD_DIM**-0.5
    )


def _mla_visible(s: dict) -> int:
    """(query token, key) pairs a sequence: the tokens' causal rows after L − Q keys of context."""
    return s["Q"] * (s["L"] - s["Q"]) + s["Q"] * (s["Q"] + 1) // 2


def _register_mla():
    for op, shapes in ((mla.mla_decode_fwd, MLA_DECODE), (mla.mla_prefill_fwd, MLA_PREFILL)):
        bench.register(
            bench.BenchSpec(
                name=op.__name__.removesuffix("_fwd"),
                op=f"mslk::{op.__name__}",
                shapes=shapes,
                make_inputs=_mla_inputs,
                run=lambda i, op=op: op(*i[0]),
                baselines={"SDPA (gathered cache, heads as rows)": _mla_sdpa},
                # Serving engines replay decode steps as CUDA graphs; timed eagerly, a 0.2 ms step measured the
                # GPU machine's host (0.25-0.48 ms a call there, 16-32% apart between rounds), not the kernels.
                cuda_graph=op is mla.mla_decode_fwd,
                flops=lambda s: 2 * s["B"] * _mla_visible(s) * s["H"] * (mla.MLA_QK_HEAD_DIM + mla.MLA_V_HEAD_DIM),
                bytes=lambda s: (
                    s["B"] * mla.MLA_QK_HEAD_DIM * (s["L"] * (1 if s["cache"] == "fp8" else 2) + s["Q"] * s["H"] * 2)
                    + 2 * s["B"] * s["Q"] * s["H"] * mla.MLA_V_HEAD_DIM
                ),
            )
        )


# Decoding over a KV cache (PERF.md's decode row: B=16, one query, 8192 keys, 32 query heads over 8 KV heads, K=128;
# "Mq": that many queries a sequence, a speculative step, all seeing every key), the cache dense ([B, L, 8, 4
# expanded, K]) or paged (pages of 64 or 256 rows, PagedBlockDiagonalCausalWithOffsetPaddedKeysMask; one query a
# sequence). `attention_decode` is memory_efficient_attention as called, `triton_splitk_decode` MSLK's split-K
# kernel pinned. Baselines: SDPA with enable_gqa over the same keys gathered into [B, 8, L, K] beforehand (not timed;
# a quantized cache's dequantized values, in bf16), and FlexAttention (compiled, enable_gqa) over the same values in
# its own layout, a pool [1, 8, pages · page, K] read through the page table (a BlockMask whose key blocks are the
# pages, PERF.md's comparison for paged masks) or the gathered keys where the cache is dense. CUDA graphs, as
# serving engines replay decode steps. Bytes: the K and V read once (int4: K / 8 + 1 int32 a row; FP8 rows: K bytes
# and a 4-byte scale).
DECODE = [
    {"B": 16, "L": 8192, "Hq": 32, "Hkv": 8, "K": 128, "page": 0, "kv": "bf16"},
    {"B": 16, "L": 8192, "Hq": 32, "Hkv": 8, "K": 128, "page": 256, "kv": "bf16"},
    {"B": 64, "L": 4096, "Hq": 32, "Hkv": 8, "K": 128, "page": 64, "kv": "bf16"},
    {"B": 4, "L": 32768, "Hq": 64, "Hkv": 8, "K": 128, "page": 64, "kv": "bf16"},
    {"B": 16, "L": 8192, "Hq": 32, "Hkv": 8, "K": 128, "page": 0, "kv": "int4"},
    {"B": 16, "L": 8192, "Hq": 32, "Hkv": 8, "K": 128, "page": 64, "kv": "int4"},
    {"B": 16, "L": 8192, "Hq": 32, "Hkv": 8, "K": 128, "page": 64, "kv": "fp8"},
    {"B": 16, "L": 8192, "Hq": 32, "Hkv": 8, "K": 128, "page": 0, "kv": "fp8"},
    {"B": 16, "L": 8192, "Hq": 32, "Hkv": 8, "K": 64, "page": 64, "kv": "fp8"},
    {"B": 16, "L": 8192, "Hq": 32, "Hkv": 8, "K": 64, "page": 0, "kv": "int4"},
    {"B": 16, "L": 8192, "Hq": 32, "Hkv": 8, "K": 128, "page": 0, "kv": "bf16", "Mq": 4},
]


def _kv_row_bytes(s: dict) -> int:
    return {"int4": (s["K"] // 8 + 1) * 4, "fp8": s["K"] + 4}.get(s["kv"], s["K"] * 2)


def _round_trip(t: torch.Tensor, kv: str) -> torch.Tensor:
    """t's values as a cache in format kv holds them."""
    if kv == "int4":
        return kv_cache.dequantize_kv_int4(kv_cache.quantize_kv_int4(t)).to(t.dtype)
    return kv_cache.dequantize_kv_fp8(*kv_cache.quantize_kv_fp8(t)).to(t.dtype) if kv == "fp8" else t


def _decode_inputs(s: dict, device: torch.device):
    """(the op's Inputs, (q, k, v) of SDPA, (q, k, v, block mask) of FlexAttention)."""
    batch, keys, kv_heads, dim, page, queries = s["B"], s["L"], s["Hkv"], s["K"], s["page"], s.get("Mq", 1)
    shared = s["Hq"] // kv_heads
    q = testing.randn(batch, queries, kv_heads, shared, dim, dtype=torch.bfloat16, device=device)
    sdpa_q = q.view(batch, queries, s["Hq"], dim).transpose(1, 2).contiguous()
    if page and queries > 1:
        raise ValueError("several queries a sequence: dense caches only")
    if page:
        pages = keys // page
        tables = torch.randperm(batch * pages, device=device).to(torch.int32).view(batch, pages)
        k, v = (testing.randn(1, batch * keys, kv_heads, 1, dim, dtype=torch.bfloat16, device=device) for _ in "kv")
        mask = ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
            [1] * batch, [keys] * batch, tables, page, device=device
        )
        rows = mask.pool_rows(device).view(batch, keys)
        values = [_round_trip(t[0, :, :, 0], s["kv"]) for t in (k, v)]  # [pool rows, 8, K], as the cache holds them
        gathered = [t[rows].transpose(1, 2) for t in values]
        flex = (sdpa_q, *(t.transpose(0, 1)[None].contiguous() for t in values), _page_block_mask(tables, page))
        q = q.view(1, batch, kv_heads, shared, dim)
    else:
        k, v = (testing.randn(batch, keys, kv_heads, 1, dim, dtype=torch.bfloat16, device=device) for _ in "kv")
        mask = None
        gathered = [_round_trip(t[:, :, :, 0].transpose(1, 2).contiguous(), s["kv"]) for t in (k, v)]
        flex = (sdpa_q, *gathered, None)
    heads = (*k.shape[:3], shared)
    if s["kv"] == "fp8":
        (k, k_scales), (v, v_scales) = (kv_cache.quantize_kv_fp8(t) for t in (k, v))
        expanded = [t.expand(*heads, t.shape[-1]) for t in (k, v)]
        scales = {"k_fp8_scale_shift": k_scales.expand(heads), "v_fp8_scale_shift": v_scales.expand(heads)}
        return InputsFp8(q, *expanded, mask, **scales), (sdpa_q, *gathered), flex
    if s["kv"] == "int4":
        k, v = (kv_cache.quantize_kv_int4(t) for t in (k, v))
    return Inputs(q, *(t.expand(*heads, t.shape[-1]) for t in (k, v)), mask), (sdpa_q, *gathered), flex


def _page_block_mask(tables: torch.Tensor, page: int):
    """FlexAttention's BlockMask of one query a sequence over a pool of pages: sequence b's key blocks are the pages of
    its table row, whole blocks (the kernel skips the mask_mod, which says the same key by key: a key is seen by its
    page's sequence)."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, pages = tables.shape
    counts = torch.full((batch, 1, 1), pages, dtype=torch.int32, device=tables.device)
    indices = torch.zeros(batch, 1, 1, tables.numel(), dtype=torch.int32, device=tables.device)  # (a column a page)
    indices[..., :pages] = tables.view(batch, 1, 1, pages)
    owner = torch.empty(tables.numel(), dtype=torch.int32, device=tables.device)
    sequences = torch.arange(batch, dtype=torch.int32, device=tables.device)
    owner[tables.flatten().long()] = sequences.repeat_interleave(pages)
    return BlockMask.from_kv_blocks(
        torch.zeros_like(counts), indices, counts, indices, BLOCK_SIZE=(128, page),
        mask_mod=lambda b, h, q, kv: owner[kv // page] == b, seq_lengths=(1, tables.numel() * page),
    )  # fmt: skip


def _decode_sdpa(i):
    q, k, v = i[1]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _decode_flex(i):
    q, k, v, block_mask = i[2]
    return _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=True)


def _register_decode():
    for name, op in (("attention_decode", None), ("triton_splitk_decode", triton_splitk.FwOp)):
        bench.register(
            bench.BenchSpec(
                name=name,
                op="mslk::memory_efficient_attention_forward",
                shapes=DECODE,
                make_inputs=_decode_inputs,
                run=lambda i, op=op: fmha._memory_efficient_attention_forward(i[0], op=op),
                baselines={
                    "SDPA (gathered cache, enable_gqa)": _decode_sdpa,
                    "FlexAttention (its own cache: through the page table where paged)": _decode_flex,
                },
                cuda_graph=True,
                flops=lambda s: 4 * s["B"] * s["Hq"] * s.get("Mq", 1) * s["L"] * s["K"],
                bytes=lambda s: 2 * s["B"] * s["L"] * s["Hkv"] * _kv_row_bytes(s),
                domain="attention",
            )
        )


_register()
_register_mla()
_register_decode()
