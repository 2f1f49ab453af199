"""The attention reference against torch's scaled_dot_product_attention and per-sequence attention."""

import math

import pytest
import torch
import torch.nn.functional as F

from mslk.attention.fmha import attn_bias as ab
from mslk.attention.fmha.reference import attention_reference
from mslk.core import testing


def sdpa(q, k, v, **kwargs):
    """torch's attention on BMHK tensors, in float64."""
    out = F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), **kwargs)
    return out.transpose(1, 2)


@pytest.mark.parametrize("kv", [64, 48], ids=lambda d: f"Kv={d}")
def test_matches_sdpa_with_and_without_masks(kv):
    q = testing.randn(2, 9, 3, 64)
    k = testing.randn(2, 9, 3, 64)
    v = testing.randn(2, 9, 3, kv)
    out, lse = attention_reference(q, k, v)
    testing.assert_rel_close(out, sdpa(q, k, v), 1e-6)
    assert lse.shape == (2, 3, 9)
    scores = torch.einsum("bmhk,bnhk->bhmn", q.double(), k.double()) / 8.0
    testing.assert_rel_close(lse, torch.logsumexp(scores, -1), 1e-6)
    out, _ = attention_reference(q, k, v, ab.LowerTriangularMask(), scale=0.3)
    testing.assert_rel_close(out, sdpa(q, k, v, is_causal=True, scale=0.3), 1e-6)
    bias = testing.randn(2, 3, 9, 9)
    out, _ = attention_reference(q, k, v, bias)
    testing.assert_rel_close(out, sdpa(q, k, v, attn_mask=bias.double()), 1e-6)


def test_block_diagonal_equals_attention_per_sequence():
    lens = [3, 5, 2]
    qs = [testing.randn(1, n, 2, 16) for n in lens]
    ks = [testing.randn(1, n + 1, 2, 16) for n in lens]
    mask, q, k, v = ab.BlockDiagonalMask.from_tensor_lists_qkv(qs, ks, ks)
    out, _ = attention_reference(q, k, v, mask.make_causal_from_bottomright())
    for part, qi, ki in zip(mask.split(out), qs, ks, strict=True):
        testing.assert_rel_close(
            part, attention_reference(qi, ki, ki, ab.LowerTriangularFromBottomRightMask())[0], 1e-6
        )


def test_grouped_query_layout_and_fully_masked_rows():
    q = testing.randn(1, 4, 2, 3, 8)  # BMGHK, 2 groups of 3 heads
    k = testing.randn(1, 6, 2, 1, 8).expand(1, 6, 2, 3, 8)  # one K/V head per group, stride 0
    out, lse = attention_reference(q, k, k)
    assert out.shape == (1, 4, 2, 3, 8) and lse.shape == (1, 2, 3, 4)
    testing.assert_rel_close(out[:, :, 1, 2], attention_reference(q[:, :, 1, 2], k[:, :, 1, 0], k[:, :, 1, 0])[0], 1e-6)
    masked, lse = attention_reference(q[:, :, 0], k[:, :, 0], k[:, :, 0], ab.LocalAttentionFromBottomRightMask(0, 0))
    # Bottom-right diagonal with 4 queries and 6 keys: every query sees exactly key i + 2.
    testing.assert_rel_close(masked, k[:, 2:, 0], 1e-6)
    empty = ab.BlockDiagonalMask.from_seqlens([2, 2], [3, 0], device="cpu")
    out, lse = attention_reference(q[:, :, 0], k[:, :3, 0], k[:, :3, 0], empty)
    assert (out[:, 2:] == 0).all() and (lse[..., 2:] == -math.inf).all(), "queries with no key: zeros, lse −inf"


def test_layout_errors():
    with pytest.raises(ValueError, match="BMK, BMHK or BMGHK"):
        attention_reference(torch.ones(1, 2, 3), torch.ones(1, 2, 1, 3), torch.ones(1, 2, 1, 3))
