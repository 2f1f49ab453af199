"""Triton support of the attention kernels: `available` says whether they may run here."""
