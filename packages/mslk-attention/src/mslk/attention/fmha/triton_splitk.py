"""`triton_splitk`: MSLK's Triton split-K attention forward for decoding (spec §2.3 row `triton_splitKF`, §7.7):
the keys are split into chunks attended in parallel, then merged. q f16/bf16/FP8, K/V possibly int32-packed
int4 or FP8 rows, head dims 16-512 (powers of two), padded / gappy / paged varlen masks and a dense tensor bias,
output in any dtype (partial attention), SM80+ or ROCm.

The kernel is not part of this release yet: the operators exist with their attributes so that code pinning them
(`FwOp`, `FwOp_S<n>`, `FwOp.get_operator(...)`) keeps importing, and report why they are not available.
"""

from __future__ import annotations

import functools

import torch

from mslk.attention.fmha.common import AttentionFwOpBase, bias_types


class FwOp(AttentionFwOpBase):
    NAME = "triton_splitKF"
    NOT_BUILT_REASON = "Triton split-K kernel is not built into this release yet"
    SUPPORTED_DEVICES = frozenset({"cuda"})
    CUDA_MINIMUM_COMPUTE_CAPABILITY = (8, 0)
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float8_e4m3fn})
    SUPPORTED_MIN_K = 16  # 16, 32, 64, 128, 256 or 512
    SUPPORTED_MAX_K = 512
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None T B11 B12 B13 B14 B15 B16 B18 B19 B21 B22")
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_BMGHK = True
    SUPPORTS_PARTIAL = True
    SUPPORTS_OUTPUT_DTYPE = True
    SUPPORTS_QUANTIZED_INPUTS = True
    # Kernel configuration: None lets the heuristics (or autotuning) choose.
    SPLIT_K: int | None = None
    BLOCK_M: int | None = None
    BLOCK_N: int | None = None
    NUM_WARPS: int | None = None
    NUM_STAGES: int | None = None
    SPLIT_K_EARLY_EXIT: bool | None = None
    AUTOTUNE: bool = False

    @classmethod
    @functools.cache
    def get_operator(
        cls,
        splitk: int,
        *,
        block_m: int | None = None,
        block_n: int | None = None,
        num_warps: int | None = None,
        num_stages: int | None = None,
        split_k_early_exit: bool | None = None,
    ) -> type[FwOp]:
        """This operator with a fixed configuration (one class per configuration)."""
        config = {
            "NAME": f"{cls.NAME}_S{splitk}",
            "SPLIT_K": splitk,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "NUM_WARPS": num_warps,
            "NUM_STAGES": num_stages,
            "SPLIT_K_EARLY_EXIT": split_k_early_exit,
        }
        return type(f"FwOp_S{splitk}", (cls,), {**config, "__module__": __name__})


FwOp_S1 = FwOp.get_operator(1)
FwOp_S2 = FwOp.get_operator(2)
FwOp_S4 = FwOp.get_operator(4)
FwOp_S8 = FwOp.get_operator(8)
FwOp_S16 = FwOp.get_operator(16)
FwOp_S32 = FwOp.get_operator(32)
FwOp_S48 = FwOp.get_operator(48)
FwOp_S64 = FwOp.get_operator(64)
FwOp_S72 = FwOp.get_operator(72)
FwOp_S80 = FwOp.get_operator(80)
FwOp_S96 = FwOp.get_operator(96)
FwOp_S112 = FwOp.get_operator(112)
FwOp_S128 = FwOp.get_operator(128)
