"""Triton support of the attention kernels: `available` says whether they may run here; `vararg_kernel` rewrites
kernels written over arrays of arguments for N of them."""
