"""Every MSLK_* environment variable, with its meaning. `mslk env` prints the effective values.

Variables are read when used (not cached at import), so a test or a user can change them at run time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    doc: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)

    def is_set(self) -> bool:
        return self.name in os.environ

    def enabled(self) -> bool:
        return self.get().strip().lower() in ("1", "true", "yes", "on")


VARIABLES: dict[str, EnvVar] = {}


def declare(name: str, default: str, doc: str) -> EnvVar:
    """Declare a variable. Domains declare theirs at import, so `mslk env` lists them too."""
    if not name.startswith("MSLK_"):
        raise ValueError(f"MSLK environment variables start with MSLK_, got {name!r}")
    known = VARIABLES.get(name)
    if known is not None:
        if known != EnvVar(name, default, doc):
            raise ValueError(f"{name} is declared twice with different defaults or docs")
        return known
    VARIABLES[name] = var = EnvVar(name, default, doc)
    return var


BACKEND = declare(
    "MSLK_BACKEND",
    "",
    "Pin backends: a comma-separated list of `op=backend` (op as `mslk::name` or `name`) or of a bare "
    "`backend` that applies to every op that has a backend of that name. A pinned backend that cannot "
    "serve the inputs raises ValueError instead of falling back.",
)
LOG_DISPATCH = declare(
    "MSLK_LOG_DISPATCH",
    "0",
    "1: log (logger `mslk.dispatch`, level INFO) which backend each op call picks.",
)
PYTHON_ONLY = declare(
    "MSLK_PYTHON_ONLY",
    "0",
    "1: load no native library (mslk-gemm's cuBLAS GEMMs): Triton kernels and PyTorch only, as the reference "
    "library's python_only builds; read when the libraries load (at import).",
)
ROCM_FORCE_FP8FNUZ_TYPE = declare(
    "MSLK_ROCM_FORCE_FP8FNUZ_TYPE",
    "0",
    "1: use float8_e4m3fnuz on gfx950 too (default there: the OCP float8_e4m3fn).",
)


def effective() -> dict[str, tuple[str, bool]]:
    """name -> (value, set in the environment?) for every declared variable."""
    return {name: (var.get(), var.is_set()) for name, var in sorted(VARIABLES.items())}
