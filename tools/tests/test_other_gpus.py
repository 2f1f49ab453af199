"""MSLK's Triton kernels compile and fit on a GPU unlike the H100 / H200 they were tuned on (tools/other_gpus.py): the
RTX 5090 (sm_120), whose blocks have 99 KiB of shared memory against Hopper's 227. Its Hopper-sized pipelines asked
up to 144 KiB there (OutOfResources at the first launch) until launch.Launcher learnt to run fewer stages."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("mslk.gemm")

TOOL = Path(__file__).resolve().parents[1] / "other_gpus.py"


def test_every_triton_backend_compiles_and_fits_an_rtx_5090():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(TOOL), "sm120"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert " 0 failed; " in done.stdout and "kernels compiled" in done.stdout
