"""combine_shuffling / split_shuffling (spec M-09, M-10) against a naive chunk loop: the ops as dispatched (the
reference on the CPU, Triton on a GPU) and the Triton backend itself (under the interpreter on the CPU)."""

import pytest
import torch

from mslk.core import testing
from mslk.moe import scatter_add_padded_tokens, shuffling

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = {
    "op": (shuffling.combine_shuffling, shuffling.split_shuffling),
    "triton": (
        shuffling.combine_shuffling_op.get_backend("triton").impl,
        shuffling.split_shuffling_op.get_backend("triton").impl,
    ),
}


@pytest.fixture(params=list(IMPLS))
def regroup(request):
    """(combine, split) as the test names them, each called on memory the allocator hands back poisoned."""

    def poisoned(fn):
        def call(tokens, *args):
            testing.poison_(torch.empty_like(tokens))  # freed: the output's allocation takes it again
            return fn(tokens, *args)

        return call

    return tuple(map(poisoned, IMPLS[request.param]))


def _layout(counts: list[list[int]], slab: int | None):
    """{(rank, expert): first row} of the rank-ordered layout (slab rows a rank when padded)."""
    first, row = {}, 0
    for r, per_rank in enumerate(counts):
        row = r * slab if slab is not None else row
        for e, n in enumerate(per_rank):
            first[r, e] = row
            row += n
    return first


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(("ep", "experts", "kept"), [(1, 4, (0, 4)), (2, 8, (2, 6)), (4, 3, (0, 3)), (3, 6, (5, 6))])
def test_combine_and_split_match_chunk_loops(regroup, ep, experts, kept, padded):
    combine, split = regroup
    start, end = kept
    counts = torch.randint(0, 5, (ep, experts))
    slab = int(counts.sum(1).max()) + 2 if padded else None
    rows = ep * slab if padded else int(counts.sum())
    tokens = testing.randn(rows + (0 if padded else 3), 40, device=DEVICE)
    first = _layout(counts.tolist(), slab)

    out, out_counts = combine(tokens, counts.to(DEVICE).int(), start, end, padded)
    expected, row = torch.zeros_like(tokens), 0
    for e in range(start, end):
        for r in range(ep):
            n = int(counts[r, e])
            expected[row : row + n] = tokens[first[r, e] : first[r, e] + n]
            row += n
    assert torch.equal(out, expected), "expert by expert, rank by rank, zeros after"
    assert out_counts.tolist() == [*counts[:, start:end].sum(0).tolist(), row]

    back = split(out, counts.to(DEVICE), start, end, padded)
    for e in range(start, end):
        for r in range(ep):
            n = int(counts[r, e])
            assert torch.equal(back[first[r, e] : first[r, e] + n], tokens[first[r, e] : first[r, e] + n])
    written = sum(int(counts[r, e]) for e in range(start, end) for r in range(ep))
    assert int((back.abs().sum(1) != 0).sum()) == written, "nothing else is written; the rest is zero"


@pytest.mark.parametrize(
    ("counts", "padded", "rows"),
    [
        ([[2, 2], [2, 2]], False, 3),  # 8 rows counted, 3 given
        ([[2, -1], [2, 2]], False, 6),  # a negative count counts as 0
        ([[3, 0], [0, 1]], True, 4),  # rank 0 counts 3 rows in its slab of 2
    ],
)
def test_counts_that_do_not_fit_the_tokens_are_cut(regroup, counts, padded, rows):
    """Counts past the tokens (or past a rank's slab) never index past T, which would stop a GPU: the rows they
    name outside are skipped, read as zero by combine and written nowhere by split."""
    tokens = testing.randn(rows, 8, device=DEVICE)
    token_counts = torch.tensor(counts, device=DEVICE)
    ranks, experts = token_counts.shape
    slab = rows // ranks if padded else None
    cut = [[max(n, 0) for n in per_rank] for per_rank in counts]
    first = _layout(cut, slab)
    expected, expected_back, row = torch.zeros_like(tokens), torch.zeros_like(tokens), 0
    for e in range(experts):
        for r in range(ranks):
            for i in range(cut[r][e]):
                source = first[r, e] + i
                inside = source < (rows if slab is None else min(rows, (r + 1) * slab))
                if row < rows and inside:
                    expected[row] = tokens[source]
                    expected_back[source] = tokens[source]
                row += 1
    combine, split = regroup
    out, out_counts = combine(tokens, token_counts, None, None, padded)
    assert torch.equal(out, expected)
    assert out_counts.tolist() == [*torch.tensor(cut).sum(0).tolist(), sum(map(sum, cut))]
    assert torch.equal(split(out, token_counts, None, None, padded), expected_back)


