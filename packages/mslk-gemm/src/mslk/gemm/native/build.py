"""Build libmslk_gemm_cublas in place, beside these Python files, without CMake and without a package registry:

    python -m mslk.gemm.native.build [--cxx COMPILER]

for a source checkout run with PYTHONPATH=packages/*/src (as on the GPU machine). The library is host code that
calls cuBLAS, so a C++ compiler is all it takes, no nvcc: one compiler call with the flags of CMakeLists.txt
(keep the two in step), against the headers and libraries that `toolkit` finds. A CUDA build of torch brings
nvidia-cublas and nvidia-cuda-runtime; the crt and CCCL headers come from nvidia-cuda-crt and nvidia-cuda-cccl,
or from a CUDA 13 toolkit (CUDA_HOME or /usr/local/cuda). Then it loads the library to check it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from mslk.gemm.native import library, toolkit

SOURCES = Path(__file__).resolve().parents[4] / "csrc" / "cublas"  # packages/mslk-gemm/csrc/cublas


def command(cxx: str, includes: list[Path], libraries: list[Path], output: Path) -> list[str]:
    sources = sorted(map(str, SOURCES.glob("*.cpp")))
    flags = ["-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden"]
    return [cxx, *flags, *(f"-isystem{d}" for d in includes), *sources, *map(str, libraries), "-o", str(output)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mslk.gemm.native.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cxx", default=os.environ.get("CXX") or shutil.which("c++") or "g++", help="C++ compiler")
    args = parser.parse_args(argv)
    if not SOURCES.is_dir():
        print(f"no C++ sources in {SOURCES}: build from a source checkout of mslk-gemm", file=sys.stderr)
        return 1
    includes, libraries, missing = toolkit.find()
    if missing:
        print(f"cannot build {library.PATH.name}: {toolkit.describe_missing(missing)}", file=sys.stderr)
        return 1
    partial = library.PATH.with_suffix(".so.partial")  # replaced in one step: a running process keeps its copy
    cmd = command(args.cxx, includes, libraries, partial)
    print(" ".join(cmd))
    if subprocess.run(cmd).returncode != 0:
        partial.unlink(missing_ok=True)
        return 1
    os.replace(partial, library.PATH)
    library.SKIPPED.unlink(missing_ok=True)
    _, error = library._load()
    print(f"built {library.PATH}: " + ("it loads" if error is None else f"it does not load: {error}"))
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main())
