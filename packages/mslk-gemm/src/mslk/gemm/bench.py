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


# The op as dispatched, eager and (decode) under graphs; and pinned to the Triton kernel under graphs at the two
# shapes of its PERF target (0.95x `_scaled_mm`): eager, its host path takes longer than the kernel there.
for name, shapes, graph, backend in (
    ("f8f8bf16_rowwise", LARGE, False, None),
    ("f8f8bf16_rowwise_decode", DECODE, True, None),
    ("f8f8bf16_rowwise_triton", LARGE[:2], True, "triton"),
):
    bench.register(
        bench.BenchSpec(
            name=name,
            op="mslk::f8f8bf16_rowwise",
            shapes=shapes,
            make_inputs=_inputs,
            run=lambda i, backend=backend: fp8_gemm.f8f8bf16_rowwise_op(*i, backend=backend),
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
    {"G": 256, "rows": 32, "N": 2048, "K": 7168},  # all 256 of DeepSeek-V3's routed experts
    {"G": 16, "rows": 512, "N": 14336, "K": 5120},  # wide experts (Mixtral-size N)
]


def _grouped_rows(shape: dict, device: torch.device):
    """bf16 X [G·rows, K], int64 M_sizes, int32 offsets for torch._grouped_mm."""
    x = testing.randn(shape["G"] * shape["rows"], shape["K"], dtype=torch.bfloat16, device=device)
    m_sizes = torch.full((shape["G"],), shape["rows"], dtype=torch.int64, device=device)
    return x, m_sizes, torch.cumsum(m_sizes, 0).to(torch.int32)


def _grouped_inputs(shape: dict, device: torch.device):
    """_grouped_rows with bf16 W [G, N, K] second."""
    x, m_sizes, offsets = _grouped_rows(shape, device)
    w = testing.randn(shape["G"], shape["N"], shape["K"], dtype=torch.bfloat16, device=device)
    return x, w, m_sizes, offsets


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


def _fp32_inputs(shape: dict, device: torch.device):
    return testing.randn(shape["M"], shape["K"], device=device), testing.randn(shape["N"], shape["K"], device=device)


def _bf16x9_triton(i):
    from mslk.gemm.triton.bf16x9_gemm import bf16x9_gemm_op  # imported on use: this module loads first

    return bf16x9_gemm_op(*i, backend="triton")


def _fp32_matmul(tf32: bool):
    """torch.matmul of the fp32 inputs with TF32 tensor cores allowed or not (the global flag is restored)."""

    def run(i):
        saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            return torch.matmul(i[0], i[1].T)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved

    return run


# FP32 GEMM on bf16 tensor cores (Triton backend) against cuBLAS fp32 (the speed target: 1.5x at 8192^3 with
# TF32 off) and TF32 (faster, but 10-bit mantissas); its accuracy is test_gpu_fp32_accuracy's (pytest -s).
bench.register(
    bench.BenchSpec(
        name="bf16x9_gemm",
        op="mslk::bf16x9_gemm",
        shapes=[{"M": 4096, "N": 4096, "K": 4096}, {"M": 8192, "N": 8192, "K": 8192}],
        make_inputs=_fp32_inputs,
        run=_bf16x9_triton,
        baselines={"torch.matmul fp32": _fp32_matmul(False), "torch.matmul tf32": _fp32_matmul(True)},
        flops=lambda s: 2 * s["M"] * s["N"] * s["K"],
        bytes=lambda s: 4 * (s["M"] * s["K"] + s["N"] * s["K"] + s["M"] * s["N"]),
        domain="gemm",
    )
)


# ------------------------------------------------------------------------ f8f8bf16_cublas (cuBLASLt, native)


def _cublas_tensorwise_inputs(shape: dict, device: torch.device):
    from mslk.gemm.native.fp8_gemm import quantize_tensor  # imported on use: this module loads first

    xq, x_scale = quantize_tensor(testing.randn(shape["M"], shape["K"], device=device))
    wq, w_scale = quantize_tensor(testing.randn(shape["N"], shape["K"], device=device))
    return xq, wq, x_scale, w_scale


def _f8f8bf16_cublas(i):
    from mslk.gemm.native.fp8_gemm import f8f8bf16_cublas

    return f8f8bf16_cublas(*i)


def _scaled_mm_tensorwise(i):
    xq, wq, x_scale, w_scale = i
    return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16, use_fast_accum=True)


