"""`flash_mtia`: FlashAttention-2 on Meta's MTIA accelerators (spec §2.3 rows `fa2F@<ver>-mtia` / `fa2B@<ver>-mtia`):
f16/bf16, head dim <= 256, dropout. Appended to the priority lists where the MTIA kernels are available.

The MTIA kernels are not part of this release: the operators exist with their attributes so that code pinning
them keeps importing, and report why they are not available.
"""

from __future__ import annotations

import torch

from mslk.attention.fmha.common import AttentionBwOpBase, AttentionFwOpBase, bias_types
from mslk.attention.fmha.flash import FLASH_VERSION

NOT_BUILT_REASON = "needs the MTIA runtime's FlashAttention kernels, which this release does not ship"
_DTYPES = frozenset({torch.float16, torch.bfloat16})


class FwOp(AttentionFwOpBase):
    NAME = f"fa2F@{FLASH_VERSION}-mtia"
    NOT_BUILT_REASON = NOT_BUILT_REASON
    SUPPORTED_DEVICES = frozenset({"mtia"})
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MAX_K = 256
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B01 B03-B14 B18 B19")
    SUPPORTS_DROPOUT = True
    SUPPORTS_CUSTOM_SCALE = True


class BwOp(AttentionBwOpBase):
    NAME = f"fa2B@{FLASH_VERSION}-mtia"
    NOT_BUILT_REASON = NOT_BUILT_REASON
    SUPPORTED_DEVICES = FwOp.SUPPORTED_DEVICES
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MAX_K = 256
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B01 B03-B10")
    SUPPORTS_DROPOUT = True
    SUPPORTS_CUSTOM_SCALE = True
