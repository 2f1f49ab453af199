"""Branch mla-waves only: MLA decode with main's key splits (cdiv(SMs, programs)) against the branch's (the fewest
waves), on the GPU, in one process.

    PYTHONPATH=$(printf '%s:' $PWD/packages/*/src) python3 tools/mla_splits_ab.py
    (then: python3 -m pytest packages/mslk-attention/tests/test_mla.py -m gpu)

Prints each shape's splits, error against the float64 reference (small shapes) and CUDA-graph times, alternated.
"""

import torch
import triton

import mslk.attention  # noqa: F401
from mslk.attention import mla
from mslk.core import arch, launch, testing

# (B sequences, query tokens a sequence, keys a sequence, heads)
SHAPES = [
    (32, 1, 4096, 128),
    (64, 1, 4096, 128),
    (128, 1, 4096, 128),
    (4, 2, 16384, 128),
    (8, 1, 32768, 128),
    (1, 1, 65536, 128),
    (35, 1, 8192, 128),
    (64, 1, 4096, 16),
    (128, 1, 8192, 16),
    (64, 1, 4096, 32),
    (8, 1, 16384, 16),
]
fewest_waves = mla._splits


def cdiv_sms(programs, key_rows, query, cfg):
    return max(1, min(launch.cdiv(arch.sm_count(query.device), programs), key_rows // 256))


for B, Q, L, H in SHAPES:
    kv, tables, used = mla.random_cache([L] * B, 64, torch.bfloat16, "cuda")
    query = testing.randn(B * Q, H, 576, device="cuda").to(torch.bfloat16)
    starts = torch.arange(0, B * Q + 1, Q, dtype=torch.int32, device="cuda")
    args = (query, kv, tables, starts, used)
    ref = mla._reference("x", *args) if B * L <= 32 * 4096 else None
    cfg = mla._config(query)
    programs = B * Q * launch.cdiv(H, cfg["BLOCK_H"])
    row = {}
    for _ in range(2):
        for name, rule in (("main", cdiv_sms), ("waves", fewest_waves)):
            mla._splits = rule
            splits = rule(programs, tables.shape[1] * 64, query, cfg)
            out = mla._run(*args)
            err = testing.rel_error(out, ref) if ref is not None else float("nan")
            ms = triton.testing.do_bench_cudagraph(lambda args=args: mla._run(*args), rep=100)
            row.setdefault(name, []).append(f"{ms * 1e3:.1f} us (splits {splits}, err {err:.1e})")
    print(dict(B=B, Q=Q, L=L, H=H), row, flush=True)
