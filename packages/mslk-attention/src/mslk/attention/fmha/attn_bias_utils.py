"""Test and reference helpers of the fmha tests (spec A-14): the mask classes, a random instance of any attention
bias, the reference attention (with dropout by an explicit mask), and a paged K/V cache.

Tensor layouts: BMK [B, M, K], BMHK [B, M, H, K], BMGHK [B, M, G, H, K]. The varlen ("block diagonal") masks
made here describe `batch_size` sequences packed into one: queries [1, batch_size · q_len, ...] and keys
[1, batch_size · kv_len, ...] (padded keys: slots of kv_len keys; paged keys: a pool of batch_size · pages_per_row
pages of page_size keys, pages_per_row = ⌈kv_len / page_size⌉).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from mslk.attention.fmha import attn_bias as ab
from mslk.attention.fmha.reference import attention_reference
from mslk.core import launch

# ------------------------------------------------------------------------------------ random biases

MASK_CLASSES = sorted(  # every public attention bias class but the base, by name
    (
        c
        for name, c in vars(ab).items()
        if isinstance(c, type) and issubclass(c, ab.AttentionBias) and c is not ab.AttentionBias and name[0] != "_"
    ),
    key=lambda c: c.__name__,
)


def _rand_parts(r: random.Random, total: int, low: Sequence[int], high: Sequence[int]) -> list[int]:
    """Random integers, part i in [low[i], high[i]], summing to total."""
    if not sum(low) <= total <= sum(high):
        raise ValueError(f"cannot split {total} into parts between {list(low)} and {list(high)}")
    parts = list(low)
    growing = [i for i, (p, hi) in enumerate(zip(parts, high, strict=True)) if p < hi]
    for _ in range(total - sum(low)):
        i = r.choice(growing)
        parts[i] += 1
        if parts[i] == high[i]:
            growing.remove(i)
    return parts


def _rand_seqlens(r, batch_size, q_len, kv_len, max_q_minus_k):
    """(query lengths, key lengths) of batch_size packed blocks totalling batch_size · q_len queries and
    batch_size · kv_len keys, each block with at least one query and one key and nq − nk <= max_q_minus_k
    (None: no bound; 0 for the bottom-right masks, whose queries need as many keys)."""
    total_q, total_k = batch_size * q_len, batch_size * kv_len
    q = _rand_parts(r, total_q, [1] * batch_size, [total_q] * batch_size)
    slack = total_k if max_q_minus_k is None else max_q_minus_k
    return q, _rand_parts(r, total_k, [max(1, n - slack) for n in q], [total_k] * batch_size)


def _rand_seqlens_padded(r, batch_size, q_len, kv_len):
    """(query lengths summing to batch_size · q_len, key lengths within slots of kv_len keys), nq <= nk per
    sequence (the padded masks are bottom-right: a query needs as many keys)."""
    if q_len > kv_len:
        raise ValueError(f"padded-key masks need q_len <= kv_len, got {q_len} > {kv_len}")
    q = _rand_parts(r, batch_size * q_len, [1] * batch_size, [kv_len] * batch_size)
    return q, [r.randint(n, kv_len) for n in q]


def _aligned_bias(shape: Sequence[int], device, dtype) -> torch.Tensor:
    """Random values (std 3) whose rows start 8-element aligned, as the CUTLASS kernels require."""
    padded = torch.randn((*shape[:-1], -(-shape[-1] // 8) * 8), device=device, dtype=dtype) * 3
    return padded[..., : shape[-1]]


def _tensor_bias(batch_size, num_heads, num_heads_groups, q_len, kv_len, device, dtype, fmt):
    """[B, G, H, Mq, Mk] for BMGHK, [B, H, Mq, Mk] for BMHK, [B · H, Mq, Mk] for BMK."""
    if fmt == "BMK":
        batch_size, num_heads = batch_size * num_heads, 1
    bias = _aligned_bias((batch_size, num_heads_groups, num_heads, q_len, kv_len), device, dtype)
    if fmt == "BMGHK":
        return bias
    return bias[:, 0, 0] if fmt == "BMK" else bias[:, 0]


def _block_tables(r: random.Random, batch_size: int, pages_per_row: int, device) -> torch.Tensor:
    """Each sequence's pages, a random permutation of the pool's."""
    pages = r.sample(range(batch_size * pages_per_row), batch_size * pages_per_row)
    return torch.tensor(pages, dtype=torch.int32, device=device).reshape(batch_size, pages_per_row)


def create_attn_bias(
    bias_type,
    batch_size: int,
    num_heads: int,
    num_heads_groups: int,
    q_len: int,
    kv_len: int,
    device,
    dtype,
    requires_grad: bool,
    fmt: str,
    op=None,
    page_size: int | None = None,
):
    """A random bias of type bias_type (None, torch.Tensor or any attn_bias mask class) for inputs of the given
    sizes in layout fmt ("BMK", "BMHK" or "BMGHK"); see the module docstring for the varlen layouts.

    The lengths, windows and page tables are seeded by the sizes, dtype and fmt (the same arguments give the
    same mask); tensor values come from torch's generator. A tensor bias (alone or in
    LowerTriangularMaskWithTensorBias) has dtype, requires_grad, and rows 8-element aligned; its first
    q_len − 1 rows and kv_len − 1 columns of batch 0, group 0, head 0 are masked (−inf), so that kernels see
    partly masked rows. page_size is required by the paged masks. op is accepted for the reference library's
    signature: every bias made here suits every backend.
    """
    del op
    if bias_type is None or bias_type is type(None):
        return None
    r = random.Random(f"{batch_size}-{q_len}-{kv_len}-{dtype}-{fmt}")
    window = r.choice([3, 128, 300])

    if bias_type is torch.Tensor:
        bias = _tensor_bias(batch_size, num_heads, num_heads_groups, q_len, kv_len, device, dtype, fmt)
        bias[(0,) * (bias.dim() - 2)][: q_len - 1, : kv_len - 1] = -math.inf
        return bias.requires_grad_(requires_grad)
    if bias_type is ab.LowerTriangularMaskWithTensorBias:
        bias = _tensor_bias(batch_size, num_heads, num_heads_groups, q_len, kv_len, device, dtype, fmt)
        return bias_type(bias.requires_grad_(requires_grad))
    if bias_type in (ab.LowerTriangularMask, ab.LowerTriangularFromBottomRightMask):
        return bias_type()
    if bias_type is ab.LowerTriangularFromBottomRightLocalAttentionMask:
        return bias_type(window)
    if bias_type is ab.LocalAttentionFromBottomRightMask:
        return bias_type(window_left=r.randint(0, 5), window_right=r.randint(0, 5))

    if fmt == "BMK":
        raise ValueError(f"create_attn_bias: {bias_type.__name__} describes packed sequences, use BMHK or BMGHK")
    if issubclass(bias_type, (ab.PagedBlockDiagonalPaddedKeysMask, ab.PagedBlockDiagonalGappyKeysMask)):
        if page_size is None:
            raise ValueError(f"create_attn_bias: {bias_type.__name__} needs a page_size")
        return _paged_bias(r, bias_type, batch_size, q_len, kv_len, page_size, window, device)

    if bias_type in (ab.BlockDiagonalPaddedKeysMask, ab.BlockDiagonalCausalWithOffsetPaddedKeysMask):
        return bias_type.from_seqlens(*_padded(r, batch_size, q_len, kv_len), device=device)
    if bias_type is ab.BlockDiagonalCausalLocalAttentionPaddedKeysMask:
        q, padding, k = _padded(r, batch_size, q_len, kv_len)
        return bias_type.from_seqlens_local(q, padding, k, min(window, *k), device=device)
    if bias_type is ab.BlockDiagonalLocalAttentionPaddedKeysMask:
        q, padding, k = _padded(r, batch_size, q_len, kv_len)
        reach = max(window, *q) + 1  # wide enough that every query sees keys
        return bias_type.from_seqlens_local(q, padding, k, reach, reach, device=device)

    bottom_right = (
        ab.BlockDiagonalCausalFromBottomRightMask,
        ab.BlockDiagonalCausalLocalAttentionFromBottomRightMask,
        ab.BlockDiagonalCausalWithOffsetGappyKeysMask,
        ab.BlockDiagonalLocalAttentionFromBottomRightGappyKeysMask,
    )
    max_q_minus_k = 0 if bias_type in bottom_right else None
    if bias_type is ab.BlockDiagonalCausalLocalAttentionMask:
        max_q_minus_k = window - 1  # the last query of a block still sees a key
    q, k = _rand_seqlens(r, batch_size, q_len, kv_len, max_q_minus_k)

    if issubclass(bias_type, ab.BlockDiagonalGappyKeysMask):
        total_k = batch_size * kv_len
        starts = [r.randint(0, total_k - n) for n in k] + [total_k]
        if bias_type is ab.BlockDiagonalLocalAttentionFromBottomRightGappyKeysMask:
            return bias_type.from_seqlens_local_gappy(q, starts, k, r.randint(0, 5), r.randint(0, 5), device=device)
        return bias_type.from_seqlens(q, starts, k, device=device)

    block_diagonal = ab.BlockDiagonalMask.from_seqlens(q, k, device=device)
    make = {
        ab.BlockDiagonalMask: lambda: block_diagonal,
        ab.BlockDiagonalCausalMask: block_diagonal.make_causal,
        ab.BlockDiagonalCausalFromBottomRightMask: block_diagonal.make_causal_from_bottomright,
        ab.BlockDiagonalCausalLocalAttentionMask: lambda: block_diagonal.make_local_attention(window),
        ab.BlockDiagonalCausalLocalAttentionFromBottomRightMask: (
            lambda: block_diagonal.make_local_attention_from_bottomright(window)
        ),
    }
    if bias_type not in make:
        raise ValueError(f"create_attn_bias: unsupported bias type {bias_type}")
    return make[bias_type]()


def _padded(r, batch_size, q_len, kv_len):
    """(q_seqlen, kv_padding, kv_seqlen) of a padded-keys mask."""
    q, k = _rand_seqlens_padded(r, batch_size, q_len, kv_len)
    return q, kv_len, k


def _paged_bias(r, bias_type, batch_size, q_len, kv_len, page_size, window, device):
    pages_per_row = launch.cdiv(kv_len, page_size)
    tables = _block_tables(r, batch_size, pages_per_row, device)
    if issubclass(bias_type, ab.PagedBlockDiagonalGappyKeysMask):
        if bias_type is ab.PagedBlockDiagonalCausalWithOffsetGappyKeysMask:
            q, k = _rand_seqlens_padded(r, batch_size, q_len, kv_len)
        else:  # full attention: any split of the queries, empty sequences included
            q = _rand_parts(r, batch_size * q_len, [0] * batch_size, [batch_size * q_len] * batch_size)
            k = [r.randint(1, kv_len) for _ in range(batch_size)]
        lane = pages_per_row * page_size
        starts = [r.randint(0, lane - n) for n in k]
        return bias_type.from_seqlens(q, starts, k, tables, page_size, device=device)
    q, k = _rand_seqlens_padded(r, batch_size, q_len, kv_len)
    if bias_type is ab.PagedBlockDiagonalCausalLocalPaddedKeysMask:
        return bias_type.from_seqlens_local(q, k, tables, page_size, min(window, *k), device=device)
    return bias_type.from_seqlens(q, k, tables, page_size, device=device)


# ---------------------------------------------------------------------------------- reference attention


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """[B, M, (G, H,) X] -> [B, (G, H,) M, X]."""
    return t.movedim(1, -2) if t.dim() > 3 else t


def _heads_last(t: torch.Tensor) -> torch.Tensor:
    return t.movedim(-2, 1) if t.dim() > 3 else t


def ref_attention(q, k, v, attn_bias=None, drop_mask=None, p=0.0, scale=None) -> torch.Tensor:
    """`softmax(scale · Q·Kᵀ + bias)`, dropped out by drop_mask (1 keeps, 0 drops; scaled by 1 / (1 − p)), times
    V: reference.attention_reference (float64 inside) in BMK, BMHK or BMGHK. drop_mask has the shape of the
    attention weights, [B, (G, H,) Mq, Mk]. Returns fp32 (fp64 for fp64 inputs)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if drop_mask is None:
        return attention_reference(q, k, v, attn_bias, scale)[0]
    # The attention weights are the attention's output for the values V = I (key j has value e_j).
    mk = k.shape[1]
    identity = torch.eye(mk, dtype=dtype, device=q.device).reshape(1, mk, *[1] * (q.dim() - 3), mk)
    weights = attention_reference(q, k, identity.expand(*k.shape[:-1], mk), attn_bias, scale)[0]
    dropped = _heads_first(weights) * drop_mask.to(dtype) / (1 - p)
    return _heads_last(dropped @ _heads_first(v))


