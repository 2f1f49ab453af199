"""Where the CUDA 13 headers and cuBLAS libraries are that the native library builds against and loads.

Looked up, in this order, in: the `nvidia/cu13` folder of the NVIDIA CUDA wheels on sys.path (nvidia-cublas,
nvidia-cuda-runtime, nvidia-cuda-crt, nvidia-cuda-cccl from the registry; a CUDA build of torch brings the first
two), then $CUDA_HOME, $CUDA_PATH, the toolkit of the nvcc on PATH and /usr/local/cuda. Each header comes from the
first place that has it.

Standard library only: CMakeLists.txt runs this file as a script in the build environment (where mslk is not
importable), `python -m mslk.gemm.native.build` imports it, and the loader uses `library_dirs`.

    python toolkit.py --cmake FILE    writes FILE setting MSLK_CUDA_INCLUDE_DIRS, MSLK_CUDA_LIBRARIES and
                                      MSLK_CUDA_MISSING (empty when everything was found)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

# A header that each piece of the toolkit provides, with the wheel that ships it. cublasLt.h includes the
# others' headers: driver_types.h (runtime), crt/host_defines.h (crt) and, via cuda_fp16.h, nv/target (CCCL).
HEADERS = {
    "cublasLt.h": "nvidia-cublas",
    "cuda_runtime_api.h": "nvidia-cuda-runtime",
    "crt/host_defines.h": "nvidia-cuda-crt",
    "nv/target": "nvidia-cuda-cccl",
}
# The libraries the native library links against, by soname (CUDA 13: any 13.x minor works).
LIBRARIES = ("libcublasLt.so.13", "libcublas.so.13")


def roots() -> list[Path]:
    """Toolkit folders (each with include/ and lib/ or lib64/), in search order."""
    found = [Path(entry) / "nvidia" / "cu13" for entry in sys.path if entry]
    found += [Path(os.environ[var]) for var in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(var)]
    nvcc = shutil.which("nvcc")
    if nvcc is not None and (Path(nvcc).resolve().parent.parent / "include" / "cuda_runtime_api.h").is_file():
        found.append(Path(nvcc).resolve().parent.parent)  # the toolkit of the nvcc on PATH (not a wrapper's)
    found.append(Path("/usr/local/cuda"))
    unique = dict.fromkeys(root.resolve() for root in found if root.is_dir())
    return list(unique)


def _include_candidates(root: Path) -> list[Path]:
    # CUDA 13 toolkits keep CCCL (nv/target) in include/cccl; the cccl wheel has it in include/ as well.
    return [root / "include", root / "include" / "cccl"]


def _lib_candidates(root: Path) -> list[Path]:
    targets = [root / "targets" / f"{machine}-linux" / "lib" for machine in ("x86_64", "sbsa")]
    return [root / "lib", root / "lib64", *targets]


def find() -> tuple[list[Path], list[Path], list[str]]:
    """(include dirs, library paths, what is missing: one line per header or library not found)."""
    search = roots()
    includes: dict[Path, None] = {}
    missing = []
    for header, package in HEADERS.items():
        where = next((d for r in search for d in _include_candidates(r) if (d / header).is_file()), None)
        if where is None:
            missing.append(f"{header} (pip install {package}, or set CUDA_HOME to a CUDA 13 toolkit)")
        else:
            includes[where] = None
    libraries = []
    for name in LIBRARIES:
        path = next((d / name for d in library_dirs(search) if (d / name).is_file()), None)
        if path is None:
            missing.append(f"{name} (pip install nvidia-cublas, or set CUDA_HOME to a CUDA 13 toolkit)")
        else:
            libraries.append(path)
    return list(includes), libraries, missing


def library_dirs(search: list[Path] | None = None) -> list[Path]:
    """Folders that hold cuBLAS libraries, in search order."""
    return [d for r in (roots() if search is None else search) for d in _lib_candidates(r) if d.is_dir()]


def describe_missing(missing: list[str]) -> str:
    return f"CUDA 13 pieces not found in {', '.join(map(str, roots())) or 'any toolkit folder'}: " + "; ".join(missing)


def _cmake_string(text: str) -> str:
    return text.replace("\\", "/").replace('"', "'").replace("$", "\\$")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cmake", required=True, help="write the CMake variables to this file")
    args = parser.parse_args(argv)
    includes, libraries, missing = find()
    Path(args.cmake).write_text(
        f'set(MSLK_CUDA_INCLUDE_DIRS "{";".join(_cmake_string(str(d)) for d in includes)}")\n'
        f'set(MSLK_CUDA_LIBRARIES "{";".join(_cmake_string(str(p)) for p in libraries)}")\n'
        f'set(MSLK_CUDA_MISSING "{_cmake_string(describe_missing(missing)) if missing else ""}")\n'
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
