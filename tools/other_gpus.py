"""Compile MSLK's Triton kernels for a GPU this machine does not have, as the first launches there would.

    python tools/other_gpus.py sm120 [--only NAME ...] [--attention] [-v]

The host code decides as on that GPU (its compute capability, SM count, vendor) while a fake active driver reports
its target: every op's Triton backends run on their samples (CPU tensors), attention's Triton kernels on a matrix
of dtypes, head dims and masks (--attention), and each launch stops after its compile. A kernel asking more shared
memory than the GPU's blocks have raises OutOfResources as Triton's first launch would (launch.Launcher then tries
fewer stages). A call fails on an error (a compile error included), a kernel that still does not fit, or a kept
compile's key that holds a tensor (launch.fast); the exit status is the number of failures. Speed and results need
the GPU itself: this finds what would not run at all.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

os.environ.pop("TRITON_INTERPRET", None)

import torch
import triton.runtime.driver as driver
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import CompiledKernel
from triton.runtime.errors import OutOfResources

# name: (vendor, capability, SMs, shared memory a block may opt into, device name)
GPUS = {
    "sm80": ("nvidia", (8, 0), 108, 166912, "NVIDIA A100-SXM4-80GB"),
    "sm89": ("nvidia", (8, 9), 128, 101376, "NVIDIA GeForce RTX 4090"),
    "sm90": ("nvidia", (9, 0), 132, 232448, "NVIDIA H100 80GB HBM3"),
    "sm120": ("nvidia", (12, 0), 170, 101376, "NVIDIA GeForce RTX 5090"),
    "gfx942": ("amd", (9, 4), 304, 65536, "AMD Instinct MI300X"),
    "gfx950": ("amd", (9, 5), 256, 163840, "AMD Instinct MI355X"),
}


class FakeDriver:
    def __init__(self, gpu: str):
        vendor, capability, *_ = GPUS[gpu]
        major, minor = capability
        self.target = GPUTarget("hip", gpu, 64) if vendor == "amd" else GPUTarget("cuda", major * 10 + minor, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def install(gpu: str, compiled: list) -> None:
    """The fake GPU: its driver and launches (install_driver), and the host code's view of it (install_host)."""
    install_driver(gpu, compiled)
    install_host(gpu)


def install_driver(gpu: str, compiled: list) -> None:
    """The GPU's driver as Triton's compiles and launches see it: the active driver reports its target, and each
    compiled kernel's first launch records (kernel name, shared bytes) or raises OutOfResources as Triton's would;
    launches do nothing."""
    shared_limit = GPUS[gpu][3]

    def init_handles(kernel):
        if kernel.module is not None:
            return
        if kernel.metadata.shared > shared_limit:
            raise OutOfResources(kernel.metadata.shared, shared_limit, "shared memory")
        compiled.append((kernel.name, kernel.metadata.shared))
        kernel._run = lambda *args, **kwargs: None
        kernel.function, kernel.module, kernel.n_regs, kernel.n_spills = 0, object(), 0, 0

    CompiledKernel._init_handles = init_handles
    CompiledKernel.launch_metadata = lambda self, grid, stream, *args: None
    driver.set_active(FakeDriver(gpu))


def install_host(gpu: str) -> None:
    """The GPU as MSLK's host code sees it: CPU tensors report CUDA (`is_cuda`, which arch.on_hopper asks), and
    arch answers with the GPU's vendor, compute capability, SM count and shared memory."""
    vendor, capability, sm_count, shared_memory, name = GPUS[gpu]
    if vendor == "amd":
        torch.version.hip = "7.1.0"
    torch.Tensor.is_cuda = property(lambda self: True)
    torch.cuda.current_device = lambda: 0
    from mslk.core import arch

    arch._gpu_visible["any"] = True
    gfx = gpu if vendor == "amd" else None
    arch._device_infos[0] = arch.DeviceInfo(0, vendor, name, capability, sm_count, gfx, shared_memory)


