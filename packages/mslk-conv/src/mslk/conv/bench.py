"""Bench specs of mslk.conv (`mslk bench --op f8f8bf16_conv`).

The FP8 3-D convolution against PyTorch's bf16 convolution (cuDNN) of the dequantized values in channels_last_3d
memory, the layout the FP8 op reads, both under CUDA graphs (DESIGN.md §5): video and 3-D vision blocks (3 x 3 x 3
with padding 1, a strided 3 x 3 x 3, a pointwise 1 x 1 x 1, a 2 x 4 x 4 patch embedding of stride 2 x 4 x 4).
"""

from __future__ import annotations

import math

import torch

from mslk.conv.triton import fp8_conv
from mslk.core import bench

SHAPES = [
    {"N": 1, "D": 16, "H": 56, "W": 56, "C": 128, "K": 128, "taps": [3, 3, 3], "pad": [1, 1, 1], "stride": [1, 1, 1]},
    {"N": 4, "D": 8, "H": 28, "W": 28, "C": 256, "K": 256, "taps": [3, 3, 3], "pad": [1, 1, 1], "stride": [1, 1, 1]},
    {"N": 2, "D": 16, "H": 28, "W": 28, "C": 256, "K": 512, "taps": [3, 3, 3], "pad": [1, 1, 1], "stride": [2, 2, 2]},
    {"N": 2, "D": 16, "H": 28, "W": 28, "C": 512, "K": 512, "taps": [1, 1, 1], "pad": [0, 0, 0], "stride": [1, 1, 1]},
    {"N": 1, "D": 32, "H": 224, "W": 224, "C": 16, "K": 1024, "taps": [2, 4, 4], "pad": [0, 0, 0],
     "stride": [2, 4, 4]},
]  # fmt: skip


def _output_positions(s: dict) -> int:
    sizes = zip((s["D"], s["H"], s["W"]), s["pad"], s["taps"], s["stride"], strict=True)
    return s["N"] * math.prod(fp8_conv._output_size(*size, 1) for size in sizes)


def _inputs(s: dict, device: torch.device):
    x = fp8_conv.random_fp8(s["N"], s["D"], s["H"], s["W"], s["C"], device=device)
    w = fp8_conv.random_fp8(s["K"], *s["taps"], s["C"], device=device)
    scale = torch.full((), 1e-3, device=device)
    # The baseline's operands: the same values in bf16, NCDHW views of channels_last_3d memory.
    x16, w16 = (t.to(torch.bfloat16).permute(0, 4, 1, 2, 3) for t in (x, w))
    return x, w, scale, x16, w16, s


def _conv(i):
    x, w, scale, _, _, s = i
    return fp8_conv.f8f8bf16_conv(x, w, scale, s["pad"], s["stride"], [1, 1, 1])


def _cudnn_bf16(i):
    _, _, scale, x16, w16, s = i
    return torch.nn.functional.conv3d(x16, w16, stride=s["stride"], padding=s["pad"]) * scale


bench.register(
    bench.BenchSpec(
        name="f8f8bf16_conv",
        op="mslk::f8f8bf16_conv",
        shapes=SHAPES,
        make_inputs=_inputs,
        run=_conv,
        baselines={"torch conv3d bf16 (dequantized, cuDNN)": _cudnn_bf16},
        flops=lambda s: 2 * _output_positions(s) * s["K"] * s["C"] * math.prod(s["taps"]),
        bytes=lambda s: (
            s["N"] * s["D"] * s["H"] * s["W"] * s["C"]
            + s["K"] * s["C"] * math.prod(s["taps"])
            + 2 * _output_positions(s) * s["K"]
        ),
        cuda_graph=True,  # the shorter convolutions take less GPU time than a call's host time (eager)
    )
)
