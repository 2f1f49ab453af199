"""combine_shuffling / split_shuffling (spec M-09, M-10) against a naive chunk loop."""

import pytest
import torch

from mslk.core import testing
from mslk.moe import scatter_add_padded_tokens, shuffling

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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
def test_combine_and_split_match_chunk_loops(ep, experts, kept, padded):
    start, end = kept
    counts = torch.randint(0, 5, (ep, experts))
    slab = int(counts.sum(1).max()) + 2 if padded else None
    rows = ep * slab if padded else int(counts.sum())
    tokens = testing.randn(rows + (0 if padded else 3), 40, device=DEVICE)
    first = _layout(counts.tolist(), slab)

    out, out_counts = shuffling.combine_shuffling(tokens, counts.to(DEVICE).int(), start, end, padded)
    expected, row = torch.zeros_like(tokens), 0
    for e in range(start, end):
        for r in range(ep):
            n = int(counts[r, e])
            expected[row : row + n] = tokens[first[r, e] : first[r, e] + n]
            row += n
    assert torch.equal(out, expected), "expert by expert, rank by rank, zeros after"
    assert out_counts.tolist() == [*counts[:, start:end].sum(0).tolist(), row]

    back = shuffling.split_shuffling(out, counts.to(DEVICE), start, end, padded)
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
def test_counts_that_do_not_fit_the_tokens_are_cut(counts, padded, rows):
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
    out, out_counts = shuffling.combine_shuffling(tokens, token_counts, is_padded=padded)
    assert torch.equal(out, expected)
    assert out_counts.tolist() == [*torch.tensor(cut).sum(0).tolist(), sum(map(sum, cut))]
    assert torch.equal(shuffling.split_shuffling(out, token_counts, is_padded=padded), expected_back)


def test_no_experts_kept_and_no_ranks():
    out, counts = shuffling.combine_shuffling(torch.rand(4, 3), torch.ones(2, 3, dtype=torch.int32), 1, 1)
    assert (out == 0).all() and counts.tolist() == [0]
    assert (shuffling.split_shuffling(torch.rand(4, 3), torch.zeros(0, 3, dtype=torch.int32)) == 0).all()
    for padded in (False, True):
        out, counts = shuffling.combine_shuffling(
            torch.rand(4, 3), torch.zeros(0, 3, dtype=torch.int32), is_padded=padded
        )
        assert (out == 0).all() and counts.tolist() == [0, 0, 0, 0]  # 3 experts, then the total


def test_bad_input():
    with pytest.raises(ValueError, match="expert_start <= expert_end"):
        shuffling.combine_shuffling(torch.rand(4, 8), torch.ones(2, 3, dtype=torch.int32), 2, 1)
    with pytest.raises(ValueError, match="integer token_counts"):
        shuffling.split_shuffling(torch.rand(4, 8), torch.ones(2, 3))
    with pytest.raises(ValueError, match="needs at least one rank"):
        scatter_add_padded_tokens(torch.rand(0, 4, 8), torch.ones(3).int(), torch.zeros(4).int(), torch.rand(4, 8))
    with pytest.raises(ValueError, match="tokens on cpu, token_counts on meta"):
        shuffling.split_shuffling(torch.rand(4, 8), torch.ones(2, 3, dtype=torch.int32, device="meta"))