def op_calls(only: list[str]):
    """(name, call, why declined) of every op's Triton backends (of the ops named in `only`, if any) on its samples."""
    from mslk.core import registry

    for qualname, op in registry.OPS.items():
        if op.samples is None or (only and qualname not in only and op.name not in only):
            continue
        for backend in op.backends:
            if "triton" not in backend.name or "cuda" not in backend.devices or backend.unavailable_reason:
                continue
            for i, sample in enumerate(op.samples(torch.device("cpu"))):
                name = f"{qualname} [{backend.name}, {sample.name or i}]"
                reasons = backend.reasons("cuda", sample.args, sample.kwargs)
                if reasons:
                    yield name, None, "; ".join(reasons)
                else:
                    yield name, (lambda b=backend, s=sample: b.impl(*s.args, **s.kwargs)), None


def attention_calls():
    """(name, call, why declined) of the Triton attention forward and backward over dtypes, head dims and masks."""
    from mslk.attention.fmha import attn_bias
    from mslk.attention.fmha import triton_flash as tf
    from mslk.attention.fmha.common import Inputs

    tf.FwOp.SUPPORTED_DEVICES = tf.BwOp.SUPPORTED_DEVICES = frozenset({"cpu", "cuda"})
    b, m, h = 2, 300, 2
    masks = {
        "none": lambda dtype: None,
        "causal": lambda dtype: attn_bias.LowerTriangularMask(),
        "bias": lambda dtype: torch.randn(b, h, m, m).to(dtype),
        "window": lambda dtype: attn_bias.LocalAttentionFromBottomRightMask(window_left=64, window_right=0),
        "varlen": lambda dtype: attn_bias.BlockDiagonalCausalMask.from_seqlens([100, 200]),
    }
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for dim in (32, 64, 80, 96, 128, 256):
            for mask, make in masks.items():
                for p in (0.0, 0.3) if mask == "none" else (0.0,):
                    batch = 1 if mask == "varlen" else b
                    q = torch.randn(batch, m, h, dim, dtype=dtype)
                    bias = make(dtype)
                    inp = Inputs(q, q, q, attn_bias=bias[:batch] if mask == "bias" else bias, p=p)
                    name = f"attention {dtype} K={dim} {mask}{f' p={p}' if p else ''}"
                    reasons = tf.FwOp.not_supported_reasons(inp)
                    if reasons:
                        yield name, None, "; ".join(reasons)
                        continue
                    yield name + " fwd+bwd", (lambda inp=inp, q=q: _forward_backward(tf, inp, q)), None
    yield from splitk_calls()


def splitk_calls():
    """(name, call, why declined) of the split-K decoding forward: dense GQA decoding, a paged cache, int4 and FP8
    caches, over dtypes and head dims (its FwOp takes CUDA inputs only; the calls go to apply, as the tests do)."""
    from mslk.attention.fmha import attn_bias, kv_cache
    from mslk.attention.fmha import triton_splitk as sk
    from mslk.attention.fmha.common import Inputs, InputsFp8

    for dtype in (torch.bfloat16, torch.float16):
        for dim in (64, 128, 256):
            q = torch.randn(4, 1, 2, 4, dim, dtype=dtype)
            kv = torch.randn(4, 1000, 2, 1, dim, dtype=dtype).expand(4, 1000, 2, 4, dim)
            yield (
                f"split-K {dtype} K={dim} GQA decode",
                lambda q=q, kv=kv: sk.FwOp.apply(Inputs(q, kv, kv), False),
                None,
            )
            tables = torch.randperm(16).to(torch.int32).view(4, 4)
            mask = attn_bias.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
                [1] * 4, [200] * 4, tables, 64
            )
            pool = torch.randn(1, 1024, 2, 1, dim, dtype=dtype).expand(1, 1024, 2, 4, dim)
            inp = Inputs(q.view(1, 4, 2, 4, dim), pool, pool, mask)
            yield f"split-K {dtype} K={dim} paged", lambda inp=inp: sk.FwOp.apply(inp, False), None
            packed = kv_cache.quantize_kv_int4(kv[..., :1, :], 2).expand(4, 1000, 2, 4, -1)
            yield (
                f"split-K {dtype} K={dim} int4 K/V",
                lambda q=q, p=packed: _int4_op().apply(Inputs(q, p, p), False),
                None,
            )
            for fp32_scales in (False, True):
                rows, scales = kv_cache.quantize_kv_fp8(kv[..., :1, :], fp32_scales)
                rows, scales = rows.expand(4, 1000, 2, 4, -1), scales.expand(4, 1000, 2, 4)
                inp = InputsFp8(q, rows, rows, None, use_fp32_scales=fp32_scales, k_fp8_scale_shift=scales,
                                v_fp8_scale_shift=scales)  # fmt: skip
                name = f"split-K {dtype} K={dim} FP8 K/V{' fp32 scales' if fp32_scales else ''}"
                reasons = [r for r in sk.FwOp.not_supported_reasons(inp) if not r.startswith("device=")]  # (cpu)
                if reasons:
                    yield name, None, "; ".join(reasons)
                else:
                    yield name, lambda inp=inp: sk.FwOp.apply(inp, False), None


