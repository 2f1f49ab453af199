"""MoE layers on several ranks (spec M-12, M-13): expert parallelism (EP, static and dynamic exchange), tensor
parallelism (TP, with and without dedup_comm) and both together give the single-rank output on the same weights
and tokens.

Each test runs this file as one worker process per rank (gloo on CPU; NCCL on GPUs), which rendezvous through
a FileStore and compare their output with a single-rank layer themselves; the test fails when a worker does,
and when they run out of time (the process group's timeout also ends any collective left waiting).
"""

import itertools
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

WORKER_TIMEOUT_S = 180
COLLECTIVE_TIMEOUT_S = 60
# Ranks -> (EP, TP) layouts run by one launch; rank = ep_rank · TP + mp_rank.
TOPOLOGIES = {2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1)]}


def _launch(world: int, backend: str, tmp_path) -> None:
    store = tmp_path / "store"
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(world), backend, str(store)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    outputs = []
    try:
        for worker in workers:
            outputs.append(worker.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
    except subprocess.TimeoutExpired:
        for worker in workers:
            worker.kill()
        pytest.fail(f"{world} {backend} workers did not finish within {WORKER_TIMEOUT_S} s")
    failed = [
        f"rank {rank} exited {worker.returncode}:\n{out}"
        for rank, (worker, out) in enumerate(zip(workers, outputs, strict=True))
        if worker.returncode != 0
    ]
    assert not failed, "\n".join(failed)


def test_ep_and_tp_on_two_gloo_ranks(tmp_path):
    """EP=2 (static and dynamic paths; dynamic with different token counts per rank), then TP=2."""
    _launch(2, "gloo", tmp_path)


def test_ep_times_tp_and_ep4_on_four_gloo_ranks(tmp_path):
    """EP=2 x TP=2 with and without dedup_comm, then EP=4."""
    _launch(4, "gloo", tmp_path)


@pytest.mark.gpu
def test_ep_and_tp_on_two_gpus_nccl(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    _launch(2, "nccl", tmp_path)


# ------------------------------------------------------------------------------------------ the worker


def _groups(rank: int, ep: int, tp: int):
    """(ep_group, ep_mp_group, ep_rank, mp_rank) of `rank` for an EP x TP layout: TP ranks are neighbours.
    Every rank creates every group, in the same order, as torch.distributed requires; size-1 groups are None."""
    import torch.distributed as dist

    ep_rank, mp_rank = divmod(rank, tp)
    ep_groups = [dist.new_group([e * tp + m for e in range(ep)]) for m in range(tp)] if ep > 1 else None
    mp_groups = [dist.new_group([e * tp + m for m in range(tp)]) for e in range(ep)] if tp > 1 else None
    return (ep_groups and ep_groups[mp_rank]), (mp_groups and mp_groups[ep_rank]), ep_rank, mp_rank


def _check_topology(rank: int, ep: int, tp: int, device: torch.device) -> list[str]:
    """Every layer, precision, path and dedup_comm setting on this layout against one rank; returns failures.
    Never raises between collectives, so that the ranks stay in step."""
    # This file runs as a script here, so its folder is on sys.path.
    from test_layers import build, full_weights

    from mslk.core import testing
    from mslk.moe.layers import BaselineMoE, MetaShufflingMoE, MoEArgs

    cases = [(p, e, k) for p in ("bf16", "fp8_rowwise") for e, k in ((4, 1), (8, 2))]
    classes = (BaselineMoE, MetaShufflingMoE)
    if ep * tp > 2:  # keep the CPU test short: two ranks have run the rest
        cases, classes = cases[1:3], (MetaShufflingMoE,)
    ep_group, mp_group, ep_rank, mp_rank = _groups(rank, ep, tp)
    failures = []
    for case, (precision, experts, top_k) in enumerate(cases):
        args = MoEArgs(precision, 64, 96, experts, top_k, mp_size=tp, ep_size=ep)
        torch.manual_seed(case)  # the same weights on every rank
        full = {key: value.to(device) for key, value in full_weights(args).items()}
        single = {cls: build(cls, replace(args, ep_size=1, mp_size=1), full, device) for cls in classes}
        for cls in classes:
            dedups = (False, True) if cls is MetaShufflingMoE and ep > 1 and tp > 1 else (False,)
            for static, dedup in itertools.product((True, False), dedups):
                layer_args = replace(args, dedup_comm=dedup)
                model = build(cls, layer_args, full, device, ep_group, mp_group, ep_rank, mp_rank)
                # Tokens differ between EP ranks, not TP ranks; the dynamic path gets a different count on each.
                torch.manual_seed(1000 + ep_rank)
                seq = 13 + (4 * ep_rank if cls is MetaShufflingMoE and not static else 0)
                x = testing.randn(3, seq, 64, dtype=torch.bfloat16).to(device)
                out, expected = model(x, use_static_shape=static), single[cls](x, use_static_shape=static)
                # FP8 under TP quantizes each rank's share of the hidden activations with its own scales.
                tol = 1e-2 if precision == "bf16" else (2e-2 if tp == 1 else 0.1)
                err = testing.rel_error(out, expected)
                what = f"EP={ep} TP={tp} {cls.__name__} {args.precision} E={experts} top_k={top_k} static={static}"
                if not err <= tol:
                    failures.append(f"{what} dedup_comm={dedup}: relative error {err:.3g} > {tol} vs one rank")
    return failures


def _main(rank: int, world: int, backend: str, store: str) -> int:
    from datetime import timedelta

    import torch.distributed as dist

    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        failures = [f for ep, tp in TOPOLOGIES[world] for f in _check_topology(rank, ep, tp, device)]
    finally:
        dist.destroy_process_group()
    print("\n".join(failures) or f"rank {rank}: all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    rank, world, backend, store = sys.argv[1:]
    sys.exit(_main(int(rank), int(world), backend, store))
