"""`ck_splitk`: AMD Composable-Kernel split-K decoding attention
(`xformers::efficient_attention_forward_decoder_splitk_ck`, spec A-31 and §2.3 row `ck_splitKF`, with fixed-split
variants `FwOp_S<n>`): f16/bf16/f32, head dim <= 256, the KV-cache mask B12. Pinned only.

MSLK's ROCm extension is not part of this release: the operators exist with their attributes so that code
pinning them keeps importing, and report why they are not available.
"""

from __future__ import annotations

import torch

from mslk.attention.fmha import ck
from mslk.attention.fmha.common import AttentionFwOpBase, bias_types


class FwOp(AttentionFwOpBase):
    NAME = "ck_splitKF"
    NOT_BUILT_REASON = ck.NOT_BUILT_REASON
    SUPPORTED_DEVICES = frozenset({"cuda"})
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
    SUPPORTED_MAX_K = 256
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B12")
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_BMGHK = True
    SPLIT_K: int | None = None  # None: a heuristic chooses


def _fixed_split(split_k: int) -> type[FwOp]:
    return type(
        f"FwOp_S{split_k}", (FwOp,), {"NAME": f"{FwOp.NAME}_S{split_k}", "SPLIT_K": split_k, "__module__": __name__}
    )


FwOp_S1 = _fixed_split(1)
FwOp_S2 = _fixed_split(2)
FwOp_S4 = _fixed_split(4)
FwOp_S8 = _fixed_split(8)
FwOp_S16 = _fixed_split(16)
FwOp_S32 = _fixed_split(32)
FwOp_S64 = _fixed_split(64)
FwOp_S128 = _fixed_split(128)
