"""iRoPE chunked attention (spec A-12, `fmha.split_blocks_fairinternal`): the split masks against the chunked rule
computed here (a query at position p of its lane sees the keys the input mask allows in positions
[⌊p / L⌋ · L, ⌊p / L⌋ · L + L)), attention through them against dense float64 attention, paging, and errors."""

import math
import random

import pytest
import torch

from mslk.attention import fmha
from mslk.attention.fmha import attn_bias as ab
from mslk.attention.fmha.split_blocks_fairinternal import (
    maybe_make_paged,
    split_blocks_for_decoding,
    split_blocks_for_decoding_gpu_part,
    split_blocks_for_prefill,
)
from mslk.core import testing

B11 = ab.BlockDiagonalPaddedKeysMask
B12 = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask


def chunked(input_bias, q_lens, k_lens, padding, chunk, queries_follow_keys) -> torch.Tensor:
    """The dense [Σnq, B · padding] mask of the chunked rule: what input_bias allows, where query i of lane b (nq
    queries, n keys) is at position n + i when queries_follow_keys, else n − nq + i, and key column b · padding + j
    at position j."""
    allowed = input_bias.materialize((sum(q_lens), len(k_lens) * padding)) == 0
    positions = [
        n + i if queries_follow_keys else n - nq + i for nq, n in zip(q_lens, k_lens, strict=True) for i in range(nq)
    ]
    p = torch.tensor(positions)[:, None]
    j = (torch.arange(len(k_lens) * padding) % padding)[None, :]
    same_chunk = torch.div(p, chunk, rounding_mode="floor") == j // chunk
    return torch.where(allowed & same_chunk, 0.0, -math.inf)


