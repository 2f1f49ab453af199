"""MoE routing ops (spec M-01, M-03, M-05, M-07) against naive per-token loops; the README quick start."""

import pytest
import torch

from mslk.core import arch, testing
from mslk.moe import (
    common,
    gather_scale_dense_tokens,
    gather_scale_quant_dense_tokens,
    index_shuffling,
    scatter_add_along_first_dim,
    scatter_add_dense_tokens,
    scatter_add_padded_tokens,
    silu_mul,
    silu_mul_quant,
)
from mslk.quantize.triton.fp8_quantize import quantize_fp8_row

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_readme_quick_start():
    t, d, e = 256, 512, 8
    x = testing.randn(t, d, device=DEVICE, dtype=torch.bfloat16)
    routing_scores = torch.softmax(testing.randn(t, e, device=DEVICE), dim=-1)
    counts, experts, tokens = torch.ops.mslk.index_shuffling(routing_scores, top_k=1)
    expert_x = gather_scale_dense_tokens(x, tokens, experts, routing_scores)
    out = torch.zeros_like(x)
    scatter_add_dense_tokens(out, expert_x, tokens)
    expected = x.float() * routing_scores.max(dim=-1).values[:, None]
    testing.assert_rel_close(out, expected, 1e-2)
    assert counts[:e].sum() == counts[e + 1] == t and counts[e] == t


def _naive_shuffling(scores, start, end, valid, top_k):
    """(counts per kept expert, [(local expert, token)] by expert then token)."""
    chosen = torch.topk(scores.float(), top_k, dim=1).indices.tolist()
    pairs = [(ex - start, tok) for tok, row in enumerate(chosen[:valid]) for ex in row if start <= ex < end]
    pairs.sort()
    counts = [sum(1 for ex, _ in pairs if ex == e - start) for e in range(start, end)]
    return counts, pairs


def _distinct_scores(t, e, dtype):
    """Scores without ties within a row (so that top-k is unambiguous), in dtype."""
    ranks = torch.stack([torch.randperm(e) for _ in range(t)]).float() if t else torch.empty(0, e)
    return ((ranks + 1) / (e + 1)).to(dtype).to(DEVICE)


