"""The attention masks (spec §3): materialize against the definitions, element by element; constructors,
derivations, split/pack round trips and errors."""

import math
import random

import numpy
import pytest
import torch

from mslk.attention.fmha import attn_bias as ab


def dense(blocks, rule, mq, mk):
    """The additive mask from (q0, q1, k0, k1) blocks and rule(i, j, nq, nk) on local indices."""
    out = torch.full((mq, mk), -math.inf)
    for q0, q1, k0, k1 in blocks:
        for i in range(q1 - q0):
            for j in range(k1 - k0):
                if rule(i, j, q1 - q0, k1 - k0):
                    out[q0 + i, k0 + j] = 0.0
    return out


def packed(q_lens, k_lens):
    qs, ks = [0], [0]
    for n in q_lens:
        qs.append(qs[-1] + n)
    for n in k_lens:
        ks.append(ks[-1] + n)
    return [(qs[b], qs[b + 1], ks[b], ks[b + 1]) for b in range(len(q_lens))]


@pytest.mark.parametrize(
    ("mask", "rule"),
    [
        (ab.LowerTriangularMask(), lambda i, j, nq, nk: j <= i),
        (ab.LowerTriangularFromBottomRightMask(), lambda i, j, nq, nk: j <= i + nk - nq),
        (
            ab.LowerTriangularFromBottomRightMask().make_local_attention(3),
            lambda i, j, nq, nk: nk - nq - 3 < j - i <= nk - nq,
        ),
        (ab.LocalAttentionFromBottomRightMask(2, 1), lambda i, j, nq, nk: -2 <= j - i - (nk - nq) <= 1),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, ab.AttentionBias) else "",
)
@pytest.mark.parametrize(("mq", "mk"), [(5, 5), (4, 9), (7, 3)], ids=str)
def test_dense_masks(mask, rule, mq, mk):
    got = mask.materialize((2, 3, mq, mk))
    assert got.shape == (2, 3, mq, mk)
    assert torch.equal(got[1, 2], dense([(0, mq, 0, mk)], rule, mq, mk))


def test_tensor_bias_is_added():
    bias = torch.randn(4, 6)
    mask = ab.LowerTriangularMask().add_bias(bias)
    assert isinstance(mask, ab.LowerTriangularMaskWithTensorBias)
    assert torch.equal(mask.materialize((4, 6)), ab.LowerTriangularMask().materialize((4, 6)) + bias)


def _lens(seed):
    rng = random.Random(seed)
    q = [rng.randint(0, 6) for _ in range(rng.randint(1, 5))]
    k = [n + rng.randint(0, 4) for n in q]  # keys cover queries (bottom-right masks need it)
    return q, k


@pytest.mark.parametrize("seed", range(4))
def test_block_diagonal_family(seed):
    q, k = _lens(seed)
    mq, mk = sum(q), sum(k)
    blocks = packed(q, k)
    base = ab.BlockDiagonalMask.from_seqlens(q, k, device="cpu")
    cases = [
        (base, lambda i, j, nq, nk: True),
        (base.make_causal(), lambda i, j, nq, nk: j <= i),
        (base.make_causal_from_bottomright(), lambda i, j, nq, nk: j <= i + nk - nq),
        (base.make_local_attention_from_bottomright(2), lambda i, j, nq, nk: nk - nq - 2 < j - i <= nk - nq),
        (base.make_local_attention(3), lambda i, j, nq, nk: i - 3 < j <= i),
    ]
    for mask, rule in cases:
        assert torch.equal(mask.materialize((mq, mk)), dense(blocks, rule, mq, mk)), type(mask).__name__
    assert base.q_seqinfo.seqstart.dtype == torch.int32 and base.q_seqinfo.seqstart.tolist() == [
        0,
        *torch.tensor(q).cumsum(0).tolist(),
    ]
    assert base.q_seqinfo.max_seqlen == max(q) and base.q_seqinfo.min_seqlen == min(q)


