"""MLA over a paged latent cache (spec A-50, A-51): mla_decode_fwd, mla_prefill_fwd.

T0: the reference against SDPA in float64 on keys gathered one by one, errors before any kernel, metadata values
the reference refuses, the fake kernel, compile. T1 (CPU, interpreter; few heads and keys) and T2 (GPU; DeepSeek-V3's
128 heads, thousands of keys): the Triton kernel against the float64 reference on decode steps, prefills after a
context, empty sequences, pages of 1 to 64 rows, heads past a block, FP8 caches, key splits, strided inputs and
poisoned allocations; on the GPU a CUDA graph replayed on new lengths.
"""

import itertools

import pytest
import torch

import mslk.attention  # noqa: F401  (registers the ops)
from mslk.attention import mla
from mslk.core import arch, testing

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D = mla.MLA_QK_HEAD_DIM
# bf16 output: its rounding alone is about 2e-3 here (3e-3 to 4e-3 measured with bf16 products)
TOL = 1e-2


def inputs(queries, keys, heads, page_size, q_dtype=torch.bfloat16, kv_dtype=None, device=DEVICE):
    """(query, kv_buffer, block_tables, cu_seqlens_q, seqused_k) of sequences with the given query and key counts;
    the cache rows no sequence uses (spare pages, the ends of last pages) are NaN: a kernel that lets one into its
    products gives NaN."""
    kv, tables, used = mla.random_cache(keys, page_size, kv_dtype or q_dtype, device)
    used_rows = torch.zeros(kv.shape[:2], dtype=torch.bool, device=device)
    for b, n in enumerate(keys):
        for first in range(0, n, page_size):
            used_rows[tables[b, first // page_size], : n - first] = True
    kv.copy_(kv.float().masked_fill(~used_rows[..., None, None], float("nan")))
    query = testing.randn(sum(queries), heads, D, device=device).to(q_dtype)
    starts = torch.tensor([0, *itertools.accumulate(queries)], dtype=torch.int32, device=device)
    return query, kv, tables, starts, used


def kernel(*args, **kwargs):
    """The ops' Triton backend itself (on a CPU it runs under the interpreter)."""
    return mla.mla_prefill_fwd_op.get_backend("triton").impl(*args, **kwargs)


def sdpa64(query, kv, tables, starts, used, softmax_scale=None):
    """float64 SDPA of each sequence's queries over its keys, gathered row by row through the block table (no
    shared code with the reference)."""
    page_size = kv.shape[1]
    out = []
    for b in range(tables.shape[0]):
        q = query[starts[b] : starts[b + 1]].double().transpose(0, 1)  # [H, n, D]
        n, length = q.shape[1], int(used[b])
        if n == 0:
            continue
        k = torch.stack([kv[tables[b, j // page_size], j % page_size, 0] for j in range(length)]).double()
        mask = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]  # bottom-right causal
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k[None], k[None, :, :512], attn_mask=mask.to(q.device), scale=softmax_scale
        )
        out.append(o.transpose(0, 1))
    return torch.cat(out) if out else query.new_empty(0, query.shape[1], 512, dtype=torch.float64)


FP8 = arch.fp8_dtype(DEVICE)
# (query tokens a sequence, keys a sequence, heads, page size, query dtype, cache dtype)
CASES = [
    ([1, 1, 1, 1], [1, 17, 64, 100], 16, 16, torch.bfloat16, None),  # decode
    ([3, 0, 5], [7, 4, 5], 20, 8, torch.float16, None),  # prefill after a context; an empty sequence
    ([2, 2], [2, 9], 4, 1, torch.bfloat16, None),  # pages of one row
    ([1, 2], [30, 50], 8, 32, torch.bfloat16, FP8),  # an FP8 cache
    ([1], [45], 16, 64, FP8, None),  # FP8 queries and cache
    ([1, 2], [20, 9], 72, 16, torch.bfloat16, None),  # two head blocks, the second partly used
    ([1], [1100], 16, 64, torch.bfloat16, None),  # one token: its keys split over 4 programs
    ([b % 3 for b in range(37)], list(range(5, 42)), 16, 8, torch.bfloat16, None),  # 37 sequences, 12 empty
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_is_sdpa(case):
    queries, keys, heads, page_size, q_dtype, kv_dtype = case
    args = inputs(queries, keys, heads, page_size, q_dtype, kv_dtype, device="cpu")
    out = mla.mla_decode_fwd(*args)
    assert out.dtype == torch.bfloat16 and out.shape == (sum(queries), heads, 512)
    testing.assert_rel_close(out, sdpa64(*args), 4e-3)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel(case, monkeypatch):
    queries, keys, heads, page_size, q_dtype, kv_dtype = case
    args = inputs(queries, keys, heads, page_size, q_dtype, kv_dtype)
    empty, new_empty = torch.empty, torch.Tensor.new_empty  # allocations come poisoned (NaN)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: testing.poison_(empty(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: testing.poison_(new_empty(self, *a, **k)))
    out = kernel(*args)
    monkeypatch.undo()
    assert out.shape == (sum(queries), heads, 512) and out.is_contiguous()
    testing.assert_rel_close(out, mla.mla_prefill_fwd_op.reference(*args), TOL)


@pytest.mark.parametrize(
    "queries, keys, page_size, dtype",
    [
        ([1, 1, 1], [70, 200, 3], 64, torch.bfloat16),  # decode
        ([3, 0, 2], [130, 1, 64], 128, torch.float16),  # prefill, an empty sequence
    ],
    ids=str,
)
def test_tma_key_tiles(queries, keys, page_size, dtype, monkeypatch):
    """The key tiles by TMA (Hopper, programs of 64 heads, pages of whole blocks; here under the interpreter on any
    machine): the pointer path's output bit for bit, though TMA reads the unused (NaN) rows of last pages."""
    args = inputs(queries, keys, 72, page_size, dtype, device="cpu")
    pointers = kernel(*args)
    monkeypatch.setattr(arch, "on_hopper", lambda t: True)
    assert mla._key_descriptors(args[1], mla._config(args[0])) is not None
    out = kernel(*args)
    assert torch.equal(out, pointers)
    testing.assert_rel_close(out, mla.mla_prefill_fwd_op.reference(*args), TOL)


@pytest.mark.parametrize(
    ("shared_memory", "heads", "block_h", "block_n"),
    [
        (232448, 128, 64, 64),  # H100 / H200
        (101376, 128, 64, 16),  # RTX 4090 / 5090
        (65536, 128, 32, 32),  # MI300X
        (163840, 16, 16, 64),  # MI355X
        (None, 128, 64, 64),  # not reported
    ],
)
def test_config_fits_shared_memory(shared_memory, heads, block_h, block_n, monkeypatch):
    """The program's heads and key rows by the GPU's shared memory a block (tools/other_gpus.py compiles them)."""
    info = arch.DeviceInfo(0, "nvidia", "a GPU", (9, 0), 132, None, shared_memory)
    monkeypatch.setattr(arch, "device_info", lambda device=None: info)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    cfg = mla._config(torch.empty(1, heads, D))
    monkeypatch.undo()
    assert (cfg["BLOCK_H"], cfg["BLOCK_N"]) == (block_h, block_n)


def test_key_splits_are_taken():
    """CASES' token of 1100 keys (18 pages of 64) runs as 4 programs over parts of its keys, merged (on the GPU:
    as many as the fewest waves of programs allow)."""
    query = torch.empty(1, 16, D)
    cfg = mla._config(query)
    assert cfg["BLOCK_H"] == 16 and mla._splits(1, 18 * 64, query, cfg) == 4


def test_scale_and_strided_inputs():
    """A given softmax_scale; a query of every other head of a wider tensor, a cache slice of wider rows and a
    column-major block table give the contiguous inputs' output bit for bit."""
    query, kv, tables, starts, used = inputs([2, 1], [40, 23], 8, 16)
    wide_q = testing.randn(3, 16, D + 64, device=DEVICE).to(query.dtype)
    wide_q[:, ::2, 32 : 32 + D] = query
    wide_kv = testing.randn(*kv.shape[:3], D + 16, device=DEVICE).to(kv.dtype)
    wide_kv[..., 16:] = kv
    strided = (wide_q[:, ::2, 32 : 32 + D], wide_kv[..., 16:], tables.t().contiguous().t(), starts, used)
    assert not any(t.is_contiguous() for t in strided[:3])
    out = kernel(*strided, softmax_scale=0.02)
    assert torch.equal(out, kernel(query, kv, tables, starts, used, softmax_scale=0.02))
    testing.assert_rel_close(out, sdpa64(query, kv, tables, starts, used, softmax_scale=0.02), TOL)


def test_fp8_cache_scale_recipe():
    """The module docstring's recipe for a cache quantized with one scale s (softmax_scale times s, the output
    times s) gives attention over the dequantized cache."""
    query, kv, tables, starts, used = inputs([1, 2], [30, 50], 8, 16)
    s = 0.05
    kv_fp8 = (kv.float() / s).to(FP8)
    out = kernel(query, kv_fp8, tables, starts, used, softmax_scale=D**-0.5 * s).double() * s
    testing.assert_rel_close(out, sdpa64(query, kv_fp8.double() * s, tables, starts, used), TOL)


def test_empty():
    """No query tokens, or no heads: an empty output without a launch."""
    for queries, heads in (([0, 0], 8), ([1, 2], 0)):
        args = inputs(queries, [3, 5], heads, 4)
        assert kernel(*args).shape == (sum(queries), heads, 512)


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_bench_baseline_computes_the_op(cache):
    """The bench's SDPA baseline (keys gathered beforehand, a sequence's tokens' heads as query rows) gives the
    op's output, so that the two are timed on the same work."""
    from mslk.attention import bench

    s = {"B": 2, "Q": 3, "L": 70, "H": 16, "cache": cache}
    inputs = bench._mla_inputs(s, torch.device("cpu"))
    baseline = bench._mla_sdpa(inputs).reshape(s["B"] * s["Q"], s["H"], 512)
    testing.assert_rel_close(baseline, mla.mla_prefill_fwd_op.reference(*inputs[0]), TOL)


def test_fake_kernel_matches():
    args = inputs([3, 1], [9, 4], 20, 8)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        faked = torch.ops.mslk.mla_decode_fwd(*(mode.from_tensor(t) for t in args))
    out = kernel(*args)
    assert faked.shape == out.shape and faked.stride() == out.stride() and faked.dtype == out.dtype


def test_compiles():
    args = inputs([1, 1], [9, 4], 16, 8, device="cpu")
    compiled = torch.compile(mla.mla_decode_fwd, fullgraph=True, backend="eager")
    assert torch.equal(compiled(*args), mla.mla_decode_fwd(*args))


def _bad_inputs():
    q, kv, tables, starts, used = inputs([1, 2], [5, 9], 4, 4, device="cpu")
    ok = (q, kv, tables, starts, used)
    fp8 = arch.fp8_dtype("cpu")

    def with_(i, value):
        return (*ok[:i], value, *ok[i + 1 :])

    return [
        ("2-D query", with_(0, q[0]), "query must be \\[T, H, 576\\]"),
        ("query dims", with_(0, q[..., :512]), "query must be \\[T, H, 576\\]"),
        ("3-D cache", with_(1, kv[:, :, 0]), "kv_buffer must be \\[num_pages, page_size, 1, 576\\]"),
        ("two KV heads", with_(1, kv.expand(-1, -1, 2, -1)), "kv_buffer must be"),
        ("fp32 query", with_(0, q.float()), "expected bf16 or fp16 query and kv_buffer"),
        ("mixed halves", with_(1, kv.half()), "expected bf16 or fp16 query and kv_buffer"),
        ("FP8 query, bf16 cache", with_(0, q.to(fp8)), "expected bf16 or fp16 query and kv_buffer"),
        ("1-D tables", with_(2, tables[0]), "block_tables must be \\[B, max_blocks\\]"),
        ("no sequence", (q, kv, tables[:0], starts[:1], used[:0]), "query has 3 tokens and block_tables no sequence"),
        ("starts", with_(3, starts[:2]), "cu_seqlens_q must be \\[3\\]"),
        ("int64 lengths", with_(4, used.long()), "seqused_k must be int32"),
        ("scale", (*ok, float("nan")), "softmax_scale must be finite"),
        ("devices", with_(1, kv.to("meta")), "all tensors must be on one device"),
        # The values, which the reference (the CPU kernel) reads:
        ("falling starts", with_(3, torch.tensor([0, 2, 1], dtype=torch.int32)), "must rise from 0 to T = 3"),
        ("fewer keys than queries", with_(4, torch.tensor([5, 1], dtype=torch.int32)), "at least the query tokens"),
        ("keys past the pages", with_(4, torch.tensor([5, 13], dtype=torch.int32)), "and fit the pages"),
        ("page id", with_(2, torch.full_like(tables, kv.shape[0])), "page ids outside \\[0, "),
    ]


@pytest.mark.parametrize(("what", "args", "match"), _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_errors(what, args, match):
    for op in (mla.mla_decode_fwd, mla.mla_prefill_fwd):
        with pytest.raises(ValueError, match=match):
            op(*args)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [
        ([1] * 8, [1, 77, 1024, 4000, 513, 2048, 3, 999], 128, 64, torch.bfloat16, None),
        ([1] * 8, [1, 77, 1024, 4000, 513, 2048, 3, 999], 128, 64, torch.bfloat16, FP8),
        ([2] * 4, [4096, 300, 2, 1500], 16, 64, torch.float16, None),  # speculative steps, a shard's heads
        ([300, 1, 129], [300, 500, 1000], 128, 64, torch.bfloat16, None),  # prefill
        ([64, 7], [1000, 7], 40, 16, FP8, None),
    ],
    ids=str,
)
def test_kernel_gpu(case):
    queries, keys, heads, page_size, q_dtype, kv_dtype = case
    args = inputs(queries, keys, heads, page_size, q_dtype, kv_dtype, device="cuda")
    for op in (mla.mla_decode_fwd, mla.mla_prefill_fwd):
        testing.assert_rel_close(op(*args), mla.mla_prefill_fwd_op.reference(*args), TOL)


@pytest.mark.gpu
def test_cuda_graph_replays_new_lengths():
    """A decode step captured once serves later steps: new lengths and tables in the same tensors."""
    query, kv, tables, starts, used = inputs([1] * 4, [900, 50, 2000, 1], 128, 64, device="cuda")
    mla.mla_decode_fwd(query, kv, tables, starts, used)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla.mla_decode_fwd(query, kv, tables, starts, used)
    for lengths in ([1, 2000, 3, 1200], [2048, 2048, 2048, 2048]):  # the table holds 32 pages of 64 rows
        used.copy_(torch.tensor(lengths, dtype=torch.int32))
        tables.copy_(torch.randint(0, kv.shape[0], tables.shape, dtype=torch.int32))
        query.copy_(testing.randn(*query.shape, device="cuda"))
        kv.copy_(testing.randn(*kv.shape, device="cuda"))  # rows inputs() poisoned are now used
        graph.replay()
        testing.assert_rel_close(out, mla.mla_prefill_fwd_op.reference(query, kv, tables, starts, used), TOL)
