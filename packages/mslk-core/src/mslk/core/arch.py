"""Every hardware question MSLK asks: vendor, compute capability, SM count, FP8 flavour.

Answers are cached per device. Nothing here runs at import time, so `import mslk` never initialises CUDA.
Code elsewhere in MSLK asks these functions, never `torch.cuda` directly, so that tests can mock one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from mslk.core import env

Vendor = Literal["nvidia", "amd", "none"]

# FP8 element type and its largest finite value per platform (spec §7.1). Dequantization scales are
# amax / FP8_MAX; quantizers floor amax at FP8_EPS.
FP8_EPS = 1e-12
_FP8_TRITON_TYPE = {torch.float8_e4m3fn: "float8e4nv", torch.float8_e4m3fnuz: "float8e4b8"}


@dataclass(frozen=True)
class DeviceInfo:
    """What MSLK needs to know about one GPU."""

    index: int
    vendor: Vendor
    name: str
    capability: tuple[int, int]
    sm_count: int
    gfx_arch: str | None  # ROCm only, e.g. "gfx942" (without the ":sramecc+:xnack-" feature suffix)
    shared_memory: int | None = None  # bytes of shared memory a block may use (opted in); None: not reported
    # What one SM holds of the blocks running on it (launch.programs_per_sm); None: not reported
    registers_per_sm: int | None = None
    shared_memory_per_sm: int | None = None
    threads_per_sm: int | None = None

    @classmethod
    def from_properties(cls, props: Any, *, index: int, hip: bool) -> DeviceInfo:
        """Build from `torch.cuda.get_device_properties(index)` (or a stand-in with the same attributes)."""
        gfx = getattr(props, "gcnArchName", None) if hip else None
        return cls(
            index=index,
            vendor="amd" if hip else "nvidia",
            name=props.name,
            capability=(props.major, props.minor),
            sm_count=props.multi_processor_count,
            gfx_arch=gfx.split(":")[0] if gfx else None,
            # ROCm builds of torch lack the opt-in figure; their per-block one is the LDS a block may use
            shared_memory=getattr(props, "shared_memory_per_block_optin", None)
            or getattr(props, "shared_memory_per_block", None),
            registers_per_sm=getattr(props, "regs_per_multiprocessor", None),
            shared_memory_per_sm=getattr(props, "shared_memory_per_multiprocessor", None),
            threads_per_sm=getattr(props, "max_threads_per_multi_processor", None),
        )

    def fp8_dtype(self) -> torch.dtype:
        """The FP8 (e4m3) flavour of this device: OCP e4m3fn on CUDA and gfx950, e4m3fnuz on gfx942."""
        if self.vendor == "nvidia":
            return torch.float8_e4m3fn
        if self.gfx_arch == "gfx942":
            return torch.float8_e4m3fnuz
        if self.gfx_arch == "gfx950":
            return torch.float8_e4m3fnuz if env.ROCM_FORCE_FP8FNUZ_TYPE.enabled() else torch.float8_e4m3fn
        raise RuntimeError(
            f"Unsupported GPU arch {self.gfx_arch} for FP8: MSLK's FP8 kernels need gfx942 or gfx950 on ROCm"
        )


# The answers, kept in dicts rather than by functools.cache: Dynamo traces through a cache's wrapper (with a warning)
# and would query the device again, while it reads a dict and guards on it, so compiled callers get the kept answer.
_gpu_visible: dict[str, bool] = {}
_device_infos: dict[int, DeviceInfo] = {}


def has_gpu() -> bool:
    """True when torch sees a CUDA or ROCm device (does not create a CUDA context)."""
    visible = _gpu_visible.get("any")
    if visible is None:
        visible = _gpu_visible["any"] = torch.cuda.is_available()
    return visible


def vendor() -> Vendor:
    if not has_gpu():
        return "none"
    return "amd" if torch.version.hip is not None else "nvidia"


def is_cuda() -> bool:
    return vendor() == "nvidia"


def is_rocm() -> bool:
    return vendor() == "amd"


def _index(device: torch.device | int | None) -> int:
    if isinstance(device, int):
        return device
    if device is not None:
        index = (device if isinstance(device, torch.device) else torch.device(device)).index
        if index is not None:
            return index
    return torch.cuda.current_device()


def _device_info(index: int) -> DeviceInfo:
    info = _device_infos.get(index)
    if info is None:
        props = torch.cuda.get_device_properties(index)
        info = _device_infos[index] = DeviceInfo.from_properties(props, index=index, hip=torch.version.hip is not None)
    return info


def device_info(device: torch.device | int | None = None) -> DeviceInfo:
    """The GPU `device` (default: the current one). Raises RuntimeError when there is no GPU."""
    if not has_gpu():
        raise RuntimeError("no CUDA or ROCm device is visible to torch (torch.cuda.is_available() is False)")
    return _device_info(_index(device))


def capability(device: torch.device | int | None = None) -> tuple[int, int]:
    return device_info(device).capability


def on_hopper(t: torch.Tensor) -> bool:
    """Whether tensor t is on an NVIDIA Hopper GPU (SM90), where MSLK's Gluon and TMA kernels run and their dispatch
    rules were measured; a CPU tensor asks no GPU. Asked of the tensor (`t.is_cuda`), not of a device, so that
    offline compiles of the Hopper kernels can stand in for a GPU by patching `is_cuda` (tools/tests)."""
    return t.is_cuda and is_cuda() and capability(t.device) == (9, 0)


def fp8_e4m3_missing(t: torch.Tensor) -> str | None:
    """Why MSLK's float8_e4m3fn kernels cannot run on the GPU holding tensor t (None: they can, or t is on no NVIDIA
    GPU): e4m3 conversions and products need compute capability 8.9 (Ada) or newer; below it Triton's compile fails
    inside the first launch ("type fp8e4nv not supported in this architecture") and cuBLAS has no FP8 GEMM. Asked
    of the tensor as `on_hopper` is."""
    if not (t.is_cuda and is_cuda()):
        return None
    major, minor = capability(t.device)
    if (major, minor) >= (8, 9):
        return None
    return (
        f"float8_e4m3fn needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
        f"{device_info(t.device).name} has {major}.{minor}"
    )


def sm_count(device: torch.device | int | None = None) -> int:
    return device_info(device).sm_count


def gfx_arch(device: torch.device | int | None = None) -> str | None:
    return device_info(device).gfx_arch if is_rocm() else None


def fp8_dtype(device: torch.device | int | None = None) -> torch.dtype:
    """The platform's FP8 e4m3 flavour; e4m3fn where there is no GPU (CPU reference paths)."""
    # Only ROCm has another flavour: CUDA builds answer without a device lookup (every GEMM call validates).
    if torch.version.hip is None or (isinstance(device, torch.device) and device.type == "cpu") or not has_gpu():
        return torch.float8_e4m3fn
    return device_info(device).fp8_dtype()