@pytest.mark.parametrize("seed", range(3))
def test_padded_and_gappy_keys(seed):
    q, k = _lens(seed)
    pad = max(k) + 2
    blocks = [(b0, b1, b * pad, b * pad + k[b]) for b, (b0, b1, _, _) in enumerate(packed(q, k))]
    mq, mk = sum(q), pad * len(q)
    padded = ab.BlockDiagonalPaddedKeysMask.from_seqlens(q, pad, k, device="cpu")
    cases = [
        (padded, lambda i, j, nq, nk: True),
        (
            ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(q, pad, k, device="cpu"),
            lambda i, j, nq, nk: j <= i + nk - nq,
        ),
        (padded.make_local_attention(1, 2), lambda i, j, nq, nk: -1 <= j - i - (nk - nq) <= 2),
        (
            ab.BlockDiagonalCausalLocalAttentionPaddedKeysMask.from_seqlens_local(q, pad, k, 2, device="cpu"),
            lambda i, j, nq, nk: nk - nq - 2 < j - i <= nk - nq,
        ),
    ]
    for mask, rule in cases:
        assert torch.equal(mask.materialize((mq, mk)), dense(blocks, rule, mq, mk)), type(mask).__name__

    starts = [3 + 10 * b for b in range(len(k))] + [10 * len(k) + 5]
    gappy_blocks = [(b0, b1, starts[b], starts[b] + k[b]) for b, (b0, b1, _, _) in enumerate(packed(q, k))]
    gappy = ab.BlockDiagonalGappyKeysMask.from_seqlens(q, starts, k, device="cpu")
    cases = [
        (gappy, lambda i, j, nq, nk: True),
        (
            ab.BlockDiagonalCausalWithOffsetGappyKeysMask.from_seqlens(q, starts, k, device="cpu"),
            lambda i, j, nq, nk: j <= i + nk - nq,
        ),
        (
            ab.BlockDiagonalLocalAttentionFromBottomRightGappyKeysMask.from_seqlens_local_gappy(
                q, starts, k, 0, 1, "cpu"
            ),
            lambda i, j, nq, nk: 0 <= j - i - (nk - nq) <= 1,
        ),
    ]
    for mask, rule in cases:
        assert torch.equal(mask.materialize((mq, starts[-1])), dense(gappy_blocks, rule, mq, starts[-1])), type(
            mask
        ).__name__


def test_materialize_causal_mask_helper():
    """Upstream's helper equals the masks' own materialize (top-left, bottom-right, local windows)."""
    shape = (2, 5, 9)
    for kwargs, mask in (
        ({}, ab.LowerTriangularMask()),
        ({"from_bottomright": True}, ab.LowerTriangularFromBottomRightMask()),
        ({"from_bottomright": True, "window_size": 3}, ab.LowerTriangularFromBottomRightLocalAttentionMask(3)),
    ):
        dense = ab._materialize_causal_mask(shape, torch.bfloat16, **kwargs)
        assert dense.dtype == torch.bfloat16 and dense.is_contiguous()
        assert torch.equal(dense, mask.materialize(shape, torch.bfloat16)), kwargs
    top_left_window = ab._materialize_causal_mask((4, 6), window_size=2)
    assert torch.equal(
        top_left_window.isfinite(), torch.tensor([[j in (i - 1, i) for j in range(6)] for i in range(4)])
    )


