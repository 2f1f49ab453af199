"""The split-K decoding kernel's configurations (triton_splitk._config's defaults come from it) on the bench's
DECODE shapes, in CUDA graphs, against SDPA and the dispatched call, in one process (about 4.5 minutes on an H100:
60 configurations a shape); outputs checked against SDPA's. On the GPU machine:

    export PYTHONPATH=$(printf '%s:' $PWD/packages/*/src)
    python3 tools/splitk_decode_sweep.py

Prints, a shape a line: SDPA's time and GB/s of K/V, the dispatched backend's time, the default configuration's and
the six fastest (split count 0: the fewest waves; block of keys, warps, stages).
"""

import itertools

import torch
import triton

from mslk.attention import bench, fmha
from mslk.attention.fmha import dispatch
from mslk.attention.fmha import triton_splitk as sk
from mslk.core import testing


def graph_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3


def sweep(shape: dict) -> None:
    inp, sdpa_inputs, _ = bench._decode_inputs(shape, torch.device("cuda"))
    kilobytes = 2 * shape["B"] * shape["L"] * shape["Hkv"] * bench._kv_row_bytes(shape) / 1e3  # / us = GB/s
    picked = dispatch._dispatch_fw(inp, False).NAME
    expected = bench._decode_sdpa((None, sdpa_inputs))
    times = {
        "SDPA": graph_us(lambda: bench._decode_sdpa((None, sdpa_inputs))),
        picked: graph_us(lambda: fmha._memory_efficient_attention_forward(inp)),
    }
    failed = {}
    for split, block_n, warps, stages in itertools.product([0, 2, 4, 8, 16], [32, 64, 128], [4, 8], [2, 3]):
        name = f"split {split} keys {block_n} warps {warps} stages {stages}"
        op = sk.FwOp.get_operator(split, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            out = fmha._memory_efficient_attention_forward(inp, op=op)
            error = testing.rel_error(out.reshape(expected.shape), expected)
            if error > 2e-2:
                failed[name] = f"error {error:.1e}"
                continue
            times[name] = graph_us(lambda op=op: fmha._memory_efficient_attention_forward(inp, op=op))
        except Exception as exc:  # a configuration that does not fit: reported, the sweep goes on
            failed[name] = type(exc).__name__
    fastest = sorted((t, n) for n, t in times.items() if n.startswith("split"))[:6]
    print(
        shape, f"SDPA {times['SDPA']:.1f} us ({kilobytes / times['SDPA']:.0f} GB/s); {picked} {times[picked]:.1f};",
        f"default {times.get('split 0 keys 64 warps 4 stages 2')};",
        "fastest", [(n, round(t, 1), round(kilobytes / t)) for t, n in fastest], "failed", failed, flush=True,
    )  # fmt: skip


for decode_shape in bench.DECODE:
    sweep(decode_shape)
