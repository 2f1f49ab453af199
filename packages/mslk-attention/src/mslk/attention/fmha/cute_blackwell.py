"""`cute_blackwell`: FlashAttention-4 CuTe-DSL kernels for Blackwell (SM100, `flash_attn.cute`, spec §2.3 rows
`cuteDSLF-blackwell`, `cuteDSLF-blackwell-decode`, `cuteDSLB-blackwell`): bf16/f16 (+FP8 e4m3 forward with
InputsFp8 / InputsMXFp8 scales), head dims 64, 96 or 128. Never auto-dispatched (pin it).

The CuTe DSL kernels are not part of this release: the operators exist with their attributes so that code
pinning them keeps importing, and report why they are not available.
"""

from __future__ import annotations

import torch

from mslk.attention.fmha.common import AttentionBwOpBase, AttentionFwOpBase, bias_types

NOT_BUILT_REASON = (
    "needs the CuTe DSL FlashAttention-4 kernels (nvidia-cutlass-dsl, flash_attn.cute), which this release does "
    "not ship"
)


class FwOp(AttentionFwOpBase):
    NAME = "cuteDSLF-blackwell"
    NOT_BUILT_REASON = NOT_BUILT_REASON
    SUPPORTED_DEVICES = frozenset({"cuda"})
    CUDA_MINIMUM_COMPUTE_CAPABILITY = (10, 0)
    SUPPORTED_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float8_e4m3fn})
    SUPPORTED_MIN_K = 64  # 64, 96 or 128
    SUPPORTED_MAX_K = 128
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B01 B03-B19")
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_BMGHK = True
    SUPPORTS_QUANTIZED_INPUTS = True


class FwOpDecode(FwOp):
    """Decoding: one query per sequence, at most 16 query heads per KV head."""

    NAME = "cuteDSLF-blackwell-decode"
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B11-B19 B21 B22")


class BwOp(AttentionBwOpBase):
    NAME = "cuteDSLB-blackwell"
    NOT_BUILT_REASON = NOT_BUILT_REASON
    SUPPORTED_DEVICES = FwOp.SUPPORTED_DEVICES
    CUDA_MINIMUM_COMPUTE_CAPABILITY = FwOp.CUDA_MINIMUM_COMPUTE_CAPABILITY
    SUPPORTED_DTYPES = frozenset({torch.bfloat16, torch.float16})
    SUPPORTED_MIN_K = FwOp.SUPPORTED_MIN_K
    SUPPORTED_MAX_K = FwOp.SUPPORTED_MAX_K
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None B01 B03-B10")
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_BMGHK = True
