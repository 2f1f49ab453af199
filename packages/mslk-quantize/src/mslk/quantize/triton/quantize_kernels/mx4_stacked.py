"""Stacked MXFP4 at the reference library's module path (spec Q-12)."""

from mslk.quantize.triton.fp4_quantize import quantize_mx4_stacked

__all__ = ["quantize_mx4_stacked"]
