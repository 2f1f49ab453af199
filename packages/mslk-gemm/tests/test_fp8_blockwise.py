"""Blockwise and groupwise FP8 GEMMs (spec G-15, G-16, G-51, G-58).

T0: the references against float64 math, validation errors, compile. T1 (CPU, interpreter) and T2 (GPU): the
Triton kernel against the dequantized product in float64.
"""

import pytest
import torch

from mslk.core import formats, testing
from mslk.gemm.triton import fp8_blockwise_gemm as g
from mslk.gemm.triton import fp8_gemm
from mslk.gemm.triton.fp8_groupwise_gemm import matmul_f8f8bf16_groupwise

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernel(op):
    return op.get_backend("triton").impl


def oracle(xq, wq, x_scale, w_scale, x_rows, w_rows, block_k):
    """float64: Σ over K blocks of the blocks' products times their scales, block by block."""
    (m, k), n = xq.shape, wq.shape[0]
    out = torch.zeros(m, n, dtype=torch.float64, device=xq.device)
    for kb in range(0, k, block_k):
        part = xq[:, kb : kb + block_k].double() @ wq[:, kb : kb + block_k].double().T
        xs = x_scale[:, kb // block_k].double().repeat_interleave(x_rows)[:m]
        ws = w_scale[:, kb // block_k].double().repeat_interleave(w_rows)[:n]
        out += part * xs[:, None] * ws[None, :]
    return out


BLOCKWISE = [
    # (m, n, k, block_m, block_n, block_k): K and the blocks not multiples of the tiles, ragged last blocks
    (1, 40, 128, 128, 128, 128),
    (70, 130, 200, 64, 32, 64),
    (129, 257, 384, 128, 128, 128),
    (33, 65, 300, 16, 48, 96),
    (20, 24, 512, 256, 256, 256),
]


@pytest.mark.parametrize(("m", "n", "k", "bm", "bn", "bk"), BLOCKWISE, ids=str)
def test_blockwise(m, n, k, bm, bn, bk):
    xq, xs = g.quantize_blocks(testing.randn(m, k, device=DEVICE, std=3.0), bm, bk)
    wq, ws = g.quantize_blocks(testing.randn(n, k, device=DEVICE, std=0.5), bn, bk)
    expected = oracle(xq, wq, xs, ws, bm, bn, bk)
    testing.assert_rel_close(g._block_scaled_reference(xq, wq, xs, ws, bm, bn, bk), expected, 1e-2)
    out = kernel(g.f8f8bf16_blockwise_op)(xq, wq, xs, ws, bm, bn, bk)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    testing.assert_rel_close(out, expected, 1e-2)
    if (bm, bn, bk) == (256, 256, 256):
        testing.assert_rel_close(fp8_gemm.matmul_fp8_block(xq, wq, xs, ws), expected, 1e-2)  # (G-51's path)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 128, 128), (37, 130, 256), (200, 300, 384)], ids=str)
def test_groupwise(m, n, k):
    xq, xs = g.quantize_blocks(testing.randn(m, k, device=DEVICE, std=3.0), 1, 128)
    wq, ws = g.quantize_blocks(testing.randn(n, k, device=DEVICE), 128, 128)
    x_scale, w_scale = xs.T.contiguous(), ws.T.contiguous()  # the M-major layouts of the recipe
    formats.Groupwise(128).check(xq, x_scale)
    formats.Blockwise(128, 128, k_major=False).check(wq, w_scale)
    expected = oracle(xq, wq, xs, ws, 1, 128, 128)
    out = kernel(g.f8f8bf16_groupwise_op)(xq, wq, x_scale, w_scale)
    testing.assert_rel_close(out, expected, 1e-2)
    poisoned = testing.empty_poisoned(m, n, dtype=torch.bfloat16, device=DEVICE)
    assert matmul_f8f8bf16_groupwise(xq, wq, x_scale, w_scale, poisoned) is poisoned  # (spec G-58's path)
    testing.assert_rel_close(poisoned, expected, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 7168), (128, 7168, 2048), (2048, 4096, 7168), (4097, 1000, 640)])
