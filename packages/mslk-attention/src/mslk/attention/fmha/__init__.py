"""mslk.attention.fmha (spec §2-§4): the attention masks (`attn_bias`) so far; memory_efficient_attention and
its backends land here next."""

from mslk.attention.fmha import attn_bias
from mslk.attention.fmha.attn_bias import (
    AttentionBias,
    BlockDiagonalCausalFromBottomRightMask,
    BlockDiagonalCausalLocalAttentionFromBottomRightMask,
    BlockDiagonalCausalLocalAttentionMask,
    BlockDiagonalCausalLocalAttentionPaddedKeysMask,
    BlockDiagonalCausalMask,
    BlockDiagonalCausalWithOffsetGappyKeysMask,
    BlockDiagonalCausalWithOffsetPaddedKeysMask,
    BlockDiagonalGappyKeysMask,
    BlockDiagonalLocalAttentionFromBottomRightGappyKeysMask,
    BlockDiagonalLocalAttentionPaddedKeysMask,
    BlockDiagonalMask,
    BlockDiagonalPaddedKeysMask,
    LocalAttentionFromBottomRightMask,
    LowerTriangularFromBottomRightLocalAttentionMask,
    LowerTriangularFromBottomRightMask,
    LowerTriangularMask,
    LowerTriangularMaskWithTensorBias,
)

__all__ = [
    "AttentionBias",
    "BlockDiagonalCausalFromBottomRightMask",
    "BlockDiagonalCausalLocalAttentionFromBottomRightMask",
    "BlockDiagonalCausalLocalAttentionMask",
    "BlockDiagonalCausalLocalAttentionPaddedKeysMask",
    "BlockDiagonalCausalMask",
    "BlockDiagonalCausalWithOffsetGappyKeysMask",
    "BlockDiagonalCausalWithOffsetPaddedKeysMask",
    "BlockDiagonalGappyKeysMask",
    "BlockDiagonalLocalAttentionFromBottomRightGappyKeysMask",
    "BlockDiagonalLocalAttentionPaddedKeysMask",
    "BlockDiagonalMask",
    "BlockDiagonalPaddedKeysMask",
    "LocalAttentionFromBottomRightMask",
    "LowerTriangularFromBottomRightLocalAttentionMask",
    "LowerTriangularFromBottomRightMask",
    "LowerTriangularMask",
    "LowerTriangularMaskWithTensorBias",
    "attn_bias",
]
