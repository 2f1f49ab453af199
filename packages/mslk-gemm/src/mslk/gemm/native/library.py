"""libmslk_gemm_cublas: the cuBLAS(Lt) GEMMs of mslk-gemm behind a C ABI (csrc/cublas/common.h), loaded with ctypes.

The library takes device pointers, sizes, scale pointers, a workspace and a cudaStream_t, and knows nothing of
torch, so one build serves every torch build of CUDA 13. The ops are torch.library ops defined in Python
(mslk.gemm.native.*_gemm): they pass `data_ptr()`s and the current stream through `Function`. The library needs
libcublasLt.so.13 and libcublas.so.13: those that a CUDA build of torch has loaded, else those that
`toolkit.library_dirs` finds (the nvidia-cublas wheel, CUDA_HOME, /usr/local/cuda).

It sits beside this file: the package build (CMakeLists.txt) puts it there, and so does the in-place build
`python -m mslk.gemm.native.build`. When it is absent or does not load, `missing()` says why: `mslk env` prints
it and every backend that needs the library reports it as its reason.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from mslk.core import env, launch, registry
from mslk.gemm.native import toolkit

NAME = "mslk_gemm_cublas"
PATH = Path(__file__).with_name(f"lib{NAME}.so")
SKIPPED = Path(__file__).with_name("native_build_skipped.txt")  # written by a build that left the library out
BUILD_HINT = "build it in place with `python -m mslk.gemm.native.build` (see docs/native.md)"
WORKSPACE_BYTES = 32 << 20  # what cuBLASLt's Hopper and Blackwell kernels may use


def _preload(soname: str) -> None:
    """Load a cuBLAS library (by soname: torch's copy when torch has loaded it), so the dynamic linker finds it."""
    try:
        ctypes.CDLL(soname)
        return
    except OSError:
        pass
    dirs = toolkit.library_dirs()
    for folder in dirs:
        if (folder / soname).is_file():
            ctypes.CDLL(str(folder / soname))
            return
    raise OSError(
        f"{soname} is not loaded and not in {', '.join(map(str, dirs)) or 'any CUDA folder'}: install nvidia-cublas "
        "(CUDA builds of torch depend on it) or set CUDA_HOME to a CUDA 13 toolkit"
    )


def _load(path: Path = PATH, skipped: Path = SKIPPED) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None), or (None, why it is unusable)."""
    if env.PYTHON_ONLY.enabled():
        return None, "MSLK_PYTHON_ONLY=1: native libraries are not loaded"
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is not a CUDA build (the library calls cuBLAS)"
    if not path.is_file():
        why = skipped.read_text().strip() if skipped.is_file() else "it has not been built"
        return None, f"{path.name} is not in {path.parent}: {why}; {BUILD_HINT}"
    try:
        for soname in toolkit.LIBRARIES:
            _preload(soname)
        lib = ctypes.CDLL(str(path))
        lib.mslk_cublas_status_name.restype = ctypes.c_char_p
        lib.mslk_cublas_status_name.argtypes = [ctypes.c_int]
    except (OSError, AttributeError) as exc:
        return None, f"{path} does not load: {exc}"
    return lib, None


_lib, _error = _load()
registry.record_native(NAME, _error)


def missing() -> str | None:
    """None when the library is loaded, else why not (the `available=` of the backends that need it)."""
    return _error


def status_name(status: int) -> str:
    return _lib.mslk_cublas_status_name(status).decode()


# Handles by (creator, device index): one cuBLASLt handle per device serves every thread; the cuBLAS handle
# keeps a stream, so the library serializes its launches.
_handles: dict[tuple[str, int], ctypes.c_void_p] = {}
_handles_lock = threading.Lock()


def _handle(creator: str, device: torch.device) -> ctypes.c_void_p:
    key = (creator, device.index)
    with _handles_lock:
        if key not in _handles:
            handle = ctypes.c_void_p()
            status = getattr(_lib, creator)(ctypes.byref(handle))  # on the current device, which the caller set
            if status:
                raise RuntimeError(f"{creator} failed on {device}: {status_name(status)}")
            _handles[key] = handle
        return _handles[key]


class Function:
    """One GEMM of the library: `available()` for the registry; `fn(device, *args)` runs it on `device`.

    `argtypes` are the ctypes of the arguments between the handle (made by the C function `creator`) and the
    workspace, size and stream, which every GEMM takes last. A nonzero cuBLAS status raises RuntimeError.
    """

    def __init__(self, name: str, *argtypes, creator: str = "mslk_cublaslt_create"):
        self.name = name
        self.argtypes = argtypes
        self.creator = creator
        self._fn = None

    def available(self) -> str | None:
        if _error is not None:
            return _error
        if self._fn is None:
            try:
                fn = getattr(_lib, self.name)
                getattr(_lib, self.creator)
            except AttributeError:
                return f"{PATH} has no {self.name}: it is older than this mslk-gemm; {BUILD_HINT}"
            fn.argtypes = [ctypes.c_void_p, *self.argtypes, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            getattr(_lib, self.creator).argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            self._fn = fn
        return None

    def __call__(self, device: torch.device, *args) -> None:
        why = self.available()
        if why is not None:
            raise RuntimeError(f"{self.name}: {why}")
        with torch.cuda.device(device):
            # Allocated on the current stream, so torch's allocator reuses it only after this GEMM has run.
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            stream = torch.cuda.current_stream(device).cuda_stream
            status = self._fn(_handle(self.creator, device), *args, workspace.data_ptr(), WORKSPACE_BYTES, stream)
        if status:
            name = status_name(status)
            hint = " (no cuBLAS kernel for this problem on this GPU)" if name == "CUBLAS_STATUS_NOT_SUPPORTED" else ""
            raise RuntimeError(f"{self.name} failed: {name}{hint}")


def pad16(size: int) -> int:
    """`size` rounded up to a multiple of 16: cuBLASLt's FP8 and INT8 kernels want K and N that are."""
    return launch.cdiv(size, 16) * 16


def tn_operand(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A 2-D operand [r, c] as cuBLASLt's FP8/INT8 kernels take it: row-major, 16-byte aligned, zero-padded to
    [rows, cols] (zeros in K add nothing; the outputs of extra rows are cut off)."""
    if tuple(t.shape) == (rows, cols) and t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    padded = torch.zeros((rows, cols), dtype=t.dtype, device=t.device)
    padded[: t.shape[0], : t.shape[1]] = t
    return padded


def tn_gemm(function: Function, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *args) -> torch.Tensor:
    """out [M, N'] = x [M, K] · w [N, K]ᵀ by a GEMM of the library that takes (x, w, out, m, n, k, *args), N' the
    padded N (`pad16`, the row length of `out`): K and N are zero-padded as `tn_operand` says. Returns out."""
    (m, k), n = x.shape, out.shape[1]
    if m and n and not k:
        out.zero_()
    elif m and n:
        xp, wp = tn_operand(x, m, pad16(k)), tn_operand(w, n, pad16(k))  # locals: alive through the launch
        function(x.device, xp.data_ptr(), wp.data_ptr(), out.data_ptr(), m, n, pad16(k), *args)
    return out
