"""mslk.conv: Convolution (spec §9): low-precision conv.

Importing this module registers the domain's `torch.ops` (`import mslk` does it for every installed domain).
"""
