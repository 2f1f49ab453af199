"""Multi-head latent attention over a paged latent cache (spec A-50, A-51): mla_decode_fwd, mla_prefill_fwd.

DeepSeek-V3's attention after weight absorption: every query head attends to one shared latent cache row a key,
    K = kv[..., :576] (512 latent + 64 rotary dims),  V = kv[..., :512]  (the same bytes),
    out[t, h] = softmax(scale · q[t, h] · Kᵀ) · V  over the keys the token sees, in fp32, rounded once to bf16.

query [T, H, 576]: the query tokens of B sequences one after another, sequence b's being rows cu_seqlens_q[b] to
cu_seqlens_q[b + 1]. kv_buffer [num_pages, page_size, 1, 576]: the paged cache; key j of sequence b is row
j % page_size of page block_tables[b, j // page_size], and sequence b has seqused_k[b] keys, its new tokens'
included (the cache is written before attending). A query token sees the keys up to its own position: token i of
sequence b's n query tokens sees keys j < seqused_k[b] − n + i + 1 (causal, bottom-right aligned; a decode
step's one token sees them all). The scale defaults to 576**−0.5. Output bf16 [T, H, 512].

Dtypes: bf16 or fp16 queries and cache, or an FP8 e4m3 cache (this platform's flavour) with FP8, bf16 or fp16
queries; FP8 values are read as they are (a cache quantized with one scale s: pass softmax_scale times s, and
multiply the output by s, as the values are the keys' bytes too). Any number of query heads (the reference library
takes 128, DeepSeek-V3 unsharded, and runs on ROCm only; tensor-parallel shards have 16-64) and any strides.

One Triton kernel serves both ops, which differ only in their usual inputs (a decode step is a prefill of one
token a sequence). A program takes one query token's heads in blocks of up to 64 and walks its visible keys in
blocks, reading cache rows through the block table (on Hopper by TMA where the pages allow, else gathered by
pointers): the 512 latent dims of a loaded row serve both products (scores against Kᵀ, then the weights times V),
so the cache is read once per head block. Where the (token, head block) programs are too few to fill the GPU
(decode), each token's visible keys are split in equal parts over more programs, whose partial outputs and
log-sum-exps `merge.merge_stacked_into` combines.

The metadata's values (cu_seqlens_q monotone from 0 to T, seqused_k[b] within the table's pages and at least
the sequence's query tokens, page ids below num_pages) are checked by the reference (the CPU kernel); on the GPU
reading them would wait for the device, so the kernel trusts them, as PyTorch's varlen attention does.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import triton
import triton.language as tl

from mslk.attention.fmha import merge
from mslk.core import arch, launch, registry, testing

MLA_NUM_HEADS = 128
MLA_NUM_KV_HEADS = 1
MLA_KV_LORA_RANK = 512
MLA_QK_ROPE_HEAD_DIM = 64
MLA_QK_HEAD_DIM = MLA_KV_LORA_RANK + MLA_QK_ROPE_HEAD_DIM
MLA_V_HEAD_DIM = MLA_KV_LORA_RANK

_INDEX_DTYPE = torch.int32


def _scale(softmax_scale: float | None) -> float:
    return MLA_QK_HEAD_DIM**-0.5 if softmax_scale is None else softmax_scale


def _validate(where, query, kv_buffer, block_tables, cu_seqlens_q, seqused_k, softmax_scale=None):
    fp8 = arch.fp8_dtype(query.device)
    if query.dim() != 3 or query.shape[-1] != MLA_QK_HEAD_DIM:
        raise ValueError(f"{where}: query must be [T, H, {MLA_QK_HEAD_DIM}], got {tuple(query.shape)}")
    if kv_buffer.dim() != 4 or kv_buffer.shape[2] != MLA_NUM_KV_HEADS or kv_buffer.shape[3] != MLA_QK_HEAD_DIM:
        raise ValueError(
            f"{where}: kv_buffer must be [num_pages, page_size, {MLA_NUM_KV_HEADS}, {MLA_QK_HEAD_DIM}], got "
            f"{tuple(kv_buffer.shape)}"
        )
    if kv_buffer.shape[1] < 1:
        raise ValueError(f"{where}: kv_buffer's pages must hold at least one row, got page_size {kv_buffer.shape[1]}")
    if query.dtype not in (torch.bfloat16, torch.float16, fp8) or kv_buffer.dtype not in (query.dtype, fp8):
        raise ValueError(
            f"{where}: expected bf16 or fp16 query and kv_buffer, or an {fp8} kv_buffer (this platform's FP8) with "
            f"{fp8}, bf16 or fp16 queries; got query {query.dtype} and kv_buffer {kv_buffer.dtype}"
        )
    if block_tables.dim() != 2:
        raise ValueError(f"{where}: block_tables must be [B, max_blocks], got {tuple(block_tables.shape)}")
    b = block_tables.shape[0]
    if b == 0 and query.shape[0]:
        raise ValueError(f"{where}: query has {query.shape[0]} tokens and block_tables no sequence")
    for name, t, shape in (("cu_seqlens_q", cu_seqlens_q, (b + 1,)), ("seqused_k", seqused_k, (b,))):
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{where}: {name} must be {list(shape)} for block_tables of {b} sequences, got {tuple(t.shape)}"
            )
    for name, t in (("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q), ("seqused_k", seqused_k)):
        if t.dtype != _INDEX_DTYPE:
            raise ValueError(f"{where}: {name} must be int32, got {t.dtype}")
    if softmax_scale is not None and not math.isfinite(softmax_scale):
        raise ValueError(f"{where}: softmax_scale must be finite, got {softmax_scale}")
    registry.check_devices(
        where, query=query, kv_buffer=kv_buffer, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q,
        seqused_k=seqused_k,
    )  # fmt: skip


def _check_metadata(where, query, kv_buffer, block_tables, cu_seqlens_q, seqused_k) -> None:
    """The values the kernel trusts (module docstring), read on the host."""
    starts, used = cu_seqlens_q.tolist(), seqused_k.tolist()
    if starts[0] != 0 or starts[-1] != query.shape[0] or any(a > b for a, b in itertools.pairwise(starts)):
        raise ValueError(f"{where}: cu_seqlens_q must rise from 0 to T = {query.shape[0]}, got {starts}")
    num_pages, page_size = kv_buffer.shape[:2]
    for b, keys in enumerate(used):
        queries = starts[b + 1] - starts[b]
        if not queries <= keys <= block_tables.shape[1] * page_size:
            raise ValueError(
                f"{where}: sequence {b} has {keys} keys (seqused_k), {queries} query tokens and "
                f"{block_tables.shape[1] * page_size} rows of pages in block_tables: the keys must number at least "
                "the query tokens (the new tokens' keys included) and fit the pages"
            )
        pages = block_tables[b, : launch.cdiv(keys, page_size)]
        if pages.numel() and not (0 <= int(pages.min()) and int(pages.max()) < num_pages):
            raise ValueError(f"{where}: sequence {b}'s block table holds page ids outside [0, {num_pages})")


def _reference(where, query, kv_buffer, block_tables, cu_seqlens_q, seqused_k, softmax_scale=None):
    """float64 softmax attention of each sequence's queries over its gathered keys (module docstring)."""
    _check_metadata(where, query, kv_buffer, block_tables, cu_seqlens_q, seqused_k)
    out = torch.zeros(*query.shape[:2], MLA_V_HEAD_DIM, dtype=torch.float64, device=query.device)
    starts, used, page_size = cu_seqlens_q.tolist(), seqused_k.tolist(), kv_buffer.shape[1]
    for b, keys in enumerate(used):
        first, last = starts[b], starts[b + 1]
        if first == last:
            continue
        pages = block_tables[b, : launch.cdiv(keys, page_size)].long()
        k = kv_buffer[pages, :, 0].double().reshape(-1, MLA_QK_HEAD_DIM)[:keys]  # [keys, 576]
        scores = torch.einsum("thd,kd->thk", query[first:last].double(), k) * _scale(softmax_scale)
        position = torch.arange(last - first, device=query.device) + keys - (last - first)
        hidden = torch.arange(keys, device=query.device)[None, :] > position[:, None]  # [tokens, keys]
        weights = scores.masked_fill(hidden[:, None, :], float("-inf")).softmax(-1)
        out[first:last] = torch.einsum("thk,kv->thv", weights, k[:, :MLA_V_HEAD_DIM])
    return out.to(torch.bfloat16)