def test_no_experts_kept_and_no_ranks(regroup):
    combine, split = regroup
    tokens, ints = torch.rand(4, 3, device=DEVICE), {"dtype": torch.int32, "device": DEVICE}
    out, counts = combine(tokens, torch.ones(2, 3, **ints), 1, 1)
    assert (out == 0).all() and counts.tolist() == [0]
    assert (split(tokens, torch.zeros(0, 3, **ints)) == 0).all()
    for padded in (False, True):
        out, counts = combine(tokens, torch.zeros(0, 3, **ints), None, None, padded)
        assert (out == 0).all() and counts.tolist() == [0, 0, 0, 0]  # 3 experts, then the total


def test_triton_copies_any_dtype_strides_and_shapes():
    """The Triton kernels move bits (ints, fp8, -0 and NaN payloads alike), read strided tokens, and take empty
    tokens; against the reference on random counts, some negative, some past the tokens."""
    combine, split = IMPLS["triton"]
    gen = torch.Generator().manual_seed(0)
    cases = [  # dtype, EP, E, kept experts, rows, bytes a row, is_padded
        (torch.float32, 7, 5, (1, 4), 37, 48, False),
        (torch.int16, 4, 9, (0, 9), 40, 130, True),
        (torch.float8_e4m3fn, 3, 12, (5, 5), 0, 16, True),
        (torch.int64, 1, 1, (0, 1), 9, 16, False),
        (torch.float8_e5m2, 5, 6, (1, 5), 33, 40, False),  # (the reference's split took no fp8 on the CPU)
        (torch.uint16, 2, 3, (0, 3), 21, 64, True),
    ]
    for dtype, ranks, experts, (start, end), rows, width, padded in cases:
        args = (torch.randint(-1, 6, (ranks, experts), generator=gen).to(DEVICE), start, end, padded)
        bits = torch.randint(0, 256, (rows, width), generator=gen, dtype=torch.uint8)
        tokens = bits.to(DEVICE).view(dtype)[:, ::2]  # every other element: strided rows
        (out, counts), (ref_out, ref_counts) = combine(tokens, *args), shuffling._combine(tokens, *args)
        assert torch.equal(counts, ref_counts)
        for got, ref in ((out, ref_out), (split(tokens, *args), shuffling._split(tokens, *args))):
            assert got.dtype == ref.dtype and got.is_contiguous()
            assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), (dtype, ranks, experts, rows)


