"""The native library of mslk-gemm (docs/native.md): it loads, or says why not, and so do the backends that need it.

T0: on CI the package build compiles the library (CMakeLists.txt), so it must load there; a build without it
(`MSLK_GEMM_NATIVE=OFF`, no compiler, no CUDA headers: ci/slim.sh installs such a wheel too) must still import and
report the reason. The toolkit search and the in-place build are checked on fake toolkit folders.
"""

import ctypes

import pytest
import torch

from mslk.core import registry
from mslk.gemm.native import bf16x9_gemm, build, fp8_gemm, library, toolkit


def test_library_loads_or_says_why():
    reason = registry.native_libraries[library.NAME]
    assert reason == library.missing()
    if library.PATH.is_file() and torch.version.cuda is not None:
        assert reason is None, reason
        assert library.status_name(15) == "CUBLAS_STATUS_NOT_SUPPORTED"
    else:
        assert reason
        assert fp8_gemm._gemm.available() == reason


def test_missing_library_names_the_file_the_cause_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    lib, reason = library._load(tmp_path / "libmslk_gemm_cublas.so", tmp_path / "skipped.txt")
    assert lib is None
    assert "libmslk_gemm_cublas.so is not in" in reason and "has not been built" in reason
    assert "python -m mslk.gemm.native.build" in reason
    (tmp_path / "skipped.txt").write_text("the package was built without it: no C++ compiler was found\n")
    _, reason = library._load(tmp_path / "libmslk_gemm_cublas.so", tmp_path / "skipped.txt")
    assert "no C++ compiler was found" in reason
    (tmp_path / "libmslk_gemm_cublas.so").write_bytes(b"not an ELF file")
    _, reason = library._load(tmp_path / "libmslk_gemm_cublas.so", tmp_path / "skipped.txt")
    assert "does not load" in reason
    monkeypatch.setattr(torch.version, "cuda", None)
    _, reason = library._load(tmp_path / "libmslk_gemm_cublas.so", tmp_path / "skipped.txt")
    assert "not a CUDA build" in reason


def test_python_only_loads_no_library(monkeypatch):
    """MSLK_PYTHON_ONLY=1 (the reference library's switch) keeps the library unloaded, whatever is built."""
    monkeypatch.setenv("MSLK_PYTHON_ONLY", "1")
    lib, reason = library._load()
    assert lib is None and reason == "MSLK_PYTHON_ONLY=1: native libraries are not loaded"


def test_backends_report_the_missing_library(monkeypatch):
    monkeypatch.setattr(library, "_error", "libmslk_gemm_cublas.so is not in here: it has not been built")
    for function in (library.Function("mslk_f8f8bf16_cublas", ctypes.c_void_p), bf16x9_gemm._gemm):
        function._fn = None
        assert "has not been built" in function.available()
    assert "has not been built" in bf16x9_gemm._available()
    with pytest.raises(RuntimeError, match="has not been built"):
        library.Function("mslk_f8f8bf16_cublas")(torch.device("cuda", 0))


@pytest.mark.skipif(library.missing() is not None, reason="the native library is not loaded here")
def test_a_library_without_a_function_says_it_is_stale():
    assert "has no mslk_no_such_gemm" in library.Function("mslk_no_such_gemm").available()
    assert fp8_gemm._gemm.available() is None


def _fake_toolkit(root, headers):
    for header in headers:
        (root / "include" / header).parent.mkdir(parents=True, exist_ok=True)
        (root / "include" / header).write_text("")
    (root / "lib").mkdir(parents=True, exist_ok=True)
    for name in toolkit.LIBRARIES:
        (root / "lib" / name).write_text("")


def test_toolkit_finds_each_header_where_it_is_and_names_the_wheel_that_lacks(tmp_path, monkeypatch):
    wheels, system = tmp_path / "site" / "nvidia" / "cu13", tmp_path / "cuda"
    _fake_toolkit(wheels, ["cublasLt.h", "cuda_runtime_api.h"])  # what torch's wheels bring
    monkeypatch.setattr(toolkit, "roots", lambda: [wheels])
    includes, libraries, missing = toolkit.find()
    assert includes == [wheels / "include"]
    assert libraries == [wheels / "lib" / name for name in toolkit.LIBRARIES]
    assert [line.split()[0] for line in missing] == ["crt/host_defines.h", "nv/target"]
    assert "pip install nvidia-cuda-crt" in missing[0] and "pip install nvidia-cuda-cccl" in missing[1]
    _fake_toolkit(system, ["crt/host_defines.h", "cccl/nv/target", "cublasLt.h"])
    monkeypatch.setattr(toolkit, "roots", lambda: [wheels, system])
    includes, _, missing = toolkit.find()
    assert includes == [wheels / "include", system / "include", system / "include" / "cccl"]
    assert missing == []


def test_toolkit_writes_cmake_variables(tmp_path, monkeypatch):
    monkeypatch.setattr(toolkit, "roots", lambda: [])
    toolkit.main(["--cmake", str(tmp_path / "t.cmake")])
    text = (tmp_path / "t.cmake").read_text()
    assert 'set(MSLK_CUDA_INCLUDE_DIRS "")' in text
    assert "set(MSLK_CUDA_MISSING " in text and "cublasLt.h (pip install nvidia-cublas" in text


def test_in_place_build_command_and_missing_headers(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(build, "SOURCES", tmp_path / "csrc")
    assert build.main([]) == 1
    assert "no C++ sources" in capsys.readouterr().err
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "gemm.cpp").write_text("")
    cmd = build.command("g++", [tmp_path / "include"], [tmp_path / "libcublasLt.so.13"], tmp_path / "out.so")
    assert cmd[0] == "g++" and f"-isystem{tmp_path / 'include'}" in cmd and str(tmp_path / "csrc" / "gemm.cpp") in cmd
    assert cmd[-3:] == [str(tmp_path / "libcublasLt.so.13"), "-o", str(tmp_path / "out.so")]
    monkeypatch.setattr(toolkit, "roots", lambda: [])
    assert build.main([]) == 1
    assert "cannot build libmslk_gemm_cublas.so: CUDA 13 pieces not found" in capsys.readouterr().err
