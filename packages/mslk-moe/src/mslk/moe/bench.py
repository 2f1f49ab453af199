"""Bench specs of mslk.moe (`mslk bench --op index_shuffling`, ...).

Routing inputs are random router scores [T, E] routed by index_shuffling, so the index arrays are what the
MoE layers hand the kernels. Baselines in the same run: the plain-PyTorch implementation of the op on the GPU
(gather_scale_quant_dense_tokens: MSLK's two unfused kernels) and, for the data movers, a device-to-device copy
of as many bytes as the op must move (inputs read once, outputs written once). index_shuffling is launch-bound
and runs under CUDA graphs, and once eagerly (host time included) at the PERF.md shape.
"""

from __future__ import annotations

import torch

from mslk.core import arch, bench
from mslk.moe import gather_scatter, shuffling
from mslk.quantize.triton.fp8_quantize import quantize_fp8_row

ROUTING = [{"T": t, "E": e, "top_k": k} for t in (128, 2048, 16384) for e in (16, 128, 256) for k in (1, 8)]
TOKENS = [
    {"T": 16384, "D": 5120, "top_k": 1},
    {"T": 16384, "D": 7168, "top_k": 1},
    {"T": 2048, "D": 5120, "top_k": 8},
    {"T": 2048, "D": 7168, "top_k": 8},
]


def _scores(shape: dict, device: torch.device) -> torch.Tensor:
    return torch.randn(shape["T"], shape["E"], device=device, dtype=torch.bfloat16)


def _routing_inputs(shape: dict, device: torch.device):
    return (_scores(shape, device), shape["top_k"])


for _name, _shapes, _graph in (
    ("index_shuffling", ROUTING, True),
    ("index_shuffling_eager", [{"T": 16384, "E": 128, "top_k": 1}], False),
):
    bench.register(
        bench.BenchSpec(
            name=_name,
            op="mslk::index_shuffling",
            shapes=_shapes,
            make_inputs=_routing_inputs,
            run=lambda i: shuffling.index_shuffling(i[0], top_k=i[1]),
            baselines={"torch eager reference": lambda i: shuffling._index_shuffling(i[0], top_k=i[1])},
            bytes=lambda s: 2 * s["T"] * s["E"] + 8 * s["T"] * s["top_k"],
            cuda_graph=_graph,
        )
    )


def _token_inputs(shape: dict, device: torch.device, moved_bytes: int):
    """x [T, D] bf16, router scores [T, 128], index_shuffling's arrays, the expert-ordered rows [T·k, D], and
    two buffers for the copy baseline."""
    t, d, k = shape["T"], shape["D"], shape["top_k"]
    scores = torch.rand(t, 128, device=device)
    _, experts, tokens = shuffling.index_shuffling(scores, top_k=k)
    x = torch.randn(t, d, device=device, dtype=torch.bfloat16)
    rows = torch.randn(t * k, d, device=device, dtype=torch.bfloat16)
    return x, scores, experts, tokens, rows, *bench.copy_buffers(moved_bytes, device)


def _gather_bytes(shape: dict) -> int:
    return 2 * 2 * shape["T"] * shape["top_k"] * shape["D"]  # rows read once and written once (bf16)


def _gather_quant_bytes(shape: dict) -> int:
    return 3 * shape["T"] * shape["top_k"] * shape["D"]  # rows read once (bf16), written once (FP8)


def _scatter_bytes(shape: dict) -> int:
    return 2 * shape["T"] * shape["D"] * (shape["top_k"] + 2)  # expert rows and out read, out written


bench.register(
    bench.BenchSpec(
        name="gather_scale_dense_tokens",
        op="mslk::gather_scale_dense_tokens",
        shapes=TOKENS,
        make_inputs=lambda s, device: _token_inputs(s, device, _gather_bytes(s)),
        run=lambda i: gather_scatter.gather_scale_dense_tokens(i[0], i[3], i[2], i[1]),
        baselines={
            "copy same bytes": lambda i: i[6].copy_(i[5]),
            "torch eager reference": lambda i: gather_scatter._gather(i[0], i[3], i[2], i[1]),
        },
        bytes=_gather_bytes,
    )
)
bench.register(
    bench.BenchSpec(
        name="gather_scale_quant_dense_tokens",
        op="mslk::gather_scale_quant_dense_tokens",
        shapes=TOKENS,
        make_inputs=lambda s, device: _token_inputs(s, device, _gather_quant_bytes(s)),
        run=lambda i: gather_scatter.gather_scale_quant_dense_tokens(i[0], i[3], i[2], i[1]),
        baselines={
            "mslk gather_scale_dense_tokens then quantize_fp8_row": lambda i: quantize_fp8_row(
                gather_scatter.gather_scale_dense_tokens(i[0], i[3], i[2], i[1]), eps_opt=arch.FP8_EPS
            ),
            "copy same bytes": lambda i: i[6].copy_(i[5]),
        },
        bytes=_gather_quant_bytes,
    )
)
bench.register(
    bench.BenchSpec(
        name="scatter_add_dense_tokens",
        op="mslk::scatter_add_dense_tokens",
        shapes=TOKENS,
        make_inputs=lambda s, device: _token_inputs(s, device, _scatter_bytes(s)),
        run=lambda i: gather_scatter.scatter_add_dense_tokens(i[0], i[4], i[3]),
        baselines={
            "copy same bytes": lambda i: i[6].copy_(i[5]),
            "torch index_add_ (bf16)": lambda i: i[0].index_add_(0, i[3], i[4]),
        },
        bytes=_scatter_bytes,
    )
)


