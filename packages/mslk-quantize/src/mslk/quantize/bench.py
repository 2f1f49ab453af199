"""Bench specs of mslk.quantize (`mslk bench --op quantize_fp8_row`, ...).

Each quantizer runs on bf16 [M, K] inputs beside two baselines on the same inputs: a device-to-device copy
of as many bytes as the quantizer must move (its speed of light: input read once, outputs written once)
and the plain-PyTorch reference run eagerly on the GPU. Large shapes are timed as users call them; the
small, launch-bound ones (1-256 rows) under CUDA graphs, as DESIGN.md §5 says.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from mslk.core import arch, bench, formats
from mslk.quantize import reference
from mslk.quantize.triton import fp4_quantize as fp4
from mslk.quantize.triton import fp4_utils
from mslk.quantize.triton import fp8_quantize as fp8

LARGE = [{"M": 8192, "K": 8192}, {"M": 16384, "K": 5120}, {"M": 16384, "K": 7168}]
SMALL = [{"M": 1, "K": 8192}, {"M": 16, "K": 5120}, {"M": 256, "K": 7168}]


def _register(name: str, op: str, run: Callable, eager: Callable, written: Callable[[int, int], float]) -> None:
    """Two specs for one quantizer: `name` (large shapes) and `name`_small (CUDA graphs). `written(M, K)`:
    bytes of the outputs (quantized data and scales)."""

    def nbytes(shape: dict) -> int:
        m, k = shape["M"], shape["K"]
        return int(2 * m * k + written(m, k))  # bf16 read once, outputs written once

    def inputs(shape: dict, device: torch.device):
        x = torch.randn(shape["M"], shape["K"], device=device, dtype=torch.bfloat16)
        return x, *bench.copy_buffers(nbytes(shape), device)

    baselines = {
        "copy same bytes": lambda i: i[2].copy_(i[1]),
        "torch eager reference": lambda i: eager(i[0]),
    }
    for suffix, shapes, graph in (("", LARGE, False), ("_small", SMALL, True)):
        bench.register(
            bench.BenchSpec(
                name=name + suffix,
                op=op,
                shapes=shapes,
                make_inputs=inputs,
                run=lambda i: run(i[0]),
                baselines=baselines,
                bytes=nbytes,
                cuda_graph=graph,
                domain="quantize",
            )
        )


_FP8 = torch.float8_e4m3fn
_register(
    "quantize_fp8_row",
    "triton::quantize_fp8_row",
    fp8.quantize_fp8_row,
    lambda x: reference.quantize_fp8_row(x, None, None, None, reference.FP8_ROW_EPS, _FP8),
    lambda m, k: m * k + 4 * m,
)
_register(
    "quantize_fp8_block",
    "triton::quantize_fp8_block",
    lambda x: fp8.quantize_fp8_block(x, 128, 128),
    lambda x: reference.quantize_fp8_block(x, 128, 128, None, True, arch.FP8_EPS, _FP8),
    lambda m, k: m * k + 4 * math.ceil(m / 128) * math.ceil(k / 128),
)
_register(
    "quantize_fp8_group",
    "quantize_fp8_group",
    lambda x: fp8.quantize_fp8_group(x, 128),
    lambda x: reference.quantize_fp8_block(x, 1, 128, None, True, arch.FP8_EPS, _FP8),
    lambda m, k: m * k + 4 * m * math.ceil(k / 128),
)
_register(
    "quantize_fp8_tensor",
    "triton::quantize_fp8_tensor",
    fp8.quantize_fp8_tensor,
    lambda x: reference.quantize_fp8_tensor(x, arch.FP8_EPS, _FP8),
    lambda m, k: m * k + 4,
)
_register(
    "quantize_mx4",
    "mslk::quantize_mx4",
    fp4.triton_quantize_mx4,
    lambda x: fp4_utils.quantize_mx4(x, 32, fp4_utils.RoundingMode.ceil, "swizzled"),
    lambda m, k: m * k / 2 + m * k / 32,
)
_register(
    "quantize_nvfp4",
    "mslk::quantize_nvfp4",
    lambda x: fp4.triton_quantize_nvfp4(x, None),
    lambda x: fp4_utils.quantize_nvfp4(x, None),
    lambda m, k: m * k / 2 + m * k / 16,
)


@functools.cache
def _experts(m: int, device: torch.device) -> torch.Tensor:
    """m_sizes of 8 ragged experts over m rows (the stacked MoE activations of the stacked benches)."""
    weights = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6], dtype=torch.float64)
    sizes = (weights / weights.sum() * m).floor().long()
    sizes[-1] += m - sizes.sum()
    return sizes.to(device)


def _stacked_scale_bytes(m: int, k: int, block: int) -> float:
    return math.prod(formats.stacked_swizzled_scale_shape(m, 8, k // block))


_register(
    "quantize_mx4_stacked",
    "mslk::quantize_mx4_stacked",
    lambda x: fp4.quantize_mx4_stacked(_experts(x.shape[0], x.device), x),
    lambda x: fp4._mx4_stacked_reference(_experts(x.shape[0], x.device), x),
    lambda m, k: m * k / 2 + _stacked_scale_bytes(m, k, 32),
)


def _nvfp4_stacked(group_max: Callable, quantize: Callable, x: torch.Tensor):
    """NVFP4 of stacked activations as MoE layers call it: per-expert global scales, then the quantizer."""
    m_sizes = _experts(x.shape[0], x.device)
    return quantize(m_sizes, x, group_max(x, m_sizes)[0])


_register(
    "quantize_nvfp4_stacked",
    "mslk::quantize_nvfp4_stacked",
    lambda x: _nvfp4_stacked(fp4.calculate_group_max, fp4.nvfp4_quantize_stacked, x),
    lambda x: _nvfp4_stacked(fp4_utils.calculate_group_max, fp4_utils.quantize_nvfp4_stacked, x),
    lambda m, k: m * k / 2 + _stacked_scale_bytes(m, k, 16),
)
_register(
    "quantize_nvfp4_stacked_token_scale",
    "mslk::quantize_nvfp4_stacked_token_scale",
    lambda x: fp4.nvfp4_quantize_stacked_with_token_scale(_experts(x.shape[0], x.device), x),
    lambda x: fp4._token_reference(_experts(x.shape[0], x.device), x),
    lambda m, k: m * k / 2 + _stacked_scale_bytes(m, k, 16) + 4 * m,
)
