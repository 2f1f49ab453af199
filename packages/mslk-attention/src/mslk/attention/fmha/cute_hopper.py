"""`cute_hopper`: FlashAttention-4 CuTe-DSL kernels for Hopper (SM90, spec §2.3 rows `cuteDSLF-hopper` /
`cuteDSLB-hopper`): bf16/f16, head dims 64 or 128. Never auto-dispatched (pin it).

The CuTe DSL kernels are not part of this release: the operators exist with their attributes so that code
pinning them keeps importing, and report why they are not available.
"""

from __future__ import annotations

import torch

from mslk.attention.fmha import cute_blackwell
from mslk.attention.fmha.common import AttentionBwOpBase, AttentionFwOpBase, bias_types

_DTYPES = frozenset({torch.bfloat16, torch.float16})


class FwOp(AttentionFwOpBase):
    NAME = "cuteDSLF-hopper"
    NOT_BUILT_REASON = cute_blackwell.NOT_BUILT_REASON
    SUPPORTED_DEVICES = frozenset({"cuda"})
    CUDA_MINIMUM_COMPUTE_CAPABILITY = (9, 0)
    CUDA_MAXIMUM_COMPUTE_CAPABILITY = (9, 9)
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MIN_K = 64  # 64 or 128
    SUPPORTED_MAX_K = 128
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B01 B03-B14 B18 B19")
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_BMGHK = True


class BwOp(AttentionBwOpBase):
    NAME = "cuteDSLB-hopper"
    NOT_BUILT_REASON = cute_blackwell.NOT_BUILT_REASON
    SUPPORTED_DEVICES = FwOp.SUPPORTED_DEVICES
    CUDA_MINIMUM_COMPUTE_CAPABILITY = FwOp.CUDA_MINIMUM_COMPUTE_CAPABILITY
    CUDA_MAXIMUM_COMPUTE_CAPABILITY = FwOp.CUDA_MAXIMUM_COMPUTE_CAPABILITY
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MIN_K = FwOp.SUPPORTED_MIN_K
    SUPPORTED_MAX_K = FwOp.SUPPORTED_MAX_K
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B01 B03-B10")  # top-left causal needs Mq >= Mkv
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_BMGHK = True
