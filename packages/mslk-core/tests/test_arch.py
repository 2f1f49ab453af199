import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

import mslk.utils.device as ref_device
from mslk.core import arch
from mslk.utils.triton.fp8_utils import get_fp8_constants

H200 = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132)
MI300X = SimpleNamespace(
    name="AMD Instinct MI300X", major=9, minor=4, multi_processor_count=304, gcnArchName="gfx942:sramecc+:xnack-"
)
MI355X = SimpleNamespace(name="AMD Instinct MI355X", major=9, minor=5, multi_processor_count=256, gcnArchName="gfx950")
MI250 = SimpleNamespace(name="AMD Instinct MI250X", major=9, minor=0, multi_processor_count=110, gcnArchName="gfx90a")


@pytest.fixture
def mock_gpu(monkeypatch):
    """Pretend torch sees one GPU with the given properties; counts property queries."""
    queries = []

    def install(props, hip=None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: queries.append(i) or props)
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.version, "cuda", None if hip else "13.0")
        arch.clear_cache()
        return queries

    yield install
    monkeypatch.undo()
    arch.clear_cache()


def test_nvidia(mock_gpu):
    queries = mock_gpu(H200)
    assert arch.vendor() == "nvidia" and arch.is_cuda() and not arch.is_rocm()
    assert arch.capability() == (9, 0)
    assert arch.sm_count() == 132
    assert arch.fp8_dtype() == torch.float8_e4m3fn and arch.fp8_max() == 448.0
    assert arch.gfx_arch() is None and ref_device.get_gfx_arch_name() == "", "a str, as upstream's"
    assert queries == [0], "device properties are queried once and cached"
    assert ref_device.compute_capability_at_least(9) and not ref_device.compute_capability_at_least(9, 1)
    assert ref_device.compute_capability_in(8, 9) and not ref_device.compute_capability_in(10)
    assert ref_device.cuda_version_at_least(13) and not ref_device.cuda_version_at_least(14)
    assert not ref_device.supports_float8_fnuz()
    assert get_fp8_constants()[0] == torch.float8_e4m3fn and get_fp8_constants()[2] == 448.0


def test_compiled_callers_read_the_kept_answers(mock_gpu, monkeypatch):
    """Code that torch.compile traces (a dispatcher choosing a kernel by capability) reads the answers as kept: the
    device is not queried again while tracing, and Dynamo has no cache wrapper to trace through and warn about."""
    real_is_available = torch.cuda.is_available
    queries = mock_gpu(H200)
    device = torch.device("cuda", 0)  # (callers pass their tensors' device; Dynamo would ask the driver for None's)
    assert arch.capability(device) == (9, 0)
    # Dynamo itself saves the CUDA RNG state when torch says a GPU is there: the answer stays kept in arch only.
    monkeypatch.setattr(torch.cuda, "is_available", real_is_available)

    def pick(x):
        return x * 2 if arch.is_cuda() and arch.capability(device) >= (9, 0) and arch.sm_count(device) == 132 else x

    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lru_cache.*")
        compiled = torch.compile(pick, fullgraph=True, backend="eager")
        assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
    assert queries == [0]


H100_SXM = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132)
B200 = SimpleNamespace(name="NVIDIA B200", major=10, minor=0, multi_processor_count=148)


