"""NVFP4 at the reference library's module path (spec Q-13): `quantize_nvfp4` is triton_quantize_nvfp4."""

from mslk.quantize.triton.fp4_quantize import triton_quantize_nvfp4 as quantize_nvfp4

__all__ = ["quantize_nvfp4"]
