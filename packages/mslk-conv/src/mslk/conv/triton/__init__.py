"""Triton kernels of mslk.conv, imported by full path as in the reference library."""