def test_pack_and_split_round_trip():
    tensors = [torch.randn(2, 3, 4, 8), torch.randn(1, 5, 4, 8), torch.randn(3, 1, 4, 8)]
    mask, packed_x = ab.BlockDiagonalMask.from_tensor_list(tensors)
    assert packed_x.shape == (1, 2 * 3 + 5 + 3, 4, 8)
    assert mask.q_seqinfo.seqstart_py == [0, 3, 6, 11, 12, 13, 14]
    assert all(torch.equal(a, b) for a, b in zip(mask.split(packed_x), tensors, strict=True))
    ks = [torch.randn(2, 4, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(3, 6, 4, 8)]
    mask, q, k, v = ab.BlockDiagonalMask.from_tensor_lists_qkv(tensors, ks, ks)
    assert torch.equal(q, packed_x)
    assert mask.k_seqinfo.seqstart_py[-1] == k.shape[1] == 2 * 4 + 2 + 18 and torch.equal(k, v)
    assert all(torch.equal(a, b) for a, b in zip(mask.split_kv(k), ks, strict=True))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: ab.LocalAttentionFromBottomRightMask(-1, 0), ValueError, "window_left must be >= 0"),
        (lambda: ab.LowerTriangularFromBottomRightLocalAttentionMask(0), ValueError, "window_size must be >= 1"),
        (lambda: ab.BlockDiagonalMask.from_seqlens([3], [2]).make_causal_from_bottomright(), ValueError, "fewer keys"),
        (lambda: ab.BlockDiagonalMask.from_seqlens([5], [2]).make_local_attention(2), RuntimeError, "without keys"),
        (lambda: ab.BlockDiagonalMask.from_seqlens([1, 2], [1]), ValueError, "2 query blocks but 1 key blocks"),
        (lambda: ab.BlockDiagonalPaddedKeysMask.from_seqlens([1], 4, [5]), ValueError, r"in \[0, padding=4\]"),
        (lambda: ab.BlockDiagonalGappyKeysMask.from_seqlens([1], [0], [1]), ValueError, "B \\+ 1 entries"),
        (lambda: ab.BlockDiagonalMask.from_seqlens([2]).split(torch.zeros(2, 2, 1)), ValueError, "batch size 1"),
        (
            lambda: ab.BlockDiagonalMask.from_seqlens([2, 3]).split(torch.zeros(1, 4, 1)),
            ValueError,
            r"5 rows .*\(1, 4, 1\)",
        ),
        (
            lambda: ab.BlockDiagonalMask.from_tensor_list([torch.zeros(1, 2, 3), torch.zeros(0, 4, 3)]),
            ValueError,
            r"batch size >= 1 .*\[1, 0\]",
        ),
        (lambda: ab.BlockDiagonalMask.from_tensor_list([]), ValueError, r"batch size >= 1 .*\[\]"),
        # lengths that are no integers: refused, not truncated (blocks of 1 and 2 rows, max_seqlen 2.5)
        (lambda: ab.BlockDiagonalMask.from_seqlens([1.5, 2.5]), TypeError, r"lengths must be integers, got \[1.5"),
        (lambda: ab.BlockDiagonalMask.from_seqlens([True, 2]), TypeError, "lengths must be integers"),
        (lambda: ab.BlockDiagonalMask.from_seqlens([2]).q_seqinfo.from_seqlens_inplace([1.5]), TypeError, "integers"),
        (lambda: ab.BlockDiagonalPaddedKeysMask.from_seqlens([1], 4.0, [2]), TypeError, "padding must be an integer"),
        (lambda: ab.BlockDiagonalPaddedKeysMask.from_seqlens([], -1, []), ValueError, "padding=-1"),
        (lambda: ab.BlockDiagonalGappyKeysMask.from_seqlens([1], [0, 4], [2.0]), TypeError, "kv_seqlen must be"),
        # windows that are no integers: refused (the reference path floored them, the Triton kernel crashed)
        (lambda: ab.LocalAttentionFromBottomRightMask(0.5, 1), TypeError, "window_left must be an integer, got 0.5"),
        (lambda: ab.BlockDiagonalMask.from_seqlens([4]).make_local_attention(2.7), TypeError, "window_size must be"),
        (
            lambda: ab.BlockDiagonalCausalLocalAttentionPaddedKeysMask.from_seqlens_local([2], 4, [3], True),
            TypeError,
            "window_size must be an integer, got True",
        ),
        # materialize's shape holds at least the mask's rows (fewer failed inside torch with "expanded size")
        (
            lambda: ab.BlockDiagonalCausalMask.from_seqlens([2, 3]).materialize((4, 5)),
            ValueError,
            r"shape must be \[\.\.\., >= 5, >= 5\] .*got \(4, 5\)",
        ),
        (
            lambda: ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 1], 4, [2, 3]).materialize((2, 7)),
            ValueError,
            r"shape must be \[\.\.\., >= 2, >= 8\]",
        ),
        (
            lambda: ab.BlockDiagonalGappyKeysMask.from_seqlens([1], [2, 9], [3]).materialize((1, 8)),
            ValueError,
            r"\[\.\.\., >= 1, >= 9\]",
        ),
        (
            lambda: ab.PagedBlockDiagonalPaddedKeysMask.from_seqlens(
                [1], [3], torch.tensor([[2, 0]], dtype=torch.int32), 2, device="cpu"
            ).materialize((1, 5)),
            ValueError,
            r"shape must be \[\.\.\., >= 1, >= 6\]",
        ),
        # v tensors that do not match k's (the totals alike): refused, not attended with the wrong rows
        (
            lambda: ab.BlockDiagonalMask.from_tensor_lists_qkv(
                [torch.zeros(1, 3, 1, 4)] * 2,
                [torch.zeros(1, 4, 1, 4), torch.zeros(1, 2, 1, 4)],
                [torch.zeros(1, 2, 1, 4), torch.zeros(1, 4, 1, 4)],
            ),
            ValueError,
            r"each v tensor must have its k tensor's batch size and length",
        ),
        (
            lambda: ab.BlockDiagonalMask.from_tensor_lists_qkv([torch.zeros(1, 3, 1, 4)] * 2, [torch.ones(1, 3, 1, 4)]),
            ValueError,
            "same batch sizes",
        ),
    ],
)
def test_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_to_moves_the_sequence_tensors():
    mask = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 2], 4, [3, 2], device="cpu")
    moved = mask.to("meta")
    assert moved.q_seqinfo.seqstart.device.type == "meta" and moved.k_seqinfo.seqlen.device.type == "meta"
    assert type(moved) is type(mask) and moved.k_seqinfo.seqlen_py == [3, 2]
    shared = ab.BlockDiagonalCausalMask.from_seqlens([1, 2], device="cpu").to("meta")
    assert shared.q_seqinfo is shared.k_seqinfo, "one metadata for queries and keys stays one (in-place updates)"


