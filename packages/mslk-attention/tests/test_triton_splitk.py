"""MSLK's Triton split-K decoding forward (`triton_splitk.FwOp`) against the float64 oracle: every mask it takes
(padded, gappy and paged keys, causal, windows), MQA / GQA heads expanded with stride 0 and separate heads, BMHK
and BMGHK, key splits forced from 1 to more than the keys, queries past one program's rows, custom scale, output
dtype, sequences without keys, the LSE; K/V int4-packed and in FP8 rows (kv_cache's formats). T1 on the CPU
(interpreter, small shapes), T2 on the GPU (marked gpu)."""

import ctypes

import pytest
import torch

from mslk.attention import fmha
from mslk.attention.fmha import (
    attn_bias_utils,
    common,
    dispatch,
    kv_cache,
    triton_splitk,
    triton_splitk_fp8,
    triton_splitk_int4,
)
from mslk.attention.fmha.common import _BIAS_BY_ID
from mslk.attention.fmha.reference import attention_reference
from mslk.core import launch, testing

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SUPPORTED_IDS = ["None", *[f"B{i}" for i in range(11, 20)], "B21", "B22"]
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _inputs(bias_id, sizes, dtype, shared_heads, fmt="BMHK", device=DEVICE, page_size=16):
    """Random q, k, v and the mask (attn_bias_utils' layouts); K/V expanded over the heads when shared_heads."""
    batch, mq, mk, groups, heads, dim = sizes
    cls = None if bias_id == "None" else _BIAS_BY_ID[bias_id]
    bias = attn_bias_utils.create_attn_bias(
        cls, batch, heads, groups, mq, mk, device, dtype, False, fmt, page_size=page_size
    )
    lead_q, lead_k = (batch, mq), (batch, mk)
    if isinstance(bias, fmha.attn_bias._Paged):  # a pool of the tables' pages
        lead_q, lead_k = (1, bias.q_seqinfo.seqstart_py[-1]), (1, bias.block_tables.numel() * page_size)
    elif bias is not None:
        lead_q, lead_k = (1, bias.q_seqinfo.seqstart_py[-1]), (1, bias.k_seqinfo.seqstart_py[-1])
    heads_shape = (groups, heads) if fmt == "BMGHK" else (heads,)
    q = testing.randn(*lead_q, *heads_shape, dim, dtype=dtype, device=device)
    kv_heads = (*heads_shape[:-1], 1) if shared_heads else heads_shape
    k, v = (testing.randn(*lead_k, *kv_heads, dim, dtype=dtype, device=device) for _ in range(2))
    if shared_heads:
        k, v = k.expand(*lead_k, *heads_shape, dim), v.expand(*lead_k, *heads_shape, dim)
    return q, k, v, bias


def _check(q, k, v, bias, dtype, op=triton_splitk.FwOp, scale=None, output_dtype=None):
    inp = common.Inputs(q, k, v, bias, scale=scale, output_dtype=output_dtype)
    out, ctx = op.apply(inp, needs_gradient=True)
    ref, lse = attention_reference(q.double(), k, v, bias, scale)
    assert out.dtype == (output_dtype or dtype) and out.shape == ref.shape
    testing.assert_rel_close(out, ref, TOLERANCE[dtype])
    assert ctx.lse.shape == lse.shape
    finite = torch.isfinite(lse)
    assert torch.equal(finite, torch.isfinite(ctx.lse))  # queries without keys: -inf in both, output zeros
    torch.testing.assert_close(ctx.lse[finite].double(), lse[finite].double(), atol=1e-3, rtol=0)
    assert not out.isnan().any()


@pytest.mark.parametrize("bias_id", SUPPORTED_IDS)
@pytest.mark.parametrize(
    ("fmt", "sizes", "shared_heads"),
    [
        ("BMHK", (3, 2, 70, 1, 4, 64), True),
        ("BMGHK", (2, 1, 45, 2, 3, 32), True),
        ("BMHK", (2, 3, 37, 1, 2, 40), False),
    ],
)
def test_masks_and_layouts(bias_id, fmt, sizes, shared_heads):
    """Every mask, heads sharing their K/V (the rows of one program) or not, a head dim that is no power of two."""
    q, k, v, bias = _inputs(bias_id, sizes, torch.bfloat16, shared_heads, fmt)
    inp = common.Inputs(q, k, v, bias)
    assert [r for r in triton_splitk.FwOp.not_supported_reasons(inp) if not r.startswith("device=")] == []
    _check(q, k, v, bias, torch.bfloat16)


@pytest.mark.parametrize("split_k", [1, 2, 5, 64])
@pytest.mark.parametrize("bias_id", ["None", "B16", "B22"])
def test_fixed_splits(split_k, bias_id):
    """Forced part counts (FwOp_S<n>), more parts than key blocks included (empty parts: LSE -inf, weight 0)."""
    q, k, v, bias = _inputs(bias_id, (2, 2, 90, 1, 4, 16), torch.float16, True)
    _check(q, k, v, bias, torch.float16, op=triton_splitk.FwOp.get_operator(split_k))