@pytest.mark.parametrize(
    ("t", "e", "top_k"),
    [(1, 1, 1), (0, 8, 1), (37, 8, 2), (100, 16, 4), (64, 60, 8), (300, 128, 1), (50, 256, 8), (20, 320, 4)],
    ids=str,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("ranged", [False, True])
def test_index_shuffling_matches_a_naive_loop(t, e, top_k, dtype, ranged):
    if dtype == torch.bfloat16 and e > 128:
        pytest.skip("steps of 1/(E+1) round together in bf16 (8 bits) past E = 128: ties make top-k ambiguous")
    scores = _distinct_scores(t, e, dtype)
    start, end = (e // 4, e - e // 4) if ranged else (0, e)
    valid = max(t - 3, 0) if ranged else t
    count = torch.tensor([valid], device=DEVICE) if ranged else None
    counts, experts, tokens = index_shuffling(scores, start, end, count, top_k)
    ref_counts, pairs = _naive_shuffling(scores, start, end, valid, top_k)
    assert counts.dtype == experts.dtype == tokens.dtype == torch.int32
    assert counts.shape == (e + 2,) and experts.shape == tokens.shape == (t * top_k,)
    assert counts[start:end].tolist() == ref_counts and counts[:start].sum() == counts[end:e].sum() == 0
    assert counts[e] == t and counts[e + 1] == len(pairs)
    assert list(zip(experts[: len(pairs)].tolist(), tokens[: len(pairs)].tolist(), strict=True)) == pairs


@pytest.mark.parametrize("d", [96, 5120, 1000], ids=str)
def test_gather_and_scatter_against_loops(d):
    t, e, a = 50, 8, 70
    x = testing.randn(t, d, device=DEVICE, dtype=torch.bfloat16)
    scores = torch.rand(t, e, device=DEVICE)
    tokens = torch.randint(0, t, (a,), device=DEVICE, dtype=torch.int32)
    experts = torch.randint(0, e, (a,), device=DEVICE, dtype=torch.int32)
    gathered = gather_scale_dense_tokens(x, tokens, experts, scores, torch.tensor([60], device=DEVICE))
    for i in (0, 17, 59):
        expected = x[tokens[i]].float() * scores[tokens[i], experts[i]]
        testing.assert_rel_close(gathered[i], expected, 1e-2)
    assert (gathered[60:] == 0).all(), "rows past valid_token_count are zero"

    out = testing.randn(t, d, device=DEVICE)
    expected = out.double().clone()
    for i in range(60):
        expected[tokens[i]] += gathered[i].double()
    scatter_add_dense_tokens(out, gathered.float(), tokens.long(), torch.tensor([60], device=DEVICE))
    testing.assert_rel_close(out, expected, 1e-6)


def test_scatter_add_along_first_dim():
    dst = testing.randn(20, 48, device=DEVICE)
    src = testing.randn(33, 48, device=DEVICE)
    index = torch.randint(0, 20, (33,), device=DEVICE, dtype=torch.int32)
    expected = dst.double().index_add(0, index.long(), src.double())
    scatter_add_along_first_dim(dst, src, index)
    testing.assert_rel_close(dst, expected, 1e-6)


def test_scatter_add_along_first_dim_skips_indices_outside_dst():
    """An index outside Dst adds nothing, on every device: the reference once raised where the kernel skips."""
    from mslk.moe import gather_scatter as gs

    src, index = testing.randn(3, 8), torch.tensor([0, 4, 1])
    for scatter in (scatter_add_along_first_dim, _triton(gs, "scatter_add_along_first_dim_op")):
        dst = testing.randn(4, 8)
        expected = dst.double().index_add(0, torch.tensor([0, 1]), src[[0, 2]].double())
        scatter(dst, src, index)
        testing.assert_rel_close(dst, expected, 1e-6)


def test_silu_mul():
    x0, x1 = (testing.randn(33, 200, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    a = x0.double()
    testing.assert_rel_close(silu_mul(x0, x1), a * torch.sigmoid(a) * x1.double(), 1e-2)
    partial = silu_mul(x0, x1, torch.tensor([10], device=DEVICE))
    assert (partial[10:] == 0).all() and torch.equal(partial[:10], silu_mul(x0[:10], x1[:10]))


def test_quantized_variants_quantize_rowwise():
    x0, x1 = (testing.randn(20, 160, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    count, ub = torch.tensor([15], device=DEVICE), torch.tensor([2.0], device=DEVICE)
    xq, scale = silu_mul_quant(x0, x1, ub, count)
    rq, rs = quantize_fp8_row(silu_mul(x0, x1, count), ub, eps_opt=arch.FP8_EPS)
    assert xq.dtype == rq.dtype and torch.equal(xq.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(scale, rs)
    back = xq.float() * scale[:, None]
    a = x0.double()
    expected = (a * torch.sigmoid(a) * x1.double()).clamp(-2, 2)  # scale_ub bounds amax at 2
    testing.assert_rel_close(back[:15], expected[:15], 0.08)

    x, scores = testing.randn(30, 64, device=DEVICE), torch.rand(30, 4, device=DEVICE)
    tokens = torch.randint(0, 30, (40,), device=DEVICE, dtype=torch.int32)
    experts = torch.randint(0, 4, (40,), device=DEVICE, dtype=torch.int32)
    gq, gs = gather_scale_quant_dense_tokens(x, tokens, experts, scores)
    rq, rs = quantize_fp8_row(gather_scale_dense_tokens(x, tokens, experts, scores), eps_opt=arch.FP8_EPS)
    assert torch.equal(gq.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(gs, rs)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: index_shuffling(torch.rand(4, 8, dtype=torch.float16)), "bfloat16 or float32"),
        (lambda: index_shuffling(torch.rand(4, 8), top_k=9), r"top_k must be in \[1, E=8\]"),
        (lambda: index_shuffling(torch.rand(4, 0)), r"top_k must be in \[1, E=0\]"),  # no expert to route to
        (lambda: index_shuffling(torch.rand(4, 8), 6, 3), "expert_index_start <= expert_index_end"),
        (lambda: index_shuffling(torch.rand(4, 8), valid_token_count=torch.ones(2)), "one integer"),
        (
            lambda: gather_scale_dense_tokens(
                torch.rand(4, 8), torch.zeros(3).int(), torch.zeros(2).int(), torch.rand(4, 2)
            ),
            r"expert_indices must be int32/int64 \[3\]",
        ),
        (
            lambda: scatter_add_dense_tokens(torch.rand(4, 8), torch.rand(3, 8).double(), torch.zeros(3).int()),
            "float64",
        ),
        (lambda: silu_mul(torch.rand(4, 8), torch.rand(4, 9)), "one shape and dtype"),
        (
            lambda: gather_scale_quant_dense_tokens(
                torch.rand(4, 8).double(), torch.zeros(3).int(), torch.zeros(3).int(), torch.rand(4, 2).double()
            ),
            "gather_scale_quant_dense_tokens: x must be float32, float16 or bfloat16",
        ),
        (  # the gather's checks name the op called (they once named gather_scale_dense_tokens)
            lambda: gather_scale_quant_dense_tokens(
                torch.rand(4, 8), torch.zeros(3).int(), torch.zeros(3).int(), torch.rand(3, 2)
            ),
            r"^gather_scale_quant_dense_tokens: scores must be floating-point \[T=4, E\]",
        ),
        # Every tensor on one device: a count or indices elsewhere would fail inside a kernel, or read wrong memory.
        (
            lambda: index_shuffling(
                torch.rand(4, 8), valid_token_count=torch.ones(1, dtype=torch.int32, device="meta")
            ),
            "one device, got routing_scores on cpu, valid_token_count on meta",
        ),
        (
            lambda: gather_scale_dense_tokens(
                torch.rand(4, 8), torch.zeros(3).int(), torch.zeros(3, device="meta").int(), torch.rand(4, 2)
            ),
            "expert_indices on meta",
        ),
        (
            lambda: scatter_add_dense_tokens(
                torch.rand(4, 8), torch.rand(3, 8), torch.zeros(3).int(), torch.ones(1, device="meta").int()
            ),
            "valid_token_count on meta",
        ),
        (
            lambda: scatter_add_along_first_dim(
                torch.rand(4, 8), torch.rand(3, 8), torch.zeros(3, device="meta").long()
            ),
            "Index on meta",
        ),
        *[  # summed in fp32: float64 or integer rows would come back rounded through it
            (
                lambda op=op, dtype=dtype: op(torch.ones(4, 8, dtype=dtype), torch.ones(3, 8, dtype=dtype)),
                f"rows are added in fp32: bfloat16, float16 or float32 only, got {dtype}",
            )
            for dtype in (torch.float64, torch.int64)
            for op in (
                lambda out, rows: scatter_add_dense_tokens(out, rows, torch.zeros(3).int()),
                lambda out, rows: scatter_add_along_first_dim(out, rows, torch.zeros(3).long()),
                lambda out, rows: scatter_add_padded_tokens(rows[None], torch.ones(1).int(), torch.zeros(3).int(), out),
            )
        ],
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_compile_and_export():
    class Route(torch.nn.Module):
        def forward(self, x, scores):
            counts, experts, tokens = index_shuffling(scores, top_k=2)
            y = silu_mul(gather_scale_dense_tokens(x, tokens, experts, scores), x[tokens.long()])
            out = torch.zeros_like(x)
            scatter_add_dense_tokens(out, y, tokens)
            return counts, out

    x, scores = testing.randn(16, 32), torch.rand(16, 4)
    counts, out = torch.compile(Route(), fullgraph=True, backend="aot_eager")(x, scores)
    assert counts.shape == (6,) and out.shape == (16, 32)
    assert "mslk.index_shuffling" in str(torch.export.export(Route(), (x, scores)).graph)


# ------------------------------------------------------------------ the Triton kernels against the references
# T1 on the CPU (interpreter, small shapes), T2 on the GPU (larger shapes, marked gpu).

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _triton(op_module, name):
    return getattr(op_module, name).get_backend("triton").impl


def _tied_scores(t, e, dtype):
    """Random scores with ties (a row of one value, bf16 collisions), a NaN and a negative zero."""
    scores = testing.randn(t, e, dtype=dtype, device=KERNEL_DEVICE)
    if t > 3:
        scores[3] = scores[3, 0].item()
    if t > 5 and e > 2:
        scores[5, 1] = float("nan")
        scores[5, 0] = -0.0
    return scores


def _check_shuffling(t, e, top_k, dtype, ranged, with_count):
    from mslk.moe import shuffling

    scores = _tied_scores(t, e, dtype)
    start, end = (e // 4, e - e // 4) if ranged else (None, None)
    count = torch.tensor([max(t - 3, 0)], device=KERNEL_DEVICE) if with_count else None
    ref = shuffling._index_shuffling(scores, start, end, count, top_k)
    for _ in range(2):  # again: the grid barrier's counter was left at zero
        out = _triton(shuffling, "index_shuffling_op")(scores, start, end, count, top_k)
        for name, a, b in zip(("counts", "expert_indices", "token_indices"), out, ref, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), name  # the unused tail too
        assert common.kept_zeros(scores.device, shuffling.BARRIER, 2)[0] == 0


@pytest.mark.parametrize(
    ("t", "e", "top_k"),
    # (19, 2000, 2): blocks of 8 tokens, so that the one program of the interpreter takes several
    [(0, 8, 1), (1, 1, 1), (37, 8, 2), (100, 16, 4), (64, 60, 3), (50, 20, 8), (19, 2000, 2)],
    ids=str,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("ranged", "with_count"), [(False, False), (True, True)], ids=["all", "ranged_count"])
def test_index_shuffling_kernel(t, e, top_k, dtype, ranged, with_count):
    _check_shuffling(t, e, top_k, dtype, ranged, with_count)


@pytest.mark.parametrize(("start", "end"), [(3, 3), (0, 0), (8, 8)], ids=str)
def test_index_shuffling_kernel_empty_expert_range(start, end):
    """No expert kept: every pair is unselected, the pairs in token order."""
    from mslk.moe import shuffling

    scores = _tied_scores(37, 8, torch.float32)
    count = torch.tensor([33], device=KERNEL_DEVICE)
    ref = shuffling._index_shuffling(scores, start, end, count, 2)
    out = _triton(shuffling, "index_shuffling_op")(scores, start, end, count, 2)
    for name, a, b in zip(("counts", "expert_indices", "token_indices"), out, ref, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("count", [2**31, 2**32 + 1, -5], ids=str)
def test_index_shuffling_kernel_int64_counts(count):
    """An int64 count past every token keeps them all, as the reference does (the kernel once cut it to int32: 2^31
    kept none, 2^32 + 1 one token); a negative one keeps none."""
    from mslk.moe import shuffling

    scores = _tied_scores(37, 8, torch.float32)
    count = torch.tensor([count], dtype=torch.int64, device=KERNEL_DEVICE)
    ref = shuffling._index_shuffling(scores, None, None, count, 2)
    assert ref[0][-1] == (74 if count > 0 else 0)
    out = _triton(shuffling, "index_shuffling_op")(scores, None, None, count, 2)
    for name, a, b in zip(("counts", "expert_indices", "token_indices"), out, ref, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("t", "e", "top_k"),
    [(16384, 128, 1), (16384, 16, 8), (2048, 256, 8), (5000, 320, 4), (3000, 4096, 2), (777, 1, 1)],
    ids=str,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("ranged", "with_count"), [(False, False), (True, True)], ids=["all", "ranged_count"])
def test_index_shuffling_kernel_gpu(t, e, top_k, dtype, ranged, with_count):
    _check_shuffling(t, e, top_k, dtype, ranged, with_count)


@pytest.mark.gpu
def test_index_shuffling_kernels_on_two_streams_at_once():
    """Kernels running at the same time on two streams keep their grid barriers apart."""
    from mslk.moe import shuffling

    scores = [_tied_scores(16384, 128, torch.bfloat16) for _ in range(2)]
    refs = [shuffling._index_shuffling(s, top_k=2) for s in scores]
    streams = [torch.cuda.Stream() for _ in scores]
    torch.cuda._sleep(100_000_000)  # holds both streams back until every launch below is queued: they then overlap
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    results = [[], []]
    for _ in range(20):
        for i, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                results[i].append(_triton(shuffling, "index_shuffling_op")(scores[i], None, None, None, 2))
    torch.cuda.synchronize()
    for ref, outs in zip(refs, results, strict=True):
        for out in outs:
            assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))


def test_index_shuffling_kernel_limits():
    from mslk.moe import shuffling

    backend = shuffling.index_shuffling_op.get_backend("triton")
    assert backend.reasons("cuda", (torch.rand(4, 5000),), {"top_k": 1}) == ["E = 5000 > 4096 experts"]
    assert backend.reasons("cuda", (torch.rand(4, 16),), {"top_k": 9}) == ["top_k = 9 > 8"]


def _routing(t, e, top_k, device):
    from mslk.moe import shuffling

    scores = torch.rand(t, e, device=device)
    _, experts, tokens = shuffling._index_shuffling(scores, top_k=top_k)
    return scores, experts, tokens


@pytest.mark.parametrize(("t", "d", "top_k"), [(40, 96, 2), (7, 3000, 1), (5, 1, 4), (0, 16, 1)], ids=str)
@pytest.mark.parametrize("with_count", [False, True])
def test_gather_and_scatter_kernels(t, d, top_k, with_count):
    _check_gather_scatter(t, d, top_k, with_count, [torch.float32, torch.float16])


@pytest.mark.parametrize(("tokens", "experts"), [(5, 3), (0, 3), (5, 0)], ids=str)
def test_gather_indices_outside_x_or_scores_give_zero_rows(tokens, experts):
    """Indices past x's tokens or the scores' experts (also where there are none): zero rows, kernel and
    reference alike (the kernel reads nothing there)."""
    from mslk.moe import gather_scatter as gs

    x = testing.randn(tokens, 40, device=DEVICE)
    scores = testing.randn(tokens, experts, device=DEVICE)
    token_indices = torch.tensor([0, tokens, -1, 1, 2], dtype=torch.int32, device=DEVICE)
    expert_indices = torch.tensor([0, 1, 2, experts, -1], dtype=torch.int32, device=DEVICE)
    readable = (token_indices >= 0) & (token_indices < tokens) & (expert_indices >= 0) & (expert_indices < experts)
    op = gs.gather_scale_dense_tokens_op
    for gather in (op.get_backend("triton").impl, op.reference):
        out = gather(x, token_indices, expert_indices, scores)
        assert (out[~readable] == 0).all() and out.shape == (5, 40)
        rows = token_indices[readable].long()
        expected = x[rows] * scores[rows, expert_indices[readable].long()][:, None]
        testing.assert_rel_close(out[readable], expected)


@pytest.mark.parametrize("tokens", [5, 0])
def test_scatter_rows_past_the_count_or_outside_out_add_nothing(tokens):
    """Rows past valid_token_count (index_shuffling leaves anything there) and indices outside out_tokens add
    nothing, kernel and reference alike (neither reads an index on the host)."""
    from mslk.moe import gather_scatter as gs

    rows = testing.randn(6, 40, device=DEVICE)
    token_indices = torch.tensor([0, tokens, -1, 1, 999, 2], dtype=torch.int32, device=DEVICE)
    count = torch.tensor([5], device=DEVICE)  # the last row, into token 2, is past it
    adds = (token_indices >= 0) & (token_indices < tokens) & (torch.arange(6, device=DEVICE) < 5)
    expected = testing.randn(tokens, 40, device=DEVICE)
    before = expected.clone()
    expected.index_add_(0, token_indices[adds].long(), rows[adds])
    op = gs.scatter_add_dense_tokens_op
    for scatter in (op.get_backend("triton").impl, op.reference):
        out = before.clone()
        scatter(out, rows, token_indices, count)
        testing.assert_rel_close(out, expected, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "d", "top_k"), [(4096, 5120, 1), (1000, 7168, 8), (333, 1000, 2), (1, 1, 1)], ids=str)
@pytest.mark.parametrize("with_count", [False, True])
def test_gather_and_scatter_kernels_gpu(t, d, top_k, with_count):
    _check_gather_scatter(t, d, top_k, with_count, [torch.bfloat16, torch.float32, torch.float16])


def _check_gather_scatter(t, d, top_k, with_count, dtypes):
    from mslk.moe import gather_scatter as gs

    scores, experts, tokens = _routing(t, 8, top_k, KERNEL_DEVICE)
    rows = t * top_k
    count = torch.tensor([max(rows - 5, 0)], device=KERNEL_DEVICE) if with_count else None
    for dtype in dtypes:
        x = testing.randn(t, d, dtype=dtype, device=KERNEL_DEVICE)
        gathered = _triton(gs, "gather_scale_dense_tokens_op")(x, tokens, experts, scores, count)
        expected = gs._gather(x, tokens, experts, scores, count)
        if testing.interpreting() and dtype == torch.bfloat16:
            testing.assert_rel_close(gathered, expected, 1e-2)  # the interpreter truncates fp32 -> bf16
        else:
            assert torch.equal(gathered, expected), dtype
        # Scatter-add: rows of one token added one by one in the output dtype; top-1 rows each hit their own token.
        out = testing.randn(t, d, dtype=dtype, device=KERNEL_DEVICE)
        ref = out.clone()
        gs._scatter(ref, expected, tokens, count)
        _triton(gs, "scatter_add_dense_tokens_op")(out, expected, tokens, count)
        if top_k == 1 or dtype == torch.float32:
            testing.assert_rel_close(out, ref, 1e-6 if dtype == torch.float32 else 0.0)
        else:
            testing.assert_rel_close(out, ref, 1e-2)
        dst = testing.randn(t + 3, d, dtype=dtype, device=KERNEL_DEVICE)
        dst_ref = dst.double().index_add(0, tokens.long(), expected.double())
        _triton(gs, "scatter_add_along_first_dim_op")(dst, expected, tokens)
        testing.assert_rel_close(dst, dst_ref, 1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize(
    ("t", "d", "top_k"), [(40, 96, 2), (7, 3000, 1), (3, 16500, 1), (5, 1, 4), (0, 16, 1)], ids=str
)
@pytest.mark.parametrize("with_count", [False, True])
def test_gather_quant_kernel(t, d, top_k, with_count, monkeypatch):
    _check_gather_quant(t, d, top_k, with_count, [torch.float32, torch.float16], monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("t", "d", "top_k"), [(4096, 5120, 1), (1000, 7168, 8), (333, 1000, 2), (7, 20000, 1), (1, 1, 1)], ids=str
)
@pytest.mark.parametrize("with_count", [False, True])
def test_gather_quant_kernel_gpu(t, d, top_k, with_count, monkeypatch):
    _check_gather_quant(t, d, top_k, with_count, [torch.bfloat16, torch.float32, torch.float16], monkeypatch)


def _check_gather_quant(t, d, top_k, with_count, dtypes, monkeypatch):
    """The fused kernel against gather_scale_dense_tokens then quantize_fp8_row (the op's reference): FP8 levels
    and scales alike, with a count, scale_ub, a NaN row (NaN scale), rows in one pass and in two (d > 16384);
    outputs allocated poisoned."""
    from mslk.moe import gather_scatter as gs

    scores, experts, tokens = _routing(t, 8, top_k, KERNEL_DEVICE)
    count = torch.tensor([max(t * top_k - 5, 0)], device=KERNEL_DEVICE) if with_count else None
    empty = torch.empty
    for dtype in dtypes:
        x = testing.randn(t, d, dtype=dtype, device=KERNEL_DEVICE, std=3.0)
        if t > 2:
            x[1, d // 2] = float("nan")
        for scale_ub in (None, torch.tensor([0.5], device=KERNEL_DEVICE)):
            monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: testing.poison_(empty(*args, **kwargs)))
            xq, scale = _triton(gs, "gather_scale_quant_dense_tokens_op")(x, tokens, experts, scores, scale_ub, count)
            monkeypatch.undo()
            rq, rs = gs._gather_quant(x, tokens, experts, scores, scale_ub, count)
            testing.assert_fp8_equal(xq, rq)
            torch.testing.assert_close(scale, rs, rtol=0, atol=0, equal_nan=True)
            if t > 2 and top_k == 1 and not with_count:
                assert scale[(tokens == 1).nonzero()[0, 0]].isnan(), "the NaN row"


@pytest.mark.parametrize(
    ("tokens", "rows", "hot"), [(64, 64, 3), (40, 300, 40), (1, 257, 1)], ids=["locked", "counted", "one-token"]
)
def test_scatter_add_with_rows_sharing_tokens(tokens, rows, hot):
    """Many rows into a few tokens, in fp32 (a lost update shows as an error of a whole row): at most a row per
    token takes the per-token locks, more rows than tokens count rows and use atomics. Every lock is free
    afterwards."""
    from mslk.moe import gather_scatter as gs

    d = 300 if testing.interpreting() else 5000
    index = torch.randint(0, hot, (rows,), device=KERNEL_DEVICE, dtype=torch.int32)
    values = testing.randn(rows, d, device=KERNEL_DEVICE)
    out = testing.randn(tokens, d, device=KERNEL_DEVICE)
    expected = out.double().index_add(0, index.long(), values.double())
    for _ in range(3):  # the same call again: races show as an error that moves
        got = out.clone()
        _triton(gs, "scatter_add_dense_tokens_op")(got, values, index)
        testing.assert_rel_close(got, expected, 1e-6)
    assert not common.kept_zeros(out.device, gs.SCATTER_LOCKS, 1).any()


def test_kept_zeros_grow_and_stay():
    """A larger request gets a larger buffer; the older ones stay allocated (graphs may hold them)."""
    device = torch.device("cpu")
    first = common.kept_zeros(device, "test", 10)
    assert common.kept_zeros(device, "test", 10) is first and first.numel() >= 10
    assert common.kept_zeros(device, "another use", 10) is not first
    grown = common.kept_zeros(device, "test", first.numel() + 1)
    kept = common._kept[(device, 0, "test")]
    assert grown.numel() >= 2 * first.numel() and kept[-1] is grown and kept[-2] is first
    assert not grown.any()


def test_out_of_range_indices_are_skipped_by_the_kernels():
    from mslk.moe import gather_scatter as gs

    x, scores = testing.randn(6, 40, device=KERNEL_DEVICE), torch.rand(6, 4, device=KERNEL_DEVICE)
    tokens = torch.tensor([2, -1, 6, 5], device=KERNEL_DEVICE, dtype=torch.int32)
    experts = torch.tensor([1, 0, 0, 4], device=KERNEL_DEVICE, dtype=torch.int32)
    out = _triton(gs, "gather_scale_dense_tokens_op")(x, tokens, experts, scores)
    assert torch.equal(out[0], x[2] * scores[2, 1]) and (out[1:] == 0).all()
    dst = testing.randn(6, 40, device=KERNEL_DEVICE)
    before = dst.clone()
    _triton(gs, "scatter_add_dense_tokens_op")(dst, testing.randn(4, 40, device=KERNEL_DEVICE), tokens[1:3].repeat(2))
    assert torch.equal(dst, before)


def test_scatter_add_kernel_yields_to_deterministic_mode():
    from mslk.moe import gather_scatter as gs

    backend = gs.scatter_add_dense_tokens_op.get_backend("triton")
    args = (torch.rand(4, 8), torch.rand(3, 8), torch.zeros(3, dtype=torch.int32))
    assert backend.reasons("cuda", args, {}) == []
    torch.use_deterministic_algorithms(True)
    try:
        assert "torch deterministic mode" in backend.reasons("cuda", args, {})[0]
    finally:
        torch.use_deterministic_algorithms(False)


def _padded_case(ranks, experts, t, top_k, d, dtype, device):
    """index_shuffling's arrays for T tokens, and in_tokens [EP, T·k, D] with each rank's rows at their
    expert-ordered positions and NaN everywhere else (padding must add nothing)."""
    from mslk.moe import shuffling

    counts, _, tokens = shuffling._index_shuffling(torch.rand(t, experts, device=device), top_k=top_k)
    counts = counts[:experts]
    rows = t * top_k
    in_tokens = torch.full((ranks, rows, d), float("nan"), dtype=dtype, device=device)
    ends = torch.cumsum(counts, 0).tolist()
    starts = [0, *ends[:-1]]
    per_rank = experts // ranks
    for e in range(experts):
        r = e // per_rank
        in_tokens[r, starts[e] : ends[e]] = testing.randn(ends[e] - starts[e], d, dtype=dtype, device=device)
    return in_tokens, counts, tokens, starts, ends


@pytest.mark.parametrize(
    ("ranks", "experts", "t", "top_k", "d"), [(2, 4, 9, 1, 40), (4, 8, 30, 2, 33), (1, 3, 5, 3, 8)]
)
def test_scatter_add_padded_tokens_against_a_loop(ranks, experts, t, top_k, d):
    from mslk.moe import gather_scatter as gs

    in_tokens, counts, tokens, starts, ends = _padded_case(ranks, experts, t, top_k, d, torch.float32, DEVICE)
    out = testing.randn(t, d, device=DEVICE)
    expected = out.double().clone()
    for e in range(experts):
        for i in range(starts[e], ends[e]):
            expected[tokens[i]] += in_tokens[e // (experts // ranks), i].double()
    gs.scatter_add_padded_tokens(in_tokens, counts, tokens, out)
    testing.assert_rel_close(out, expected, 1e-6)
    kernel_out = testing.randn(t, d, device=KERNEL_DEVICE)
    reference_out = kernel_out.clone()
    args = [a.to(KERNEL_DEVICE) for a in (in_tokens, counts, tokens)]
    _triton(gs, "scatter_add_padded_tokens_op")(*args, kernel_out)
    gs._scatter_padded(*args, reference_out)
    testing.assert_rel_close(kernel_out, reference_out, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_scatter_add_padded_tokens_kernel_gpu(dtype):
    from mslk.moe import gather_scatter as gs

    in_tokens, counts, tokens, _, _ = _padded_case(4, 16, 2000, 1, 5120, dtype, "cuda")
    out = testing.randn(2000, 5120, dtype=dtype, device="cuda")
    ref = out.clone()
    _triton(gs, "scatter_add_padded_tokens_op")(in_tokens, counts, tokens, out)
    gs._scatter_padded(in_tokens, counts, tokens, ref)
    assert torch.equal(out, ref)  # top-1: one row per token, rounded once on both paths


@pytest.mark.gpu
def test_routing_records_into_a_cuda_graph():
    """index_shuffling, gather and scatter-add run without host syncs: they replay from a CUDA graph."""
    x = testing.randn(300, 256, dtype=torch.bfloat16, device="cuda")
    scores = torch.rand(300, 16, device="cuda")
    out, count = torch.zeros_like(x), torch.tensor([250], device="cuda")

    def step():
        out.zero_()
        _, experts, tokens = index_shuffling(scores, valid_token_count=count, top_k=2)
        scatter_add_dense_tokens(out, gather_scale_dense_tokens(x, tokens, experts, scores), tokens)

    torch.cuda.synchronize()
    step()
    expected = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.fill_(float("nan"))
    graph.replay()
    testing.assert_rel_close(out, expected, 1e-2)
