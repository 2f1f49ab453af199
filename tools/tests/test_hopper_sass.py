"""MSLK's Triton kernels on Hopper's warpgroup MMAs, compiled for sm_90a on this machine (GPU or not): no register
race of a warpgroup MMA (tools/wgmma_hazards.py; the INT4 GEMMs and the attention multiply operands held in
registers), no serialized warpgroup MMAs (ptxas C7515 / C7513) and no spills. All came and went with compiler
details (RESULTS.md, thirteenth and fifteenth sessions), and CI's Triton is not the GPU machine's."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

TOOLS = Path(__file__).resolve().parents[1]
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

# Runs in a fresh interpreter without TRITON_INTERPRET (which would make the kernels interpreted at import): a fake
# active driver reports sm_90, each launch stops after its compile, and each compiled kernel's SASS is written out.
COMPILE = r"""
import os, subprocess, sys
import torch
from triton.compiler.compiler import CompiledKernel

sys.path.insert(0, sys.argv[4])
import other_gpus

class Compiled(Exception):
    pass

def stop(kernel, *args, **kwargs):
    raise Compiled(kernel)

other_gpus.install_driver("sm90", [])
CompiledKernel.launch_metadata = stop


def cuda_host_branch():  # what host code decides for CUDA tensors on an H100 / H200 (TMA, bf16 products)
    other_gpus.install_host("sm90")


def gluon_off(call, module, name, value):  # call() with module.name, which picks a Gluon kernel, set to value
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        call()
    finally:
        setattr(module, name, saved)


