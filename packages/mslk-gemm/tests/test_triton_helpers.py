"""The reference library's Triton GEMM helpers (spec G-62): `utils.map_dtype_to_triton` and
`matmul_perf_model.estimate_matmul_time`."""

import pytest
import torch
import triton.language as tl

from mslk.gemm.triton import matmul_perf_model, utils

H100 = (132, 989.0, 3352.0)  # SMs, bf16 dense TFLOP/s, DRAM GB/s


def test_map_dtype_to_triton():
    assert utils.map_dtype_to_triton(torch.bfloat16) == tl.bfloat16
    assert utils.map_dtype_to_triton(torch.float8_e4m3fn) == tl.float8e4nv
    assert utils.map_dtype_to_triton(torch.float8_e5m2fnuz) == tl.float8e5b16
    assert utils.map_dtype_to_triton(torch.int8) == tl.int8
    with pytest.raises(ValueError, match="complex64 has no Triton element type"):
        utils.map_dtype_to_triton(torch.complex64)
    with pytest.raises(AttributeError, match=r"Triton 3\.4 removed"):
        utils.TmaAutoTuneHelper  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        utils.nothing  # noqa: B018


def _estimate(monkeypatch, m, n, k, block=(128, 128, 64), split_k=1, warps=8, dtype=torch.bfloat16, **kwargs):
    monkeypatch.setattr(matmul_perf_model, "_device_peaks", lambda device, dtype: H100)
    a, b, c = torch.empty(1, dtype=dtype), torch.empty(1, dtype=dtype), torch.empty(1, dtype=torch.bfloat16)
    return matmul_perf_model.estimate_matmul_time(
        num_warps=warps, num_stages=3, A=a, B=b, C=c, M=m, N=n, K=k, BLOCK_M=block[0], BLOCK_N=block[1],
        BLOCK_K=block[2], SPLIT_K=split_k, **kwargs,
    )  # fmt: skip


def test_estimate_matmul_time(monkeypatch, capsys):
    # 8192^3 bf16: at least its multiplying time at 989 TFLOP/s plus C's 128 MiB at 60% of DRAM's rate, and within
    # 2x of it (the model has A and B re-read from DRAM 20% a reuse).
    big = _estimate(monkeypatch, 8192, 8192, 8192)
    bound = 2 * 8192**3 / 989e9 + 8192 * 8192 * 2 / (0.6 * 3352.0 * 1e6)
    assert bound <= big < 2 * bound
    # Decoding (16 rows) is bound by reading B (8192 x 8192 bf16, 128 MiB): at least that at DRAM's rate.
    decode = _estimate(monkeypatch, 16, 8192, 8192, block=(16, 128, 128))
    assert 8192 * 8192 * 2 / (3352.0 * 1e6) < decode < big / 10
    # Fewer warps than an SM's 4 sub-partitions, fewer programs than SMs: slower; split K: C stored and zeroed more.
    assert _estimate(monkeypatch, 1024, 1024, 65536, warps=1) > _estimate(monkeypatch, 1024, 1024, 65536, warps=4)
    assert _estimate(monkeypatch, 128, 128, 65536, split_k=4) != _estimate(monkeypatch, 128, 128, 65536)
    # FP8 operands multiply twice as fast; the autotuner's other arguments are taken and ignored.
    fp8 = _estimate(monkeypatch, 8192, 8192, 8192, dtype=torch.float8_e4m3fn, stride_am=8192)
    assert fp8 < big
    _estimate(monkeypatch, 64, 64, 64, debug=True)
    assert "estimate_matmul_time: 64x64x64 in 128x128x64 tiles" in capsys.readouterr().out


@pytest.mark.gpu
def test_device_peaks_gpu():
    sms, tflops, dram = matmul_perf_model._device_peaks(torch.device("cuda"), torch.bfloat16)
    assert sms == torch.cuda.get_device_properties(0).multi_processor_count
    assert 50 < tflops < 5000 and 300 < dram < 10000, (tflops, dram)
    a = torch.empty(8, 8, device="cuda", dtype=torch.bfloat16)
    ms = matmul_perf_model.estimate_matmul_time(8, 3, a, a, a, 8192, 8192, 8192, 128, 256, 64)
    assert 0.1 < ms < 20, ms
