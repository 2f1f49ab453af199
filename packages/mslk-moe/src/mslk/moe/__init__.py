"""mslk.moe: MoE (spec §8): routing (index_shuffling), gather/scatter, SwiGLU, shuffling and the MoE layers.

Importing this module registers the domain's `torch.ops` (`import mslk` does it for every installed domain).
"""
