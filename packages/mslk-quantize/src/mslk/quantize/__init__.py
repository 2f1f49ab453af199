"""mslk.quantize: Quantizers (spec §6-§7): FP8 row/block/group/tensor, INT4, MXFP4, NVFP4, MXFP8 and their dequantizers.

Importing this module registers the domain's `torch.ops` (`import mslk` does it for every installed domain).
"""
