"""MSLK's Triton kernels compile and fit on GPUs unlike the H100 / H200 they were tuned on (tools/other_gpus.py).
The RTX 5090 (sm_120), whose blocks have 99 KiB of shared memory against Hopper's 227: its Hopper-sized pipelines
asked up to 144 KiB there (OutOfResources at the first launch) until launch.Launcher learnt to run fewer stages.
The MI300X (gfx942, 64 KiB): the split-K GEMMs passed Triton a `launch_pdl` option it has no use for on ROCm
(KeyError), and the grouped GEMM's scatter epilogue asked 128 KiB (the ops named here). MLA's products of 64 heads
by 64 key rows asked 200 KiB on the RTX 5090 (its layout changes pass through shared memory there), and 64 heads
80 KiB on the MI300X with the latent dims in halves. launch.fast kept the merge kernels' compiles under keys holding
their tensors (a tuple keyed as itself)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("mslk.gemm")

TOOL = Path(__file__).resolve().parents[1] / "other_gpus.py"


@pytest.mark.parametrize(
    ("gpu", "only"),
    [
        # GEMMs with deep pipelines (the whole sweep: the tool without --only, with --attention)
        ("sm120", ["f8f8bf16_rowwise", "f8f8bf16_blockwise", "bf16bf16bf16_grouped_stacked", "bf16x9_gemm"]),
        ("sm120", ["mla_decode_fwd"]),  # key blocks of 1024 / heads rows (64 x 64 asked 200 KiB)
        ("gfx942", ["grouped_gemm_scatter_add", "i8i8bf16", "bf16i4bf16_rowwise", "f8i4bf16_shuffled"]),
        ("gfx942", ["mla_decode_fwd"]),  # at most 32 heads a program (64 asked 80 KiB)
        # tuples of tensors (the merge kernels' chunks) were keyed as themselves: kept alive, every launch a miss
        (
            "sm90",
            ["fmha_merge_attentions_stacked", "fmha_merge_attentions_varargs", "merge_attentions_varargs_backward"],
        ),
    ],
)
def test_triton_backends_compile_and_fit(gpu, only):
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    args = [sys.executable, str(TOOL), gpu, *(["--only", *only] if only else [])]
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert " 0 failed; " in done.stdout and "kernels compiled" in done.stdout
