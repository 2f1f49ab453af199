"""Whether the attention package's Triton kernels may run here (spec §4). The dispatcher leaves MSLK's own
(triton_flash) out of GPU calls when the environment switches them off (`switched_off`).

Read when asked (environment included), so that a test or a user can change the answer at run time; the device
answers are cached by `mslk.core.arch`.
"""

from __future__ import annotations

import sys

from mslk.core import arch, env, registry

# Upstream's switches, kept by name (xformers and its users set them).
FORCE_DISABLE_TRITON = env.EnvVar(
    "XFORMERS_FORCE_DISABLE_TRITON", "0", "1: the attention package's Triton kernels are not used."
)
ENABLE_TRITON = env.EnvVar(
    "XFORMERS_ENABLE_TRITON",
    "0",
    "1: the attention package's Triton kernels are used wherever Triton imports, whatever the platform, GPU or "
    "XFORMERS_FORCE_DISABLE_TRITON say.",
)

# Triton's kernels fail on many pre-Ampere GPUs (V100) with recent Triton versions.
MIN_CAPABILITY = (8, 0)


def switched_off() -> str | None:
    """Why the environment keeps the Triton kernels off (None: it does not)."""
    if FORCE_DISABLE_TRITON.enabled() and not ENABLE_TRITON.enabled():
        return "XFORMERS_FORCE_DISABLE_TRITON is set"
    return None


def triton_unavailable_reason() -> str | None:
    """None when the Triton kernels may run here, else why not."""
    missing = registry.triton_missing()
    if missing is not None:
        return missing
    if ENABLE_TRITON.enabled():
        return None
    if sys.platform == "win32":
        return "Triton kernels are not used on Windows (set XFORMERS_ENABLE_TRITON=1 to use them)"
    if switched_off():
        return switched_off()
    if not arch.has_gpu():
        return "no CUDA or ROCm device is visible to torch"
    capability = arch.capability()
    if capability < MIN_CAPABILITY:
        return f"the GPU's capability {capability} is below {MIN_CAPABILITY}"
    return None


def is_triton_available() -> bool:
    """False on Windows, without a GPU, on a GPU of capability below 8.0, with XFORMERS_FORCE_DISABLE_TRITON=1, or
    when Triton does not import; XFORMERS_ENABLE_TRITON=1 overrides all but the last."""
    return triton_unavailable_reason() is None
