"""iRoPE chunked attention (spec A-12): the padded-keys mask of a KV cache, re-expressed so that each query sees
only the keys of its chunk, over the same query and key tensors.

A model with chunked attention splits positions into chunks of L = batchify_len: a query at position p sees the
keys the input mask allows at positions [⌊p / L⌋ · L, ⌊p / L⌋ · L + L) of its lane. Positions count from the
start of the lane. Query i of a lane of n keys and nq queries is at position
- n − nq + i for a causal mask (B12, bottom-right: the last query sits on the last key) and in prefill;
- n + i for a non-causal mask in decoding (B11: the prefix mask of speculative decoding, whose draft follows the
  cached keys; the draft's own keys are attended separately).

Decoding (and speculative decoding with one draft length for every lane) assumes that each lane's queries lie in
one chunk: its keys become one gappy range, from the start of that chunk to the lane's end (B18/B19, paged
B21/B22). Queries that cross into the next chunk get the keys of the last query's chunk (causal: the earlier
queries see none of them) or of the first query's (non-causal): the caller attends those separately. Prefill
splits every lane of `padding` keys into padding / L lanes of L keys, with the queries of each chunk.

Nothing here reads a device tensor on the host: the masks' Python lists give their host values, and their device
tensors are computed on the device from the input's, so no call waits for the GPU (building a mask from lists on
the GPU would: a host-to-device copy synchronizes the stream). The device part of decoding can be computed ahead:
`split_blocks_for_decoding_gpu_part`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mslk.attention.fmha.attn_bias import (
    AttentionBias,
    BlockDiagonalCausalLocalAttentionPaddedKeysMask,
    BlockDiagonalCausalWithOffsetGappyKeysMask,
    BlockDiagonalCausalWithOffsetPaddedKeysMask,
    BlockDiagonalGappyKeysMask,
    BlockDiagonalPaddedKeysMask,
    PagedBlockDiagonalCausalLocalPaddedKeysMask,
    PagedBlockDiagonalCausalWithOffsetGappyKeysMask,
    PagedBlockDiagonalCausalWithOffsetPaddedKeysMask,
    PagedBlockDiagonalGappyKeysMask,
    PagedBlockDiagonalPaddedKeysMask,
    _SeqLenInfo,
)

# The masks that can be split, each with its decoding result (unpaged, paged).
_DECODING_TYPES: dict[type, tuple[type, type]] = {
    BlockDiagonalPaddedKeysMask: (BlockDiagonalGappyKeysMask, PagedBlockDiagonalGappyKeysMask),
    BlockDiagonalCausalWithOffsetPaddedKeysMask: (
        BlockDiagonalCausalWithOffsetGappyKeysMask,
        PagedBlockDiagonalCausalWithOffsetGappyKeysMask,
    ),
}

# maybe_make_paged: the paged form of each mask that has one (the same rule over the same keys).
_PAGED_TYPES: dict[type, type] = {
    BlockDiagonalPaddedKeysMask: PagedBlockDiagonalPaddedKeysMask,
    BlockDiagonalCausalWithOffsetPaddedKeysMask: PagedBlockDiagonalCausalWithOffsetPaddedKeysMask,
    BlockDiagonalCausalLocalAttentionPaddedKeysMask: PagedBlockDiagonalCausalLocalPaddedKeysMask,
    BlockDiagonalGappyKeysMask: PagedBlockDiagonalGappyKeysMask,
    BlockDiagonalCausalWithOffsetGappyKeysMask: PagedBlockDiagonalCausalWithOffsetGappyKeysMask,
}
_PAGED_ALREADY = (PagedBlockDiagonalPaddedKeysMask, PagedBlockDiagonalGappyKeysMask)


def _names(types) -> str:
    return ", ".join(t.__name__ for t in types)


def _check_splittable(function: str, input_bias: AttentionBias, batchify_len: int) -> None:
    if type(input_bias) not in _DECODING_TYPES:
        raise ValueError(
            f"{function}: input_bias must be a padded-keys mask ({_names(_DECODING_TYPES)}), got "
            f"{type(input_bias).__name__}"
        )
    if isinstance(batchify_len, bool) or not isinstance(batchify_len, int) or batchify_len <= 0:
        raise ValueError(f"{function}: batchify_len (the chunk length) must be a positive int, got {batchify_len!r}")


def _with_device_tensors(
    mask: AttentionBias, q_seqinfo: _SeqLenInfo, k_seqstart: torch.Tensor, k_seqlen: torch.Tensor
) -> AttentionBias:
    """mask, built on the host from the Python lists, with the given query metadata and key tensors (those of the
    device, computed there)."""
    return replace(mask, q_seqinfo=q_seqinfo, k_seqinfo=replace(mask.k_seqinfo, seqstart=k_seqstart, seqlen=k_seqlen))


# --------------------------------------------------------------------------------------------------- decoding


def _check_decoding(input_bias, batchify_len, block_tables, page_size) -> None:
    _check_splittable("split_blocks_for_decoding", input_bias, batchify_len)
    if (block_tables is None) != (page_size is None):
        raise ValueError("split_blocks_for_decoding: give block_tables and page_size together (paged keys) or neither")
    query_lengths = set(input_bias.q_seqinfo.lengths())
    if len(query_lengths) > 1:
        raise ValueError(
            "split_blocks_for_decoding: every lane must have the same number of queries (one decoding step, or "
            f"drafts of one length), got {sorted(query_lengths)}"
        )


def _chunk_start(seqlen: torch.Tensor, causal: bool, batchify_len: int) -> torch.Tensor:
    """Where, inside its lane, the chunk of each lane's queries starts: the chunk of the last key's position when
    the queries end there (causal), of the next position when they follow the keys. 0 for a lane without keys."""
    return (seqlen - int(causal)).clamp(min=0) // batchify_len * batchify_len


def split_blocks_for_decoding_gpu_part(
    input_bias: BlockDiagonalPaddedKeysMask,
    batchify_len: int | None,
    block_tables: torch.Tensor | None = None,
    page_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The device tensors (key seqstart [B + 1], key seqlen [B], int32; paged, as _GappySeqInfo's paged layout) of
    the mask split_blocks_for_decoding returns for the same arguments, computed on the device alone: compute them
    ahead and pass them as its gpu_data. None when batchify_len is None."""
    if batchify_len is None:
        return None
    _check_decoding(input_bias, batchify_len, block_tables, page_size)
    keys = input_bias.k_seqinfo
    start = _chunk_start(keys.seqlen, type(input_bias) is BlockDiagonalCausalWithOffsetPaddedKeysMask, batchify_len)
    if block_tables is not None:  # paged gappy keys: the starts inside the lanes (then -1), and the ends
        return torch.cat([start, start.new_full((1,), -1)]), keys.seqlen
    # padded lanes start at b · padding (then the number of key rows)
    return keys.seqstart + torch.cat([start, start.new_zeros(1)]), keys.seqlen - start


