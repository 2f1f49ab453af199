"""Bench specs of mslk.quantize (`mslk bench --op quantize_fp8_row`).

Baselines on the same inputs: the plain-PyTorch reference run eagerly on the GPU, and a device-to-device
copy of as many bytes as the quantizer must move (its speed of light).
"""

from __future__ import annotations

import torch

from mslk.core import bench
from mslk.quantize import reference
from mslk.quantize.triton.fp8_quantize import quantize_fp8_row


def _row_bytes(shape: dict) -> int:
    m, k = shape["M"], shape["K"]
    return 2 * m * k + m * k + 4 * m  # bf16 read, fp8 written, fp32 scales written


def _row_inputs(shape: dict, device: torch.device):
    a = torch.randn(shape["M"], shape["K"], device=device, dtype=torch.bfloat16)
    # The copy baseline moves the same number of bytes: half read, half written.
    half = _row_bytes(shape) // 2
    return a, torch.empty(half, dtype=torch.uint8, device=device), torch.empty(half, dtype=torch.uint8, device=device)


bench.register(
    bench.BenchSpec(
        name="quantize_fp8_row",
        op="triton::quantize_fp8_row",
        shapes=[{"M": 8192, "K": 8192}, {"M": 16384, "K": 5120}, {"M": 1, "K": 8192}, {"M": 256, "K": 7168}],
        make_inputs=_row_inputs,
        run=lambda inputs: quantize_fp8_row(inputs[0]),
        baselines={
            "copy same bytes": lambda inputs: inputs[2].copy_(inputs[1]),
            "torch eager reference": lambda inputs: reference.quantize_fp8_row(
                inputs[0], None, None, None, reference.FP8_ROW_EPS, torch.float8_e4m3fn
            ),
        },
        bytes=_row_bytes,
        domain="quantize",
    )
)
