"""`mslk.utils.device` (spec U-01): the reference library's arch predicates, answered by mslk.core.arch."""

from __future__ import annotations

import torch

from mslk.core import arch
from mslk.core.arch import is_cuda, is_rocm

__all__ = [
    "compute_capability_at_least",
    "compute_capability_in",
    "cuda_version_at_least",
    "get_gfx_arch_name",
    "gfx_arch_in",
    "is_cuda",
    "is_gfx942",
    "is_gfx950",
    "is_rocm",
    "rocm_version_at_least",
    "supports_float8_fnuz",
]


def compute_capability_in(major_min: int, major_max: int | None = None) -> bool:
    """NVIDIA GPU whose major capability lies in [major_min, major_max] (no upper bound when None)."""
    return is_cuda() and major_min <= arch.capability()[0] <= (major_max if major_max is not None else 1 << 30)


def compute_capability_at_least(major_min: int, minor_min: int = 0) -> bool:
    return is_cuda() and arch.capability() >= (major_min, minor_min)


def cuda_version_at_least(major_min: int) -> bool:
    version = arch.cuda_version()
    return version is not None and version[0] >= major_min


def rocm_version_at_least(major_min: int, minor_min: int = 0) -> bool:
    version = arch.hip_version()
    return version is not None and version >= (major_min, minor_min)


def get_gfx_arch_name() -> str:
    """The ROCm GPU's gfx architecture ("gfx942"), "" without one (as upstream: `"gfx9" in ...` stays valid)."""
    return arch.gfx_arch() or ""


def gfx_arch_in(arch_list: list[str] | tuple[str, ...]) -> bool:
    return is_rocm() and arch.gfx_arch() in arch_list


def is_gfx942() -> bool:
    return gfx_arch_in(["gfx942"])


def is_gfx950() -> bool:
    return gfx_arch_in(["gfx950"])


def supports_float8_fnuz(throw_on_hip_incompatibility: bool = True) -> bool:
    """True where the platform FP8 is e4m3fnuz (gfx942). On a ROCm arch without FP8, raise or say False."""
    if not is_rocm():
        return False
    try:
        return arch.fp8_dtype() == torch.float8_e4m3fnuz
    except RuntimeError:
        if throw_on_hip_incompatibility:
            raise
        return False
