"""Triton kernels of mslk.quantize, imported by full path as in the reference library
(`from mslk.quantize.triton.fp8_quantize import quantize_fp8_row`)."""
