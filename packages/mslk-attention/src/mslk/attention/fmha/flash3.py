"""`flash3`: FlashAttention-3 from the `flash-attn-3` pip package (`torch.ops.flash_attn_3.fwd/bwd`), spec §2.3
rows `fa3F@pip_pkg`, `fa3F_splitKV@pip_pkg`, `fa3B@pip_pkg`: SM80-SM90, f16/bf16 and FP8 e4m3 (ScaledTensor
descales), head dims 64, 128, 192 or 256 (K != Kv on SM90 only), every mask but a dense tensor.

MSLK does not wrap the package yet: the operators exist with their attributes so that code pinning them keeps
importing, and report why they are not available.
"""

from __future__ import annotations

import importlib.util

import torch

from mslk.attention.fmha.common import AttentionBwOpBase, AttentionFwOpBase, bias_types

_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float8_e4m3fn})


if importlib.util.find_spec("flash_attn_3") is None:
    NOT_BUILT_REASON = "flash_attn_3 is not installed (pip install flash-attn-3)"
else:
    NOT_BUILT_REASON = "MSLK's wrapper of flash_attn_3 is not part of this release yet"


class FwOp(AttentionFwOpBase):
    NAME = "fa3F@pip_pkg"
    NOT_BUILT_REASON = NOT_BUILT_REASON
    SUPPORTED_DEVICES = frozenset({"cuda"})
    CUDA_MINIMUM_COMPUTE_CAPABILITY = (8, 0)
    CUDA_MAXIMUM_COMPUTE_CAPABILITY = (9, 0)
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MIN_K = 64  # 64, 128, 192 or 256
    SUPPORTED_MAX_K = 256
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B01 B03-B22")
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_DIFFERENT_VALUE_EMBED = True  # on SM90
    SUPPORTS_BMGHK = True
    SUPPORTS_PARTIAL = True


class FwOp_KVSplit(FwOp):
    """The split-KV variant for queries of one length attending to longer keys (decoding, tree attention)."""

    NAME = "fa3F_splitKV@pip_pkg"
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B11 B12 B13 B14 B15 B16 B18 B19 B21 B22")


class BwOp(AttentionBwOpBase):
    NAME = "fa3B@pip_pkg"
    NOT_BUILT_REASON = NOT_BUILT_REASON
    SUPPORTED_DEVICES = FwOp.SUPPORTED_DEVICES
    CUDA_MINIMUM_COMPUTE_CAPABILITY = FwOp.CUDA_MINIMUM_COMPUTE_CAPABILITY
    CUDA_MAXIMUM_COMPUTE_CAPABILITY = FwOp.CUDA_MAXIMUM_COMPUTE_CAPABILITY
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16})
    SUPPORTED_MIN_K = FwOp.SUPPORTED_MIN_K
    SUPPORTED_MAX_K = FwOp.SUPPORTED_MAX_K
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B01 B03-B10")
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_DIFFERENT_VALUE_EMBED = True  # on SM90