@pytest.mark.parametrize("split", [False, True])
def test_triton_plan_fills_its_whole_table(split):
    """Every entry of the plan table written (poisoned before), its chunk ends in order (the copy's binary search
    needs them so), and the rows each chunk reads inside its written rows and the first T."""
    gen = torch.Generator().manual_seed(1)
    for ranks, experts, (start, end), rows, padded in [(3, 5, (1, 4), 30, False), (5, 7, (0, 7), 41, True),
                                                       (2, 3, (2, 2), 9, False), (6, 9, (3, 8), 20, True)]:  # fmt: skip
        counts = torch.randint(-1, 5, (ranks, experts), generator=gen, dtype=torch.int32).to(DEVICE)
        n = shuffling._table_size(counts, start, end, split)
        table = testing.poison_(torch.empty(4 * n, dtype=torch.int32, device=DEVICE))
        shuffling._plan(counts, start, end, rows, padded, split, table)
        ends, first, last, _ = table.view(4, n).cpu()
        assert (table != torch.iinfo(torch.int32).max).all(), "an entry left unwritten"
        assert (ends[1:] >= ends[:-1]).all() and (ends <= rows).all()
        assert (first >= 0).all() and (first <= last).all() and (last <= ends).all()


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("ranks", "experts", "kept", "rows", "width", "padded"),
    [
        (8, 16, (0, 16), 16384, 5120, False),  # dynamic exchange: all kept, the rows exactly counted
        (8, 128, (16, 32), 16384, 7168, True),  # static exchange: one rank's 16 experts of 128
        (16, 256, (240, 256), 2053, 129, True),  # odd rows and width, slabs with rows left over
        (5, 300, (7, 299), 4099, 33, False),  # counts past the tokens
    ],
)
def test_triton_regroup_gpu(ranks, experts, kept, rows, width, padded):
    """The Triton backends bit for bit against the references on MoE-sized random counts (some negative)."""
    combine, split = IMPLS["triton"]
    mean = 2 * rows // (ranks * experts) + 1
    counts = torch.randint(-1, mean, (ranks, experts), device="cuda", dtype=torch.int32)
    if not padded and kept == (0, experts):
        counts = torch.bincount(torch.randint(0, ranks * experts, (rows,)), minlength=ranks * experts)
        counts = counts.view(ranks, experts).int().cuda()
    tokens = testing.randn(rows, width, dtype=torch.bfloat16, device="cuda")
    args = (counts, *kept, padded)
    testing.poison_(torch.empty_like(tokens))
    (out, out_counts), (ref_out, ref_counts) = combine(tokens, *args), shuffling._combine(tokens, *args)
    assert torch.equal(out_counts, ref_counts) and torch.equal(out, ref_out)
    testing.poison_(torch.empty_like(tokens))
    assert torch.equal(split(out, *args), shuffling._split(out, *args))


def test_triton_says_what_it_cannot_serve():
    backend = shuffling.combine_shuffling_op.get_backend("triton")
    tokens = torch.rand(4, 3)
    assert backend.reasons("cuda", (tokens, torch.ones(2, 3, dtype=torch.int32)), {}) == []
    (reason,) = backend.reasons("cuda", (tokens, torch.ones(300, 300, dtype=torch.int32)), {})
    assert "more than 65536 chunks" in reason


def test_bad_input():
    with pytest.raises(ValueError, match="expert_start <= expert_end"):
        shuffling.combine_shuffling(torch.rand(4, 8), torch.ones(2, 3, dtype=torch.int32), 2, 1)
    with pytest.raises(ValueError, match="integer token_counts"):
        shuffling.split_shuffling(torch.rand(4, 8), torch.ones(2, 3))
    with pytest.raises(ValueError, match="needs at least one rank"):
        scatter_add_padded_tokens(torch.rand(0, 4, 8), torch.ones(3).int(), torch.zeros(4).int(), torch.rand(4, 8))
    with pytest.raises(ValueError, match="tokens on cpu, token_counts on meta"):
        shuffling.split_shuffling(torch.rand(4, 8), torch.ones(2, 3, dtype=torch.int32, device="meta"))


def test_split_takes_its_flags_by_keyword():
    """With a backend pinned through the Op (registry), is_padded and init_with_zeros by keyword (the validation
    took them positionally only: TypeError)."""
    tokens = testing.randn(12, 5)
    counts = torch.tensor([[2, 1, 0], [1, 0, 3]], dtype=torch.int32)
    want = shuffling._split(tokens, counts, 0, 2, True)
    got = shuffling.split_shuffling_op(tokens, counts, 0, 2, is_padded=True, init_with_zeros=True, backend="reference")
    assert torch.equal(got, want)