# The same cuBLASLt FP8 kernels behind a C ABI and through torch: the ratio is what MSLK's call path costs (or
# saves); decode shapes under CUDA graphs. Rowwise scales (sm_90: cuBLASLt's outer-vector scaling) against
# torch._scaled_mm rowwise and MSLK's rowwise GEMM on the same inputs.
for name, shapes, graph in (("f8f8bf16_cublas", LARGE, False), ("f8f8bf16_cublas_decode", DECODE, True)):
    bench.register(
        bench.BenchSpec(
            name=name,
            op="mslk::f8f8bf16_cublas",
            shapes=shapes,
            make_inputs=_cublas_tensorwise_inputs,
            run=_f8f8bf16_cublas,
            baselines={"torch._scaled_mm tensorwise": _scaled_mm_tensorwise},
            flops=lambda s: 2 * s["M"] * s["N"] * s["K"],
            bytes=lambda s: s["M"] * s["K"] + s["N"] * s["K"] + 2 * s["M"] * s["N"],
            cuda_graph=graph,
            domain="gemm",
        )
    )
bench.register(
    bench.BenchSpec(
        name="f8f8bf16_cublas_rowwise",
        op="mslk::f8f8bf16_cublas",
        shapes=LARGE,
        make_inputs=_inputs,
        run=_f8f8bf16_cublas,
        baselines={
            "torch._scaled_mm rowwise": _scaled_mm,
            "mslk f8f8bf16_rowwise": lambda i: fp8_gemm.f8f8bf16_rowwise(*i),
        },
        flops=lambda s: 2 * s["M"] * s["N"] * s["K"],
        bytes=lambda s: s["M"] * s["K"] + s["N"] * s["K"] + 2 * s["M"] * s["N"],
        domain="gemm",
    )
)


# --------------------------------------------------------------------------- INT4 / INT8 weight GEMMs (Triton)

# N = K = 8192, group 128 (PERF.md): prefill, and decode under CUDA graphs. Every spec's baseline is torch.matmul in
# bf16 on the same weights dequantized ahead of time (what serving without the INT4/INT8 kernel costs).
INT_PREFILL = [{"M": m, "N": 8192, "K": 8192} for m in (1024, 8192)]
INT_DECODE = [{"M": m, "N": 8192, "K": 8192} for m in (1, 16, 64)]
_INT4_GROUP = 128
# Decode replays back to back and 8192 x 8192 int4 weights (32 MiB) fit in the H200's L2 (50 MiB): each call
# takes the next of 3 copies, so that the weights come from HBM as in a model's decode step.
_DECODE_COPIES = 3


class _Rotation:
    """Copies of the weights, handed out in turn (also inside a captured CUDA graph: one per unrolled call)."""

    def __init__(self, copies: list):
        self.copies, self.turn = copies, 0

    def next(self):
        self.turn = (self.turn + 1) % len(self.copies)
        return self.copies[self.turn]


def _int_weight_copies(shape: dict, make) -> _Rotation:
    """`make()` -> (the op's weight arguments, bf16 dequantized weights [N, K]), once per copy."""
    return _Rotation([make() for _ in range(_DECODE_COPIES if shape["M"] <= 64 else 1)])


def _int4_inputs(shape: dict, device: torch.device, shuffled: bool, fp8: bool):
    """X (bf16, and FP8 with rowwise scales) and rotating int4 weights: bf16 group scales and zeros, or the FP8
    tables and fp32 row scales of f8i4bf16_shuffled."""
    from mslk.gemm.triton import int4_gemm  # imported on use: this module loads first

    n, k = shape["N"], shape["K"]

    def make():
        w = int4_gemm.random_int4(n, k, device=device)
        if fp8:
            table = int4_gemm.random_fp8_table(n, k, group_size=_INT4_GROUP, device=device)
            row_scale = torch.rand(n, device=device) + 0.5
            dequantized = int4_gemm.dequantize_int4_table(w, table) * row_scale[:, None]
            return (w, row_scale, table), dequantized.to(torch.bfloat16)
        scale, zero = int4_gemm.random_group_scales(n, k, group_size=_INT4_GROUP, device=device)
        dequantized = int4_gemm.dequantize_int4(w, scale, zero, shuffled=shuffled)
        return (w, scale, zero), dequantized.to(torch.bfloat16)

    x = testing.randn(shape["M"], k, dtype=torch.bfloat16, device=device)
    return x, fp8_gemm.quantize_rows(x) if fp8 else None, _int_weight_copies(shape, make)


def _int4_run(name: str):
    def run(i):
        from mslk.gemm.triton import int4_gemm

        x, x_fp8, weights = i
        w = weights.next()[0]
        if name == "f8i4bf16_shuffled":
            return int4_gemm.f8i4bf16_shuffled(x_fp8[0], w[0], x_fp8[1], w[1], w[2])
        return getattr(int4_gemm, name)(x, *w)

    return run


def _dequantized_matmul(i):
    x, weights = i[0], i[-1]
    return torch.matmul(x.to(torch.bfloat16), weights.next()[1].T)


