"""Tree attention for speculative decoding, Medusa / EAGLE style (spec A-10, A-11).

A draft tree of candidate tokens is verified in one step: each tree node (query) attends to the sequence's KV cache
and to its own ancestors in the tree (itself included), never to other branches. That is two partial attentions
merged by their log-sum-exps (`merge_attentions`):

    prefix: q over the cache, under a varlen mask of the cache lengths (BlockDiagonalPaddedKeysMask, or a paged one)
    suffix: q over the tree's keys, under the dense tree mask `TreeAttnMetadata.attention_bias` (0 or −inf)

Both biases are built once by the caller (the tree mask never changes; the prefix mask is updated in place), so a
call can replay inside a CUDA graph. Trees are written in the Medusa choice-tuple format: each node is the path
of child numbers from the root, e.g. (1, 0) is child 0 of the root's child 1; the root itself is implicit.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mslk.attention import fmha  # its functions are used at call time: fmha/__init__ imports this module
from mslk.attention.fmha import flash, flash3, triton_splitk
from mslk.attention.fmha.attn_bias import (
    VARLEN_BIASES,
    AttentionBias,
    PagedBlockDiagonalGappyKeysMask,
    PagedBlockDiagonalPaddedKeysMask,
)
from mslk.attention.fmha.common import (
    AttentionFwOpBase,
    Inputs,
    bias_type,
    rocm_build,
)
from mslk.attention.fmha.dispatch import _get_use_fa3, fa3_available
from mslk.attention.fmha.merge import merge_attentions

# ------------------------------------------------------------------------------------------ tree metadata


@dataclass
class TreeAttnMetadata:
    """What a speculative decoder needs to know about a tree of T nodes (the root and one per tree choice).

    Nodes are numbered 0 (the root), then the tree choices sorted by depth, then lexicographically; "node" below
    means that number. Per-node tensors have T entries (as upstream documents them; its code gives
    parent_node_indices and candidate_idx only for the T − 1 nodes below the root).

    tree_choices: the choices in node order (node n is tree_choices[n - 1]).
    attention_bias [T, T]: 0 where node i may see node j (j is i or an ancestor of i), −inf elsewhere; the
        `spec_attn_bias` of tree_attention (its last tree_q rows when fewer nodes are queried).
    tree_indices [T]: the position of each node's token among the draft candidates laid out level by level,
        [root, level 1's top-k, level 2's top-k, ...] (k of a level: 1 + its largest child number).
    retrieval_indices [leaves, depth + 1]: the nodes of each root-to-leaf path, padded with −1; one row per leaf,
        in depth-first order (leaves sorted by their choice tuple). A tree of the root alone has the path [0].
    path_lengths: the unpadded length of each row of retrieval_indices.
    tree_seq_position_ids [T] int32: each node's depth (its position in its path, for positional embeddings).
    parent_node_indices [T]: each node's parent; 0 for the root (which has none) and for its children.
    child_node_indices [T, max children]: each node's children as indices into tree_choices (node − 1), padded
        by repeating the last child; a leaf's row is all 0.
    num_children_per_node [T]: how many children each node has.
    candidate_idx [T]: each node's rank among its siblings (0 for the root).
    num_nodes_per_level [depth + 1] (and its CPU copy): nodes per depth, the root's level (1) first.
    num_children_per_node_at_level (and their CPU copies): num_children_per_node cut per level.
    subtree_sizes: how many nodes the levels up to each one hold (cumulative num_nodes_per_level).

    Example: tree_choices [(0,), (0, 0), (0, 1), (0, 2), (1,), (1, 0), (1, 1), (1, 2), (2,), (2, 0), (2, 1), (2, 2)]
    is the tree 0 -> {1 -> {4, 5, 6}, 2 -> {7, 8, 9}, 3 -> {10, 11, 12}}, with
        tree_indices = [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 4, 5, 6]
        retrieval_indices = [[0, 1, 4], [0, 1, 5], [0, 1, 6], [0, 2, 7], ..., [0, 3, 12]], path_lengths = [3] * 9
        tree_seq_position_ids = [0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2]
        parent_node_indices = [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
        child_node_indices = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [0, 0, 0], ..., [0, 0, 0]]
        num_children_per_node = [3, 3, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        candidate_idx = [0, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2]
        num_nodes_per_level = [1, 3, 9], subtree_sizes = [1, 4, 13]
        num_children_per_node_at_level = [[3], [3, 3, 3], [0, 0, 0, 0, 0, 0, 0, 0, 0]]
    """

    tree_choices: list[tuple[int, ...]]
    attention_bias: torch.Tensor
    tree_indices: torch.Tensor
    retrieval_indices: torch.Tensor
    path_lengths: list[int]
    tree_seq_position_ids: torch.Tensor
    parent_node_indices: torch.Tensor
    child_node_indices: torch.Tensor
    num_children_per_node: torch.Tensor
    candidate_idx: torch.Tensor
    num_nodes_per_level: torch.Tensor
    num_nodes_per_level_cpu: torch.Tensor
    num_children_per_node_at_level: list[torch.Tensor]
    num_children_per_node_at_level_cpu: list[torch.Tensor]
    subtree_sizes: list[int]

    @classmethod
    def from_tree_choices(
        cls,
        tree_choices: Sequence[Sequence[int]],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> TreeAttnMetadata:
        """The metadata of the tree whose nodes are `tree_choices` (paths of child numbers from the root, in any
        order; every node's parent must be listed too). `dtype` is attention_bias's (default: torch's default
        dtype); every tensor but the *_cpu copies is on `device`."""
        choices = _sorted_tree_choices(tree_choices)
        nodes = [(), *choices]
        node_of = {choice: node for node, choice in enumerate(nodes)}
        parent = [0] + [node_of[choice[:-1]] for choice in choices]
        depth = [0] + [len(choice) for choice in choices]
        children: list[list[int]] = [[] for _ in depth]
        candidate = [0] * len(depth)
        for node in range(1, len(depth)):  # parents come first, and siblings in choice order
            candidate[node] = len(children[parent[node]])
            children[parent[node]].append(node)

        sees = torch.eye(len(depth), dtype=torch.bool)
        for node in range(1, len(depth)):
            sees[node] |= sees[parent[node]]
        attention_bias = torch.full(sees.shape, -math.inf, dtype=dtype).masked_fill_(sees, 0.0)

        nodes_per_level = [depth.count(d) for d in range(max(depth) + 1)]
        subtree_sizes = list(itertools.accumulate(nodes_per_level))
        level_slices = list(itertools.pairwise([0, *subtree_sizes]))

        tree_indices = [0]
        for start, end in level_slices[1:]:  # a level's candidates are numbered after those of the levels above
            offset = max(tree_indices) + 1
            tree_indices += [offset + choices[node - 1][-1] for node in range(start, end)]

        def path(node: int) -> list[int]:
            chain = [node]
            while chain[-1] != 0:
                chain.append(parent[chain[-1]])
            return chain[::-1]

        leaves = sorted((node for node in range(len(depth)) if not children[node]), key=nodes.__getitem__)
        paths = [path(leaf) for leaf in leaves]
        retrieval = [p + [-1] * (len(nodes_per_level) - len(p)) for p in paths]

        width = max(1, *map(len, children))
        child_rows = [[child - 1 for child in kids] or [0] for kids in children]
        child_rows = [row + row[-1:] * (width - len(row)) for row in child_rows]

        def as_tensor(values, tensor_dtype=torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=tensor_dtype, device=device)

        num_children = as_tensor([len(kids) for kids in children])
        num_children_at_level = [num_children[start:end] for start, end in level_slices]
        num_nodes_per_level = as_tensor(nodes_per_level)
        return cls(
            tree_choices=choices,
            attention_bias=attention_bias.to(device),
            tree_indices=as_tensor(tree_indices),
            retrieval_indices=as_tensor(retrieval),
            path_lengths=[len(p) for p in paths],
            tree_seq_position_ids=as_tensor(depth, torch.int32),
            parent_node_indices=as_tensor(parent),
            child_node_indices=as_tensor(child_rows),
            num_children_per_node=num_children,
            candidate_idx=as_tensor(candidate),
            num_nodes_per_level=num_nodes_per_level,
            num_nodes_per_level_cpu=num_nodes_per_level.cpu(),
            num_children_per_node_at_level=num_children_at_level,
            num_children_per_node_at_level_cpu=[t.cpu() for t in num_children_at_level],
            subtree_sizes=subtree_sizes,
        )

    @classmethod
    def from_tree_choices_cached(
        cls,
        tree_choices: tuple[tuple[int, ...], ...],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> TreeAttnMetadata:
        """from_tree_choices memoized on its (hashable) arguments: calls with equal arguments share one object,
        whose tensors must then not be modified."""
        return _cached_metadata(cls, tree_choices, dtype, device)


@functools.lru_cache
def _cached_metadata(cls, tree_choices, dtype, device) -> TreeAttnMetadata:
    return cls.from_tree_choices(tree_choices, dtype, device)


def _sorted_tree_choices(tree_choices: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The choices as tuples sorted by depth, then lexicographically; ValueError for a malformed tree."""
    choices = []
    for choice in tree_choices:
        if not (isinstance(choice, (tuple, list)) and choice and all(isinstance(c, int) and c >= 0 for c in choice)):
            raise ValueError(
                f"tree_choices: each node is a non-empty tuple of child numbers >= 0 (the root is implicit), got "
                f"{choice!r}"
            )
        choices.append(tuple(choice))
    choices.sort(key=lambda choice: (len(choice), choice))
    seen = set()
    for choice in choices:  # a parent, one level up, is seen before its children
        if choice in seen:
            raise ValueError(f"tree_choices: node {choice} is listed twice")
        if len(choice) > 1 and choice[:-1] not in seen:
            raise ValueError(f"tree_choices: node {choice} has no parent (node {choice[:-1]} is not listed)")
        seen.add(choice)
    return choices


def construct_tree_choices(branching: Sequence[int]) -> list[tuple[int, ...]]:
    """The tree whose nodes at depth d + 1 each have branching[d] children (leaves at depth len(branching)), as
    tree choices in node order."""
    if any(b < 0 for b in branching):
        raise ValueError(f"construct_tree_choices: branching factors must be >= 0, got {list(branching)}")
    return [
        choice
        for depth in range(1, len(branching) + 1)
        for choice in itertools.product(*(range(b) for b in branching[:depth]))
    ]


def construct_full_tree_choices(depth: int, branching: int) -> list[tuple[int, ...]]:
    """The full tree of `depth` levels below the root, `branching` children per inner node, as tree choices."""
    return construct_tree_choices([branching] * depth)


def get_full_tree_size(depth: int, branching: int) -> int:
    """Nodes of a full tree of `depth` levels counting the root's: the tree of construct_full_tree_choices(d, b)
    has get_full_tree_size(d + 1, b) nodes."""
    return sum(branching**level for level in range(depth))


# ---------------------------------------------------------------------------------------- backend choice


class SplitKAutotune(triton_splitk.FwOp):
    """triton_splitk with its kernel configuration autotuned (tree_attention's `autotune=True`)."""

    AUTOTUNE = True


def use_triton_splitk_for_prefix(B: int, G: int, tree_size: int) -> bool:
    """Whether Triton split-K beats FlashAttention on the prefix (tree queries over a long cache): measured
    upstream for little batch × group parallelism and small trees, where splitting the keys fills the GPU."""
    return (B * G <= 128 and tree_size <= 64) or (B * G < 4 and tree_size < 100) or B * G < 2


def _usable(op: type[AttentionFwOpBase], attn_bias) -> type[AttentionFwOpBase] | None:
    """op if it exists in this build and takes this bias, else None (the dispatcher then chooses)."""
    return op if op.is_available() and bias_type(attn_bias) in op.SUPPORTED_ATTN_BIAS_TYPES else None


def select_prefix_op(
    B: int, G: int, tree_size: int, autotune: bool, attn_bias: AttentionBias, kv_cache_dtype: torch.dtype
) -> type[AttentionFwOpBase] | None:
    """The backend for the prefix part of tree attention, or None to let the dispatcher choose: Triton split-K on
    ROCm, for masks FlashAttention does not take and for a quantized (uint8) cache; FlashAttention-3 from a batch
    of 64 when it is on; Triton split-K where use_triton_splitk_for_prefix says. An op missing from this build or
    not taking the mask gives None."""
    splitk = SplitKAutotune if autotune else triton_splitk.FwOp
    mask = bias_type(attn_bias)
    fa3_splitkv_mask = mask in flash3.FwOp_KVSplit.SUPPORTED_ATTN_BIAS_TYPES
    flash_mask = fa3_splitkv_mask or mask in flash3.FwOp.SUPPORTED_ATTN_BIAS_TYPES
    flash_mask = flash_mask or mask in flash.FwOp.SUPPORTED_ATTN_BIAS_TYPES
    if rocm_build() or not flash_mask or kv_cache_dtype == torch.uint8:
        choice = splitk
    elif B >= 64 and _get_use_fa3() and fa3_available():
        choice = flash3.FwOp_KVSplit if fa3_splitkv_mask else flash3.FwOp
    elif use_triton_splitk_for_prefix(B, G, tree_size):
        choice = splitk
    else:
        return None
    return _usable(choice, attn_bias)


def _fitting(op: type[AttentionFwOpBase] | None, inp: Inputs) -> type[AttentionFwOpBase] | None:
    """A default op, kept only where it takes these inputs (else None: the dispatcher chooses)."""
    return op if op is not None and op.supports(inp) else None


# ---------------------------------------------------------------------------------------- tree attention


def tree_attention(
    q: torch.Tensor,
    spec_k: torch.Tensor,
    spec_v: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    spec_attn_bias: torch.Tensor,
    prefix_attn_bias: AttentionBias,
    prefix_op: type[AttentionFwOpBase] | None = None,
    suffix_op: type[AttentionFwOpBase] | None = None,
    autotune: bool = False,
    quantized_kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    q_fp8: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the tree's queries over the cache and their ancestors in the tree (see the module docstring).

    q [B, tree_q, (G,) H, D]: the queries of the last tree_q nodes (tree_q < tree_kv when nodes are added to a
        tree whose first nodes were attended before, as EAGLE's drafting does: aligned bottom-right).
    spec_k, spec_v [B, tree_kv, (G,) H, D]: the keys and values of the tree's nodes.
    cache_k, cache_v [B, Mk, (G,) H, D], or [1, pool rows, (G,) H, D] under a paged mask: the KV cache. Upstream
        also takes a uint8 cache (row-wise FP8 with `quantized_kv_scales`, on triton_splitk) and FP8 ones (with the
        query as `q_fp8`, on FlashAttention-3's KV split): neither kernel ships here, so those raise.
    spec_attn_bias [tree_q, tree_kv]: additive tree mask, e.g. TreeAttnMetadata.attention_bias[-tree_q:].
    prefix_attn_bias: the cache's varlen mask over B blocks of tree_q queries (BlockDiagonalPaddedKeysMask and
        its paged and gappy kin), updated in place as the cache grows.
    prefix_op, suffix_op: backends to pin; by default select_prefix_op's choice and Triton split-K (`autotune`:
        SplitKAutotune), each where it exists and takes the inputs, else the dispatcher's.
    Returns [B, tree_q, (G,) H, D] in q's dtype.
    """
    if cache_k.dtype in (torch.uint8, torch.float8_e4m3fn) or q_fp8 is not None or quantized_kv_scales is not None:
        raise NotImplementedError(
            "tree_attention: quantized KV caches (uint8 row-wise FP8 with quantized_kv_scales, or FP8 with q_fp8) "
            "need triton_splitk's or FlashAttention-3's KV-split kernels, which this release does not ship"
        )
    _check_tree_attention_inputs(q, spec_k, spec_v, cache_k, cache_v, spec_attn_bias, prefix_attn_bias)
    B, tree_q, *heads, D = q.shape
    splitk = SplitKAutotune if autotune else triton_splitk.FwOp
    # The prefix runs on the batch packed into one varlen sequence, as its mask describes.
    q_packed = q.reshape(1, B * tree_q, *heads, D)
    # (a copy where the cache's lanes are not back to back: a slice [:, :Mk] of a larger buffer)
    cache_k_packed, cache_v_packed = (c.reshape(1, -1, *c.shape[2:]) for c in (cache_k, cache_v))
    inputs = Inputs(q_packed, cache_k_packed, cache_v_packed, prefix_attn_bias, is_partial=True)
    groups = heads[0] if len(heads) == 2 else 1
    default = select_prefix_op(B, groups, spec_k.shape[1], autotune, prefix_attn_bias, cache_k.dtype)
    prefix_op = prefix_op or _fitting(default, inputs)
    out_prefix, lse_prefix = fmha.memory_efficient_attention_partial(
        q_packed, cache_k_packed, cache_v_packed, prefix_attn_bias, op=prefix_op
    )

    spec_bias = spec_attn_bias.expand(B, *heads, tree_q, spec_k.shape[1])
    suffix_op = suffix_op or _fitting(splitk, Inputs(q, spec_k, spec_v, spec_bias))
    out_suffix, lse_suffix = fmha.memory_efficient_attention_partial(q, spec_k, spec_v, spec_bias, op=suffix_op)
    outs = [out_prefix.view(B, tree_q, *out_prefix.shape[2:]), out_suffix]
    lses = [_lse_per_sequence(lse_prefix, B, tree_q), lse_suffix]
    # The two backends may differ in dtypes (a partial output has q's dtype where output_dtype is not supported).
    out_dtype, lse_dtype = (torch.promote_types(*(t.dtype for t in ts)) for ts in (outs, lses))
    out, _ = merge_attentions(
        [t.to(out_dtype) for t in outs], [t.to(lse_dtype) for t in lses], write_lse=False, output_dtype=q.dtype
    )
    return out


def _lse_per_sequence(lse: torch.Tensor, B: int, tree_q: int) -> torch.Tensor:
    """[B, (G,) H, tree_q] from the LSE of the packed prefix: packed [1, (G,) H, B · tree_q], or padded
    [B, (G,) H, >= tree_q] (backends with VARLEN_LSE_PACKED false)."""
    if lse.shape[0] == 1:
        return lse[..., : B * tree_q].unflatten(-1, (B, tree_q)).squeeze(0).movedim(-2, 0)
    return lse[..., :tree_q]


def _check_tree_attention_inputs(q, spec_k, spec_v, cache_k, cache_v, spec_attn_bias, prefix_attn_bias) -> None:
    """ValueError for shapes or masks that do not describe one tree attention."""
    tensors = {"q": q, "spec_k": spec_k, "spec_v": spec_v, "cache_k": cache_k, "cache_v": cache_v}
    shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in tensors.items())
    if q.dim() not in (4, 5) or any(t.dim() != q.dim() for t in tensors.values()):
        raise ValueError(f"tree_attention: every input must be BMHK [B, M, H, D] or BMGHK [B, M, G, H, D]: {shapes}")
    B, tree_q, *heads, D = q.shape
    tree_kv = spec_k.shape[1]
    if spec_k.shape != (B, tree_kv, *heads, D) or spec_v.shape != spec_k.shape:
        raise ValueError(
            f"tree_attention: spec_k and spec_v must be [B, tree_kv, (G,) H, D] with q's batch, heads and head "
            f"dim: {shapes}"
        )
    if tree_q > tree_kv:
        raise ValueError(
            f"tree_attention: {tree_q} tree queries but {tree_kv} tree keys; the queries are the last tree_q of the "
            f"tree's nodes, so tree_q <= tree_kv"
        )
    if not isinstance(spec_attn_bias, torch.Tensor) or tuple(spec_attn_bias.shape) != (tree_q, tree_kv):
        got = tuple(spec_attn_bias.shape) if isinstance(spec_attn_bias, torch.Tensor) else type(spec_attn_bias)
        raise ValueError(
            f"tree_attention: spec_attn_bias must be a tensor [tree_q, tree_kv] = {[tree_q, tree_kv]}, got {got}"
        )
    paged = isinstance(prefix_attn_bias, (PagedBlockDiagonalPaddedKeysMask, PagedBlockDiagonalGappyKeysMask))
    if cache_k.shape != cache_v.shape or cache_k.shape[0] != (1 if paged else B) or cache_k.shape[2:] != q.shape[2:]:
        layout = "[1, pool rows, (G,) H, D] (paged mask)" if paged else "[B, Mk, (G,) H, D]"
        raise ValueError(
            f"tree_attention: cache_k and cache_v must be {layout}, alike, with q's heads and head dim: {shapes}"
        )
    starts = [b * tree_q for b in range(B + 1)]
    if not isinstance(prefix_attn_bias, VARLEN_BIASES) or prefix_attn_bias.q_seqinfo.seqstart_py != starts:
        got = type(prefix_attn_bias).__name__
        if isinstance(prefix_attn_bias, VARLEN_BIASES):
            got += f" with query blocks starting at {prefix_attn_bias.q_seqinfo.seqstart_py}"
        raise ValueError(
            f"tree_attention: prefix_attn_bias must be a varlen mask (e.g. BlockDiagonalPaddedKeysMask) of B={B} "
            f"query blocks of tree_q={tree_q} each, got {got}"
        )
    padding = getattr(prefix_attn_bias.k_seqinfo, "padding", None)
    if not paged and padding is not None and padding != cache_k.shape[1]:
        # The cache's lanes are packed back to back: lane b's keys start at row b · Mk, where the mask reads them.
        raise ValueError(
            f"tree_attention: prefix_attn_bias pads each lane's keys to {padding} rows, cache_k has Mk="
            f"{cache_k.shape[1]}: they must agree ({shapes})"
        )