@pytest.mark.parametrize("seed", range(3))
def test_paged_masks_read_keys_through_the_page_table(seed):
    rng = random.Random(seed)
    page, pages, lanes = 4, 3, rng.randint(1, 3)
    q = [rng.randint(1, 4) for _ in range(lanes)]
    k = [rng.randint(n, pages * page) for n in q]
    physical_pages = lanes * pages + 2
    tables = torch.tensor([rng.sample(range(physical_pages), pages) for _ in range(lanes)], dtype=torch.int32)
    mq, pool = sum(q), physical_pages * page
    qs = [0, *torch.tensor(q).cumsum(0).tolist()]

    def rows(b, j):
        return int(tables[b, j // page]) * page + j % page

    cases = [
        (ab.PagedBlockDiagonalPaddedKeysMask.from_seqlens(q, k, tables, page, device="cpu"), lambda i, j, nq, nk: True),
        (
            ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(q, k, tables, page, device="cpu"),
            lambda i, j, nq, nk: j <= i + nk - nq,
        ),
        (
            ab.PagedBlockDiagonalCausalLocalPaddedKeysMask.from_seqlens_local(q, k, tables, page, 2, device="cpu"),
            lambda i, j, nq, nk: nk - nq - 2 < j - i <= nk - nq,
        ),
    ]
    for mask, rule in cases:
        expected = torch.full((mq, pool), -math.inf)
        for b in range(lanes):
            for i in range(q[b]):
                for j in range(k[b]):
                    if rule(i, j, q[b], k[b]):
                        expected[qs[b] + i, rows(b, j)] = 0.0
        assert torch.equal(mask.materialize((mq, pool)), expected), type(mask).__name__

    unpaged = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(q, pages * page, k, device="cpu")
    paged = unpaged.make_paged(tables, page, ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask)
    assert torch.equal(paged.materialize((mq, pool)), cases[1][0].materialize((mq, pool)))


@pytest.mark.parametrize("seed", range(3))
def test_paged_gappy_masks(seed):
    rng = random.Random(seed)
    page, pages, lanes = 4, 3, rng.randint(1, 3)
    q = [rng.randint(1, 4) for _ in range(lanes)]
    lens = [rng.randint(n, 8) for n in q]
    starts = [rng.randint(0, pages * page - n) for n in lens]
    physical_pages = lanes * pages + 1
    tables = torch.tensor([rng.sample(range(physical_pages), pages) for _ in range(lanes)], dtype=torch.int32)
    mq, pool = sum(q), physical_pages * page
    qs = [0, *torch.tensor(q).cumsum(0).tolist()]
    for cls, rule in (
        (ab.PagedBlockDiagonalGappyKeysMask, lambda i, j, nq, nk: True),
        (ab.PagedBlockDiagonalCausalWithOffsetGappyKeysMask, lambda i, j, nq, nk: j <= i + nk - nq),
    ):
        mask = cls.from_seqlens(q, starts, lens, tables, page, device="cpu")
        expected = torch.full((mq, pool), -math.inf)
        for b in range(lanes):
            for i in range(q[b]):
                for j in range(lens[b]):
                    if rule(i, j, q[b], lens[b]):
                        logical = starts[b] + j
                        expected[qs[b] + i, int(tables[b, logical // page]) * page + logical % page] = 0.0
        assert torch.equal(mask.materialize((mq, pool)), expected), cls.__name__


def test_paged_gappy_key_metadata_has_upstreams_layout():
    """_GappySeqInfo.from_seqlens_gappy(paged=True) and B21/B22's k_seqinfo as upstream's (spec 3): the starts
    inside the lanes then -1, the ends (start + length), max/min of the lengths; the sequences' lengths and their
    keys laid out lane after lane (what the attention reference reads) follow."""
    info = ab._GappySeqInfo.from_seqlens_gappy([2, 0, 5], [3, 1, 0], True, device="cpu")
    assert info.seqstart_py == [2, 0, 5, -1] and info.seqstart.tolist() == [2, 0, 5, -1]
    assert info.seqlen_py == [5, 1, 5] and info.seqlen.tolist() == [5, 1, 5]
    assert (info.max_seqlen, info.min_seqlen) == (3, 0) and info.lengths() == [3, 1, 0]
    laid_out = info.lanes_laid_out(8)
    assert laid_out.seqstart_py == [2, 8, 21, 24] and laid_out.seqstart.tolist() == [2, 8, 21, 24]
    assert laid_out.seqlen_py == [3, 1, 0] and laid_out.seqlen.tolist() == [3, 1, 0] and not laid_out.paged
    tables = torch.zeros(3, 2, dtype=torch.int32)
    mask = ab.PagedBlockDiagonalCausalWithOffsetGappyKeysMask.from_seqlens([1, 1, 0], [2, 0, 5], [3, 1, 0], tables, 4)
    assert mask.k_seqinfo.seqstart_py == [2, 0, 5, -1] and mask.k_seqinfo.seqlen_py == [5, 1, 5]
    with pytest.raises(ValueError, match=r"one start \(inside its lane\) and one length per sequence"):
        ab._GappySeqInfo.from_seqlens_gappy([2, 0, 5, 9], [3, 1, 0], True)


def test_paged_mask_errors():
    tables = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        ab.PagedBlockDiagonalPaddedKeysMask.from_seqlens([1, 1], [2, 2], tables.long(), 4)
    padded = ab.BlockDiagonalPaddedKeysMask.from_seqlens([1, 1], 16, [2, 5], device="cpu")
    with pytest.raises(ValueError, match=r"needs \['_window_size'\], which BlockDiagonalPaddedKeysMask lacks"):
        padded.make_paged(tables, 4, ab.PagedBlockDiagonalCausalLocalPaddedKeysMask)
    with pytest.raises(ValueError, match="paged_type must be a paged padded-keys mask"):
        padded.make_paged(tables, 4, ab.BlockDiagonalPaddedKeysMask)
    with pytest.raises(ValueError, match=r"key lengths must be in \[0, padding=4\]"):
        padded.make_paged(tables[:, :1], 4, ab.PagedBlockDiagonalPaddedKeysMask)
    with pytest.raises(ValueError, match="inside its lane of 12 keys"):
        ab.PagedBlockDiagonalGappyKeysMask.from_seqlens([1, 1], [0, 11], [2, 2], tables, 4)
    with pytest.raises(TypeError, match="kv_seqstarts must be integers"):
        ab.PagedBlockDiagonalGappyKeysMask.from_seqlens([1, 1], [0, 1.0], [2, 2], tables, 4)
    for window in (0, -3):  # B14's rule: common.causal_window read 0 as no window at all
        with pytest.raises(ValueError, match=f"window_size must be >= 1, got {window}"):
            ab.PagedBlockDiagonalCausalLocalPaddedKeysMask.from_seqlens_local([1, 1], [2, 2], tables, 4, window)
    with pytest.raises(TypeError, match="_window_size"):  # (it defaulted to 0)
        ab.PagedBlockDiagonalCausalLocalPaddedKeysMask.from_seqlens([1, 1], [2, 2], tables, 4)
    # A 1-D table failed on its second dim (IndexError); a page size of 0 spoke of key lengths.
    for make in (
        lambda t, size: ab.PagedBlockDiagonalPaddedKeysMask.from_seqlens([1, 1], [2, 2], t, size),
        lambda t, size: ab.PagedBlockDiagonalGappyKeysMask.from_seqlens([1, 1], [0, 1], [2, 2], t, size),
        lambda t, size: padded.make_paged(t, size, ab.PagedBlockDiagonalPaddedKeysMask),
    ):
        with pytest.raises(ValueError, match=r"block_tables must be int32 \[B, max_pages\], got \(3,\)"):
            make(tables[0], 4)
        with pytest.raises(ValueError, match="page_size must be at least 1, got 0"):
            make(tables, 0)


def test_lengths_of_integer_types_become_ints():
    mask = ab.BlockDiagonalMask.from_seqlens(torch.tensor([2, 3]), [numpy.int64(4), 5], device="cpu")
    assert mask.q_seqinfo.seqstart_py == [0, 2, 5] and mask.k_seqinfo.seqstart_py == [0, 4, 9]
    assert all(type(n) is int for n in (mask.q_seqinfo.max_seqlen, mask.k_seqinfo.min_seqlen))


def test_make_paged_lays_the_keys_out_in_pages():
    """make_paged (B11-B14 -> B15-B17, B18/B19 -> B21/B22) equals the paged mask built directly, whatever the
    unpaged mask's padding; the paged type's rule applies."""
    page, tables = 4, torch.tensor([[2, 0, 5], [1, 4, 3]], dtype=torch.int32)
    q, k, pool = [2, 3], [6, 9], 6 * 4
    for padding in (12, 16):
        padded = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(q, padding, k, device="cpu")
        for paged_type in (ab.PagedBlockDiagonalPaddedKeysMask, ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask):
            paged = padded.make_paged(tables, page, paged_type)
            direct = paged_type.from_seqlens(q, k, tables, page, device="cpu")
            assert type(paged) is paged_type and paged.k_seqinfo.padding == 12
            assert torch.equal(paged.materialize((5, pool)), direct.materialize((5, pool)))
    local = ab.BlockDiagonalCausalLocalAttentionPaddedKeysMask.from_seqlens_local(q, 16, k, 3, device="cpu")
    paged = local.make_paged(tables, page, ab.PagedBlockDiagonalCausalLocalPaddedKeysMask)
    direct = ab.PagedBlockDiagonalCausalLocalPaddedKeysMask.from_seqlens_local(q, k, tables, page, 3, device="cpu")
    assert paged._window_size == 3 and torch.equal(paged.materialize((5, pool)), direct.materialize((5, pool)))
    lane_starts, notional = [1, 2], 20  # gappy keys laid out in lanes of 20 keys
    gappy = ab.BlockDiagonalCausalWithOffsetGappyKeysMask.from_seqlens(
        q, [lane_starts[0], notional + lane_starts[1], 2 * notional], k, device="cpu"
    )
    paged = gappy.make_paged(tables, page, notional, ab.PagedBlockDiagonalCausalWithOffsetGappyKeysMask)
    direct = ab.PagedBlockDiagonalCausalWithOffsetGappyKeysMask.from_seqlens(q, lane_starts, k, tables, page)
    assert torch.equal(paged.materialize((5, pool)), direct.materialize((5, pool)))
    with pytest.raises(ValueError, match="inside its lane of 12 keys"):
        gappy.make_paged(tables, page, notional - 2, ab.PagedBlockDiagonalGappyKeysMask)


def test_padded_and_gappy_masks_construct_as_upstream():
    """Upstream's dataclass fields, positionally: padded and gappy masks are not BlockDiagonalMasks (no
    _batch_sizes field), B12 keeps an unused causal_diagonal."""
    q = ab._SeqLenInfo.from_seqlens([2, 1], device="cpu")
    padded = ab._PaddedSeqLenInfo.from_seqlens_padded([3, 4], 8, device="cpu")
    gappy = ab._GappySeqInfo.from_seqlens_gappy([0, 5, 9], [3, 4], device="cpu")
    b13 = ab.BlockDiagonalLocalAttentionPaddedKeysMask(q, padded, 2, 3)
    b14 = ab.BlockDiagonalCausalLocalAttentionPaddedKeysMask(q, padded, 4)
    b20 = ab.BlockDiagonalLocalAttentionFromBottomRightGappyKeysMask(q, gappy, 1, 2)
    assert (b13.window_left, b13.window_right, b14._window_size, b20.window_left, b20.window_right) == (2, 3, 4, 1, 2)
    b12 = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask(q_seqinfo=q, k_seqinfo=padded, causal_diagonal=None)
    assert torch.equal(
        b12.materialize((3, 16)),
        ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([2, 1], 8, [3, 4], None).materialize((3, 16)),
    )
    for mask in (b12, b13, b14, b20, ab.BlockDiagonalCausalWithOffsetGappyKeysMask(q, gappy)):
        assert not isinstance(mask, ab.BlockDiagonalMask) and isinstance(mask, ab.VARLEN_BIASES)


@pytest.mark.gpu
def test_masks_reach_the_gpu_without_a_sync():
    """Constructors and in-place updates copy their lists from pinned memory, queued on the stream (a copy from
    pageable memory would wait for the GPU: torch's sync debug mode raises on it)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1], 8, [5, 3], device="cuda")
        mask.k_seqinfo.from_seqlens_padded_inplace([6, 4])
        packed = ab.BlockDiagonalMask.from_seqlens([3, 5], [4, 6], device="cuda")
        packed.q_seqinfo.from_seqlens_inplace([2, 5])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert mask.k_seqinfo.seqlen.tolist() == [6, 4] and mask.k_seqinfo.seqstart.tolist() == [0, 8, 16]
    assert packed.q_seqinfo.seqstart.tolist() == [0, 2, 7] and packed.k_seqinfo.seqstart.tolist() == [0, 4, 10]


def test_in_place_updates_keep_the_tensors():
    mask = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1], 8, [5, 3], device="cpu")
    q_start, k_len = mask.q_seqinfo.seqstart, mask.k_seqinfo.seqlen
    mask.k_seqinfo.from_seqlens_padded_inplace([6, 4])  # a decode step: one more key each
    assert mask.k_seqinfo.seqlen is k_len and k_len.tolist() == [6, 4] and mask.k_seqinfo.seqlen_py == [6, 4]
    expected = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 1], 8, [6, 4], device="cpu")
    assert torch.equal(mask.materialize((2, 16)), expected.materialize((2, 16)))
    packed_mask = ab.BlockDiagonalMask.from_seqlens([3, 5], device="cpu")
    packed_mask.q_seqinfo.from_seqlens_inplace([4, 2])
    assert packed_mask.q_seqinfo.seqstart.tolist() == [0, 4, 6] and mask.q_seqinfo.seqstart is q_start
    with pytest.raises(ValueError, match=r"in \[0, max_seqlen=5\]"):
        packed_mask.q_seqinfo.from_seqlens_inplace([6, 1])
    with pytest.raises(ValueError, match="the captured batch has 2"):
        packed_mask.q_seqinfo.from_seqlens_inplace([1])
    with pytest.raises(ValueError, match=r"in \[0, padding=8\]"):
        mask.k_seqinfo.from_seqlens_padded_inplace([9, 1])
    # Packed starts would move padded slots and replace gappy starts: refused, the metadata left as it was.
    with pytest.raises(ValueError, match="use from_seqlens_padded_inplace"):
        mask.k_seqinfo.from_seqlens_inplace([6, 4])
    gappy = ab.BlockDiagonalGappyKeysMask.from_seqlens([1, 1], [0, 10, 16], [3, 4], device="cpu")
    with pytest.raises(ValueError, match="gappy keys is not supported"):
        gappy.k_seqinfo.from_seqlens_inplace([2, 2])
    assert mask.k_seqinfo.seqstart.tolist() == [0, 8, 16] and gappy.k_seqinfo.seqstart.tolist() == [0, 10, 16]


def test_kv_seqlen_none_shares_one_info():
    """Without kv_seqlen, queries and keys share one info that in-place updates (CUDA graphs) move together; equal
    lengths given are the keys' own, which updates may make unequal (flash declines those while capturing)."""
    shared = ab.BlockDiagonalCausalMask.from_seqlens([3, 5], device="cpu")
    assert shared.q_seqinfo is shared.k_seqinfo
    shared.q_seqinfo.from_seqlens_inplace([2, 4])
    assert shared.k_seqinfo.seqstart_py == [0, 2, 6]
    separate = ab.BlockDiagonalCausalMask.from_seqlens([3, 5], [3, 5], device="cpu")
    separate.q_seqinfo.from_seqlens_inplace([2, 4])
    separate.k_seqinfo.from_seqlens_inplace([1, 5])
    assert (separate.q_seqinfo.seqstart_py, separate.k_seqinfo.seqstart_py) == ([0, 2, 6], [0, 1, 6])


def test_windows_become_ints():
    window = ab.LocalAttentionFromBottomRightMask(torch.tensor(2), numpy.int64(1))
    assert (window.window_left, window.window_right) == (2, 1) and type(window.window_left) is int


def test_default_device_is_cuda_then_mtia_then_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.mtia, "is_available", lambda: True)
    assert ab._default_device() == torch.device("mtia")
    monkeypatch.setattr(torch.mtia, "is_available", lambda: False)
    assert ab._default_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ab._default_device() == torch.device("cuda")


def test_materialize_past_the_masks_rows_is_minus_inf():
    """Tensors may hold more rows than a varlen mask's lengths (after an in-place update under a CUDA graph): the
    reference materializes the mask over them, −inf past its rows and columns."""
    mask = ab.BlockDiagonalCausalMask.from_seqlens([2, 3], device="cpu")
    big = mask.materialize((7, 8))
    assert torch.equal(big[:5, :5], mask.materialize((5, 5)))
    assert (big[5:] == -math.inf).all() and (big[:, 5:] == -math.inf).all()
