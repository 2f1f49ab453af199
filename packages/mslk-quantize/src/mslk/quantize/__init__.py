"""mslk.quantize: quantizers (spec §6-§7): FP8 row/block/group/tensor, INT8 row, INT4, MXFP4, NVFP4 (dense,
stacked, fake-quantized), MXFP6 and their dequantizers (MXFP8's `to_mxfp8` lives in mslk.gemm, as in the spec).

Importing this module registers the domain's `torch.ops` (`import mslk` does it for every installed domain).
As in the reference library, the functions are imported by full path
(`from mslk.quantize.triton.fp8_quantize import quantize_fp8_row`).
"""

from mslk.quantize import bench as _bench  # noqa: F401  (registers the bench specs)
from mslk.quantize import shuffle as _shuffle  # noqa: F401  (registers the ops)
from mslk.quantize.triton import fp4_quantize as _fp4_quantize  # noqa: F401
from mslk.quantize.triton import fp8_quantize as _fp8_quantize  # noqa: F401
from mslk.quantize.triton import int8_quantize as _int8_quantize  # noqa: F401
from mslk.quantize.triton import nvfp4_fake_quantize as _nvfp4_fake_quantize  # noqa: F401