# Expert-parallel regrouping (spec M-09, M-10) of T received rows, as the MoE layers run it: EP ranks' rows back to
# back for this rank's EG experts (dynamic exchange: ragged counts, all kept), or all ranks' slabs of T/EP rows with
# counts for all E experts, of which this rank keeps EG (static exchange: is_padded, each slab split evenly).
REGROUP = [
    {"T": 16384, "D": 5120, "EP": 8, "E": 16, "EG": 16, "padded": False},
    {"T": 16384, "D": 7168, "EP": 8, "E": 32, "EG": 32, "padded": False},
    {"T": 16384, "D": 5120, "EP": 8, "E": 128, "EG": 16, "padded": True},
    {"T": 2048, "D": 7168, "EP": 16, "E": 256, "EG": 16, "padded": True},
]


def _kept_rows(shape: dict) -> int:
    return shape["T"] * shape["EG"] // shape["E"] if shape["padded"] else shape["T"]


def _regroup_bytes(shape: dict) -> int:
    return 2 * shape["D"] * (_kept_rows(shape) + shape["T"])  # kept rows read once, all rows written (bf16)


def _regroup_inputs(shape: dict, device: torch.device):
    """(rank-ordered tokens [T, D] bf16, token_counts int32 [EP, E], the expert-ordered rows combine_shuffling
    makes of them, the op's other arguments (experts [0, EG), is_padded), two buffers for the copy baseline)."""
    t, ranks, experts = shape["T"], shape["EP"], shape["E"]
    if shape["padded"]:  # an even split of each slab (as _kept_rows counts)
        counts = torch.full((ranks, experts), t // ranks // experts, dtype=torch.int32)
    else:  # T rows over the EP x E chunks at random
        chunk = torch.randint(0, ranks * experts, (t,))
        counts = torch.bincount(chunk, minlength=ranks * experts).view(ranks, experts).int()
    tokens = torch.randn(t, shape["D"], device=device, dtype=torch.bfloat16)
    counts, args = counts.to(device), (0, shape["EG"], shape["padded"])
    combined, _ = shuffling._combine(tokens, counts, *args)
    return tokens, counts, combined, args, *bench.copy_buffers(_regroup_bytes(shape), device)


for _name, _run, _reference, _rows in (
    ("combine_shuffling", shuffling.combine_shuffling, shuffling._combine, 0),
    ("split_shuffling", shuffling.split_shuffling, shuffling._split, 2),
):
    bench.register(
        bench.BenchSpec(
            name=_name,
            op=f"mslk::{_name}",
            shapes=REGROUP,
            make_inputs=_regroup_inputs,
            run=lambda i, run=_run, rows=_rows: run(i[rows], i[1], *i[3]),
            baselines={
                "copy same bytes": lambda i: i[5].copy_(i[4]),
                "torch eager reference": lambda i, ref=_reference, rows=_rows: ref(i[rows], i[1], *i[3]),
            },
            bytes=_regroup_bytes,
        )
    )


LAYERS = [
    {"tokens": 4096, "dim": 5120, "hidden_dim": 8192, "experts": 16, "top_k": 1, "precision": "bf16"},
    {"tokens": 4096, "dim": 5120, "hidden_dim": 8192, "experts": 16, "top_k": 1, "precision": "fp8_rowwise"},
    {"tokens": 512, "dim": 5120, "hidden_dim": 8192, "experts": 16, "top_k": 1, "precision": "bf16"},
]


def _layer_inputs(shape: dict, device: torch.device):
    """The same weights in a MetaShufflingMoE and a BaselineMoE (one rank), and tokens x [1, T, D]."""
    from mslk.moe import layers

    args = layers.MoEArgs(
        shape["precision"], shape["dim"], shape["hidden_dim"], shape["experts"], shape["top_k"], 1, 1, None
    )
    with torch.device(device):
        torch.manual_seed(0)
        fast = layers.MetaShufflingMoE(None, None, args).build()
        torch.manual_seed(0)
        baseline = layers.BaselineMoE(None, None, args).build()
    x = torch.randn(1, shape["tokens"], shape["dim"], device=device, dtype=torch.bfloat16)
    return fast, baseline, x


def _layer_flops(shape: dict) -> float:
    """The routed experts' (top_k per token) and the shared expert's three GEMMs: what the layer must compute."""
    return 2 * shape["tokens"] * (shape["top_k"] + 1) * 3 * shape["dim"] * shape["hidden_dim"]


bench.register(
    bench.BenchSpec(
        name="moe_layer",
        op="mslk::index_shuffling",
        shapes=LAYERS,
        make_inputs=_layer_inputs,
        run=lambda i: i[0](i[2], use_static_shape=False),
        baselines={"BaselineMoE (dense, masked bmm)": lambda i: i[1](i[2], use_static_shape=False)},
        flops=_layer_flops,
    )
)
