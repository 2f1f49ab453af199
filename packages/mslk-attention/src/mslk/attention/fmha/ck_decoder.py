"""`ck_decoder`: AMD Composable-Kernel decoding attention (`xformers::efficient_attention_forward_decoder_ck`,
spec A-31 and §2.3 row `ck_decoderF`): f16/bf16/f32, head dim <= 256, the KV-cache mask B12 with equal query
lengths. Pinned only (never auto-dispatched).

MSLK's ROCm extension is not part of this release: the operator exists with its attributes so that code pinning
it keeps importing, and reports why it is not available.
"""

from __future__ import annotations

import torch

from mslk.attention.fmha import ck
from mslk.attention.fmha.common import AttentionFwOpBase, bias_types


class FwOp(AttentionFwOpBase):
    NAME = "ck_decoderF"
    NOT_BUILT_REASON = ck.NOT_BUILT_REASON
    SUPPORTED_DEVICES = frozenset({"cuda"})
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
    SUPPORTED_MAX_K = 256
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B12")
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_BMGHK = True