def ref_attention_bmhk(q, k, v, attn_bias, scale=None) -> torch.Tensor:
    """ref_attention for BMHK inputs only."""
    if q.dim() != 4:
        raise ValueError(f"ref_attention_bmhk: q must be BMHK [B, M, H, K], got shape {tuple(q.shape)}")
    return ref_attention(q, k, v, attn_bias, scale=scale)


# ------------------------------------------------------------------------------------------ paged cache


def pack_kv_cache(
    cache_k: torch.Tensor, cache_v: torch.Tensor, kv_seqlens: Sequence[int], BLOCK_N: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A paged copy of K/V caches [B, MAX_T, H_kv, D] (unexpanded heads) holding kv_seqlens[b] keys each:
    (block_tables int32 [B, ⌈MAX_T / BLOCK_N⌉], k pool [1, P · BLOCK_N, H_kv, D], v pool likewise), where sequence
    b owns ⌈kv_seqlens[b] / BLOCK_N⌉ consecutive pages of the P in all, in batch order, and its table lists them.
    A table's entries past its sequence's pages point at the pool's last page (valid, and masked by the length);
    the pool's rows past a sequence's keys are zero."""
    batch, max_t = cache_k.shape[:2]
    pages = [launch.cdiv(n, BLOCK_N) for n in kv_seqlens]
    first_page = [sum(pages[:b]) for b in range(batch)]
    last_page = max(sum(pages) - 1, 0)
    pools = []
    for cache in (cache_k, cache_v):
        pool = cache.new_zeros((1, sum(pages) * BLOCK_N, *cache.shape[2:]))
        for b, n in enumerate(kv_seqlens):
            pool[0, first_page[b] * BLOCK_N : first_page[b] * BLOCK_N + n] = cache[b, :n]
        pools.append(pool)
    width = launch.cdiv(max_t, BLOCK_N)
    tables = [[first_page[b] + j if j < pages[b] else last_page for j in range(width)] for b in range(batch)]
    return torch.tensor(tables, dtype=torch.int32, device=cache_k.device), pools[0], pools[1]