def test_queries_past_one_program():
    """40 queries x 4 heads = 160 rows: three programs of rows a (sequence, KV head), causal from the bottom right."""
    q, k, v, bias = _inputs("B12", (2, 40, 100, 1, 4, 32), torch.bfloat16, True)
    _check(q, k, v, bias, torch.bfloat16, op=triton_splitk.FwOp.get_operator(3))


@pytest.mark.parametrize("split_k", [1, 3])
def test_windows_where_a_query_sees_no_key_of_a_block(split_k):
    """A window of 3 keys over 8 queries: the last query sees none of the first key block its program walks (its
    running max stays -inf there, which must not turn into NaN)."""
    mask = fmha.attn_bias.BlockDiagonalCausalLocalAttentionPaddedKeysMask.from_seqlens_local(
        [8, 5], 256, [200, 150], 3, device=DEVICE
    )
    q = testing.randn(1, 13, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    k, v = (testing.randn(1, 512, 1, 32, dtype=torch.bfloat16, device=DEVICE).expand(1, 512, 2, 32) for _ in range(2))
    _check(q, k, v, mask, torch.bfloat16, op=triton_splitk.FwOp.get_operator(split_k))


def test_scale_output_dtype_and_strides():
    q, k, v, bias = _inputs("B16", (3, 1, 50, 1, 8, 64), torch.bfloat16, True)
    _check(q, k, v, bias, torch.bfloat16, scale=0.3, output_dtype=torch.float32)
    q, k, v, _ = _inputs("None", (2, 3, 64, 1, 2, 32), torch.float16, False)
    k_strided = torch.empty(2, 64, 2, 48, dtype=k.dtype, device=k.device)[..., :32].copy_(k)  # rows apart
    _check(q, k_strided, v, None, torch.float16)


def test_sequences_without_queries_or_keys():
    """Empty query blocks, a sequence without keys (its queries: zeros, LSE -inf), no query at all."""
    padded = fmha.attn_bias.BlockDiagonalCausalWithOffsetPaddedKeysMask
    bias = padded.from_seqlens([2, 0, 1], 32, [5, 9, 0], device=DEVICE)
    q = testing.randn(1, 3, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    k, v = (testing.randn(1, 96, 2, 16, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    out, ctx = triton_splitk.FwOp.apply(common.Inputs(q, k, v, bias), needs_gradient=True)
    assert torch.equal(out[0, 2], torch.zeros_like(out[0, 2])) and ctx.lse[0, :, 2].isneginf().all()
    _check(q, k, v, bias, torch.bfloat16)
    empty = q[:, :0]
    out, _ = triton_splitk.FwOp.apply(common.Inputs(empty, k[:, :0], v[:, :0]), needs_gradient=False)
    assert out.shape == empty.shape


def test_int4_layout_and_round_trip():
    """quantize_kv_int4's layout (spec §7.7): element 8w + j is nibble j of code word w, after one scale-and-shift
    int32 a group (fp16 scale low, shift high); values come back within half a step (plus fp16 rounding)."""
    ramp = torch.arange(16, dtype=torch.float32)[None]  # scale 1, shift 0: codes 0..15
    packed = kv_cache.quantize_kv_int4(ramp)
    assert packed.dtype == torch.int32 and packed.shape == (1, 3)
    assert [w & 0xFFFFFFFF for w in packed[0].tolist()] == [0x00003C00, 0x76543210, 0xFEDCBA98]  # fp16 1.0 = 0x3C00
    assert torch.equal(kv_cache.dequantize_kv_int4(packed), ramp)
    x = testing.randn(4, 3, 128)
    x[0, 0, :16] = 0.5  # a constant group: scale 0, exact
    for groups in (1, 2, 4, 8):
        packed = kv_cache.quantize_kv_int4(x, groups)
        assert packed.shape == (4, 3, groups + 16)
        back = kv_cache.dequantize_kv_int4(packed, groups)
        step = x.reshape(4, 3, groups, -1).aminmax(dim=-1)
        half_step = ((step.max - step.min) / 30).repeat_interleave(128 // groups, -1)
        assert ((back - x).abs() <= half_step * 1.01 + 1e-3).all()
    assert (kv_cache.dequantize_kv_int4(kv_cache.quantize_kv_int4(x, 8), 8)[0, 0, :16] == 0.5).all()
    with pytest.raises(ValueError, match="multiple of 8"):
        kv_cache.quantize_kv_int4(x[..., :60], 1)
    with pytest.raises(ValueError, match="num_groups >= 1"):
        kv_cache.quantize_kv_int4(x, 0)
    for bad in (x.half(), packed[..., :groups]):  # not int32 (values came back); no words left
        with pytest.raises(ValueError, match=r"dequantize_kv_int4: expected quantize_kv_int4's int32"):
            kv_cache.dequantize_kv_int4(bad, groups)


def _quantized_check(fmt, q, k, v, bias, op=triton_splitk.FwOp, shared_heads=True, groups=1, lse_atol=1e-3):
    """The op over K/V in kv_cache's format fmt (int4-packed in `groups` scale groups, fp8 or fp8-fp32 rows; shifted
    off zero, so that the shifts weigh in) against the float64 oracle on their dequantized values (and, on CUDA,
    the public op pinned to it); K/V of the first head expanded over the heads when shared_heads."""
    rows = [(t[..., :1, :] if shared_heads else t) * 2 + 3 for t in (k, v)]
    if fmt == "int4":
        packed = [kv_cache.quantize_kv_int4(t, groups).expand(*k.shape[:-1], -1) for t in rows]
        op = type("Int4", (op,), {"NUM_GROUPS": groups})
        inp = common.Inputs(q, *packed, bias)
        k_values, v_values = (kv_cache.dequantize_kv_int4(t, groups) for t in packed)
    else:
        fp32 = fmt == "fp8-fp32"
        quantized = [kv_cache.quantize_kv_fp8(t, fp32) for t in rows]
        (k8, k_scales), (v8, v_scales) = ((p.expand(*k.shape[:-1], -1), s.expand(k.shape[:-1])) for p, s in quantized)
        inp = common.InputsFp8(q, k8, v8, bias, use_fp32_scales=fp32, k_fp8_scale_shift=k_scales,
                               v_fp8_scale_shift=v_scales)  # fmt: skip
        k_values, v_values = (kv_cache.dequantize_kv_fp8(t, s) for t, s in ((k8, k_scales), (v8, v_scales)))
    assert [r for r in op.not_supported_reasons(inp) if not r.startswith("device=")] == []
    out, ctx = op.apply(inp, needs_gradient=True)
    ref, lse = attention_reference(q.double(), k_values.double(), v_values.double(), bias)
    testing.assert_rel_close(out, ref, TOLERANCE[q.dtype])
    finite = torch.isfinite(lse)
    assert torch.equal(finite, torch.isfinite(ctx.lse))
    torch.testing.assert_close(ctx.lse[finite].double(), lse[finite].double(), atol=lse_atol, rtol=0)
    if q.is_cuda:  # the public op pinned to it (CUDA only)
        torch.testing.assert_close(fmha._memory_efficient_attention_forward(inp, op=op), out)
    return out, ctx


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("groups", [1, 2, 8])
@pytest.mark.parametrize("bias_id", ["None", "B12", "B16", "B22"])
def test_int4_kv(groups, bias_id, dtype):
    """int4-packed K/V (GQA-shared and expanded): the kernel applies the scales to the products, not to K/V."""
    inputs = _inputs(bias_id, (2, 2, 70, 1, 4, 64), dtype, True)
    _quantized_check("int4", *inputs, triton_splitk.FwOp.get_operator(3), groups=groups)


def _quantized(fmt, q, k, v, bias):
    """(Inputs, op, dequantized k, dequantized v) of k and v in kv_cache's format fmt: int4, fp8, fp8-fp32."""
    if fmt == "int4":
        packed = [kv_cache.quantize_kv_int4(t) for t in (k, v)]
        return common.Inputs(q, *packed, bias), triton_splitk.FwOp_S1, *(kv_cache.dequantize_kv_int4(t) for t in packed)
    fp32 = fmt == "fp8-fp32"
    (k8, k_scales), (v8, v_scales) = (kv_cache.quantize_kv_fp8(t, fp32) for t in (k, v))
    inp = common.InputsFp8(q, k8, v8, bias, use_fp32_scales=fp32, k_fp8_scale_shift=k_scales,
                           v_fp8_scale_shift=v_scales)  # fmt: skip
    values = (kv_cache.dequantize_kv_fp8(t, scales) for t, scales in ((k8, k_scales), (v8, v_scales)))
    return inp, triton_splitk.FwOp_S1, *values


def _check_rows_far_apart(fmt, keys, dim):
    """test_quantized_rows_far_apart's case in kv_cache's format fmt: 3 queries over `keys` keys of head dim `dim`."""
    mask = fmha.attn_bias.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([3], keys, [keys], device=DEVICE)
    q = testing.randn(1, 3, 1, dim, device=DEVICE).to(torch.bfloat16)
    q[0, 2] *= 1e35 / q[0, 2].abs().max()
    k = testing.randn(1, keys, 1, dim, device=DEVICE)
    v = testing.randn(1, keys, 1, dim, device=DEVICE) * 1e-4
    v[0, keys - 1] *= 1e8  # the last key, which query 0 does not see (causal from the bottom right)
    inp, op, k_values, v_values = _quantized(fmt, q, k, v, mask)
    out, ctx = op.apply(inp, needs_gradient=True)
    ref, lse = attention_reference(q.double(), k_values.double(), v_values.double(), mask)
    for row in range(3):
        testing.assert_rel_close(out[:, row], ref[:, row], TOLERANCE[torch.bfloat16])
    torch.testing.assert_close(ctx.lse.double(), lse.double(), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("fmt", ["int4", "fp8", "fp8-fp32"])
def test_quantized_rows_far_apart(fmt):
    """Quantized K/V whose rows' scales lie 1e8 apart in one tile, one of them masked off for a query, and a query
    row of 1e35 (bf16): each output row keeps its own precision (int4's V weights go to fp16 under a power of two
    per query row: one per tile had zeroed a row of small values beside a large one; its q's power of two covers
    bf16's range, where 1e35 had overflowed fp16 to NaN)."""
    _check_rows_far_apart(fmt, keys=8, dim=32)


def test_fp8_layout_and_round_trip():
    """quantize_kv_fp8's layout (spec §7.7): element 4w + j is byte j of word w (e4m3), a row's fp16 scale and shift
    in one int32 (scale low), or an fp32 scale alone; values come back to FP8's precision: half a step of 3
    mantissa bits at the code's magnitude, or a subnormal's half step."""
    packed, scales = kv_cache.quantize_kv_fp8(torch.tensor([[-448.0, 0.0, 448.0, 224.0]]))  # scale 1, shift 0
    assert packed.dtype == scales.dtype == torch.int32 and packed.shape == (1, 1) and scales.shape == (1,)
    assert packed.item() & 0xFFFFFFFF == 0x767E00FE and scales.item() == 0x3C00  # 224, 448, 0, -448; fp16 1.0
    x = testing.randn(3, 5, 64) * 4 + 1
    x[0, 0] = 0.5  # a constant row: scale 0, exact
    for fp32_scales in (False, True):
        packed, scales = kv_cache.quantize_kv_fp8(x, use_fp32_scales=fp32_scales)
        assert packed.shape == (3, 5, 16) and scales.shape == (3, 5)
        assert scales.dtype == (torch.float32 if fp32_scales else torch.int32)
        back = kv_cache.dequantize_kv_fp8(packed, scales)
        shift = 0 if fp32_scales else (x.amax(-1, keepdim=True) + x.amin(-1, keepdim=True)) / 2
        step = (x - shift).abs().amax(-1, keepdim=True) / 448
        assert ((back - x).abs() <= (x - shift).abs() / 16 + step * 2**-9 + 1e-3 * x.abs()).all()
        assert (back[0, 0] == 0.5).all()
    with pytest.raises(ValueError, match="multiple of 4"):
        kv_cache.quantize_kv_fp8(x[..., :62])
    with pytest.raises(ValueError, match="positive multiple of 4"):
        kv_cache.quantize_kv_fp8(x[..., :0])
    with pytest.raises(ValueError, match="fp8_dtype must be one of"):  # (fp16 words were packed as if FP8)
        kv_cache.quantize_kv_fp8(x, fp8_dtype=torch.float16)
    for bad in ((packed, scales[:2]), (packed.float(), scales), (packed, scales.double())):  # (a broadcast error)
        with pytest.raises(ValueError, match="dequantize_kv_fp8: expected quantize_kv_fp8's int32 rows"):
            kv_cache.dequantize_kv_fp8(*bad)


def test_tiny_rows_keep_their_codes():
    """Rows whose range is below fp16's smallest scale step times 448 (FP8) or 15 (int4): their scale stays at that
    step (2^-24) instead of rounding to 0, which had turned an FP8 row of ±1e-5 into zeros and an int4 row of ±1e-7
    into its minimum."""
    x = torch.linspace(-1e-5, 1e-5, 64).view(1, 64)
    fp8 = kv_cache.dequantize_kv_fp8(*kv_cache.quantize_kv_fp8(x))
    int4 = kv_cache.dequantize_kv_int4(kv_cache.quantize_kv_int4(x * 1e-2))
    assert testing.rel_error(fp8, x) < 0.05 and testing.rel_error(int4, x * 1e-2) < 0.5  # (was 1.0 and 1.15)


@pytest.mark.parametrize("fp32_scales", [False, True])
@pytest.mark.parametrize("bias_id", ["None", "B12", "B16", "B22"])
def test_fp8_kv(fp32_scales, bias_id):
    """K/V in FP8 rows (InputsFp8; GQA-shared, scales expanded with them) against the float64 oracle on their
    dequantized values; a head dim that is no power of two."""
    q, k, v, bias = _inputs(bias_id, (2, 2, 70, 1, 4, 40), torch.bfloat16, True)
    quantized = [kv_cache.quantize_kv_fp8(t[..., :1, :], fp32_scales) for t in (k, v)]
    (k8, k_scales), (v8, v_scales) = ((p.expand(*k.shape[:-1], -1), s.expand(k.shape[:-1])) for p, s in quantized)
    inp = common.InputsFp8(q, k8, v8, bias, use_fp32_scales=fp32_scales, k_fp8_scale_shift=k_scales,
                           v_fp8_scale_shift=v_scales)  # fmt: skip
    op = triton_splitk.FwOp.get_operator(3)
    assert [r for r in op.not_supported_reasons(inp) if not r.startswith("device=")] == []
    out, ctx = op.apply(inp, needs_gradient=True)
    k_values, v_values = (kv_cache.dequantize_kv_fp8(p, s).double() for p, s in ((k8, k_scales), (v8, v_scales)))
    ref, lse = attention_reference(q.double(), k_values, v_values, bias)
    testing.assert_rel_close(out, ref, TOLERANCE[torch.bfloat16])
    finite = torch.isfinite(lse)
    torch.testing.assert_close(ctx.lse[finite].double(), lse[finite].double(), atol=1e-3, rtol=0)


def test_fp8_kv_shared_rows_with_scales_per_head():
    """K/V rows expanded over the heads with stride 0 but scales of their own a head: the heads are not one program's
    rows (a program read its first head's scale for all of them: head 1 off by 7.9)."""
    q = testing.randn(1, 2, 2, 32, dtype=torch.bfloat16)
    k, v = (testing.randn(1, 40, 1, 32, dtype=torch.bfloat16) for _ in "kv")
    (k8, k_scales), (v8, v_scales) = (kv_cache.quantize_kv_fp8(t) for t in (k, v))
    k_scales, v_scales = (
        torch.cat([s, kv_cache.quantize_kv_fp8(t * 3)[1]], dim=2) for s, t in ((k_scales, k), (v_scales, v))
    )
    inp = common.InputsFp8(q, k8.expand(1, 40, 2, 8), v8.expand(1, 40, 2, 8), k_fp8_scale_shift=k_scales,
                           v_fp8_scale_shift=v_scales)  # fmt: skip
    out, _ = triton_splitk.FwOp.apply(inp, needs_gradient=False)
    values = [
        kv_cache.dequantize_kv_fp8(p.expand(1, 40, 2, 8), s).double() for p, s in ((k8, k_scales), (v8, v_scales))
    ]
    testing.assert_rel_close(out, attention_reference(q.double(), *values, None)[0], TOLERANCE[torch.bfloat16])


def test_fp8_kv_bmk_scales():
    """BMK inputs: normalize_bmhk gives the scales their head dim too."""
    q = testing.randn(2, 3, 16, dtype=torch.float16)
    k, v = (testing.randn(2, 50, 16, dtype=torch.float16) for _ in "kv")
    (k8, k_scales), (v8, v_scales) = (kv_cache.quantize_kv_fp8(t) for t in (k, v))
    inp = common.InputsFp8(q, k8, v8, k_fp8_scale_shift=k_scales, v_fp8_scale_shift=v_scales)
    inp.validate_inputs()
    assert inp.normalize_bmhk() == (2, 3, 16) and inp.k_fp8_scale_shift.shape == (2, 50, 1)
    out, _ = triton_splitk.FwOp.apply(inp, needs_gradient=False)
    values = [kv_cache.dequantize_kv_fp8(p, s).double() for p, s in ((k8, k_scales), (v8, v_scales))]
    testing.assert_rel_close(out[:, :, 0], attention_reference(q.double(), *values, None)[0], TOLERANCE[torch.float16])


def test_reasons():
    q, k, v, _ = _inputs("None", (1, 1, 32, 1, 2, 16), torch.bfloat16, True, device="cpu")
    reasons = triton_splitk.FwOp.not_supported_reasons
    assert "dtype=torch.float32 (supported: {torch.bfloat16, torch.float16})" in reasons(
        common.Inputs(q.float(), k.float(), v.float())
    )
    assert "attn_bias type is <class 'torch.Tensor'>" in reasons(common.Inputs(q, k, v, torch.zeros(1, 2, 1, 32)))
    wide = torch.zeros(1, 1, 2, 320, dtype=torch.bfloat16)
    assert "max(query.shape[-1], value.shape[-1]) > 256" in reasons(common.Inputs(wide, wide, wide))
    wrong_width = common.Inputs(q, k.contiguous().view(torch.int32), v.contiguous().view(torch.int32))  # 8, not 3
    assert (
        "int4-packed K/V of head dim 16 in 1 scale group(s) need a power of two of at least 16 and 3 int32 a row "
        "(quantize_kv_int4), got 8"
    ) in reasons(wrong_width)
    narrow = kv_cache.quantize_kv_int4(k[..., :8].float())  # head dim 8: below the kernel's tile
    assert any(
        r.startswith("int4-packed K/V of head dim 8") for r in reasons(common.Inputs(q[..., :8], narrow, narrow))
    )
    packed = kv_cache.quantize_kv_int4(k.float())
    assert not [r for r in reasons(common.Inputs(q, packed, packed)) if not r.startswith("device=")]
    fp8_products = (
        "FP8 queries or products and MX FP8 K/V (quantize_*_to_fp8, q_fp8_scale_shift, InputsMXFp8) not supported: "
        "K/V in FP8 rows (InputsFp8) or int4-packed"
    )
    assert fp8_products in reasons(common.Inputs(q, packed, packed, quantize_qk_to_fp8=True))
    (k8, k_scales), (v8, v_scales) = (kv_cache.quantize_kv_fp8(t) for t in (k, v))
    fp8 = common.InputsFp8(q, k8, v8, k_fp8_scale_shift=k_scales, v_fp8_scale_shift=v_scales)
    assert not [r for r in reasons(fp8) if not r.startswith("device=")]
    fp8.q_fp8_scale_shift = k_scales[:, :1]
    assert fp8_products in reasons(fp8)
    no_scales = common.InputsFp8(q, k8, v8, k_fp8_scale_shift=k_scales)
    assert (
        "InputsFp8: value's scales must be torch.int32 (1, 32, 2) (a scale a row; use_fp32_scales=False), got None"
    ) in reasons(no_scales)
    fp32_expected = common.InputsFp8(q, k8, v8, k_fp8_scale_shift=k_scales, v_fp8_scale_shift=v_scales,
                                     use_fp32_scales=True)  # fmt: skip
    assert (
        "InputsFp8: key's scales must be torch.float32 (1, 32, 2) (a scale a row; use_fp32_scales=True), got "
        "torch.int32 (1, 32, 2)"
    ) in reasons(fp32_expected)
    wide = common.InputsFp8(q, packed, packed, k_fp8_scale_shift=k_scales, v_fp8_scale_shift=v_scales)  # int4's width
    assert (
        "InputsFp8: key must be int32 of four FP8 values each, [..., 16 / 4] (kv_cache.quantize_kv_fp8), got "
        "torch.int32 (1, 32, 2, 3)"
    ) in reasons(wide)


def test_fake_kernel_and_opcheck():
    q, k, v, bias = _inputs("B16", (2, 1, 40, 1, 4, 16), torch.float16, True)
    mask, tables, lane, page_size = triton_splitk._paging(bias)
    varlen = common.varlen_args(mask)
    args = (q, k, v, None, None, varlen.seqstart_q, varlen.seqstart_k, varlen.seqlen_k, tables, varlen.max_seqlen_q,
            varlen.max_seqlen_k, lane, page_size, 0.25, -1, 0, True, torch.float32, 2, 0, [0, 0, 0])  # fmt: skip
    torch.library.opcheck(triton_splitk._splitk_forward_op, args, test_utils=("test_schema", "test_faketensor"))
    (k8, k_scales), (v8, v_scales) = (kv_cache.quantize_kv_fp8(t) for t in (k, v))
    fp8_args = (q, k8, v8, k_scales, v_scales, *args[5:])
    torch.library.opcheck(triton_splitk._splitk_forward_op, fp8_args, test_utils=("test_schema", "test_faketensor"))


# ------------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("bias_id", SUPPORTED_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("sizes", "shared_heads"), [((16, 1, 1000, 2, 4, 128), True), ((3, 4, 333, 1, 2, 256), False)])
def test_gpu(bias_id, dtype, sizes, shared_heads):
    q, k, v, bias = _inputs(bias_id, sizes, dtype, shared_heads, "BMGHK" if sizes[3] > 1 else "BMHK")
    _check(q, k, v, bias, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("bias_id", ["None", "B12", "B16", "B21"])
def test_gpu_compiled_whole(bias_id, backend):
    """Decoding (the mask an input: padded keys, paged) compiled with fullgraph, as serving stacks compile a model's
    step: split-K's launch is a torch op, the dispatch around it traced; twice, the second on other values."""
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v, bias: fmha.memory_efficient_attention_forward(q, k, v, bias, op=triton_splitk.FwOp),
        fullgraph=True,
        backend=backend,
    )
    for _ in range(2):
        q, k, v, bias = _inputs(bias_id, (4, 1, 300, 1, 8, 128), torch.bfloat16, True)
        ref, _ = attention_reference(q.double(), k, v, bias)
        testing.assert_rel_close(compiled(q, k, v, bias), ref, TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("bias_id", ["None", "B16"])
def test_gpu_int4_kv(bias_id, groups, dtype):
    _quantized_check("int4", *_inputs(bias_id, (16, 1, 3000, 1, 8, 128), dtype, True, page_size=64), groups=groups)


@pytest.fixture
def gluon_runs(monkeypatch):
    """Calls in which a Gluon kernel (triton_splitk_int4's, triton_splitk_fp8's) took the quantized K/V (a list of
    booleans, one a launch)."""
    runs = []
    for module in (triton_splitk_int4, triton_splitk_fp8):
        supports = module.supports
        monkeypatch.setattr(module, "supports", lambda q, supports=supports: runs.append(supports(q)) or runs[-1])
    return runs


GLUON_FORMATS = ["fp8", "fp8-fp32", "int4"]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GLUON_FORMATS)
@pytest.mark.parametrize("bias_id", SUPPORTED_IDS)
@pytest.mark.parametrize(
    ("sizes", "shared_heads", "split_k", "page_size", "dtype"),
    [
        ((16, 1, 1000, 1, 8, 128), True, 0, 64, torch.bfloat16),  # decoding, 8 query heads a KV head
        ((2, 9, 700, 2, 4, 64), True, 0, 64, torch.float16),  # queries past a program's 16 rows, BMGHK
        ((3, 4, 333, 1, 2, 128), False, 5, 16, torch.float16),  # heads apart: a head's queries a program
        ((2, 1, 500, 1, 32, 128), True, 64, 48, torch.bfloat16),  # MQA, 32 heads: two programs a KV head; more
        # parts than key blocks; pages of 48 keys (no power of two: divisions; tiles across two pages)
        ((3, 2, 130, 1, 4, 128), True, 1, 64, torch.float16),  # one part: the output written as it is, no merge
        ((2, 1, 500, 1, 8, 64), True, 3, 8, torch.bfloat16),  # pages smaller than a tile: a key's page each
    ],
)
def test_gpu_gluon(fmt, bias_id, sizes, shared_heads, split_k, page_size, dtype, gluon_runs):
    """Quantized K/V through the Gluon kernel (loaded straight into the MMA operands' registers; FP8 rows, int4 in
    one scale group): every mask, head dims 64 and 128, fp16 and bf16, fixed part counts, page sizes."""
    fmt_name = "BMGHK" if sizes[3] > 1 else "BMHK"
    inputs = _inputs(bias_id, sizes, dtype, shared_heads, fmt_name, page_size=page_size)
    _quantized_check(fmt, *inputs, triton_splitk.FwOp.get_operator(split_k), shared_heads)
    assert gluon_runs and all(gluon_runs)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GLUON_FORMATS)
def test_gpu_gluon_rows_far_apart_and_windows(fmt, gluon_runs):
    """The Gluon kernel on test_quantized_rows_far_apart's rows (scales 1e8 apart in a tile, a q row of 1e35)
    and on a window where a query sees no key of a block; bf16 output and LSE."""
    _check_rows_far_apart(fmt, keys=64, dim=64)
    mask = fmha.attn_bias.BlockDiagonalCausalLocalAttentionPaddedKeysMask.from_seqlens_local(
        [8, 5], 256, [200, 150], 3, device=DEVICE
    )
    q = testing.randn(1, 13, 2, 128, dtype=torch.bfloat16, device=DEVICE)
    k, v = (testing.randn(1, 512, 1, 128, dtype=torch.bfloat16, device=DEVICE).expand(1, 512, 2, 128) for _ in "kv")
    for split_k in (1, 3):
        _quantized_check(fmt, q, k, v, mask, triton_splitk.FwOp.get_operator(split_k))
    assert gluon_runs and all(gluon_runs)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GLUON_FORMATS)
def test_gpu_gluon_sequences_without_keys(fmt, gluon_runs):
    """A first sequence of no key (its rows: zeros, LSE -inf), whose program reads no row (the first tile's loads
    would read the row before the cache), beside sequences of keys, through the Gluon kernel."""
    padded = fmha.attn_bias.BlockDiagonalCausalWithOffsetPaddedKeysMask
    bias = padded.from_seqlens([1, 1, 2], 64, [0, 5, 64], device=DEVICE)
    q = testing.randn(1, 4, 1, 4, 128, dtype=torch.float16, device=DEVICE)
    k, v = (testing.randn(1, 192, 1, 1, 128, dtype=torch.float16, device=DEVICE) for _ in "kv")
    k, v = k.expand(1, 192, 1, 4, 128), v.expand(1, 192, 1, 4, 128)
    for split_k in (1, 4):
        out, ctx = _quantized_check(fmt, q, k, v, bias, triton_splitk.FwOp.get_operator(split_k))
        assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0])) and ctx.lse[0, :, :, 0].isneginf().all()
    assert gluon_runs and all(gluon_runs)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GLUON_FORMATS)