@pytest.mark.parametrize(
    ("props", "hip", "hopper"),
    [(H200, None, True), (H100_SXM, None, True), (B200, None, False), (MI250, "7.1.0", False)],
)
def test_on_hopper(mock_gpu, props, hip, hopper):
    """Hopper is an NVIDIA sm_90 GPU (MI250 reports capability 9.0 too); a CPU tensor asks no GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    queries = mock_gpu(props, hip=hip)
    assert not arch.on_hopper(torch.ones(2))
    assert queries == []
    with FakeTensorMode():
        on_gpu = torch.ones(2, device="cuda")
    assert arch.on_hopper(on_gpu) is hopper


A100 = SimpleNamespace(name="NVIDIA A100-SXM4-80GB", major=8, minor=0, multi_processor_count=108)
L4 = SimpleNamespace(name="NVIDIA L4", major=8, minor=9, multi_processor_count=58)
RTX_5090 = SimpleNamespace(name="NVIDIA GeForce RTX 5090", major=12, minor=0, multi_processor_count=170)


@pytest.mark.parametrize(
    ("props", "hip", "missing"),
    [(A100, None, True), (L4, None, False), (H200, None, False), (RTX_5090, None, False), (MI300X, "7.1.0", False)],
)
def test_fp8_e4m3_missing(mock_gpu, props, hip, missing):
    """float8_e4m3fn kernels need NVIDIA compute capability 8.9 (Triton compiles no e4m3 below it); ROCm has its own
    FP8 flavours (fp8_dtype) and a CPU tensor asks no GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    queries = mock_gpu(props, hip=hip)
    assert arch.fp8_e4m3_missing(torch.ones(2)) is None
    assert queries == []
    with FakeTensorMode():
        on_gpu = torch.ones(2, device="cuda")
    why = arch.fp8_e4m3_missing(on_gpu)
    if missing:
        assert why == (
            "float8_e4m3fn needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
            "NVIDIA A100-SXM4-80GB has 8.0"
        )
    else:
        assert why is None


def test_gfx942_uses_fnuz(mock_gpu):
    mock_gpu(MI300X, hip="7.1.0")
    assert arch.vendor() == "amd" and arch.gfx_arch() == "gfx942" and ref_device.get_gfx_arch_name() == "gfx942"
    assert arch.fp8_dtype() == torch.float8_e4m3fnuz and arch.fp8_max() == 240.0
    assert ref_device.supports_float8_fnuz() and ref_device.is_gfx942() and not ref_device.is_gfx950()
    assert ref_device.rocm_version_at_least(7, 1) and not ref_device.rocm_version_at_least(7, 2)
    assert not ref_device.compute_capability_at_least(9), "capability predicates are CUDA-only"


def test_gfx950_uses_ocp_unless_forced(mock_gpu, monkeypatch):
    mock_gpu(MI355X, hip="7.2.0")
    assert arch.fp8_dtype() == torch.float8_e4m3fn and arch.fp8_max() == 448.0
    monkeypatch.setenv("MSLK_ROCM_FORCE_FP8FNUZ_TYPE", "1")
    assert arch.fp8_dtype() == torch.float8_e4m3fnuz


@pytest.mark.parametrize(
    ("props", "hip", "shared_memory"),
    [
        (
            SimpleNamespace(**vars(H200), shared_memory_per_block=49152, shared_memory_per_block_optin=232448),
            None,
            232448,
        ),
        (SimpleNamespace(**vars(MI300X), shared_memory_per_block=65536), "7.1.0", 65536),  # ROCm: no opt-in figure
        (H200, None, None),  # not reported
    ],
    ids=["nvidia-opt-in", "rocm-per-block", "none"],
)
def test_shared_memory(mock_gpu, props, hip, shared_memory):
    mock_gpu(props, hip=hip)
    assert arch.device_info().shared_memory == shared_memory


def test_old_rocm_has_no_fp8(mock_gpu):
    mock_gpu(MI250, hip="7.1.0")
    with pytest.raises(RuntimeError, match="Unsupported GPU arch gfx90a for FP8"):
        arch.fp8_dtype()
    with pytest.raises(RuntimeError):
        ref_device.supports_float8_fnuz()
    assert ref_device.supports_float8_fnuz(throw_on_hip_incompatibility=False) is False


def test_no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    arch.clear_cache()
    try:
        assert arch.vendor() == "none" and not arch.is_cuda() and not arch.is_rocm()
        assert arch.fp8_dtype() == torch.float8_e4m3fn, "CPU reference paths use the OCP flavour"
        with pytest.raises(RuntimeError, match="no CUDA or ROCm device"):
            arch.capability()
    finally:
        monkeypatch.undo()
        arch.clear_cache()


def test_triton_fp8_types():
    import triton.language as tl

    assert arch.triton_fp8_type(torch.float8_e4m3fn) == tl.float8e4nv
    assert arch.triton_fp8_type(torch.float8_e4m3fnuz) == tl.float8e4b8
    with pytest.raises(ValueError, match="not an FP8 e4m3 dtype"):
        arch.triton_fp8_type(torch.bfloat16)


def test_import_does_not_initialise_cuda():
    code = "import torch, mslk, mslk.utils.device, mslk.core.testing; print(torch.cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
