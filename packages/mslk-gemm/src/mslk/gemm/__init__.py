"""mslk.gemm: GEMMs (spec §5): FP8 rowwise/tensorwise/blockwise/groupwise, grouped BF16/FP8, INT4/INT8 weight-only.

Importing this module registers the domain's `torch.ops` (`import mslk` does it for every installed domain).
"""

from mslk.gemm import bench as _bench  # noqa: F401  (registers the bench specs)
from mslk.gemm.triton import fp8_blockwise_gemm as _fp8_blockwise_gemm  # noqa: F401  (registers the ops)
from mslk.gemm.triton import fp8_gemm as _fp8_gemm  # noqa: F401  (registers the ops)
from mslk.gemm.triton import grouped_gemm as _grouped_gemm  # noqa: F401  (registers the ops)