def test_gpu_triton_kernel_where_gluon_declines(fmt, monkeypatch):
    """The Triton kernel, which serves the head dims, GPUs and int4 scale groups the Gluon kernel does not, on the
    decode shape the Gluon kernel takes otherwise. It rounds dequantized FP8 rows to the queries' dtype, which moved
    the LSE of these rows by up to 2e-3 in fp16 (5e-3 in bf16; H100)."""
    for module in (triton_splitk_int4, triton_splitk_fp8):
        monkeypatch.setattr(module, "supports", lambda q: False)
    inputs = _inputs("B16", (16, 1, 1000, 1, 8, 128), torch.float16, True, page_size=64)
    _quantized_check(fmt, *inputs, lse_atol=1e-3 if fmt == "int4" else 5e-3)


def _driver_programs_per_sm(compiled) -> int:
    """The CUDA driver's own count of a compiled kernel's blocks an SM runs at once."""
    blocks = ctypes.c_int()
    status = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(compiled.function), compiled.metadata.num_warps * 32,
        ctypes.c_size_t(compiled.metadata.shared),
    )  # fmt: skip
    assert status == 0
    return blocks.value


@pytest.mark.gpu
@pytest.mark.skipif(torch.version.hip is not None, reason="CUDA's occupancy")
@pytest.mark.parametrize("fmt", ["bf16", *GLUON_FORMATS])
def test_gpu_parts_follow_the_compiled_kernels_programs_per_sm(fmt, monkeypatch):
    """The part count fills the SMs with as many programs as the compiled kernel lets run at once: that count
    (launch.programs_per_sm, from its registers and shared memory) is the driver's own for each kernel variant
    (dense, paged, a varlen mask; head dims 64 and 128), and the outputs hold."""
    counted = []

    def programs_per_sm(compiled, device, count=launch.programs_per_sm):
        counted.append((compiled, count(compiled, device)))
        return counted[-1][1]

    monkeypatch.setattr(launch, "programs_per_sm", programs_per_sm)
    monkeypatch.setattr(triton_splitk, "_PROGRAMS_PER_SM", {})  # each variant compiled and counted here
    cases = [(bias_id, dim) for bias_id in ("None", "B12", "B16") for dim in (64, 128)]
    for bias_id, dim in cases:
        inputs = _inputs(bias_id, (16, 1, 2000, 1, 8, dim), torch.bfloat16, True, page_size=64)
        if fmt == "bf16":
            _check(*inputs, torch.bfloat16)
        else:
            _quantized_check(fmt, *inputs)
    assert len(counted) == len(cases)
    for compiled, programs in counted:
        assert programs == _driver_programs_per_sm(compiled), (compiled.name, compiled.n_regs, programs)


