"""A roofline estimate of a tiled Triton GEMM's time, for pruning autotuning configs (spec G-62).

`estimate_matmul_time` takes the kernel's arguments by name, as Triton's autotuner hands them to a `perf_model`:
the time is max(multiplying, loading) + storing. Multiplying runs at the tensor cores' dense peak, scaled by the
share of an SM's four sub-partitions the programs' warps can fill; loading reads A and B once from DRAM plus 20% of
each re-read (the rest hits L2, at 4x DRAM's bandwidth), with fewer than 32 programs short of DRAM's bandwidth;
storing writes C (each split of K, and zeros first when split) at 60% of it. The model of Triton's original
`triton.ops.matmul_perf_model`, with the multiply rates of GPUs since Hopper, which it predates.
"""

from __future__ import annotations

import torch

from mslk.core import arch, launch

# Dense tensor-core multiply-adds x 2 an SM a clock, for (fp32 as tf32, 16-bit, 8-bit) operands; datacenter parts
# (GeForce cards of compute capability 8.6-8.9 and 12.x run 16-bit products accumulated in fp32 at half rate).
_FLOPS_AN_SM_A_CLOCK = {
    (8, 0): (1024, 2048, 4096),  # A100: 312 TFLOP/s bf16 at 1.41 GHz on 108 SMs
    (8, 6): (512, 1024, 2048),
    (8, 7): (512, 1024, 2048),
    (8, 9): (512, 1024, 2048),  # L40S: 362 TFLOP/s at 2.52 GHz on 142 SMs
    (9, 0): (2048, 4096, 8192),  # H100 SXM: 989 TFLOP/s at 1.83 GHz on 132 SMs
    (10, 0): (4096, 8192, 16384),
    (10, 3): (4096, 8192, 16384),
    (12, 0): (512, 1024, 2048),
    (12, 1): (512, 1024, 2048),
}
_ROCM_FLOPS_A_CU_A_CLOCK = (1024, 2048, 4096)  # MI300X: 1307 TFLOP/s bf16 at 2.1 GHz on 304 CUs


def _operand_class(dtype: torch.dtype) -> int:
    if dtype.itemsize >= 4:
        return 0
    return 1 if dtype.itemsize == 2 else 2


def _device_peaks(device: torch.device, dtype: torch.dtype) -> tuple[int, float, float]:
    """(SMs, dense tensor-core TFLOP/s of dtype operands, DRAM GB/s) of the GPU."""
    from triton.runtime import driver
    from triton.testing import get_dram_gbps

    index = device.index if device.index is not None else 0
    properties = driver.active.utils.get_device_properties(index)
    sms = properties["multiprocessor_count"]
    if torch.version.hip is not None:
        rate = _ROCM_FLOPS_A_CU_A_CLOCK
    else:
        rate = _FLOPS_AN_SM_A_CLOCK.get(arch.capability(device), _FLOPS_AN_SM_A_CLOCK[(8, 0)])
    tflops = sms * properties["sm_clock_rate"] * 1e3 * rate[_operand_class(dtype)] * 1e-12  # (clock in kHz)
    return sms, tflops, get_dram_gbps(index)


def estimate_matmul_time(
    num_warps, num_stages, A, B, C, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K=1, debug=False, **kwargs
) -> float:
    """Estimated milliseconds of C[M, N] = A[M, K] @ B[K, N] in BLOCK_M x BLOCK_N tiles, K split SPLIT_K ways,
    num_warps a program (num_stages and BLOCK_K do not enter the model). The other keyword arguments (the rest of
    the kernel's) are ignored."""
    sms, peak_tflops, dram_gbps = _device_peaks(A.device, A.dtype)
    row_tiles, col_tiles = launch.cdiv(M, BLOCK_M), launch.cdiv(N, BLOCK_N)
    programs = row_tiles * col_tiles * SPLIT_K
    rows, cols = max(M, BLOCK_M), max(N, BLOCK_N)  # (a tile computes whole, whatever it keeps)
    warps = programs * min(num_warps, 4)  # a program's warps fill at most an SM's 4 sub-partitions
    tflops = peak_tflops * min(warps, 4 * sms) / (4 * sms)
    compute_ms = 2 * rows * cols * K / (tflops * 1e9)

    bandwidth = dram_gbps * (0.95 * min(1, programs / 32) + 0.05 * max(min(1, (programs - 32) / max(sms - 32, 1)), 0))
    a_bytes, b_bytes = rows * K * A.element_size(), cols * K * B.element_size()
    dram = a_bytes * (1 + 0.2 * (col_tiles - 1)) + b_bytes * (1 + 0.2 * (row_tiles - 1))
    l2 = 0.8 * (a_bytes * (col_tiles - 1) + b_bytes * (row_tiles - 1))
    load_ms = (dram / bandwidth + l2 / (4 * bandwidth)) / 1e6  # (bytes / (GB/s) = ns)

    store_bandwidth = 0.6 * bandwidth
    c_bytes = rows * cols * C.element_size()
    store_ms = c_bytes * SPLIT_K / store_bandwidth / 1e6
    if SPLIT_K > 1:  # the output zeroed before the splits add into it
        store_ms += c_bytes / store_bandwidth / 1e6
    total_ms = max(compute_ms, load_ms) + store_ms
    if debug:
        print(
            f"estimate_matmul_time: {M}x{N}x{K} in {BLOCK_M}x{BLOCK_N}x{BLOCK_K} tiles, split {SPLIT_K}, {num_warps} "
            f"warps, {num_stages} stages: {total_ms:.4f} ms = max(compute {compute_ms:.4f}, load {load_ms:.4f}) + "
            f"store {store_ms:.4f}"
        )
    return total_ms