def _int4_op():
    """triton_splitk with int4-packed K/V in two scale groups a row."""
    from mslk.attention.fmha import triton_splitk as sk

    return type("Int4", (sk.FwOp,), {"NUM_GROUPS": 2})


def _forward_backward(tf, inp, grad):
    ctx = tf.FwOp.apply(inp, True)[1]
    if not tf.BwOp.not_supported_reasons(inp):
        tf.BwOp.apply(ctx, inp, grad)


def keys_holding_tensors() -> list[str]:
    """The kernels whose compiles launch.fast keeps under a key holding a tensor: keyed by the tensor itself, a
    launch on new tensors misses, and the key keeps the old ones alive (a tuple of tensors did, for the merge
    kernels, until tuples were keyed item by item)."""
    from mslk.core import launch

    def holds(value) -> bool:
        return isinstance(value, torch.Tensor) or (isinstance(value, tuple) and any(map(holds, value)))

    return [
        getattr(launcher.kernel, "__name__", repr(launcher.kernel))
        for launcher in launch._launchers.values()
        if any(holds(key) for key in launcher._kept)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gpu", choices=sorted(GPUS))
    parser.add_argument("--only", nargs="*", default=[], help="these ops only (names, with or without mslk::)")
    parser.add_argument("--attention", action="store_true", help="also attention's dtype x head dim x mask matrix")
    parser.add_argument("-v", action="store_true", help="every call, and the tracebacks of failures")
    args = parser.parse_args()
    compiled: list = []
    install(args.gpu, compiled)
    import mslk  # noqa: F401  (every installed domain registers its ops)
    from mslk.core import registry

    names = {name for op in registry.OPS.values() for name in (op.qualname, op.name)}
    unknown = [name for name in args.only if name not in names]
    if unknown:
        parser.error(f"no op named {', '.join(unknown)}")

    calls = list(op_calls(args.only))
    if args.attention:
        calls += list(attention_calls())
    failures = 0
    for name, call, declined in calls:
        if call is None:
            if args.v:
                print(f"declined  {name}: {declined}")
            continue
        start = len(compiled)
        try:
            call()
            holding = keys_holding_tensors()
            if holding:
                raise AssertionError(
                    f"launch.fast keys {', '.join(holding)} by tensors themselves (kept alive; new ones miss)"
                )
        except Exception as exc:
            failures += 1
            print(f"FAILED    {name}: {type(exc).__name__}: {str(exc).strip()[:300]}")
            if args.v:
                traceback.print_exc()
            continue
        if args.v:
            kernels = ", ".join(f"{kernel} {shared}" for kernel, shared in compiled[start:])
            print(f"ok        {name}: {kernels}")
    limit = GPUS[args.gpu][3]
    print(
        f"{args.gpu}: {len(calls)} calls, {failures} failed; {len(compiled)} kernels compiled, the most shared memory "
        f"{max((shared for _, shared in compiled), default=0)} of {limit} bytes"
    )
    return failures


if __name__ == "__main__":
    sys.exit(main())
