"""mslk.gemm: GEMMs (spec §5): FP8 rowwise/tensorwise/blockwise/groupwise, grouped BF16/FP8, INT4/INT8 weight-only.

Importing this module registers the domain's `torch.ops` (`import mslk` does it for every installed domain).
"""