def _int4_bytes(s: dict, fp8: bool) -> int:
    """Activations, int4 weights, scales (bf16 scale + zero, or the 8-entry FP8 table + row scales), bf16 out."""
    groups = -(-s["K"] // _INT4_GROUP)
    scales = groups * s["N"] * 8 + 4 * (s["N"] + s["M"]) if fp8 else 2 * 2 * groups * s["N"]
    return s["M"] * s["K"] * (1 if fp8 else 2) + s["N"] * s["K"] // 2 + scales + 2 * s["M"] * s["N"]


def _register_prefill_and_decode(name: str, prefill: list, decode: list, **spec) -> None:
    """Specs `name` over the prefill shapes and `name_decode` over the decode shapes (under CUDA graphs: launch-bound),
    both of op mslk::name."""
    for suffix, shapes, graph in (("", prefill, False), ("_decode", decode, True)):
        bench.register(
            bench.BenchSpec(
                name=name + suffix, op=f"mslk::{name}", shapes=shapes, cuda_graph=graph, domain="gemm", **spec
            )
        )


for _name, _shuffled, _fp8 in (
    ("bf16i4bf16_rowwise", False, False),
    ("bf16i4bf16_shuffled", True, False),
    ("f8i4bf16_shuffled", True, True),
):
    _register_prefill_and_decode(
        _name,
        INT_PREFILL,
        INT_DECODE,
        make_inputs=lambda s, device, shuffled=_shuffled, fp8=_fp8: _int4_inputs(s, device, shuffled, fp8),
        run=_int4_run(_name),
        baselines={"torch.matmul bf16 (dequantized)": _dequantized_matmul},
        flops=lambda s: 2 * s["M"] * s["N"] * s["K"],
        bytes=lambda s, fp8=_fp8: _int4_bytes(s, fp8),
    )


def _int4_grouped_inputs(shape: dict, device: torch.device, shuffled: bool):
    """The bf16 grouped inputs with W as int4 [G, N, K/2] (groups of 128, bf16 scales and zeros), and its
    dequantized bf16 copy for torch._grouped_mm."""
    from mslk.gemm.triton import int4_gemm

    x, m_sizes, offsets = _grouped_rows(shape, device)
    g, n, k = shape["G"], shape["N"], shape["K"]
    w = int4_gemm.random_int4(g, n, k, device=device)
    scale, zero = int4_gemm.random_group_scales(g, n, k, group_size=_INT4_GROUP, device=device)
    dequantized = int4_gemm.dequantize_int4(w, scale, zero, shuffled=shuffled).to(torch.bfloat16)
    return x, (w, scale, zero), m_sizes, offsets, dequantized


# MoE decode steps: a few tokens an expert (DeepSeek-V3's and Llama-4's expert shapes), under CUDA graphs as the
# INT4 decode specs (the weights, 117 MB to 940 MB, do not fit in L2).
GROUPED_DECODE = [
    {"G": 128, "rows": 4, "N": 2048, "K": 7168},
    {"G": 64, "rows": 8, "N": 2048, "K": 7168},
    {"G": 16, "rows": 16, "N": 4096, "K": 7168},
    {"G": 8, "rows": 1, "N": 4096, "K": 7168},
]

for _name, _shuffled in (("bf16i4bf16_rowwise_grouped", False), ("bf16i4bf16_shuffled_grouped", True)):
    _register_prefill_and_decode(
        _name,
        GROUPED,
        GROUPED_DECODE,
        make_inputs=lambda s, device, shuffled=_shuffled: _int4_grouped_inputs(s, device, shuffled),
        run=lambda i, name=_name: getattr(torch.ops.mslk, name)(i[0], *i[1], i[2]),
        baselines={"torch._grouped_mm bf16 (dequantized)": lambda i: torch._grouped_mm(i[0], i[4].mT, offs=i[3])},
        flops=lambda s: 2 * s["G"] * s["rows"] * s["N"] * s["K"],
        bytes=lambda s: s["G"] * _int4_bytes({"M": s["rows"], "N": s["N"], "K": s["K"]}, fp8=False),
    )


def _int8_inputs(shape: dict, device: torch.device):
    from mslk.gemm.triton import int8_gemm  # imported on use: this module loads first

    def make():
        wq = int8_gemm.random_int8(shape["N"], shape["K"], device=device)
        return wq, wq.to(torch.bfloat16)

    return int8_gemm.random_int8(shape["M"], shape["K"], device=device), _int_weight_copies(shape, make)


def _i8i8bf16(i):
    from mslk.gemm.triton import int8_gemm

    return int8_gemm.i8i8bf16(i[0], i[1].next()[0], 1e-4)


def _int_mm(i):
    return torch._int_mm(i[0], i[1].next()[0].T)


for _suffix, _shapes, _graph in (("", INT_PREFILL, False), ("_decode", INT_DECODE, True)):
    bench.register(
        bench.BenchSpec(
            name="i8i8bf16" + _suffix,
            op="mslk::i8i8bf16",
            shapes=_shapes,
            make_inputs=_int8_inputs,
            run=_i8i8bf16,
            # torch._int_mm (cuBLAS int8, int32 out) takes M > 16 only: prefill alone.
            baselines={"torch.matmul bf16 (dequantized)": _dequantized_matmul}
            | ({} if _graph else {"torch._int_mm": _int_mm}),
            flops=lambda s: 2 * s["M"] * s["N"] * s["K"],
            bytes=lambda s: s["M"] * s["K"] + s["N"] * s["K"] + 2 * s["M"] * s["N"],
            cuda_graph=_graph,
            domain="gemm",
        )
    )


# ----------------------------------------------- grouped: dgrad, wgrad, groupwise, the fused scatter-add


def _grouped_backward_inputs(shape: dict, device: torch.device):
    """dY [G·rows, N] and the forward's X [G·rows, K] and W [G, N, K] (bf16), int64 M_sizes, int32 offsets."""
    x, w, m_sizes, offsets = _grouped_inputs(shape, device)
    return testing.randn(x.shape[0], shape["N"], dtype=torch.bfloat16, device=device), x, w, m_sizes, offsets


# dX = dY · W[g] (W's N-contiguous view, no copy) and dW[g] = dY[rows of g]ᵀ · X[rows of g], as MoE training runs them.
for _name, _run, _baseline in (
    (
        "bf16bf16bf16_grouped_grad",
        lambda i: grouped_gemm.bf16bf16bf16_grouped_grad(i[0], i[2].mT, i[3]),
        lambda i: torch._grouped_mm(i[0], i[2], offs=i[4]),
    ),
    (
        "bf16bf16bf16_grouped_wgrad",
        lambda i: grouped_gemm.bf16bf16bf16_grouped_wgrad(i[0], i[1], i[3]),
        lambda i: torch._grouped_mm(i[0].mT, i[1], offs=i[4]),
    ),
):
    bench.register(
        bench.BenchSpec(
            name=_name,
            op=f"mslk::{_name}",
            shapes=GROUPED,
            make_inputs=_grouped_backward_inputs,
            run=_run,
            baselines={"torch._grouped_mm": _baseline},
            flops=lambda s: 2 * s["G"] * s["rows"] * s["N"] * s["K"],
            domain="gemm",
        )
    )


def _groupwise_grouped_inputs(shape: dict, device: torch.device):
    """The rowwise FP8 grouped inputs (for the baseline) and the groupwise ones of the same X and W."""
    (x, w, m_sizes, _), rowwise = _grouped_fp8_inputs(shape, device)
    return rowwise, (*grouped_gemm.groupwise_grouped_inputs(x.float(), w.float(), m_sizes), m_sizes)


bench.register(
    bench.BenchSpec(
        name="f8f8bf16_groupwise_grouped",
        op="mslk::f8f8bf16_groupwise_grouped",
        shapes=GROUPED,
        make_inputs=_groupwise_grouped_inputs,
        run=lambda i: grouped_gemm.f8f8bf16_groupwise_grouped(*i[1]),
        baselines={
            "mslk f8f8bf16_rowwise_grouped_stacked": lambda i: grouped_gemm.f8f8bf16_rowwise_grouped_stacked(*i[0]),
        },
        flops=lambda s: 2 * s["G"] * s["rows"] * s["N"] * s["K"],
        domain="gemm",
    )
)


def _scatter_inputs(shape: dict, device: torch.device):
    """The bf16 grouped inputs, w as [G·N, K] (grouped_gemm's layout), a permutation of the rows as the tokens
    they add into (top-1 routing) and the bf16 [G·rows, N] target."""
    x, w, m_sizes, offsets = _grouped_inputs(shape, device)
    indices = torch.randperm(x.shape[0], device=device)
    output = torch.zeros(x.shape[0], shape["N"], dtype=torch.bfloat16, device=device)
    return x, w, m_sizes, offsets, indices, output


# The MoE down projection: the grouped GEMM whose rows are added into their tokens, in one kernel here against
# torch._grouped_mm then index_add_ (the result written and read again).
bench.register(
    bench.BenchSpec(
        name="grouped_gemm_scatter_add",
        op="mslk::grouped_gemm_scatter_add",
        shapes=GROUPED,
        make_inputs=_scatter_inputs,
        run=lambda i: grouped_gemm.grouped_gemm(
            i[0], i[1].flatten(0, 1), i[2], _output_tensor=i[5], _scatter_add_indices=i[4]
        ),
        baselines={
            "torch._grouped_mm + index_add_": lambda i: i[5].index_add_(
                0, i[4], torch._grouped_mm(i[0], i[1].mT, offs=i[3])
            ),
        },
        flops=lambda s: 2 * s["G"] * s["rows"] * s["N"] * s["K"],
        domain="gemm",
    )
)