def _fake(query, *args, **kwargs):
    return query.new_empty(*query.shape[:2], MLA_V_HEAD_DIM, dtype=torch.bfloat16)


@triton.jit
def _compute(x, PRODUCTS: tl.constexpr):
    """x in the products' dtype (`_products_dtype`)."""
    if PRODUCTS == "fp16":
        return x.to(tl.float16)
    elif PRODUCTS == "bf16":
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def _load_rows(rows, dims, stride, ok, PRODUCTS: tl.constexpr):
    """[rows, dims] elements at rows[i] + dims[j] · stride (zeros where not ok[i]) in the products' dtype."""
    return _compute(tl.load(rows[:, None] + dims[None, :] * stride, mask=ok[:, None], other=0.0), PRODUCTS)


@triton.jit
def _key_tiles(kv_ptr, k_lo_desc, k_hi_desc, k_rope_desc, table, page_size, first_key, end, stride_ti, stride_kvp,
               stride_kvs, stride_kvd, PRODUCTS: tl.constexpr, D_V: tl.constexpr, D_ROPE: tl.constexpr,
               BLOCK_N: tl.constexpr, TMA: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """The sequence's keys first_key ... first_key + BLOCK_N − 1 as (latent dims 0-255, 256-511, rotary dims) of
    their cache rows in the products' dtype; with MASKED, keys from `end` on are zeros. TMA: by the descriptors of
    the cache as [pages · rows, 576] (the block lies in one page: page_size is a multiple of BLOCK_N); else rows
    gathered through the block table."""
    HALF: tl.constexpr = D_V // 2
    key = first_key + tl.arange(0, BLOCK_N)
    key_ok = key < end
    if TMA:
        row = tl.load(table + (first_key // page_size) * stride_ti) * page_size + first_key % page_size
        k_lo, k_hi, k_rope = k_lo_desc.load([row, 0]), k_hi_desc.load([row, HALF]), k_rope_desc.load([row, D_V])
        if MASKED:  # rows past the sequence's keys hold whatever the page holds (the scores of all are masked)
            k_lo = tl.where(key_ok[:, None], k_lo, 0.0)
            k_hi = tl.where(key_ok[:, None], k_hi, 0.0)
        return _compute(k_lo, PRODUCTS), _compute(k_hi, PRODUCTS), _compute(k_rope, PRODUCTS)
    else:
        page = tl.load(table + (key // page_size) * stride_ti, mask=key_ok, other=0)
        rows = kv_ptr + page.to(tl.int64) * stride_kvp + (key % page_size).to(tl.int64) * stride_kvs
        dims = tl.arange(0, HALF)
        k_lo = _load_rows(rows, dims, stride_kvd, key_ok, PRODUCTS)
        k_hi = _load_rows(rows, HALF + dims, stride_kvd, key_ok, PRODUCTS)
        return k_lo, k_hi, _load_rows(rows, D_V + tl.arange(0, D_ROPE), stride_kvd, key_ok, PRODUCTS)


@triton.jit
def _attend_block(acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_rope, kv_ptr, k_lo_desc, k_hi_desc, k_rope_desc, table,
                  page_size, first_key, end, scale_log2, stride_ti, stride_kvp, stride_kvs, stride_kvd,
                  PRODUCTS: tl.constexpr, D_V: tl.constexpr, D_ROPE: tl.constexpr, BLOCK_N: tl.constexpr,
                  TMA: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """The online softmax's step over the block of keys from first_key (MASKED: the last, keys from `end` on left
    out)."""
    k_lo, k_hi, k_rope = _key_tiles(
        kv_ptr, k_lo_desc, k_hi_desc, k_rope_desc, table, page_size, first_key, end, stride_ti, stride_kvp,
        stride_kvs, stride_kvd, PRODUCTS, D_V, D_ROPE, BLOCK_N, TMA, MASKED,
    )  # fmt: skip
    s = tl.dot(q_rope, tl.trans(k_rope), tl.dot(q_hi, tl.trans(k_hi), tl.dot(q_lo, tl.trans(k_lo)))) * scale_log2
    if MASKED:
        s = tl.where((first_key + tl.arange(0, BLOCK_N) < end)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    p_products = _compute(p, PRODUCTS)
    acc_lo = tl.dot(p_products, k_lo, acc_lo * alpha[:, None])
    acc_hi = tl.dot(p_products, k_hi, acc_hi * alpha[:, None])
    return acc_lo, acc_hi, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _mla_kernel(
    q_ptr, kv_ptr, k_lo_desc, k_hi_desc, k_rope_desc, tables_ptr, starts_ptr, used_ptr, out_ptr, lse_ptr, sequences,
    search_steps, H, page_size, splits, scale_log2, stride_qt, stride_qh, stride_qd, stride_kvp, stride_kvs,
    stride_kvd, stride_tb, stride_ti, stride_starts, stride_used, stride_os, stride_ot, stride_oh, stride_od,
    stride_ls, stride_lt, stride_lh, PRODUCTS: tl.constexpr, D_V: tl.constexpr, D_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """One query token's heads hb·BLOCK_H ... (program id 0: token · head blocks + hb, so that a token's head blocks
    run together and share its cache rows in L2) over part `split` (program id 1) of its visible keys: the output
    normalized over that part, and with WRITE_LSE its log-sum-exp (natural log; −inf over no key). The latent dims
    go in halves of 256 (a TMA box's widest; fewer registers live at once)."""
    HALF: tl.constexpr = D_V // 2
    head_blocks = tl.cdiv(H, BLOCK_H)
    token, hb, split = tl.program_id(0) // head_blocks, tl.program_id(0) % head_blocks, tl.program_id(1)
    # The token's sequence: the last b with starts[b] <= token (binary search over the B + 1 starts).
    lo, hi = tl.zeros([], tl.int32), sequences - 1
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        up = tl.load(starts_ptr + mid * stride_starts) <= token
        lo, hi = tl.where(up, mid, lo), tl.where(up, hi, mid - 1)
    first_query = tl.load(starts_ptr + lo * stride_starts)
    queries = tl.load(starts_ptr + (lo + 1) * stride_starts) - first_query
    keys = tl.load(used_ptr + lo * stride_used)
    visible = tl.maximum(keys - queries + (token - first_query) + 1, 0)  # bottom-right causal
    per_split = tl.cdiv(tl.cdiv(visible, splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(visible, start + per_split)
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N  # the blocks of keys all visible

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    dims = tl.arange(0, HALF)
    q_rows = q_ptr + token.to(tl.int64) * stride_qt + heads * stride_qh
    q_lo = _load_rows(q_rows, dims, stride_qd, head_ok, PRODUCTS)
    q_hi = _load_rows(q_rows, HALF + dims, stride_qd, head_ok, PRODUCTS)
    q_rope = _load_rows(q_rows, D_V + tl.arange(0, D_ROPE), stride_qd, head_ok, PRODUCTS)
    table = tables_ptr + lo.to(tl.int64) * stride_tb

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the scores, log2 units
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_lo = tl.zeros([BLOCK_H, HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_H, HALF], tl.float32)
    for first_key in range(start, full_end, BLOCK_N):
        acc_lo, acc_hi, m_i, l_i = _attend_block(
            acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_rope, kv_ptr, k_lo_desc, k_hi_desc, k_rope_desc, table, page_size,
            first_key, end, scale_log2, stride_ti, stride_kvp, stride_kvs, stride_kvd, PRODUCTS, D_V, D_ROPE, BLOCK_N,
            TMA, False,
        )  # fmt: skip
    if full_end < end:  # the last block, in part visible
        acc_lo, acc_hi, m_i, l_i = _attend_block(
            acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_rope, kv_ptr, k_lo_desc, k_hi_desc, k_rope_desc, table, page_size,
            full_end, end, scale_log2, stride_ti, stride_kvp, stride_kvs, stride_kvd, PRODUCTS, D_V, D_ROPE, BLOCK_N,
            TMA, True,
        )  # fmt: skip

    inverse = tl.where(l_i > 0, 1.0 / l_i, 0.0)[:, None]  # over no key: zeros (weight 0 in the merge)
    out_rows = out_ptr + split * stride_os + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
    out_lo, out_hi = (acc_lo * inverse).to(out_ptr.dtype.element_ty), (acc_hi * inverse).to(out_ptr.dtype.element_ty)
    tl.store(out_rows + dims[None, :] * stride_od, out_lo, mask=head_ok[:, None])
    tl.store(out_rows + (HALF + dims[None, :]) * stride_od, out_hi, mask=head_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_i)) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + split * stride_ls + token.to(tl.int64) * stride_lt + heads * stride_lh, lse, mask=head_ok)


def _key_descriptors(kv_buffer: torch.Tensor, cfg: dict) -> tuple | None:
    """TMA descriptors of the cache as [pages · rows, 576] (latent halves, rotary dims), BLOCK_N rows a box, where
    they beat gathering rows by pointers (H100, RESULTS.md, fifty-ninth session): 1.16-1.19x at 64 heads a program
    on a bf16 / fp16 cache. None elsewhere: off Hopper; an FP8 cache (its tiles pass through registers to become
    bf16 anyway: 0.95x, ptxas spills 800 bytes); programs of 16 or 32 heads (0.64-0.84x: their products take no
    wgmma, which reads tiles from shared memory); pages not whole blocks, rows not 16-byte aligned or pages apart."""
    page_size, block_n = kv_buffer.shape[1], cfg["BLOCK_N"]
    if cfg["BLOCK_H"] != 64 or kv_buffer.element_size() != 2 or page_size % block_n or not arch.on_hopper(kv_buffer):
        return None
    strides = kv_buffer.stride()
    if strides[3] != 1 or strides[0] != page_size * strides[1] or strides[1] % 8 or kv_buffer.data_ptr() % 16:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    shape, flat = [kv_buffer.shape[0] * page_size, MLA_QK_HEAD_DIM], [strides[1], 1]
    half = MLA_V_HEAD_DIM // 2
    return tuple(TensorDescriptor(kv_buffer, shape, flat, [block_n, w]) for w in (half, half, MLA_QK_ROPE_HEAD_DIM))


def _products_dtype(query: torch.Tensor, kv_buffer: torch.Tensor) -> str:
    """fp16 when the query and cache are fp16, else bf16 (FP8 values fit it exactly); fp32 instead of bf16 under
    the Triton interpreter (CPU tensors), which multiplies bf16 dot operands as raw integers."""
    if query.dtype == kv_buffer.dtype == torch.float16:
        return "fp16"
    return "bf16" if query.is_cuda else "fp32"


def _config(query: torch.Tensor) -> dict:
    """Up to 64 heads a program (its products 64 rows deep), at least 16 (the products' least M); cache rows 64 at
    a time, two blocks in flight: 1.25-1.43x the speed of 32 rows at DeepSeek-V3's shapes (H100, RESULTS.md). GPUs
    of less shared memory a block, where the products' layout changes pass through it, take 1024 heads x rows (RTX
    4090 and 5090: about 100 KiB), and at most 32 heads below 96 KiB (MI300's 64 KiB: a 64-head query's change of
    layout alone asks 64 KiB)."""
    shared_memory = arch.device_info(query.device).shared_memory if query.is_cuda else None
    if shared_memory is None:  # the interpreter, or a GPU that does not say: the configuration tuned on Hopper
        shared_memory = 160 * 1024
    block_h = max(16, min(64 if shared_memory >= 96 * 1024 else 32, launch.next_power_of_2(query.shape[1])))
    block_n = 64 if shared_memory >= 160 * 1024 else 1024 // block_h
    return {"BLOCK_H": block_h, "BLOCK_N": block_n, "num_warps": 8 if block_h == 64 else 4, "num_stages": 2}


def _splits(programs: int, key_rows: int, query: torch.Tensor, cfg: dict) -> int:
    """Key splits a token: the fewest that give the shortest time (launch.fewest_waves), as the programs run one an
    SM at 8 warps (255 registers a thread take an SM's 64 K) and two at 4. Against cdiv(SMs, programs), which ran
    B=32 decode steps' 64 programs as 192 in 1.45 waves: 1.0-1.7x as fast on 11 decode shapes (H200, RESULTS.md)."""
    sms = arch.sm_count(query.device) if query.is_cuda else 4  # 4: a few programs under the interpreter
    return launch.fewest_waves(programs, key_rows, sms * (1 if cfg["num_warps"] == 8 else 2))


def _run(query, kv_buffer, block_tables, cu_seqlens_q, seqused_k, softmax_scale=None):
    tokens, heads = query.shape[:2]
    out = torch.empty(tokens, heads, MLA_V_HEAD_DIM, dtype=torch.bfloat16, device=query.device)
    if out.numel() == 0:
        return out
    cfg = _config(query)
    programs = tokens * launch.cdiv(heads, cfg["BLOCK_H"])
    splits = _splits(programs, block_tables.shape[1] * kv_buffer.shape[1], query, cfg)
    sequences = block_tables.shape[0]
    if splits == 1:
        partial, lse = out[None], out.new_empty((1, 1, 1), dtype=torch.float32)  # lse: not written
    else:
        partial = query.new_empty(splits, tokens, heads, MLA_V_HEAD_DIM, dtype=torch.float32)
        lse = query.new_empty(splits, tokens, heads, dtype=torch.float32)
    descriptors = _key_descriptors(kv_buffer, cfg)
    launch.fast(_mla_kernel)[(programs, splits)](
        query, kv_buffer, *(descriptors or (None, None, None)), block_tables, cu_seqlens_q, seqused_k, partial, lse,
        sequences, (sequences - 1).bit_length(), heads, kv_buffer.shape[1], splits,
        _scale(softmax_scale) * math.log2(math.e), *query.stride(), kv_buffer.stride(0), kv_buffer.stride(1),
        kv_buffer.stride(3), *block_tables.stride(), cu_seqlens_q.stride(0), seqused_k.stride(0), *partial.stride(),
        *lse.stride(), PRODUCTS=_products_dtype(query, kv_buffer), D_V=MLA_V_HEAD_DIM, D_ROPE=MLA_QK_ROPE_HEAD_DIM,
        TMA=descriptors is not None, WRITE_LSE=splits > 1, **cfg,
    )  # fmt: skip
    if splits == 1:
        return out
    # The merge's stacked form: chunks [n, B, M, G, H, K] and LSEs [n, B, G, H, M], here B = G = 1 and M = T.
    merge.merge_stacked_into(partial[:, None, :, None], lse.transpose(1, 2)[:, None, None], out[None, :, None])
    return out


def random_cache(
    lengths: list[int], page_size: int, dtype: torch.dtype, device="cpu", spare_pages: int = 3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_buffer, block_tables, seqused_k) of sequences of the given key counts: random rows on shuffled pages
    (with spare pages no sequence uses) and a table as wide as the longest sequence needs."""
    need = [launch.cdiv(n, page_size) for n in lengths]
    pages = sum(need) + spare_pages
    kv = testing.randn(pages, page_size, MLA_NUM_KV_HEADS, MLA_QK_HEAD_DIM, device=device).to(dtype)
    order = torch.randperm(pages, device=device).to(_INDEX_DTYPE)
    tables = torch.zeros(len(lengths), max(need, default=0) or 1, dtype=_INDEX_DTYPE, device=device)
    taken = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[taken : taken + n]
        taken += n
    return kv, tables, torch.tensor(lengths, dtype=_INDEX_DTYPE, device=device)


def _samples(device):
    # (query tokens a sequence, keys a sequence, heads, page size, query dtype, cache dtype)
    fp8 = arch.fp8_dtype(device)
    cases = (
        ([1, 1, 1], [5, 40, 1], 72, 16, torch.bfloat16, torch.bfloat16),  # decode; two head blocks
        ([3, 0, 5], [7, 4, 5], 20, 8, torch.float16, torch.float16),  # prefill with context, an empty sequence
        ([2, 1], [9, 33], 4, 32, torch.bfloat16, fp8),  # an FP8 cache
    )
    for queries, keys, heads, page_size, q_dtype, kv_dtype in cases:
        kv, tables, used = random_cache(keys, page_size, kv_dtype, device)
        query = testing.randn(sum(queries), heads, MLA_QK_HEAD_DIM, device=device).to(q_dtype)
        starts = torch.tensor([0, *itertools.accumulate(queries)], dtype=_INDEX_DTYPE, device=device)
        yield registry.Sample((query, kv, tables, starts, used), name=f"q{queries} k{keys} h{heads} {kv_dtype}")


def _supports(query, kv_buffer, *args, **kwargs) -> list[str]:
    """An FP8 cache (an FP8 query comes with one) needs a GPU with FP8 conversions."""
    why = arch.fp8_e4m3_missing(kv_buffer) if kv_buffer.element_size() == 1 else None
    return [why] if why else []


def _op(name: str) -> registry.Op:
    op = registry.Op(
        f"mslk::{name}(Tensor query, Tensor kv_buffer, Tensor block_tables, Tensor cu_seqlens_q, Tensor seqused_k, "
        "float? softmax_scale=None) -> Tensor",
        domain="attention",
        reference=functools.partial(_reference, name),
        fake=_fake,
        samples=_samples,
        validate=functools.partial(_validate, name),
    )
    op.backend("triton", available=registry.triton_missing, supports=_supports)(_run)
    return op


mla_decode_fwd_op = _op("mla_decode_fwd")
mla_prefill_fwd_op = _op("mla_prefill_fwd")


def mla_decode_fwd(query, kv_buffer, block_tables, cu_seqlens_q, seqused_k, softmax_scale=None) -> torch.Tensor:
    """MLA decode: query [B, H, 576] (a token a sequence, or a few: speculative steps) over the paged latent cache
    kv_buffer [num_pages, page_size, 1, 576] -> bf16 [B, H, 512]. See the module docstring."""
    return torch.ops.mslk.mla_decode_fwd(query, kv_buffer, block_tables, cu_seqlens_q, seqused_k, softmax_scale)


def mla_prefill_fwd(query, kv_buffer, block_tables, cu_seqlens_q, seqused_k, softmax_scale=None) -> torch.Tensor:
    """MLA prefill: query [T, H, 576], the new tokens of the sequences, causal over their keys (the cache holds
    theirs too) -> bf16 [T, H, 512]. See the module docstring."""
    return torch.ops.mslk.mla_prefill_fwd(query, kv_buffer, block_tables, cu_seqlens_q, seqused_k, softmax_scale)