@pytest.mark.gpu
@pytest.mark.parametrize("fp32_scales", [False, True])
@pytest.mark.parametrize("bias_id", ["None", "B16"])
def test_gpu_fp8_kv(bias_id, fp32_scales):
    """FP8 rows dispatched here (nothing else on CUDA takes InputsFp8), with the platform's FP8 flavour."""
    q, k, v, bias = _inputs(bias_id, (16, 1, 3000, 1, 8, 128), torch.bfloat16, True, page_size=64)
    quantized = [kv_cache.quantize_kv_fp8(t[..., :1, :], fp32_scales) for t in (k, v)]
    (k8, k_scales), (v8, v_scales) = ((p.expand(*k.shape[:-1], -1), s.expand(k.shape[:-1])) for p, s in quantized)
    inp = common.InputsFp8(q, k8, v8, bias, use_fp32_scales=fp32_scales, k_fp8_scale_shift=k_scales,
                           v_fp8_scale_shift=v_scales)  # fmt: skip
    assert dispatch._dispatch_fw(inp, False) is triton_splitk.FwOp
    out = fmha._memory_efficient_attention_forward(inp)
    values = [kv_cache.dequantize_kv_fp8(p, s).double() for p, s in ((k8, k_scales), (v8, v_scales))]
    testing.assert_rel_close(out, attention_reference(q.double(), *values, bias)[0], TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_paged_decode_is_dispatched_here_and_replays_in_a_graph():
    """memory_efficient_attention over a paged cache picks this kernel (nothing else on CUDA takes paged masks but
    the reference); a CUDA graph of the call replays on new lengths written in place."""
    q, k, v, bias = _inputs("B16", (8, 1, 2048, 1, 8, 128), torch.bfloat16, True, page_size=64)
    assert dispatch._dispatch_fw(common.Inputs(q, k, v, bias), False) is triton_splitk.FwOp
    out = fmha.memory_efficient_attention_forward(q, k, v, bias)
    testing.assert_rel_close(out, attention_reference(q.double(), k, v, bias)[0], TOLERANCE[torch.bfloat16])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fmha.memory_efficient_attention_forward(q, k, v, bias)
    bias.k_seqinfo.from_seqlens_padded_inplace([7, 2048, 1, 900, 64, 65, 1000, 3])
    replayed.fill_(float("nan"))
    graph.replay()
    testing.assert_rel_close(replayed, attention_reference(q.double(), k, v, bias)[0], TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("kv", ["bf16", "int4", "fp8"])
@pytest.mark.parametrize(("page", "queries"), [(0, 1), (16, 1), (0, 3)])
def test_bench_baselines_compute_the_op(page, queries, kv, monkeypatch):
    """The decode bench's SDPA over the gathered cache and FlexAttention over its own cache (through the page table
    when paged; eager here) give the op's output (the reference's on the CPU; a quantized cache's dequantized values,
    as the kernel computes them), with one query a sequence or several."""
    from torch.nn.attention.flex_attention import flex_attention

    from mslk.attention import bench

    monkeypatch.setattr(bench, "_compiled_flex", lambda: flex_attention)

    shape = {"B": 3, "L": 64, "Hq": 8, "Hkv": 2, "K": 32, "page": page, "kv": kv, "Mq": queries}
    inputs = bench._decode_inputs(shape, torch.device("cpu"))
    q, k, v, mask = inputs[0].query, inputs[0].key, inputs[0].value, inputs[0].attn_bias
    if kv == "int4":
        k, v = (kv_cache.dequantize_kv_int4(t) for t in (k, v))
    elif kv == "fp8":
        k, v = (kv_cache.dequantize_kv_fp8(t, s) for t, s in ((k, inputs[0].k_fp8_scale_shift),
                                                               (v, inputs[0].v_fp8_scale_shift)))  # fmt: skip
    out = fmha.memory_efficient_attention_forward(q.float(), k.float(), v.float(), mask)
    sdpa = bench._decode_sdpa((None, [t.float() for t in inputs[1]]))
    out = out.reshape(3, queries, 8, 32).transpose(1, 2)  # (paged: [1, 3 queries, ...])
    testing.assert_rel_close(out, sdpa, 1e-5 if kv == "bf16" else 1e-2)  # (SDPA's bf16 values)
    flex = bench._decode_flex((None, None, [t.float() if isinstance(t, torch.Tensor) else t for t in inputs[2]]))
    testing.assert_rel_close(flex, sdpa, 1e-5)