def fp8_max(device: torch.device | int | None = None) -> float:
    """Largest finite value of the platform FP8 flavour: 448 (e4m3fn) or 240 (e4m3fnuz)."""
    return torch.finfo(fp8_dtype(device)).max


def triton_fp8_type(dtype: torch.dtype):
    """The Triton element type for a torch FP8 dtype (`tl.float8e4nv` for e4m3fn, `tl.float8e4b8` fnuz)."""
    import triton.language as tl

    try:
        name = _FP8_TRITON_TYPE[dtype]
    except KeyError:
        raise ValueError(f"{dtype} is not an FP8 e4m3 dtype (expected one of {list(_FP8_TRITON_TYPE)})") from None
    return getattr(tl, name)


def cuda_version() -> tuple[int, int] | None:
    """CUDA version torch was built with, or None (ROCm or CPU build)."""
    if torch.version.cuda is None:
        return None
    major, minor = torch.version.cuda.split(".")[:2]
    return int(major), int(minor)


def hip_version() -> tuple[int, int] | None:
    if torch.version.hip is None:
        return None
    major, minor = torch.version.hip.split(".")[:2]
    return int(major), int(minor)


def clear_cache() -> None:
    """Forget cached answers (tests that mock devices call this)."""
    _gpu_visible.clear()
    _device_infos.clear()
