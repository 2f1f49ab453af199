"""Triton kernels of mslk.gemm and their helpers (`utils`, `matmul_perf_model`), imported by full path as in the
reference library."""
