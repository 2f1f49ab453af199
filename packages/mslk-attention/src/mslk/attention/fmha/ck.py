"""`ck`: AMD Composable-Kernel attention for ROCm (`xformers::efficient_attention_forward_ck` /
`_backward_ck`, spec A-29/A-30 and §2.3 rows `ckF` / `ckB`): f16/bf16, head dim <= 256, dense tensor bias
(with its gradient), dropout, K != Kv.

MSLK's ROCm extension is not part of this release: the operators exist with their attributes so that code
pinning them keeps importing, and report why they are not available.
"""

from __future__ import annotations

import torch

from mslk.attention.fmha.common import AttentionBwOpBase, AttentionFwOpBase, bias_types

NOT_BUILT_REASON = "needs ROCm and MSLK's CK extension (_C_hip), which this release does not ship"
_DTYPES = frozenset({torch.float16, torch.bfloat16})


class FwOp(AttentionFwOpBase):
    NAME = "ckF"
    NOT_BUILT_REASON = NOT_BUILT_REASON
    SUPPORTED_DEVICES = frozenset({"cuda"})  # ROCm GPUs are torch "cuda" devices
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MAX_K = 256
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None T B01 B02 B03 B04 B06-B12 B15 B16 B18 B19 B21")
    SUPPORTS_DROPOUT = True
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_DIFFERENT_VALUE_EMBED = True
    SUPPORTS_BMGHK = True
    SUPPORTS_PARTIAL = True


class BwOp(AttentionBwOpBase):
    NAME = "ckB"
    NOT_BUILT_REASON = NOT_BUILT_REASON
    SUPPORTED_DEVICES = FwOp.SUPPORTED_DEVICES
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MAX_K = 256
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None T B01 B03 B04 B06-B09")
    SUPPORTS_ATTN_BIAS_GRAD = True
    SUPPORTS_DROPOUT = True
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_DIFFERENT_VALUE_EMBED = True