def int4_calls():
    from mslk.gemm.triton import int4_gemm as g

    # What the host code decides for CUDA tensors on an H100 / H200.
    g._device_flags = lambda t: {"ASM": True, "UPCAST": False}
    g._wgmma_wait = lambda device, warps: warps >= 4
    g._programs = lambda device: 132
    g.int4_hopper.arch.sm_count = lambda device: 132
    n = k = 2048
    w = torch.randint(-128, 128, (n, k // 2), dtype=torch.int8)
    s = torch.rand(k // 128, n).bfloat16()
    table = g.random_fp8_table(n, k, group_size=128)
    # 8 groups of 256 rows
    x8, sizes8 = torch.randn(8 * 256, k).bfloat16(), torch.full((8,), 256)
    w8, s8 = w.expand(8, n, k // 2).contiguous(), s.expand(8, -1, -1).contiguous()
    calls = {
        "plain_m64": lambda: g._run_int4_rows(torch.randn(64, k).bfloat16(), w, s, s, shuffled=False),
        "plain_m1024": lambda: g._run_int4_rows(torch.randn(1024, k).bfloat16(), w, s, s, shuffled=False),
        "shuffled_m1024": lambda: g._run_int4_rows(torch.randn(1024, k).bfloat16(), w, s, s, shuffled=True),
        "table_m1024": lambda: g._run_int4_rows(torch.randn(1024, k).to(torch.float8_e4m3fn), w, table, None,
                                                shuffled=True, table=True, x_scale=torch.rand(1024),
                                                w_scale=torch.rand(n)),
        "plain_m1024_gluon": lambda: g.int4_hopper.run(torch.randn(1024, k).bfloat16(), w, s, s,
                                                       torch.empty(1024, n).bfloat16(), 128),
        # The decode kernel's first kernel, the relabelled activations (dense: no work list), then the decode kernel
        # itself (X' and the sums given).
        "plain_m16_decode_activations": lambda: g.int4_decode_hopper.relabelled_activations(
            torch.randn(16, k).bfloat16()
        ),
        "plain_m16_gluon_decode": lambda: g.int4_decode_hopper.multiply(torch.randn(k // 64, 16, 64).bfloat16(),
                                                                       torch.randn(k // 256, 16, 4), w, s, s,
                                                                       torch.empty(16, n).bfloat16(), 128),
        # Its grouped form: 8 groups of 4 rows, items of 8 (the work list the first kernel writes: given here).
        "grouped_gluon_decode": lambda: g.int4_decode_hopper.multiply(torch.randn(k // 64, 32, 64).bfloat16(),
                                                                     torch.randn(k // 256, 32, 4), w8, s8, s8,
                                                                     torch.empty(32, n).bfloat16(), 128,
                                                                     torch.zeros(8, 3, dtype=torch.int32), 8),
        "grouped": lambda: g._run_grouped(x8, w8, s8, s8, sizes8, torch.empty(8 * 256, n).bfloat16()),
        "grouped_plain_gluon": lambda: g.int4_hopper.run(x8, w8, s8, s8, torch.empty(8 * 256, n).bfloat16(), 128,
                                                        sizes=sizes8),
        # (on the CPU tensors here the grouped GEMM takes the Triton kernel, as where the Gluon one cannot serve)
        "grouped_plain": lambda: g._run_grouped(x8, w8, s8, s8, sizes8, torch.empty(8 * 256, n).bfloat16(),
                                                shuffled=False),
    }
    return calls


def attention_calls():
    cuda_host_branch()
    from mslk.attention.fmha import attn_bias, triton_flash as tf
    from mslk.attention.fmha.common import Context, Inputs
    # (not launched: delta's shape)
    tf._backward_prologue = lambda out, *_: torch.empty(out.shape[0], out.shape[2], out.shape[3], out.shape[1])
    b, m, h = 2, 1024, 4
    calls = {}
    for dim in (64, 128):
        q, k, v, do = (torch.randn(b, m, h, dim).bfloat16() for _ in range(4))
        inp = Inputs(q, k, v, attn_bias=attn_bias.LowerTriangularMask())
        ctx = Context(lse=torch.randn(b, h, m), out=torch.randn(b, m, h, dim).bfloat16())
        calls[f"attention_fwd_k{dim}"] = lambda inp=inp: tf.FwOp.apply(inp, False)
        calls[f"attention_bwd_k{dim}"] = lambda ctx=ctx, inp=inp, do=do: tf.BwOp.apply(ctx, inp, do)
    # Varlen: sequences of 300 and 724 rows in one batch element (its rows at partial blocks; head dim 128).
    mask = attn_bias.BlockDiagonalCausalMask.from_seqlens([300, 724])
    q1, lse1 = q[:1], torch.randn(1, h, m)
    calls["attention_bwd_k128_varlen"] = lambda: tf.BwOp.apply(Context(lse=lse1, out=q1), Inputs(q1, q1, q1, mask), q1)
    # FwOp and BwOp run the Gluon kernels (triton_flash_hopper_fwd, triton_flash_hopper); these the Triton ones they
    # stand in for.
    from mslk.attention.fmha import triton_flash_hopper

    for dim in (64, 128):
        calls[f"attention_bwd_k{dim}_triton"] = lambda bwd=calls[f"attention_bwd_k{dim}"]: gluon_off(
            bwd, triton_flash_hopper, "supports", lambda *args: False
        )
    calls["attention_fwd_k128_triton"] = lambda: gluon_off(
        calls["attention_fwd_k128"], tf, "_GLUON_FORWARD_MIN_KEYS", 1 << 62
    )
    # An fp32 output (partial attention, merged later): the Gluon forward's warpgroups store it themselves.
    inp32 = Inputs(q, k, v, attn_bias=attn_bias.LowerTriangularMask(), output_dtype=torch.float32)
    calls["attention_fwd_k128_fp32_out"] = lambda: tf.FwOp.apply(inp32, False)
    # A tensor bias [B, H, M, M], whose tiles take shared memory too: the Triton kernels (the backward's with the
    # bias's gradient), and the Gluon backward (without: its dQ ring gives the bias ring a slot's room).
    bias = torch.randn(b, h, m, m).bfloat16()
    bias_with_grad = bias.clone().requires_grad_()
    lse = torch.randn(b, h, m)
    for dim in (64, 128, 256):
        q = torch.randn(b, m, h, dim).bfloat16()
        inp = Inputs(q, q, q, attn_bias=bias)
        ctx = Context(lse=lse, out=q)
        calls[f"attention_fwd_k{dim}_bias"] = lambda inp=inp: tf.FwOp.apply(inp, False)
        calls[f"attention_bwd_k{dim}_bias"] = lambda q=q, ctx=ctx: tf.BwOp.apply(
            ctx, Inputs(q, q, q, attn_bias=bias_with_grad), q
        )
        if dim < 256:
            calls[f"attention_bwd_k{dim}_bias_gluon"] = lambda inp=inp, q=q, ctx=ctx: tf.BwOp.apply(ctx, inp, q)
    # At head dim 128 the forward with a bias is the Gluon kernel (bias tiles in its ring); this the Triton kernel it
    # stands in for, which fewer keys keep.
    calls["attention_fwd_k128_bias_triton"] = lambda: gluon_off(
        calls["attention_fwd_k128_bias"], tf, "_GLUON_FORWARD_MIN_KEYS", 1 << 62
    )
    # Split-K decoding: the Gluon kernels over int4-packed K/V of one scale group (triton_splitk_int4) and FP8 rows
    # (triton_splitk_fp8), dense and paged.
    from mslk.attention.fmha import kv_cache, triton_splitk as sk
    from mslk.attention.fmha.common import InputsFp8

    tables = torch.randperm(128).to(torch.int32).view(16, 8)
    paged = attn_bias.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1] * 16, [500] * 16, tables, 64)
    for dim in (64, 128):
        q = torch.randn(16, 1, 8, 4, dim).bfloat16()
        rows = torch.randn(16, 512, 8, 1, dim)
        packed = kv_cache.quantize_kv_int4(rows).expand(16, 512, 8, 4, -1)
        calls[f"splitk_int4_k{dim}"] = lambda q=q, p=packed: sk.FwOp.apply(Inputs(q, p, p), False)
        fp8, scales = (t.expand(16, 512, 8, 4, *t.shape[4:]) for t in kv_cache.quantize_kv_fp8(rows))
        inp = InputsFp8(q, fp8, fp8, k_fp8_scale_shift=scales, v_fp8_scale_shift=scales)
        calls[f"splitk_fp8_k{dim}"] = lambda inp=inp: sk.FwOp.apply(inp, False)
    pool, fp8_pool, scale_pool = (t.reshape(1, 16 * 512, *t.shape[2:]) for t in (packed, fp8, scales))
    q = q.view(1, 16, 8, 4, 128)
    calls["splitk_int4_k128_paged"] = lambda: sk.FwOp.apply(Inputs(q, pool, pool, attn_bias=paged), False)
    paged_fp8 = InputsFp8(q, fp8_pool, fp8_pool, paged, k_fp8_scale_shift=scale_pool, v_fp8_scale_shift=scale_pool)
    calls["splitk_fp8_k128_paged"] = lambda: sk.FwOp.apply(paged_fp8, False)
    # Pages of 8 keys, fewer than a tile's: each key's page looked up (pages of a tile or more: two a tile at most).
    tables = torch.randperm(1024).to(torch.int32).view(16, 64)
    paged8 = attn_bias.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1] * 16, [500] * 16, tables, 8)
    calls["splitk_int4_k128_paged8"] = lambda: sk.FwOp.apply(Inputs(q, pool, pool, attn_bias=paged8), False)
    paged8_fp8 = InputsFp8(q, fp8_pool, fp8_pool, paged8, k_fp8_scale_shift=scale_pool, v_fp8_scale_shift=scale_pool)
    calls["splitk_fp8_k128_paged8"] = lambda: sk.FwOp.apply(paged8_fp8, False)
    return calls


def gemm_calls():
    cuda_host_branch()
    from mslk.gemm.triton import fp8_blockwise_gemm, fp8_blockwise_hopper, fp8_gemm, grouped_gemm, grouped_gemm_hopper
    grouped_gemm_hopper.MIN_MACS = 0  # the small grouped problems here take the Gluon kernel too
    fp8 = torch.float8_e4m3fn
    x, w = torch.randn(2048, 2048), torch.randn(8, 1024, 2048)
    sizes = torch.full((8,), 256, dtype=torch.int32)
    out = torch.empty(2048, 2048, dtype=torch.bfloat16)
    calls = {
        "fp8_rowwise": lambda: fp8_gemm._rowwise_into(x.to(fp8), w[0].to(fp8), torch.rand(2048), torch.rand(1024),
                                                     None, True, torch.empty(2048, 1024).bfloat16()),
        # 448 tiles: the last round's 52 as half-wide tiles.
        "fp8_rowwise_half_tail": lambda: fp8_gemm._rowwise_into(
            x.to(fp8), torch.randn(7168, 2048).to(fp8), torch.rand(2048), torch.rand(7168), None, True,
            torch.empty(2048, 7168).bfloat16(),
        ),
        "grouped_bf16": lambda: grouped_gemm._run_grouped(x.bfloat16(), w.bfloat16(),
                                                          torch.empty(2048, 1024).bfloat16(), sizes),
        "grouped_fp8": lambda: grouped_gemm._fp8_triton(x.to(fp8), w.to(fp8), torch.rand(2048), torch.rand(8, 1024),
                                                        sizes),
        "blockwise_fp8": lambda: fp8_blockwise_gemm._blockwise_triton(x.to(fp8), x.to(fp8), torch.rand(16, 16),
                                                                      torch.rand(16, 16)),
        "blockwise_fp8_gluon": lambda: fp8_blockwise_hopper.run(x.to(fp8), x.to(fp8), out, torch.rand(16, 16), (16, 1),
                                                                torch.rand(16, 16), (16, 1), 128, 128, 128),
        "groupwise_fp8_gluon": lambda: fp8_blockwise_hopper.run(x.to(fp8), x.to(fp8), out, torch.rand(16, 2048),
                                                                (1, 2048), torch.rand(16, 16), (16, 1), 1, 128, 128),
    }
    # grouped_fp8 runs grouped_gemm_hopper's Gluon kernel; this the Triton kernel it stands in for.
    calls["grouped_fp8_triton"] = lambda: gluon_off(
        calls["grouped_fp8"], grouped_gemm_hopper, "supports", lambda *args: False
    )
    return calls


out, bin_dir, suite = sys.argv[1:4]
calls = {"int4": int4_calls, "attention": attention_calls, "gemm": gemm_calls}[suite]()
for name, call in calls.items():
    try:
        call()
        raise SystemExit(f"{name}: no kernel was compiled")
    except Compiled as done:
        kernel = done.args[0]
    with open(os.path.join(out, name + ".ptx"), "w") as f:
        f.write(kernel.asm["ptx"])
    with open(os.path.join(out, name + ".cubin"), "wb") as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", os.path.join(out, name + ".cubin")],
                          capture_output=True, text=True, check=True).stdout
    with open(os.path.join(out, name + ".sass"), "w") as f:
        f.write(sass)
    with open(os.path.join(out, name + ".shared"), "w") as f:
        f.write(str(kernel.metadata.shared))
"""  # fmt: skip

SUITES = {
    "int4": (
        "mslk.gemm",
        [
            "plain_m64",
            "plain_m1024",
            "plain_m1024_gluon",
            "plain_m16_decode_activations",
            "plain_m16_gluon_decode",
            "grouped_gluon_decode",
            "shuffled_m1024",
            "table_m1024",
            "grouped",
            "grouped_plain",
            "grouped_plain_gluon",
        ],
    ),
    "attention": (
        "mslk.attention",
        [
            *(f"attention_{p}_k{d}" for d in (64, 128) for p in ("fwd", "bwd")),
            *(f"attention_bwd_k{d}_triton" for d in (64, 128)),
            "attention_bwd_k128_varlen",
            "attention_fwd_k128_triton",
            "attention_fwd_k128_fp32_out",
            *(f"attention_{p}_k{d}_bias" for d in (64, 128, 256) for p in ("fwd", "bwd")),
            *(f"attention_bwd_k{d}_bias_gluon" for d in (64, 128)),
            "attention_fwd_k128_bias_triton",
            *(f"splitk_{kind}_k{d}" for kind in ("int4", "fp8") for d in (64, 128)),
            *(f"splitk_{kind}_k128_{pages}" for kind in ("int4", "fp8") for pages in ("paged", "paged8")),
        ],
    ),
    "gemm": (
        "mslk.gemm",
        [
            "fp8_rowwise",
            "fp8_rowwise_half_tail",
            "grouped_bf16",
            "grouped_fp8",
            "grouped_fp8_triton",
            "blockwise_fp8",
            "blockwise_fp8_gluon",
            "groupwise_fp8_gluon",
        ],
    ),
}
KERNELS = [(suite, kernel) for suite, (_, kernels) in SUITES.items() for kernel in kernels]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """suite -> the folder of its kernels' PTX and SASS (compiled on first use)."""
    if not (BIN / "nvdisasm").exists() or not (BIN / "ptxas").exists():
        pytest.skip(f"no nvdisasm / ptxas in {BIN}")
    folders = {}

    def get(suite):
        if suite not in folders:
            pytest.importorskip(SUITES[suite][0])
            out = tmp_path_factory.mktemp(suite)
            env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
            args = [sys.executable, "-c", COMPILE, str(out), str(BIN), suite, str(TOOLS)]
            done = subprocess.run(args, env=env, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-3000:]
            folders[suite] = out
        return folders[suite]

    return get


# Kernels on mma.sync (operands in registers are read when the instruction issues) or of no MMA: no warpgroup MMA to
# race.
NO_WARPGROUP_MMA = {
    ("int4", "plain_m16_gluon_decode"),
    ("int4", "grouped_gluon_decode"),
    ("int4", "plain_m16_decode_activations"),
    *(("attention", f"splitk_{kind}_k{d}") for kind in ("int4", "fp8") for d in (64, 128)),
    *(("attention", f"splitk_{kind}_k128_{pages}") for kind in ("int4", "fp8") for pages in ("paged", "paged8")),
}


@pytest.mark.parametrize(("suite", "kernel"), [pair for pair in KERNELS if pair not in NO_WARPGROUP_MMA])
def test_no_register_race(compiled, suite, kernel):
    sass = compiled(suite) / f"{kernel}.sass"
    done = subprocess.run([sys.executable, str(TOOLS / "wgmma_hazards.py"), str(sass)], capture_output=True, text=True)
    assert done.returncode == 0 and "no race in" in done.stdout, done.stdout[-3000:]


def ptxas_report(compiled, suite: str, kernel: str) -> str:
    """What `ptxas -v` says compiling the kernel's PTX for sm_90a (warnings, registers, spills)."""
    ptx = compiled(suite) / f"{kernel}.ptx"
    done = subprocess.run(
        [str(BIN / "ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


@pytest.mark.parametrize(("suite", "kernel"), KERNELS)
def test_warpgroup_mmas_not_serialized(compiled, suite, kernel):
    """Whatever the reason ptxas gives (C7510-C7515), e.g. C7514, an accumulator read inside its MMA's pipeline
    stage, which a warpgroup MMA left in flight across a loop's back edge caused (fiftieth session, 13% slower)."""
    report = ptxas_report(compiled, suite, kernel)
    assert "instructions are serialized" not in report, report[-3000:]


# The Triton attention backward at head dim 128 spills (255 registers; RESULTS.md), and so do the Gluon backward
# kernels (a few scalars out of their multiplying warps' 240 registers: 20-72 bytes, more with varlen): known, not
# regressions. The Gluon forward spills nowhere, its tensor-bias variant included, since it takes `units` from the
# host (forty-ninth session).
SPILLING = {
    ("attention", "attention_bwd_k128"),  # 20 bytes (ptxas 12.8; 80 before delta's later load, fiftieth session)
    ("attention", "attention_bwd_k128_varlen"),  # 168 bytes (Triton 3.6): the sequences' bounds take registers
    ("attention", "attention_bwd_k128_triton"),
    ("attention", "attention_bwd_k64_bias"),  # 8 bytes writing the bias gradient (Triton 3.7; none under 3.6)
    ("attention", "attention_bwd_k128_bias"),  # the same kernel reading a bias
    ("attention", "attention_bwd_k256_bias"),  # 656 bytes; 400 without a bias (Triton 3.7)
    ("attention", "attention_bwd_k128_bias_gluon"),  # 72 bytes (212 before delta's later load)
    # The tensor-bias forward's fastest tiles (RESULTS.md, twenty-eighth session): 8 bytes under Triton 3.6 (none
    # under 3.7) at head dim 64; 92-108 bytes at 256, 1.9x as fast as 64 x 64 tiles, which do not spill.
    ("attention", "attention_fwd_k64_bias"),
    ("attention", "attention_fwd_k256_bias"),
    # int4 in pages of 64 at 32 keys a tile: 8 bytes of spill loads at 255 registers (Triton 3.7), 91.6 us against
    # 100.5 at 16 keys a tile, which does not spill (H100, PERF.md's decode shape; sixty-fifth session).
    ("attention", "splitk_int4_k128_paged"),
}


@pytest.mark.parametrize(("suite", "kernel"), [pair for pair in KERNELS if pair not in SPILLING])
def test_no_spills(compiled, suite, kernel):
    """Spills would slow these kernels (the blockwise Gluon kernel's multiplying warps hold three 64-register
    products within the 240 registers they get)."""
    report = ptxas_report(compiled, suite, kernel)
    assert " 0 bytes spill stores" in report, report[-3000:]


HOPPER_SHARED_BYTES = 232448  # 227 KiB a block on H100 and H200


@pytest.mark.parametrize(("suite", "kernel"), KERNELS)
def test_shared_memory_fits_hopper(compiled, suite, kernel):
    """More shared memory than a Hopper block has is OutOfResources at the first launch: the tensor-bias forward's
    tiles at head dim 128 once asked 288 KiB (RESULTS.md, twenty-seventh session)."""
    shared = int((compiled(suite) / f"{kernel}.shared").read_text())
    assert shared <= HOPPER_SHARED_BYTES, f"{kernel}: {shared} bytes of shared memory"
