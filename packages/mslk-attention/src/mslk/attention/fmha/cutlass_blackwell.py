"""`cutlass_blackwell`: MSLK's native CUTLASS FMHA for Blackwell (SM100, `mslk::fmha_fwd/_bwd/_gen_fwd`, spec
A-24..A-28 and §2.3 rows `cutlassF-blackwell`, `cutlassF-blackwell-decode`, `cutlassB-blackwell`): bf16/f16,
head dims 64 or 128. Never auto-dispatched (pin it).

The native library is not part of this release: the operators exist with their attributes so that code pinning
them keeps importing, and report why they are not available.
"""

from __future__ import annotations

import torch

from mslk.attention.fmha.common import AttentionBwOpBase, AttentionFwOpBase, bias_types

NOT_BUILT_REASON = "needs MSLK's native Blackwell FMHA library (mslk.so), which this release does not ship"
_DTYPES = frozenset({torch.bfloat16, torch.float16})


class FwOp(AttentionFwOpBase):
    NAME = "cutlassF-blackwell"
    NOT_BUILT_REASON = NOT_BUILT_REASON
    SUPPORTED_DEVICES = frozenset({"cuda"})
    CUDA_MINIMUM_COMPUTE_CAPABILITY = (10, 0)
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MIN_K = 64  # 64 or 128
    SUPPORTED_MAX_K = 128
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B01 B03-B14 B18 B19")
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_BMGHK = True


class FwOpDecode(FwOp):
    """Decoding (split-K over the keys, at most 16 query heads per KV head), forward only."""

    NAME = "cutlassF-blackwell-decode"
    SUPPORTED_DTYPES = frozenset({torch.bfloat16})
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B12")


class BwOp(AttentionBwOpBase):
    NAME = "cutlassB-blackwell"
    NOT_BUILT_REASON = NOT_BUILT_REASON
    SUPPORTED_DEVICES = FwOp.SUPPORTED_DEVICES
    CUDA_MINIMUM_COMPUTE_CAPABILITY = FwOp.CUDA_MINIMUM_COMPUTE_CAPABILITY
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MIN_K = FwOp.SUPPORTED_MIN_K
    SUPPORTED_MAX_K = FwOp.SUPPORTED_MAX_K
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B01 B03-B10")
    SUPPORTS_CUSTOM_SCALE = True
