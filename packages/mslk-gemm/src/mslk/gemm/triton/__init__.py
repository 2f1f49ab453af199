"""Triton kernels of mslk.gemm, imported by full path as in the reference library."""
