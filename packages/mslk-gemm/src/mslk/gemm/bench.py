"""Bench specs of mslk.gemm (`mslk bench --op f8f8bf16_rowwise`).

FP8 rowwise GEMMs against `torch._scaled_mm` with rowwise scales on the same inputs (the cuBLAS FP8 GEMM),
at the shapes of PERF.md and Llama-70B/405B projections; decode shapes (M <= 128) under CUDA graphs, so that
both sides are timed without their host overhead (DESIGN.md §5). Blockwise and groupwise GEMMs compare with
the same rowwise `_scaled_mm` at the same shapes: the same FLOPs with the cheapest scaling, so the ratio says
what the finer scales cost.
"""

from __future__ import annotations

import torch

from mslk.core import bench, testing
from mslk.gemm.triton import fp8_blockwise_gemm, fp8_gemm, grouped_gemm

LARGE = [
    {"M": 8192, "N": 8192, "K": 8192},
    {"M": 2048, "N": 7168, "K": 2048},
    {"M": 4096, "N": 28672, "K": 8192},  # Llama-70B FFN up
    {"M": 1024, "N": 8192, "K": 28672},  # Llama-70B FFN down
    {"M": 4096, "N": 16384, "K": 16384},  # Llama-405B attention projection
]
DECODE = [
    {"M": 16, "N": 8192, "K": 8192},
    {"M": 128, "N": 8192, "K": 8192},
    {"M": 1, "N": 28672, "K": 8192},
    {"M": 64, "N": 8192, "K": 28672},
]


def _inputs(shape: dict, device: torch.device):
    xq, x_scale = fp8_gemm.quantize_rows(testing.randn(shape["M"], shape["K"], device=device))
    wq, w_scale = fp8_gemm.quantize_rows(testing.randn(shape["N"], shape["K"], device=device))
    return xq, wq, x_scale, w_scale


def _scaled_mm(i):
    xq, wq, x_scale, w_scale = i
    return torch._scaled_mm(
        xq, wq.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :], out_dtype=torch.bfloat16, use_fast_accum=True
    )


for name, shapes, graph in (("f8f8bf16_rowwise", LARGE, False), ("f8f8bf16_rowwise_decode", DECODE, True)):
    bench.register(
        bench.BenchSpec(
            name=name,
            op="mslk::f8f8bf16_rowwise",
            shapes=shapes,
            make_inputs=_inputs,
            run=lambda i: fp8_gemm.f8f8bf16_rowwise(*i),
            baselines={"torch._scaled_mm rowwise": _scaled_mm},
            flops=lambda s: 2 * s["M"] * s["N"] * s["K"],
            bytes=lambda s: s["M"] * s["K"] + s["N"] * s["K"] + 2 * s["M"] * s["N"],
            cuda_graph=graph,
            domain="gemm",
        )
    )


def _block_inputs(shape: dict, device: torch.device, groupwise: bool):
    """Rowwise operands for the baseline, and the block-scaled ones in the layout of the GEMM: blockwise 128 x 128
    tiles for both, or groupwise (XQ per row and 128 of K, M-major; WQ per 128 x 128 tile, N-major)."""
    x = testing.randn(shape["M"], shape["K"], device=device)
    w = testing.randn(shape["N"], shape["K"], device=device)
    xq, x_scale = fp8_blockwise_gemm.quantize_blocks(x, 1 if groupwise else 128, 128)
    wq, w_scale = fp8_blockwise_gemm.quantize_blocks(w, 128, 128)
    if groupwise:
        x_scale, w_scale = x_scale.T.contiguous(), w_scale.T.contiguous()
    return (*fp8_gemm.quantize_rows(x), *fp8_gemm.quantize_rows(w)), (xq, wq, x_scale, w_scale)


def _rowwise_baseline(i):
    (xq, x_scale, wq, w_scale), _ = i
    return _scaled_mm((xq, wq, x_scale, w_scale))


