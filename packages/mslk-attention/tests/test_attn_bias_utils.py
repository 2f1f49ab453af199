"""The fmha test helpers (spec A-14): create_attn_bias for every bias class, ref_attention(_bmhk) with and
without dropout, pack_kv_cache."""

import math

import pytest
import torch

from mslk.attention.fmha import attn_bias as ab
from mslk.attention.fmha.attn_bias_utils import (
    MASK_CLASSES,
    create_attn_bias,
    pack_kv_cache,
    ref_attention,
    ref_attention_bmhk,
)
from mslk.attention.fmha.reference import attention_reference
from mslk.core import launch, testing

PAGED = (ab.PagedBlockDiagonalPaddedKeysMask, ab.PagedBlockDiagonalGappyKeysMask)
BATCH, HEADS, GROUPS, Q_LEN, KV_LEN, PAGE = 3, 2, 2, 5, 11, 4


def inputs_for(bias, fmt):
    """q, k, v in fmt for the bias: packed sequences (B = 1) for the varlen masks, a page pool for the paged."""
    batch, mq, mk = BATCH, Q_LEN, KV_LEN
    if isinstance(bias, ab.VARLEN_BIASES):
        batch, mq, mk = 1, BATCH * Q_LEN, BATCH * KV_LEN
    if isinstance(bias, PAGED):
        mk = BATCH * launch.cdiv(KV_LEN, PAGE) * PAGE
    heads = {"BMK": (), "BMHK": (HEADS,), "BMGHK": (GROUPS, HEADS)}[fmt]
    return tuple(testing.randn(batch, m, *heads, 8) for m in (mq, mk, mk))


@pytest.mark.parametrize("fmt", ["BMHK", "BMGHK"])
@pytest.mark.parametrize("bias_type", [*MASK_CLASSES, torch.Tensor], ids=lambda c: c.__name__)
def test_create_attn_bias_every_type(bias_type, fmt):
    make = lambda: create_attn_bias(  # noqa: E731
        bias_type, BATCH, HEADS, GROUPS, Q_LEN, KV_LEN, "cpu", torch.float32, False, fmt, page_size=PAGE
    )
    bias = make()
    assert type(bias) is bias_type
    q, k, v = inputs_for(bias, fmt)
    out, lse = attention_reference(q, k, v, bias)
    assert lse.isfinite().all(), "every query sees a key"
    again = make()  # lengths, windows and tables seeded by the arguments: the same mask twice
    if not isinstance(bias, (torch.Tensor, ab.LowerTriangularMaskWithTensorBias)):
        shape = (*lse.shape, k.shape[1])
        assert torch.equal(bias.materialize(shape), again.materialize(shape))
    testing.assert_rel_close(ref_attention(q, k, v, bias), out.float(), 1e-6)


@pytest.mark.parametrize("fmt", ["BMK", "BMHK", "BMGHK"])
def test_tensor_biases(fmt):
    bias = create_attn_bias(torch.Tensor, BATCH, HEADS, GROUPS, Q_LEN, KV_LEN, "cpu", torch.float16, True, fmt)
    heads = {"BMK": (), "BMHK": (HEADS,), "BMGHK": (GROUPS, HEADS)}[fmt]
    batch = BATCH * HEADS if fmt == "BMK" else BATCH
    assert bias.shape == (batch, *heads, Q_LEN, KV_LEN) and bias.dtype == torch.float16 and bias.requires_grad
    assert bias.stride(-2) % 8 == 0, "rows 8-element aligned"
    first = bias[(0,) * (bias.dim() - 2)]
    assert (first[: Q_LEN - 1, : KV_LEN - 1] == -math.inf).all() and first[:, -1].isfinite().all()
    with_mask = create_attn_bias(ab.LowerTriangularMaskWithTensorBias, BATCH, HEADS, GROUPS, Q_LEN, KV_LEN, "cpu",
                                 torch.float32, True, fmt)  # fmt: skip
    assert with_mask._bias.shape == bias.shape and with_mask._bias.requires_grad
    assert create_attn_bias(None, BATCH, HEADS, GROUPS, Q_LEN, KV_LEN, "cpu", torch.float32, False, fmt) is None


