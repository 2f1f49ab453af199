"""Tree attention (spec A-10, A-11).

T0: TreeAttnMetadata against upstream's worked example and against definitions recomputed from the choice tuples
(ancestors are tuple prefixes), the tree constructors, tree_attention against a float64 dense-attention oracle
(each query over the cache keys its sequence may see and its tree ancestors), the backend choice, and errors.
"""

import itertools
import math
import random

import pytest
import torch

from mslk.attention.fmha import attn_bias as ab
from mslk.attention.fmha import triton_flash, triton_splitk
from mslk.attention.fmha.common import pack_fp8_tensorwise_per_head
from mslk.attention.fmha.tree_attention import (
    SplitKAutotune,
    TreeAttnMetadata,
    construct_full_tree_choices,
    construct_tree_choices,
    get_full_tree_size,
    select_prefix_op,
    tree_attention,
    use_triton_splitk_for_prefix,
)
from mslk.core import testing

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The worked example of upstream's TreeAttnMetadata docstring: 0 -> {1 -> {4, 5, 6}, 2 -> {7, 8, 9}, 3 -> {10, 11, 12}}.
EXAMPLE = [(0,), (0, 0), (0, 1), (0, 2), (1,), (1, 0), (1, 1), (1, 2), (2,), (2, 0), (2, 1), (2, 2)]
# EAGLE's mc_sim_7b_63 tree (github.com/SafeAILab/EAGLE, model/choices.py): ragged, five levels below the root.
EAGLE_TREE = [
    (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (0, 0, 0), (0, 0, 1),
    (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
]  # fmt: skip


def node_order(choices):
    """The root () and the choices by depth, then lexicographically (the node numbering of the contract)."""
    return [(), *sorted(map(tuple, choices), key=lambda c: (len(c), c))]


def is_ancestor_or_self(a, b) -> bool:
    return b[: len(a)] == a


def sees_matrix(choices) -> torch.Tensor:
    """[T, T] bool: node i sees node j iff j is i or one of its ancestors."""
    nodes = node_order(choices)
    return torch.tensor([[is_ancestor_or_self(b, a) for b in nodes] for a in nodes])


# ----------------------------------------------------------------------------------------------- metadata


def test_metadata_of_the_worked_example():
    meta = TreeAttnMetadata.from_tree_choices(EXAMPLE)
    tensors = {
        "tree_indices": [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 4, 5, 6],
        "retrieval_indices": [[0, 1, 4], [0, 1, 5], [0, 1, 6], [0, 2, 7], [0, 2, 8], [0, 2, 9], [0, 3, 10],
                              [0, 3, 11], [0, 3, 12]],
        "tree_seq_position_ids": [0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2],
        "parent_node_indices": [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3],
        "child_node_indices": [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]] + [[0, 0, 0]] * 9,
        "num_children_per_node": [3, 3, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        "candidate_idx": [0, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2],
        "num_nodes_per_level": [1, 3, 9],
        "num_nodes_per_level_cpu": [1, 3, 9],
    }  # fmt: skip
    for name, expected in tensors.items():
        assert getattr(meta, name).tolist() == expected, name
    assert meta.tree_seq_position_ids.dtype == torch.int32 and meta.tree_indices.dtype == torch.long
    assert meta.tree_choices == node_order(EXAMPLE)[1:]
    assert meta.path_lengths == [3] * 9
    assert meta.subtree_sizes == [1, 4, 13]
    for levels in (meta.num_children_per_node_at_level, meta.num_children_per_node_at_level_cpu):
        assert [t.tolist() for t in levels] == [[3], [3, 3, 3], [0] * 9]
    expected_bias = torch.zeros(13, 13).masked_fill(~sees_matrix(EXAMPLE), -math.inf)
    assert torch.equal(meta.attention_bias, expected_bias)


@pytest.mark.parametrize("tree", ["eagle", "branching"])
def test_metadata_matches_its_definitions(tree):
    """Every field recomputed from the choice tuples alone, for choices given in a shuffled order."""
    choices = EAGLE_TREE if tree == "eagle" else construct_tree_choices([3, 1, 2])
    shuffled = random.Random(0).sample(choices, len(choices))
    meta = TreeAttnMetadata.from_tree_choices(shuffled, dtype=torch.bfloat16, device=DEVICE)
    nodes = node_order(choices)
    index = {node: n for n, node in enumerate(nodes)}
    children = [[m for m, c in enumerate(nodes) if c and c[:-1] == node] for node in nodes]
    depth = max(map(len, nodes))

    assert meta.tree_choices == nodes[1:]
    assert meta.attention_bias.dtype == torch.bfloat16 and meta.attention_bias.device.type == DEVICE
    assert torch.equal(meta.attention_bias.isfinite().cpu(), sees_matrix(choices))
    assert (meta.attention_bias[meta.attention_bias.isfinite()] == 0).all()
    assert meta.tree_seq_position_ids.tolist() == [len(c) for c in nodes]
    assert meta.parent_node_indices.tolist() == [0] + [index[c[:-1]] for c in nodes[1:]]
    assert meta.num_children_per_node.tolist() == [len(kids) for kids in children]
    for row, kids in zip(meta.child_node_indices.tolist(), children, strict=True):
        assert row[: len(kids)] == [k - 1 for k in kids] and set(row[len(kids) :]) <= {row[max(len(kids) - 1, 0)]}
    assert meta.candidate_idx.tolist() == [sum(1 for m in nodes if m and m[:-1] == c[:-1] and m < c) for c in nodes]
    # Draft candidates level by level: level d's take 1 + its largest child number slots after those above it.
    slots = [max(c[-1] for c in nodes if len(c) == d) + 1 for d in range(1, depth + 1)]
    assert meta.tree_indices.tolist() == [0] + [1 + sum(slots[: len(c) - 1]) + c[-1] for c in nodes[1:]]
    leaves = sorted(c for c in nodes if not children[index[c]])  # depth-first order
    paths = [[index[leaf[:n]] for n in range(len(leaf) + 1)] for leaf in leaves]
    assert meta.retrieval_indices.tolist() == [p + [-1] * (depth + 1 - len(p)) for p in paths]
    assert meta.path_lengths == [len(p) for p in paths]
    per_level = [sum(1 for c in nodes if len(c) == d) for d in range(depth + 1)]
    assert meta.num_nodes_per_level.tolist() == per_level and meta.num_nodes_per_level_cpu.device.type == "cpu"
    assert meta.subtree_sizes == list(itertools.accumulate(per_level))
    starts = [0, *meta.subtree_sizes]
    assert [t.tolist() for t in meta.num_children_per_node_at_level] == [
        meta.num_children_per_node[a:b].tolist() for a, b in itertools.pairwise(starts)
    ]


def test_metadata_of_the_root_alone():
    meta = TreeAttnMetadata.from_tree_choices([])
    assert meta.attention_bias.tolist() == [[0.0]]
    assert meta.retrieval_indices.tolist() == [[0]] and meta.path_lengths == [1]
    assert meta.child_node_indices.tolist() == [[0]] and meta.num_children_per_node.tolist() == [0]
    assert meta.num_nodes_per_level.tolist() == [1] and meta.subtree_sizes == [1]


def test_cached_metadata_is_shared_and_equal():
    choices = tuple(EXAMPLE)
    cached = TreeAttnMetadata.from_tree_choices_cached(choices, torch.float16)
    assert TreeAttnMetadata.from_tree_choices_cached(choices, torch.float16) is cached
    fresh = TreeAttnMetadata.from_tree_choices([list(c) for c in EXAMPLE], torch.float16)  # EAGLE writes lists
    assert torch.equal(cached.attention_bias, fresh.attention_bias)
    assert torch.equal(cached.retrieval_indices, fresh.retrieval_indices)


@pytest.mark.parametrize(
    "choices, match",
    [
        ([(0,), (0, 1), (0,)], r"\(0,\) is listed twice"),
        ([(0,), (1, 0)], r"\(1, 0\) has no parent \(node \(1,\)"),
        ([(0,), ()], "non-empty tuple"),
        ([(0,), (0, -1)], "child numbers >= 0"),
        ([0, 1], "non-empty tuple"),
    ],
)
def test_malformed_trees_raise(choices, match):
    with pytest.raises(ValueError, match=match):
        TreeAttnMetadata.from_tree_choices(choices)


def test_tree_constructors():
    assert construct_full_tree_choices(2, 3) == node_order(EXAMPLE)[1:]
    assert construct_tree_choices([2, 1, 2]) == [
        (0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1),
    ]  # fmt: skip
    assert construct_full_tree_choices(0, 4) == []
    for depth, branching in itertools.product(range(5), range(1, 4)):
        assert get_full_tree_size(depth + 1, branching) == len(construct_full_tree_choices(depth, branching)) + 1
    assert get_full_tree_size(3, 2) == 7
    with pytest.raises(ValueError, match="branching factors must be >= 0"):
        construct_tree_choices([2, -1])


# ------------------------------------------------------------------------------------------ tree attention


def dense_tree_attention(q, spec_k, spec_v, cache_keys, cache_values, sees):
    """float64 oracle: query i of sequence b attends to cache_keys[b] ([n_b, (G,) H, D], the keys its mask allows)
    and to the tree keys j with sees[i, j]."""
    outs = []
    for b in range(q.shape[0]):
        k = torch.cat([cache_keys[b], spec_k[b]]).double()
        v = torch.cat([cache_values[b], spec_v[b]]).double()
        allowed = torch.cat([torch.ones(q.shape[1], cache_keys[b].shape[0], dtype=torch.bool), sees], dim=1)
        scores = torch.einsum("q...d,k...d->...qk", q[b].double(), k) / math.sqrt(q.shape[-1])
        weights = scores.masked_fill(~allowed.to(scores.device), -math.inf).softmax(-1)
        outs.append(torch.einsum("...qk,k...d->q...d", weights, v))
    return torch.stack(outs)


def tree_inputs(layout, dtype, B, tree_q, tree_kv, cache_rows, D=16):
    heads = (2, 3) if layout == "BMGHK" else (3,)

    def randn(*shape):
        return testing.randn(*shape, *heads, D, dtype=dtype, device=DEVICE)

    return randn(B, tree_q), randn(B, tree_kv), randn(B, tree_kv), randn(*cache_rows), randn(*cache_rows)


@pytest.mark.parametrize("op", [None, triton_flash.FwOp], ids=["dispatched", "mslk-triton"])
@pytest.mark.parametrize("layout", ["BMHK", "BMGHK"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree_q", [13, 5])
def test_tree_attention_with_padded_cache(layout, dtype, tree_q, op):
    """A cache of B slots of Mk keys with ragged lengths (one empty); all the tree or only its last nodes queried;
    through the dispatcher (the reference on a CPU) and pinned to MSLK's Triton kernel (a GPU's choice; the
    interpreter on a CPU): its packed varlen LSE and tensor-bias partials merge alike."""
    B, Mk, kv_lens = 3, 11, [7, 0, 11]
    meta = TreeAttnMetadata.from_tree_choices(EXAMPLE, dtype, DEVICE)
    tree_kv = len(EXAMPLE) + 1
    q, spec_k, spec_v, cache_k, cache_v = tree_inputs(layout, dtype, B, tree_q, tree_kv, (B, Mk))
    prefix = ab.BlockDiagonalPaddedKeysMask.from_seqlens([tree_q] * B, Mk, kv_lens, device=DEVICE)
    out = tree_attention(
        q, spec_k, spec_v, cache_k, cache_v, meta.attention_bias[-tree_q:], prefix, prefix_op=op, suffix_op=op
    )
    cache_keys, cache_values = ([c[b, :n] for b, n in enumerate(kv_lens)] for c in (cache_k, cache_v))
    ref = dense_tree_attention(q, spec_k, spec_v, cache_keys, cache_values, sees_matrix(EXAMPLE)[-tree_q:])
    assert out.dtype == dtype and out.shape == q.shape
    testing.assert_rel_close(out, ref)


@pytest.mark.parametrize("layout", ["BMHK", "BMGHK"])
def test_tree_attention_with_paged_cache(layout):
    """Keys read through a page table from a shared pool of pages, in shuffled order."""
    B, page_size, max_pages, kv_lens = 2, 4, 3, [9, 4]
    pool_pages = B * max_pages + 1
    block_tables = torch.randperm(pool_pages)[: B * max_pages].view(B, max_pages).to(torch.int32)
    tree_kv = len(EAGLE_TREE) + 1
    q, spec_k, spec_v, pool_k, pool_v = tree_inputs(layout, torch.float32, B, tree_kv, tree_kv,
                                                    (1, pool_pages * page_size))  # fmt: skip
    prefix = ab.PagedBlockDiagonalPaddedKeysMask.from_seqlens(
        [tree_kv] * B, kv_lens, block_tables.to(DEVICE), page_size, device=DEVICE
    )
    spec_bias = TreeAttnMetadata.from_tree_choices(EAGLE_TREE, device=DEVICE).attention_bias
    out = tree_attention(q, spec_k, spec_v, pool_k, pool_v, spec_bias, prefix)
    rows = [[int(block_tables[b, j // page_size]) * page_size + j % page_size for j in range(n)]
            for b, n in enumerate(kv_lens)]  # fmt: skip
    ref = dense_tree_attention(
        q, spec_k, spec_v, [pool_k[0, r] for r in rows], [pool_v[0, r] for r in rows], sees_matrix(EAGLE_TREE)
    )
    testing.assert_rel_close(out, ref)


def test_default_ops_that_do_not_fit_fall_back_to_the_dispatcher(monkeypatch):
    """Were Triton split-K built, the heuristics would pick it; inputs it cannot take (the CPU) go to the
    dispatcher instead of failing."""
    monkeypatch.setattr(triton_splitk.FwOp, "OPERATOR", lambda *args: None)
    padded = ab.BlockDiagonalPaddedKeysMask.from_seqlens([4] * 2, 8, [3, 8], device=DEVICE)
    assert select_prefix_op(2, 1, 13, False, padded, torch.bfloat16) is triton_splitk.FwOp
    assert select_prefix_op(2, 1, 13, True, padded, torch.bfloat16) is SplitKAutotune
    assert select_prefix_op(256, 1, 100, False, padded, torch.bfloat16) is None  # FlashAttention's regime
    assert select_prefix_op(256, 1, 100, False, padded, torch.uint8) is triton_splitk.FwOp
    block_diagonal = ab.BlockDiagonalMask.from_seqlens([4] * 2, [8, 8], device=DEVICE)  # split-K does not take it
    assert select_prefix_op(2, 1, 13, False, block_diagonal, torch.bfloat16) is None
    if DEVICE == "cpu":
        q, spec_k, spec_v, cache_k, cache_v = tree_inputs("BMHK", torch.float32, 2, 4, 13, (2, 8))
        sees = sees_matrix(EXAMPLE)[-4:]
        out = tree_attention(q, spec_k, spec_v, cache_k, cache_v, torch.zeros(4, 13).masked_fill(~sees, -math.inf),
                             padded, autotune=True)  # fmt: skip
        ref = dense_tree_attention(q, spec_k, spec_v, [cache_k[0, :3], cache_k[1]], [cache_v[0, :3], cache_v[1]], sees)
        testing.assert_rel_close(out, ref)


def test_prefix_op_choice_never_names_a_missing_backend():
    padded = ab.BlockDiagonalPaddedKeysMask.from_seqlens([4] * 2, 8, [3, 8], device=DEVICE)
    for B, autotune, dtype in itertools.product([1, 2, 64, 256], [False, True], [torch.bfloat16, torch.uint8]):
        op = select_prefix_op(B, 1, 13, autotune, padded, dtype)
        assert op is None or op.is_available()
    assert issubclass(SplitKAutotune, triton_splitk.FwOp) and SplitKAutotune.AUTOTUNE
    assert use_triton_splitk_for_prefix(128, 1, 64) and use_triton_splitk_for_prefix(3, 1, 99)
    assert use_triton_splitk_for_prefix(1, 1, 1000) and not use_triton_splitk_for_prefix(129, 1, 64)
    assert not use_triton_splitk_for_prefix(4, 1, 99)


def bad_inputs(**changes):
    """Valid BMHK inputs (B=2, tree_q=3, tree_kv=5, Mk=6) with some replaced."""
    q, spec_k, spec_v, cache_k, cache_v = tree_inputs("BMHK", torch.float32, 2, 3, 5, (2, 6))
    args = {
        "q": q, "spec_k": spec_k, "spec_v": spec_v, "cache_k": cache_k, "cache_v": cache_v,
        "spec_attn_bias": torch.zeros(3, 5),
        "prefix_attn_bias": ab.BlockDiagonalPaddedKeysMask.from_seqlens([3, 3], 6, [2, 6], device=DEVICE),
    }  # fmt: skip
    return {**args, **changes}


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"q": testing.randn(2, 3, 3)}, "BMHK"),
        ({"q": testing.randn(2, 6, 3, 16)}, "tree_q <= tree_kv"),
        ({"spec_k": testing.randn(2, 5, 2, 16), "spec_v": testing.randn(2, 5, 2, 16)}, "spec_k and spec_v must be"),
        ({"cache_k": testing.randn(2, 6, 3, 8), "cache_v": testing.randn(2, 6, 3, 8)}, "cache_k and cache_v must be"),
        ({"cache_k": testing.randn(1, 12, 3, 16), "cache_v": testing.randn(1, 12, 3, 16)}, r"\[B, Mk, \(G,\) H, D\]"),
        ({"spec_attn_bias": torch.zeros(5, 5)}, r"spec_attn_bias must be a tensor \[tree_q, tree_kv\] = \[3, 5\]"),
        ({"prefix_attn_bias": None}, "prefix_attn_bias must be a varlen mask"),
        ({"prefix_attn_bias": ab.BlockDiagonalPaddedKeysMask.from_seqlens([2, 4], 6, [2, 6])}, "starting at"),
        # a mask padding the lanes to 4 keys over a cache of 6: lane 1's keys read from lane 0's rows (silently)
        (
            {"prefix_attn_bias": ab.BlockDiagonalPaddedKeysMask.from_seqlens([3, 3], 4, [2, 4])},
            "pads each lane's keys to 4 rows, cache_k has Mk=6",
        ),
    ],
)
def test_bad_inputs_raise(changes, match):
    inputs = bad_inputs(**{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in changes.items()})
    with pytest.raises(ValueError, match=match):
        tree_attention(**inputs)


def test_cache_sliced_from_a_larger_buffer():
    """A cache [:, :Mk] of a preallocated buffer (lanes not back to back: it crashed in a view) gives what its
    contiguous copy gives."""
    inputs = bad_inputs()
    buffers = [testing.randn(2, 10, 3, 16, device=DEVICE) for _ in range(2)]
    sliced = {"cache_k": buffers[0][:, :6], "cache_v": buffers[1][:, :6]}
    out = tree_attention(**{**inputs, **sliced})
    want = tree_attention(**{**inputs, **{name: c.contiguous() for name, c in sliced.items()}})
    testing.assert_rel_close(out, want, 1e-6)


def test_quantized_caches_are_refused():
    """uint8 and FP8 caches need kernels this release does not ship (triton_splitk, FlashAttention-3's KV split)."""
    uint8_cache = torch.randint(0, 256, (2, 6, 3, 16), dtype=torch.uint8, device=DEVICE)
    scales = torch.randint(0, 2**31 - 1, (2, 6, 3), dtype=torch.int32, device=DEVICE)
    inputs = bad_inputs()
    q_fp8 = pack_fp8_tensorwise_per_head(inputs["q"].to(torch.float8_e4m3fn), 0.5, torch.float32)
    for changes, extra in (
        ({"cache_k": uint8_cache, "cache_v": uint8_cache}, {"quantized_kv_scales": (scales, scales)}),
        ({}, {"quantized_kv_scales": (scales, scales)}),
        ({}, {"q_fp8": q_fp8}),
    ):
        with pytest.raises(NotImplementedError, match=r"quantized KV caches .* this release does not ship"):
            tree_attention(**bad_inputs(**changes), **extra)