def split_blocks_for_decoding(
    input_bias: BlockDiagonalPaddedKeysMask,
    batchify_len: int | None,
    block_tables: torch.Tensor | None = None,
    page_size: int | None = None,
    gpu_data: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> BlockDiagonalGappyKeysMask | PagedBlockDiagonalGappyKeysMask | None:
    """input_bias (B11 or B12, the same number of queries in every lane) as a gappy mask where each lane's queries
    see the keys of their chunk only: B18/B19, or B21/B22 over block_tables with pages of page_size keys (lane b's
    logical keys are its padded keys). gpu_data: split_blocks_for_decoding_gpu_part's result for the same
    arguments (computed now when None). None when batchify_len is None. See the module docstring."""
    if batchify_len is None:
        return None
    _check_decoding(input_bias, batchify_len, block_tables, page_size)
    keys = input_bias.k_seqinfo
    causal = type(input_bias) is BlockDiagonalCausalWithOffsetPaddedKeysMask
    seqlen = torch.tensor(keys.seqlen_py, dtype=torch.int64)
    start = _chunk_start(seqlen, causal, batchify_len)
    lengths, start = (seqlen - start).tolist(), start.tolist()
    unpaged_type, paged_type = _DECODING_TYPES[type(input_bias)]
    query_lengths = input_bias.q_seqinfo.lengths()
    if block_tables is None:
        kv_seqstarts = [lane + s for lane, s in zip(keys.seqstart_py, [*start, 0], strict=True)]
        mask = unpaged_type.from_seqlens(query_lengths, kv_seqstarts, lengths, device="cpu")
    else:
        mask = paged_type.from_seqlens(query_lengths, start, lengths, block_tables, page_size, device="cpu")
    if gpu_data is None:
        gpu_data = split_blocks_for_decoding_gpu_part(input_bias, batchify_len, block_tables, page_size)
    k_seqstart, k_seqlen = gpu_data
    if k_seqstart.shape != (len(lengths) + 1,) or k_seqlen.shape != (len(lengths),):
        raise ValueError(
            f"split_blocks_for_decoding: gpu_data must be split_blocks_for_decoding_gpu_part's result for the same "
            f"arguments (seqstart [{len(lengths) + 1}], seqlen [{len(lengths)}]), got shapes "
            f"{tuple(k_seqstart.shape)} and {tuple(k_seqlen.shape)}"
        )
    return _with_device_tensors(mask, input_bias.q_seqinfo, k_seqstart, k_seqlen)


# ---------------------------------------------------------------------------------------------------- prefill


def _prefill_chunks(
    keys: torch.Tensor, queries: torch.Tensor, padding: int, batchify_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, queries) of each chunk of batchify_len positions, lane after lane [B · padding / batchify_len]: a
    lane's queries sit on its last key positions."""
    chunks = padding // batchify_len
    total = len(keys) * chunks  # output_size: repeat_interleave would otherwise read the repeats on the host
    chunk_start = torch.arange(0, padding, batchify_len, dtype=keys.dtype, device=keys.device).repeat(len(keys))
    lane_keys = keys.repeat_interleave(chunks, output_size=total)
    before_queries = (keys - queries).repeat_interleave(chunks, output_size=total)
    chunk_keys = (lane_keys - chunk_start).clamp(0, batchify_len)
    return chunk_keys, chunk_keys - (before_queries - chunk_start).clamp(0, batchify_len)


def split_blocks_for_prefill(
    input_bias: BlockDiagonalPaddedKeysMask, batchify_len: int | None
) -> BlockDiagonalPaddedKeysMask | None:
    """input_bias (B11 or B12, padding a multiple of batchify_len) with every lane of `padding` keys split into
    padding / batchify_len lanes of batchify_len keys, each with the queries at its positions (some none): a mask of
    input_bias's class. Queries and keys keep their rows. None when batchify_len is None."""
    if batchify_len is None:
        return None
    _check_splittable("split_blocks_for_prefill", input_bias, batchify_len)
    keys, queries = input_bias.k_seqinfo, input_bias.q_seqinfo
    if keys.padding % batchify_len:
        raise ValueError(
            f"split_blocks_for_prefill: the key padding {keys.padding} must be a multiple of batchify_len "
            f"{batchify_len} (each lane splits into whole chunks)"
        )
    query_lengths = queries.lengths()
    if any(nq > n for nq, n in zip(query_lengths, keys.seqlen_py, strict=True)):
        raise ValueError(
            "split_blocks_for_prefill: a lane has more queries than keys (its queries sit on its last key "
            f"positions), got {query_lengths} queries and {keys.seqlen_py} keys"
        )
    host_keys, host_queries = _prefill_chunks(
        torch.tensor(keys.seqlen_py, dtype=torch.int64),
        torch.tensor(query_lengths, dtype=torch.int64),
        keys.padding,
        batchify_len,
    )
    mask = type(input_bias).from_seqlens(host_queries.tolist(), batchify_len, host_keys.tolist(), device="cpu")
    chunk_keys, chunk_queries = _prefill_chunks(keys.seqlen, queries.seqstart.diff(), keys.padding, batchify_len)
    q_seqstart = torch.cat([chunk_queries.new_zeros(1), chunk_queries.cumsum(0, dtype=torch.int32)])
    k_seqstart = torch.arange(
        0, len(host_keys) * batchify_len + 1, batchify_len, dtype=torch.int32, device=chunk_keys.device
    )
    return _with_device_tensors(mask, replace(mask.q_seqinfo, seqstart=q_seqstart), k_seqstart, chunk_keys)


# ------------------------------------------------------------------------------------------------------ paging


def _lanes_of_table(attn_bias, block_tables: torch.Tensor, page_size: int, lane_keys: int) -> torch.Tensor:
    """block_tables with one row per lane of attn_bias: a split prefill mask has several lanes per table row, so
    each row is cut into as many lanes (its pages in order), which must hold the mask's lane_keys keys each."""
    lanes = len(attn_bias.k_seqinfo.seqstart_py) - 1
    if block_tables.dim() != 2:
        raise ValueError(
            f"maybe_make_paged: block_tables must be [B, max_pages], got shape {tuple(block_tables.shape)}"
        )
    rows, pages = block_tables.shape
    if rows == lanes:
        return block_tables
    if rows == 0 or lanes % rows or pages % (lanes // rows) or pages // (lanes // rows) * page_size != lane_keys:
        raise ValueError(
            f"maybe_make_paged: {type(attn_bias).__name__} has {lanes} lanes of {lane_keys} keys and block_tables "
            f"{rows} rows of {pages} pages of {page_size} keys: each row must split into lanes of exactly those keys"
        )
    return block_tables.reshape(lanes, pages // (lanes // rows))


def maybe_make_paged(
    attn_bias: AttentionBias | None,
    block_tables: torch.Tensor | None,
    page_size: int,
    notional_padding: int | None,
) -> AttentionBias | None:
    """attn_bias with its keys read through block_tables ([B, max_pages] int32, logical to physical pages of
    page_size keys), keeping its rule: B11/B12/B14 -> B15/B16/B17, B18/B19 -> B21/B22. attn_bias itself when
    block_tables is None or it is paged already; None for None.

    A gappy mask has no lanes: notional_padding says where they start (lane b at key b · notional_padding, as laid
    out when block_tables was made; a mask from split_blocks_for_decoding keeps the input's padding). A mask from
    split_blocks_for_prefill has padding / batchify_len lanes per table row: each row is cut into as many."""
    if attn_bias is None or block_tables is None or isinstance(attn_bias, _PAGED_ALREADY):
        return attn_bias
    paged_type = _PAGED_TYPES.get(type(attn_bias))
    if paged_type is None:
        raise ValueError(
            f"maybe_make_paged: {type(attn_bias).__name__} has no paged form (masks that have one: "
            f"{_names(_PAGED_TYPES)})"
        )
    if issubclass(paged_type, PagedBlockDiagonalGappyKeysMask):
        if notional_padding is None:
            raise ValueError(
                "maybe_make_paged: a gappy mask needs notional_padding (where lane b of block_tables starts: "
                "b · notional_padding)"
            )
        block_tables = _lanes_of_table(attn_bias, block_tables, page_size, notional_padding)
        return attn_bias.make_paged(block_tables, page_size, notional_padding, paged_type)
    block_tables = _lanes_of_table(attn_bias, block_tables, page_size, attn_bias.k_seqinfo.padding)
    return attn_bias.make_paged(block_tables, page_size, paged_type)
