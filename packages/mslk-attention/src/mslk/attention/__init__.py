"""mslk.attention: fused attention (spec §2-§4).

memory_efficient_attention, the attn_bias masks, partial attention and merge.

Importing this module registers the domain's `torch.ops` (`import mslk` does it for every installed domain)
and its bench specs.
"""

from mslk.attention import bench as _bench  # noqa: F401  (registers the bench specs)
from mslk.attention import fmha, mla  # noqa: F401  (registers the domain's ops)