for name, groupwise, gemm in (
    ("f8f8bf16_blockwise", False, fp8_blockwise_gemm.f8f8bf16_blockwise),
    ("f8f8bf16_groupwise", True, fp8_blockwise_gemm.f8f8bf16_groupwise),
):
    bench.register(
        bench.BenchSpec(
            name=name,
            op=f"mslk::{name}",
            shapes=LARGE,
            make_inputs=lambda s, device, groupwise=groupwise: _block_inputs(s, device, groupwise),
            run=lambda i, gemm=gemm: gemm(*i[1]),
            baselines={"torch._scaled_mm rowwise": _rowwise_baseline},
            flops=lambda s: 2 * s["M"] * s["N"] * s["K"],
            domain="gemm",
        )
    )


GROUPED = [
    {"G": 8, "rows": 2048, "N": 4096, "K": 7168},
    {"G": 64, "rows": 128, "N": 2048, "K": 7168},
    {"G": 16, "rows": 512, "N": 2048, "K": 5120},  # Llama-4 experts
    {"G": 128, "rows": 64, "N": 2048, "K": 7168},  # DeepSeek-V3 experts
]


def _grouped_inputs(shape: dict, device: torch.device):
    """bf16 X [G·rows, K] and W [G, N, K], int64 M_sizes, int32 offsets for torch._grouped_mm."""
    x = testing.randn(shape["G"] * shape["rows"], shape["K"], dtype=torch.bfloat16, device=device)
    w = testing.randn(shape["G"], shape["N"], shape["K"], dtype=torch.bfloat16, device=device)
    m_sizes = torch.full((shape["G"],), shape["rows"], dtype=torch.int64, device=device)
    return x, w, m_sizes, torch.cumsum(m_sizes, 0).to(torch.int32)


bench.register(
    bench.BenchSpec(
        name="bf16bf16bf16_grouped_stacked",
        op="mslk::bf16bf16bf16_grouped_stacked",
        shapes=GROUPED,
        make_inputs=_grouped_inputs,
        run=lambda i: grouped_gemm.bf16bf16bf16_grouped_stacked(i[0], i[1], i[2]),
        baselines={"torch._grouped_mm": lambda i: torch._grouped_mm(i[0], i[1].transpose(-2, -1), offs=i[3])},
        flops=lambda s: 2 * s["G"] * s["rows"] * s["N"] * s["K"],
        domain="gemm",
    )
)


def _grouped_fp8_inputs(shape: dict, device: torch.device):
    """The bf16 grouped inputs, and the same X and W rowwise-quantized to FP8 (x_scale [G·rows], w_scale [G, N])."""
    x, w, m_sizes, offsets = _grouped_inputs(shape, device)
    xq, x_scale = fp8_gemm.quantize_rows(x)
    wq, w_scale = fp8_gemm.quantize_rows(w.flatten(0, 1))
    return (x, w, m_sizes, offsets), (xq, wq.view_as(w), x_scale, w_scale.view(shape["G"], shape["N"]), m_sizes)


def _scaled_grouped_mm(i):
    (_, _, _, offsets), (xq, wq, x_scale, w_scale, _) = i
    return torch._scaled_grouped_mm(
        xq, wq.transpose(-2, -1), x_scale, w_scale, offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=True
    )


# The FP8 target (PERF: at least 1.6x MSLK's BF16 grouped GEMM) compares with the BF16 kernel on the same data.
bench.register(
    bench.BenchSpec(
        name="f8f8bf16_rowwise_grouped_stacked",
        op="mslk::f8f8bf16_rowwise_grouped_stacked",
        shapes=GROUPED,
        make_inputs=_grouped_fp8_inputs,
        run=lambda i: grouped_gemm.f8f8bf16_rowwise_grouped_stacked(*i[1]),
        baselines={
            "mslk bf16bf16bf16_grouped_stacked": lambda i: grouped_gemm.bf16bf16bf16_grouped_stacked(*i[0][:3]),
            "torch._scaled_grouped_mm": _scaled_grouped_mm,
        },
        flops=lambda s: 2 * s["G"] * s["rows"] * s["N"] * s["K"],
        domain="gemm",
    )
)
