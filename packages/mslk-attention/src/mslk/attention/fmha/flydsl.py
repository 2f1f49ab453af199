"""`flydsl`: FlyDSL flash attention for ROCm (`mslk.attention.flydsl`, spec §2.6 and §2.3 rows `flydslF` /
`flydslB`): f16/bf16, head dim <= 256, dense tensor bias in q's dtype, dropout (dense only).

FlyDSL is not part of this release: the operators exist with their attributes so that code pinning them keeps
importing, and report why they are not available.
"""

from __future__ import annotations

import torch

from mslk.attention.fmha.common import AttentionBwOpBase, AttentionFwOpBase, bias_types

NOT_BUILT_REASON = "needs ROCm and FlyDSL (pip flydsl), which this release does not use yet"
_DTYPES = frozenset({torch.float16, torch.bfloat16})


class FwOp(AttentionFwOpBase):
    NAME = "flydslF"
    NOT_BUILT_REASON = NOT_BUILT_REASON
    SUPPORTED_DEVICES = frozenset({"cuda"})  # ROCm GPUs are torch "cuda" devices
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MIN_K = 1
    SUPPORTED_MAX_K = 256
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None T B01 B02 B03 B04 B06-B12 B15 B16 B18 B19 B21")
    SUPPORTS_DROPOUT = True
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_BMGHK = True


class BwOp(AttentionBwOpBase):
    NAME = "flydslB"
    NOT_BUILT_REASON = NOT_BUILT_REASON
    SUPPORTED_DEVICES = FwOp.SUPPORTED_DEVICES
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MIN_K = 32  # multiples of 32
    SUPPORTED_MAX_K = 256
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B01 B06 B07")
    SUPPORTS_CUSTOM_SCALE = True
    IS_DETERMINISTIC = False
