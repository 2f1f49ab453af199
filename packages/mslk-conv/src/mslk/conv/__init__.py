"""mslk.conv: Convolution (spec §9): low-precision conv.

Importing this module registers the domain's `torch.ops` (`import mslk` does it for every installed domain).
"""

from mslk.conv import bench as _bench  # noqa: F401  (registers the bench specs)
from mslk.conv.triton import fp8_conv as _fp8_conv  # noqa: F401  (registers the ops)
from mslk.conv.triton.fp8_conv import f8f8bf16_conv

__all__ = ["f8f8bf16_conv"]