def on_pool(logical: torch.Tensor, tables: torch.Tensor, page_size: int, padding: int) -> torch.Tensor:
    """A mask over padded lanes of `padding` keys moved to the pool rows that tables map them to."""
    out = torch.full((logical.shape[0], tables.numel() * page_size), -math.inf)
    for b in range(tables.shape[0]):
        for j in range(padding):
            out[:, int(tables[b, j // page_size]) * page_size + j % page_size] = logical[:, b * padding + j]
    return out


def page_tables(lanes: int, padding: int, page_size: int, extra_pages: int = 0) -> torch.Tensor:
    """int32 [lanes, padding / page_size + extra_pages]: every page of the pool once, shuffled."""
    pages = padding // page_size + extra_pages
    return torch.randperm(lanes * pages).to(torch.int32).reshape(lanes, pages)


def dense_attention(q, k, v, mask) -> torch.Tensor:
    """softmax(q·kᵀ/√K + mask)·v in float64 per head, [1, M, H, K] layouts; a query with no key gets zeros."""
    scores = torch.einsum("bmhk,bnhk->bhmn", q.double(), k.double()) * q.shape[-1] ** -0.5 + mask.double()
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhmn,bnhk->bmhk", weights, v.double())


def decoding_lanes(rng, padding, chunk, nq, causal) -> list[int]:
    """Key lengths whose nq queries lie in one chunk, shuffled: the corner cases (empty, whole chunks, one past a
    chunk, full) and a few random ones."""

    def one_chunk(n):
        first, last = (n - nq, n - 1) if causal else (n, n + nq - 1)
        return n == 0 or (n >= nq and first // chunk == last // chunk)

    corners = [n for n in (0, chunk, 2 * chunk, chunk + 1, padding) if n <= padding and one_chunk(n)]
    randoms = [n for n in (rng.randint(0, padding) for _ in range(100)) if one_chunk(n)][: rng.randint(2, 5)]
    lanes = corners + randoms
    rng.shuffle(lanes)
    return lanes


def assert_device_tensors_match_lists(mask) -> None:
    """The tensors computed on the device hold what the mask's Python lists say (the kernels read the tensors)."""
    assert mask.q_seqinfo.seqstart.tolist() == mask.q_seqinfo.seqstart_py
    assert mask.k_seqinfo.seqstart.tolist() == mask.k_seqinfo.seqstart_py
    assert mask.k_seqinfo.seqlen.tolist() == mask.k_seqinfo.seqlen_py


# The reference, and MSLK's Triton kernel (a GPU's choice for these masks; the interpreter on a CPU).
ATTENTION_OPS = [fmha.torch_reference.FwOp, fmha.triton_flash.FwOp]


def assert_attention_is_dense(split, queries: int, keys: int, expected: torch.Tensor) -> None:
    """Attention under split, through every op of ATTENTION_OPS, equals float64 attention under the dense mask."""
    q = torch.randn(1, queries, 2, 8)
    k, v = torch.randn(2, 1, keys, 2, 8).unbind(0)
    for op in ATTENTION_OPS:
        out = fmha.memory_efficient_attention_forward(q, k, v, attn_bias=split, op=op)
        torch.testing.assert_close(out.double(), dense_attention(q, k, v, expected), rtol=1e-5, atol=1e-5)


CASES = [(seed, bias_type, nq) for seed in range(3) for bias_type in (B11, B12) for nq in (1, 3)]


def _decoding_case(seed, bias_type, nq):
    rng = random.Random(seed)
    chunk = rng.choice([4, 8])
    padding = chunk * rng.randint(2, 4)
    k_lens = decoding_lanes(rng, padding, chunk, nq, causal=bias_type is B12)
    bias = bias_type.from_seqlens([nq] * len(k_lens), padding, k_lens, device="cpu")
    return bias, [nq] * len(k_lens), k_lens, padding, chunk


@pytest.mark.parametrize(("seed", "bias_type", "nq"), CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_decoding_is_the_chunked_rule(seed, bias_type, nq):
    torch.manual_seed(seed)
    bias, q_lens, k_lens, padding, chunk = _decoding_case(seed, bias_type, nq)
    split = split_blocks_for_decoding(bias, chunk)
    gappy = ab.BlockDiagonalCausalWithOffsetGappyKeysMask if bias_type is B12 else ab.BlockDiagonalGappyKeysMask
    assert type(split) is gappy
    assert split.q_seqinfo is bias.q_seqinfo
    assert_device_tensors_match_lists(split)
    assert all(0 <= n <= chunk for n in split.k_seqinfo.seqlen_py)
    expected = chunked(bias, q_lens, k_lens, padding, chunk, queries_follow_keys=bias_type is B11)
    assert torch.equal(split.materialize(expected.shape), expected)

    assert_attention_is_dense(split, sum(q_lens), len(k_lens) * padding, expected)


@pytest.mark.parametrize(("seed", "bias_type", "nq"), CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_paged_decoding_is_the_chunked_rule(seed, bias_type, nq):
    torch.manual_seed(seed)
    bias, q_lens, k_lens, padding, chunk = _decoding_case(seed, bias_type, nq)
    page_size = 2
    tables = page_tables(len(k_lens), padding, page_size, extra_pages=seed)  # table lanes may exceed the padding
    split = split_blocks_for_decoding(bias, chunk, tables, page_size)
    paged = (
        ab.PagedBlockDiagonalCausalWithOffsetGappyKeysMask if bias_type is B12 else ab.PagedBlockDiagonalGappyKeysMask
    )
    assert type(split) is paged
    assert_device_tensors_match_lists(split)
    expected = on_pool(chunked(bias, q_lens, k_lens, padding, chunk, bias_type is B11), tables, page_size, padding)
    assert torch.equal(split.materialize(expected.shape), expected)

    q = torch.randn(1, sum(q_lens), 2, 8)
    k, v = torch.randn(2, 1, expected.shape[1], 2, 8).unbind(0)
    out = fmha.memory_efficient_attention_forward(q, k, v, attn_bias=split, op=fmha.torch_reference.FwOp)
    torch.testing.assert_close(out.double(), dense_attention(q, k, v, expected), rtol=1e-5, atol=1e-5)

    # The same mask as the unpaged split made paged afterwards (lanes of the input's padding).
    later = maybe_make_paged(split_blocks_for_decoding(bias, chunk), tables, page_size, padding)
    assert type(later) is paged
    assert torch.equal(later.materialize(expected.shape), expected)


@pytest.mark.parametrize("paged", [False, True], ids=["", "paged"])
def test_decoding_device_part_computed_ahead(paged):
    bias = B12.from_seqlens([1] * 4, 16, [0, 5, 8, 16], device="cpu")
    tables, page_size = (page_tables(4, 16, 4), 4) if paged else (None, None)
    ahead = split_blocks_for_decoding_gpu_part(bias, 8, tables, page_size)
    split = split_blocks_for_decoding(bias, 8, tables, page_size, gpu_data=ahead)
    assert split.k_seqinfo.seqstart is ahead[0] and split.k_seqinfo.seqlen is ahead[1]
    assert_device_tensors_match_lists(split)
    assert torch.equal(
        split.materialize((4, 64)), split_blocks_for_decoding(bias, 8, tables, page_size).materialize((4, 64))
    )


def test_decoding_queries_across_a_chunk_boundary_get_the_last_querys_chunk():
    """Causal, 4 queries on key positions 6..9 with chunks of 8: the split gives keys 8, 9 only; queries 6, 7 see
    none of them (the caller attends them to their own chunk separately)."""
    bias = B12.from_seqlens([4], 16, [10], device="cpu")
    split = split_blocks_for_decoding(bias, 8)
    assert split.k_seqinfo.seqstart_py == [8, 16] and split.k_seqinfo.seqlen_py == [2]
    allowed = split.materialize((4, 16)) == 0
    assert allowed.nonzero().tolist() == [[2, 8], [3, 8], [3, 9]]


CASES_PREFILL = [(seed, bias_type) for seed in range(6) for bias_type in (B11, B12)]


def _prefill_case(seed, bias_type):
    rng = random.Random(seed)
    chunk = rng.choice([4, 8])
    padding = chunk * rng.randint(1, 4)
    k_lens = [rng.choice([0, chunk, padding, rng.randint(0, padding)]) for _ in range(rng.randint(2, 5))]
    q_lens = [rng.choice([n, rng.randint(0, n), min(n, 2)]) for n in k_lens]  # all keys, some, the last few
    return bias_type.from_seqlens(q_lens, padding, k_lens, device="cpu"), q_lens, k_lens, padding, chunk


@pytest.mark.parametrize(("seed", "bias_type"), CASES_PREFILL, ids=lambda v: getattr(v, "__name__", str(v)))
def test_prefill_is_the_chunked_rule(seed, bias_type):
    torch.manual_seed(seed)
    bias, q_lens, k_lens, padding, chunk = _prefill_case(seed, bias_type)
    split = split_blocks_for_prefill(bias, chunk)
    assert type(split) is bias_type
    assert split.k_seqinfo.padding == chunk and len(split.k_seqinfo.seqlen_py) == len(k_lens) * padding // chunk
    assert_device_tensors_match_lists(split)
    expected = chunked(bias, q_lens, k_lens, padding, chunk, queries_follow_keys=False)
    assert torch.equal(split.materialize(expected.shape), expected)

    assert_attention_is_dense(split, sum(q_lens), len(k_lens) * padding, expected)

    # Paged: each table row (one input lane) is cut into the lanes of its chunks.
    page_size = 2
    tables = page_tables(len(k_lens), padding, page_size)
    paged = maybe_make_paged(split, tables, page_size, None)
    paged_type = (
        ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask if bias_type is B12 else ab.PagedBlockDiagonalPaddedKeysMask
    )
    assert type(paged) is paged_type
    assert torch.equal(paged.materialize(expected.shape), on_pool(expected, tables, page_size, padding))


def test_decoding_and_prefill_agree_for_one_query_per_lane():
    """Upstream's check: for one causal query per lane, both splits give the same mask (prefill's has lanes
    without queries in addition)."""
    bias = B12.from_seqlens([1] * 5, 16, [1, 4, 5, 12, 16], device="cpu")
    shape = (5, 80)
    assert torch.equal(
        split_blocks_for_decoding(bias, 4).materialize(shape), split_blocks_for_prefill(bias, 4).materialize(shape)
    )


def test_no_device_value_is_read_on_the_host():
    """The masks' tensors on the meta device (no values at all): splitting never reads them, as it never waits for a
    GPU."""
    bias = B12.from_seqlens([1, 1, 1], 8, [3, 1, 8], device="cpu").to("meta")
    tables = page_tables(3, 8, 2).to("meta")
    for split in (
        split_blocks_for_decoding(bias, 4),
        split_blocks_for_decoding(bias, 4, tables, 2),
        split_blocks_for_prefill(bias, 4),
        maybe_make_paged(split_blocks_for_prefill(bias, 4), tables, 2, None),
    ):
        assert split.k_seqinfo.seqstart.is_meta and split.k_seqinfo.seqlen.is_meta
    assert split_blocks_for_decoding(bias, 4).k_seqinfo.seqlen_py == [3, 1, 4]


@pytest.mark.gpu
@testing.skipUnlessCuda()
def test_no_call_waits_for_the_gpu():
    """On the GPU, splitting never synchronizes (torch's sync debug mode turns any wait into an error)."""
    bias = B12.from_seqlens([1, 1, 1], 8, [3, 1, 8], device="cuda")
    tables = page_tables(3, 8, 2).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        splits = [
            split_blocks_for_decoding(bias, 4),
            split_blocks_for_decoding(bias, 4, tables, 2),
            split_blocks_for_decoding(bias, 4, gpu_data=split_blocks_for_decoding_gpu_part(bias, 4)),
            split_blocks_for_prefill(bias, 4),
            maybe_make_paged(bias, tables, 2, None),  # (its lists reach the GPU from pinned memory)
        ]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for split in splits:
        assert split.k_seqinfo.seqstart.is_cuda and split.k_seqinfo.seqlen.is_cuda
        assert_device_tensors_match_lists(split)


def test_nothing_to_split():
    bias = B12.from_seqlens([1], 8, [3], device="cpu")
    assert split_blocks_for_decoding(bias, None) is None
    assert split_blocks_for_decoding_gpu_part(bias, None) is None
    assert split_blocks_for_prefill(bias, None) is None
    assert maybe_make_paged(None, page_tables(1, 8, 2), 2, None) is None
    assert maybe_make_paged(bias, None, 2, None) is bias
    paged = maybe_make_paged(bias, page_tables(1, 8, 2), 2, None)
    assert type(paged) is ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask
    assert maybe_make_paged(paged, page_tables(1, 8, 2), 2, None) is paged


def test_maybe_make_paged_keeps_the_rule():
    """B14 keeps its window (B17), B19 its causality (B22)."""
    local = ab.BlockDiagonalCausalLocalAttentionPaddedKeysMask.from_seqlens_local([2, 1], 8, [5, 8], 3, device="cpu")
    tables = page_tables(2, 8, 2)
    paged = maybe_make_paged(local, tables, 2, None)
    assert type(paged) is ab.PagedBlockDiagonalCausalLocalPaddedKeysMask and paged._window_size == 3
    assert torch.equal(paged.materialize((3, 16)), on_pool(local.materialize((3, 16)), tables, 2, 8))
    gappy = ab.BlockDiagonalCausalWithOffsetGappyKeysMask.from_seqlens([2, 1], [1, 9, 16], [4, 5], device="cpu")
    paged = maybe_make_paged(gappy, tables, 2, 8)
    assert type(paged) is ab.PagedBlockDiagonalCausalWithOffsetGappyKeysMask
    assert torch.equal(paged.materialize((3, 16)), on_pool(gappy.materialize((3, 16)), tables, 2, 8))


B12_ONE = B12.from_seqlens([1, 1], 8, [3, 5], device="cpu")


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: split_blocks_for_decoding(ab.BlockDiagonalMask.from_seqlens([1], [3]), 4), "padded-keys mask"),
        (
            lambda: split_blocks_for_prefill(
                ab.BlockDiagonalCausalLocalAttentionPaddedKeysMask.from_seqlens_local([1], 8, [3], 2), 4
            ),
            "padded-keys mask",
        ),
        (lambda: split_blocks_for_decoding(B12_ONE, 0), "positive int"),
        (lambda: split_blocks_for_decoding_gpu_part(B12_ONE, 2.5), "positive int"),
        (lambda: split_blocks_for_decoding(B12_ONE, 4, page_tables(2, 8, 2)), "together"),
        (lambda: split_blocks_for_decoding(B12.from_seqlens([1, 2], 8, [3, 5]), 4), "same number of queries"),
        (lambda: split_blocks_for_decoding(B12_ONE, 4, gpu_data=(torch.zeros(2), torch.zeros(2))), "gpu_data must"),
        (lambda: split_blocks_for_prefill(B12_ONE, 3), "multiple of batchify_len"),
        (lambda: split_blocks_for_prefill(B12.from_seqlens([4], 8, [3]), 4), "more queries than keys"),
        (
            lambda: maybe_make_paged(split_blocks_for_decoding(B12_ONE, 4), page_tables(2, 8, 2), 2, None),
            "needs notional_padding",
        ),
        (
            lambda: maybe_make_paged(
                ab.BlockDiagonalLocalAttentionPaddedKeysMask.from_seqlens_local([1], 8, [3], 1, 1),
                page_tables(1, 8, 2),
                2,
                None,
            ),
            "no paged form",
        ),
        (lambda: maybe_make_paged(split_blocks_for_prefill(B12_ONE, 4), page_tables(2, 8, 1), 2, None), "split into"),
        (
            lambda: maybe_make_paged(split_blocks_for_prefill(B12_ONE, 4), torch.zeros(8, dtype=torch.int32), 2, None),
            r"\[B, max_pages\]",
        ),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