def test_block_scaled_gpu(m, n, k):
    xq, xs = g.quantize_blocks(testing.randn(m, k, device="cuda"), 128, 128)
    wq, ws = g.quantize_blocks(testing.randn(n, k, device="cuda"), 128, 128)
    testing.assert_rel_close(g.f8f8bf16_blockwise(xq, wq, xs, ws), oracle(xq, wq, xs, ws, 128, 128, 128), 1e-2)
    if k % 128 == 0:
        gq, gs = g.quantize_blocks(testing.randn(m, k, device="cuda"), 1, 128)
        out = g.f8f8bf16_groupwise(gq, wq, gs.T.contiguous(), ws.T.contiguous())
        testing.assert_rel_close(out, oracle(gq, wq, gs, ws, 1, 128, 128), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "n", "k", "block", "row_pad"),
    [(129, 257, 384, 128, 0), (1000, 777, 208, 128, 0), (300, 520, 1024, 256, 0), (4096, 4096, 4096, 128, 0),
     (200, 136, 512, 128, 32), (300, 264, 1408, 128, 0)],
    ids=str,
)  # fmt: skip
def test_hopper_kernel_gpu(m, n, k, block, row_pad):
    """The Gluon kernel (sm_90), called directly (dispatch takes it for K >= 4096 only): ragged M and N, K not a
    multiple of 128 (TMA pads with zeros), 256-blocks (two K steps per scale), XQ rows strided inside a wider
    tensor, K steps fewer than, a multiple of and not a multiple of the kernel's UNROLL; every output element
    written (poisoned output)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is for sm_90")
    wide_q, wide_s = g.quantize_blocks(testing.randn(m, k + row_pad, device="cuda"), block, block)
    xq, xs = wide_q[:, :k], wide_s[:, : -(-k // block)].contiguous()  # row_pad > 0 only where k % block == 0
    wq, ws = g.quantize_blocks(testing.randn(n, k, device="cuda"), block, block)
    assert g.fp8_blockwise_hopper.supports(xq, wq, block, block, block)
    out = testing.empty_poisoned(m, n, dtype=torch.bfloat16, device="cuda")
    g.fp8_blockwise_hopper.run(xq, wq, out, xs, xs.stride(), ws, ws.stride(), block, block, block)
    testing.assert_rel_close(out, oracle(xq, wq, xs, ws, block, block, block), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n"), [(300, 264), (129, 136)], ids=str)
def test_hopper_kernel_output_inside_a_wider_buffer_gpu(m, n):
    """Blockwise tiles leave by TMA stores: into the first n columns of a wider row-major buffer (rows 16-byte
    aligned, TMA can write them), the tiles at the right and bottom edges clipped to the output; the columns past
    n, which the last tiles' boxes cover, keep their poison."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is for sm_90")
    xq, xs = g.quantize_blocks(testing.randn(m, 4096, device="cuda"), 128, 128)
    wq, ws = g.quantize_blocks(testing.randn(n, 4096, device="cuda"), 128, 128)
    wide = testing.empty_poisoned(m, n + 56, dtype=torch.bfloat16, device="cuda")
    out = wide[:, :n]
    assert g.fp8_blockwise_hopper.tma_ready(out)
    g.fp8_blockwise_hopper.run(xq, wq, out, xs, xs.stride(), ws, ws.stride(), 128, 128, 128)
    testing.assert_rel_close(out, oracle(xq, wq, xs, ws, 128, 128, 128), 1e-2)
    assert wide[:, n:].isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("m_major", [True, False], ids=["m_major", "k_major"])
@pytest.mark.parametrize(("m", "n", "k"), [(129, 257, 384), (300, 264, 1408), (1000, 777, 4224)], ids=str)
def test_hopper_kernel_groupwise_gpu(m, n, k, m_major):
    """The Gluon kernel with a scale per row of XQ (groupwise's M-major [K/128, M], or blockwise's [M, K/128] with
    block_m = 1) and 128 x 128 blocks of WQ: ragged M and N (rows past M read row M - 1's scale), K steps fewer
    than, and not a multiple of, the kernel's UNROLL."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is for sm_90")
    xq, xs = g.quantize_blocks(testing.randn(m, k, device="cuda"), 1, 128)
    wq, ws = g.quantize_blocks(testing.randn(n, k, device="cuda"), 128, 128)
    x_scale, strides = (xs.T.contiguous(), xs.T.contiguous().stride()[::-1]) if m_major else (xs, xs.stride())
    assert g.fp8_blockwise_hopper.supports(xq, wq, 1, 128, 128)
    out = testing.empty_poisoned(m, n, dtype=torch.bfloat16, device="cuda")
    g.fp8_blockwise_hopper.run(xq, wq, out, x_scale, strides, ws, ws.stride(), 1, 128, 128)
    testing.assert_rel_close(out, oracle(xq, wq, xs, ws, 1, 128, 128), 1e-2)


def test_small_k_blocks_go_to_the_reference():
    backend = g.f8f8bf16_blockwise_op.get_backend("triton")
    args = (torch.empty(0), torch.empty(0), torch.empty(0), torch.empty(0), 128, 128, 16)
    assert "block_k=16" in backend.reasons("cuda", args, {})[0]


def test_bad_scales_name_the_layout_and_the_quantizer():
    xq, xs = g.quantize_blocks(testing.randn(200, 256, device=DEVICE), 128, 128)
    wq, ws = g.quantize_blocks(testing.randn(32, 256, device=DEVICE), 128, 128)
    with pytest.raises(formats.ScaleFormatError, match=r"blockwise\(64, 128\).*quantize_fp8_block\(x, 64, 128\)"):
        g.f8f8bf16_blockwise(xq, wq, xs, ws, 64, 128, 128)
    with pytest.raises(formats.ScaleFormatError, match=r"groupwise\(128\).*quantize_fp8_group"):
        g.f8f8bf16_groupwise(xq, wq, xs, ws.T.contiguous())
    with pytest.raises(ValueError, match="same K"):
        g.f8f8bf16_blockwise(xq, wq[:, :128], xs, ws)
    with pytest.raises(formats.ScaleFormatError):
        g.f8f8bf16_blockwise(xq.float(), wq, xs, ws)


def test_compile_and_export():
    class Linear(torch.nn.Module):
        def forward(self, xq, wq, xs, ws):
            return g.f8f8bf16_blockwise(xq, wq, xs, ws)

    xq, xs = g.quantize_blocks(testing.randn(16, 256), 128, 128)
    wq, ws = g.quantize_blocks(testing.randn(48, 256), 128, 128)
    out = torch.compile(Linear(), fullgraph=True, backend="aot_eager")(xq, wq, xs, ws)
    assert out.shape == (16, 48) and out.dtype == torch.bfloat16
    assert "mslk.f8f8bf16_blockwise" in str(torch.export.export(Linear(), (xq, wq, xs, ws)).graph)