def test_create_attn_bias_errors():
    args = (BATCH, HEADS, GROUPS, Q_LEN, KV_LEN, "cpu", torch.float32, False)
    with pytest.raises(ValueError, match="packed sequences"):
        create_attn_bias(ab.BlockDiagonalMask, *args, "BMK")
    with pytest.raises(ValueError, match="page_size"):
        create_attn_bias(ab.PagedBlockDiagonalPaddedKeysMask, *args, "BMHK")
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        create_attn_bias(
            ab.BlockDiagonalPaddedKeysMask, BATCH, HEADS, GROUPS, 7, 3, "cpu", torch.float32, False, "BMHK"
        )


@pytest.mark.parametrize("fmt", ["BMK", "BMHK", "BMGHK"])
def test_ref_attention_with_dropout_mask(fmt):
    heads = {"BMK": (), "BMHK": (HEADS,), "BMGHK": (GROUPS, HEADS)}[fmt]
    q, k, v = (testing.randn(2, m, *heads, 8, dtype=torch.bfloat16) for m in (4, 6, 6))
    out = ref_attention(q, k, v, ab.LowerTriangularFromBottomRightMask())
    assert out.dtype == torch.float32
    testing.assert_rel_close(
        out, attention_reference(q.float(), k.float(), v.float(), ab.LowerTriangularFromBottomRightMask())[0]
    )
    keep = torch.rand(2, *heads, 4, 6) > 0.3
    dropped = ref_attention(q, k, v, None, keep, p=0.3, scale=0.5)
    # The same from the formula: softmax(0.5 · Q·Kᵀ) · keep / 0.7 · V, heads first.
    qh, kh, vh = (t.double().movedim(1, -2) if t.dim() > 3 else t.double() for t in (q, k, v))
    expected = (torch.softmax(qh @ kh.transpose(-1, -2) * 0.5, -1) * keep / 0.7) @ vh
    testing.assert_rel_close(dropped, expected.movedim(-2, 1) if q.dim() > 3 else expected, 1e-6)
    if fmt == "BMHK":
        testing.assert_rel_close(ref_attention_bmhk(q, k, v, None, scale=0.5), ref_attention(q, k, v, scale=0.5), 0)
    else:
        with pytest.raises(ValueError, match="BMHK"):
            ref_attention_bmhk(q, k, v, None)


def test_pack_kv_cache_pages_and_attention():
    lengths, block = [10, 3, 0, 8], 4
    cache_k, cache_v = testing.randn(4, 10, 1, 8), testing.randn(4, 10, 1, 8)
    tables, k_pool, v_pool = pack_kv_cache(cache_k, cache_v, lengths, block)
    assert tables.dtype == torch.int32 and tables.shape == (4, 3)
    assert k_pool.shape == v_pool.shape == (1, (3 + 1 + 0 + 2) * block, 1, 8)
    assert int(tables.max()) < k_pool.shape[1] // block, "every entry is a page of the pool"
    for b, n in enumerate(lengths):
        rows = (tables[b].long()[:, None] * block + torch.arange(block)).flatten()[:n]
        assert torch.equal(k_pool[0, rows], cache_k[b, :n]) and torch.equal(v_pool[0, rows], cache_v[b, :n])
    # The paged mask over the pool gives the attention over each cache's first keys.
    q = testing.randn(1, 4, 1, 8)
    mask = ab.PagedBlockDiagonalPaddedKeysMask.from_seqlens([1] * 4, lengths, tables, block, device="cpu")
    out, _ = attention_reference(q, k_pool, v_pool, mask)
    for b, n in enumerate(lengths):
        expected = attention_reference(q[:, b : b + 1], cache_k[b : b + 1, :n], cache_v[b : b + 1, :n])[0]
        testing.assert_rel_close(out[:, b : b + 1], expected, 1e-6)
