"""`mslk.testing.device` (spec U-02): the reference library's skip decorators, from mslk.core.testing."""

from mslk.core.testing import (
    skipUnlessCuda,
    skipUnlessCudaCapability,
    skipUnlessCudaVersion,
    skipUnlessGfxArch,
    skipUnlessRocm,
)

__all__ = ["skipUnlessCuda", "skipUnlessCudaCapability", "skipUnlessCudaVersion", "skipUnlessGfxArch", "skipUnlessRocm"]
