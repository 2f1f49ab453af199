"""mslk.gemm: GEMMs (spec §5): FP8 rowwise/tensorwise/blockwise/groupwise, grouped BF16/FP8, INT4/INT8 weight-only.

Importing this module registers the domain's `torch.ops` (`import mslk` does it for every installed domain).
"""

from mslk.gemm import bench as _bench  # noqa: F401  (registers the bench specs)
from mslk.gemm.native import bf16x9_gemm as _bf16x9_cublas  # noqa: F401  (adds the cuBLAS backend)
from mslk.gemm.native import fp8_gemm as _fp8_cublas  # noqa: F401  (registers f8f8bf16_cublas)
from mslk.gemm.native import int8_gemm as _int8_cublas  # noqa: F401  (adds the cuBLAS backends)
from mslk.gemm.triton import bf16x9_gemm as _bf16x9_gemm  # noqa: F401  (registers the ops)
from mslk.gemm.triton import fp8_blockwise_gemm as _fp8_blockwise_gemm  # noqa: F401  (registers the ops)
from mslk.gemm.triton import fp8_gemm as _fp8_gemm  # noqa: F401  (registers the ops)
from mslk.gemm.triton import grouped_gemm as _grouped_gemm  # noqa: F401  (registers the ops)
from mslk.gemm.triton import grouped_gemm_forms as _grouped_gemm_forms  # noqa: F401  (registers the ops)
from mslk.gemm.triton import int4_gemm as _int4_gemm  # noqa: F401  (registers the ops)
from mslk.gemm.triton import int8_gemm as _int8_gemm  # noqa: F401  (registers the ops)
