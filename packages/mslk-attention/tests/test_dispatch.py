"""The backends' declarations and the dispatcher (spec §2.3, §4): attributes, the exact reason strings, the priority
lists (NVIDIA, ROCm, MQA decoding, FA3 toggle) and backend choice on a faked CUDA device: FakeTensorMode gives
"cuda" tensors without a GPU (PyTorch's fake kernels of the ATen attention ops check our calls' arguments), and
`mslk.core.arch` is patched to answer the capability."""

import contextlib
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mslk.attention import fmha
from mslk.attention.fmha import attn_bias as ab
from mslk.attention.fmha import (
    ck,
    ck_decoder,
    ck_splitk,
    common,
    cudnn,
    cute_blackwell,
    cute_hopper,
    cutlass,
    cutlass_blackwell,
    dispatch,
    flash,
    flash3,
    flash_mtia,
    flydsl,
    torch_reference,
    triton_flash,
    triton_splitk,
)
from mslk.core import arch, testing

BACKEND_MODULES = [
    cutlass,
    flash,
    flash3,
    triton_splitk,
    ck,
    ck_decoder,
    ck_splitk,
    cutlass_blackwell,
    cute_hopper,
    cute_blackwell,
    flydsl,
    flash_mtia,
    torch_reference,
]
KERNEL_MODULES = [cutlass, flash, triton_splitk, torch_reference]  # the others declare kernels this release lacks
STUB_MODULES = [module for module in BACKEND_MODULES if module not in KERNEL_MODULES]


def operators(module):
    return [
        value
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, common.AttentionOpBase) and value.__module__ == module.__name__
    ]


@contextlib.contextmanager
def fake_gpu(monkeypatch, capability=(9, 0)):
    """FakeTensorMode ("cuda" tensors without a GPU) and an NVIDIA GPU of `capability` as far as MSLK asks."""
    monkeypatch.setattr(arch, "capability", lambda device=None: capability)
    monkeypatch.setattr(arch, "is_cuda", lambda: True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def cuda_qkv(b=2, mq=16, mk=16, heads=(4,), k=64, kv=None, dtype=torch.float16):
    """Inside fake_gpu: q [b, mq, *heads, k], k/v [b, mk, *heads, k / kv]."""
    q = torch.randn(b, mq, *heads, k, device="cuda", dtype=dtype)
    key = torch.randn(b, mk, *heads, k, device="cuda", dtype=dtype)
    return q, key, torch.randn(b, mk, *heads, kv or k, device="cuda", dtype=dtype)


# ----------------------------------------------------------------------------------- declarations


def test_every_backend_module_declares_its_operators():
    names = set()
    for module in BACKEND_MODULES:
        ops = operators(module)
        assert ops, module.__name__
        for op in ops:
            assert op.NAME and op.NAME not in names, op
            names.add(op.NAME)
            assert isinstance(op.SUPPORTED_DEVICES, frozenset) and op.SUPPORTED_DEVICES
            assert op.SUPPORTED_DTYPES and all(isinstance(d, torch.dtype) for d in op.SUPPORTED_DTYPES)
            assert op.SUPPORTED_MAX_K >= op.SUPPORTED_MIN_K and op.SUPPORTS_CUSTOM_SCALE
            assert type(None) in op.SUPPORTED_ATTN_BIAS_TYPES
            assert op.SUPPORTED_ATTN_BIAS_TYPES <= set(common._BIAS_BY_ID.values())
            assert isinstance(op.is_available(), bool)
            if module in STUB_MODULES:
                assert not op.is_available() and op.unavailable_reason()
                with pytest.raises(NotImplementedError, match=re.escape(op.unavailable_reason())):
                    op.apply(None, None, None) if issubclass(op, common.AttentionBwOpBase) else op.apply(None, False)
    assert torch_reference.FwOp.is_available() and torch_reference.BwOp.is_available()
    if torch.version.cuda is not None:
        assert cutlass.FwOp.is_available() and cutlass.BwOp.is_available()


def test_spec_table_rows():
    assert cutlass.FwOp.CUDA_MAXIMUM_COMPUTE_CAPABILITY == (9, 0) and cutlass.FwOp.VARLEN_LSE_PACKED is False
    assert common.bias_types("None T B01 B02 B03 B04 B06 B07 B08 B09 B10 B12") == cutlass.FwOp.SUPPORTED_ATTN_BIAS_TYPES
    assert cutlass.BwOp.SUPPORTS_ATTN_BIAS_GRAD and not cutlass.BwOp.SUPPORTS_BMGHK
    assert flash.FwOp.NAME.startswith("fa2F@") and flash.FwOp.NAME.endswith("-pt") and flash.FwOp.SUPPORTS_PARTIAL
    version = flash.FLASH_VERSION
    assert (flash_mtia.FwOp.NAME, flash_mtia.BwOp.NAME) == (f"fa2F@{version}-mtia", f"fa2B@{version}-mtia")
    assert not flash.BwOp.IS_DETERMINISTIC and not flash.FwOp.SUPPORTS_DIFFERENT_VALUE_EMBED
    assert flash3.FwOp.SUPPORTED_ATTN_BIAS_TYPES == common.bias_types("None B01 B03-B22")
    assert torch.float8_e4m3fn in flash3.FwOp.SUPPORTED_DTYPES and flash3.FwOp.SUPPORTED_MIN_K == 64
    assert triton_splitk.FwOp.SUPPORTS_OUTPUT_DTYPE and triton_splitk.FwOp.SUPPORTS_QUANTIZED_INPUTS  # int4 K/V
    assert triton_splitk.FwOp_S8.SPLIT_K == 8 and issubclass(triton_splitk.FwOp_S8, triton_splitk.FwOp)
    assert triton_splitk.FwOp.get_operator(8) is triton_splitk.FwOp_S8
    assert ck_splitk.FwOp_S128.SPLIT_K == 128 and ck.BwOp.SUPPORTS_ATTN_BIAS_GRAD
    assert flydsl.BwOp.SUPPORTED_ATTN_BIAS_TYPES == common.bias_types("None B01 B06 B07")
    assert cutlass_blackwell.FwOpDecode.SUPPORTED_DTYPES == {torch.bfloat16}
    assert cute_hopper.FwOp.CUDA_MAXIMUM_COMPUTE_CAPABILITY == (9, 9)
    assert flash_mtia.FwOp.SUPPORTED_DEVICES == {"mtia"}
    assert torch_reference.FwOp.SUPPORTED_ATTN_BIAS_TYPES == set(common._BIAS_BY_ID.values())


def test_package_surface():
    assert fmha.MemoryEfficientAttentionCutlassFwdFlashBwOp == (cutlass.FwOp, flash.BwOp)
    assert fmha.MemoryEfficientAttentionCkDecoderOp == (ck_decoder.FwOp, ck.BwOp)
    assert fmha.MemoryEfficientAttentionSplitKCkOp == (ck_splitk.FwOp, ck.BwOp)
    assert fmha.MemoryEfficientAttentionCuteFlashAttentionOp == (cute_blackwell.FwOp, cute_blackwell.BwOp)
    assert fmha.ALL_FW_OPS[0] is cutlass.FwOp and torch_reference.FwOp in fmha.ALL_FW_OPS
    assert fmha.ALL_BW_OPS[0] is cutlass.BwOp and flydsl.BwOp not in fmha.ALL_BW_OPS
    for name in fmha.__all__:
        assert hasattr(fmha, name), name
    for name in ("memory_efficient_attention_partial", "triton_splitk", "flash3", "Inputs", "dispatch"):
        assert hasattr(fmha, name)
    assert dispatch.fa3_available() is False


def test_triton_op_declines_cpu_tensors_without_the_interpreter():
    """Pinned to MSLK's Triton op, CPU tensors get the error that names the device unless the Triton interpreter
    runs (TRITON_INTERPRET=1, read at import as triton.jit does); they failed inside Triton's launcher before."""
    code = """
import torch
from mslk.attention import fmha
q = torch.randn(1, 4, 2, 16)
try:
    fmha.memory_efficient_attention(q, q, q, op=fmha.MemoryEfficientAttentionMslkTritonOp)
except ValueError as e:
    assert "device=cpu (supported: {'cuda'})" in str(e), e
else:
    raise AssertionError("no error")
"""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert triton_flash.FwOp.SUPPORTED_DEVICES == ({"cuda", "cpu"} if testing.interpreting() else {"cuda"})


# -------------------------------------------------------------------------------------- reasons


def test_generic_reasons_on_cpu():
    q, k, v = (torch.randn(2, 5, 3, 16) for _ in range(3))
    inp = fmha.Inputs(q, k, torch.randn(2, 5, 3, 300), p=0.5, output_dtype=torch.float64, is_partial=True)
    assert flash.FwOp.not_supported_reasons(inp) == [
        "query.shape[-1] != value.shape[-1]",
        "max(query.shape[-1], value.shape[-1]) > 256",
        "device=cpu (supported: {'cuda'})",
        "dtype=torch.float32 (supported: {torch.bfloat16, torch.float16})",
        "Custom output dtype not supported",
        "value.shape[-1] % 8 != 0",
    ]
    assert cutlass.FwOp.not_supported_reasons(inp) == [
        "device=cpu (supported: {'cuda'})",
        "Custom output dtype not supported",
        "Partial attention not supported",
    ]
    assert torch_reference.FwOp.not_supported_reasons(inp) == ["dropout > 0.0"]
    assert flash3.FwOp.not_supported_reasons(fmha.Inputs(q, k, v))[:2] == [
        "min(query.shape[-1], value.shape[-1]) < 64",
        "device=cpu (supported: {'cuda'})",
    ]

    class NoCustomScale(torch_reference.FwOp):
        SUPPORTS_CUSTOM_SCALE = False

    assert NoCustomScale.not_supported_reasons(fmha.Inputs(q, k, v, scale=0.1)) == ["has custom scale"]
    quantized = fmha.Inputs(q, k.view(torch.int32), v.view(torch.int32))
    assert torch_reference.FwOp.not_supported_reasons(quantized) == [
        "quantized inputs (int32 K/V, FP8 scales or quantize_*_to_fp8) not supported"
    ]
    q5 = q[:, :, None]
    assert "operator does not support BMGHK format" in cutlass.BwOp.not_supported_reasons(fmha.Inputs(q5, q5, q5))
    not_built = ck.FwOp.not_supported_reasons(fmha.Inputs(q, k, v))
    assert not_built[-2:] == ["operator wasn't built", ck.FwOp.NOT_BUILT_REASON]

    class MyMask(ab.LowerTriangularMask):
        pass

    assert torch_reference.FwOp.not_supported_reasons(fmha.Inputs(q, k, v, MyMask())) == [
        f"attn_bias type is {MyMask}"
    ], "bias types match exactly: a subclass is another mask"
    parameter = torch.nn.Parameter(torch.zeros(2, 3, 5, 5))
    assert torch_reference.BwOp.not_supported_reasons(fmha.Inputs(q, k, v, parameter)) == []
    assert "Computing the bias gradient is not supported (attn_bias.requires_grad = True)" in (
        flash.BwOp.not_supported_reasons(fmha.Inputs(q, k, v, parameter))
    )


def test_capability_dtype_and_determinism_reasons(monkeypatch):
    with fake_gpu(monkeypatch, capability=(7, 5)):
        inp = fmha.Inputs(*cuda_qkv(dtype=torch.bfloat16))
        assert flash.FwOp.not_supported_reasons(inp) == [
            "requires device with capability >= (8, 0) but your GPU has capability (7, 5) (too old)",
            "bf16 is only supported on A100+ GPUs and MTIA",
        ]
    with fake_gpu(monkeypatch, capability=(10, 0)):
        inp = fmha.Inputs(*cuda_qkv(dtype=torch.float32))
        assert cutlass.FwOp.not_supported_reasons(inp) == [
            "requires device with capability <= (9, 0) but your GPU has capability (10, 0) (too new)"
        ]
    with fake_gpu(monkeypatch, capability=(8, 6)):
        inp = fmha.Inputs(*cuda_qkv())
        assert flash.BwOp.not_supported_reasons(inp) == []
        torch.use_deterministic_algorithms(True)
        try:
            assert flash.BwOp.not_supported_reasons(inp) == [
                "operator is non-deterministic, but torch.use_deterministic_algorithms is set"
            ]
        finally:
            torch.use_deterministic_algorithms(False)
        dropout_256 = fmha.Inputs(*cuda_qkv(k=256), p=0.1)
        assert flash.BwOp.not_supported_reasons(dropout_256) == [
            "requires a GPU with compute capability 8.0 (A100) or 9.0 (H100) for dropout with query.shape[-1] > 224"
        ]


def test_kernel_layout_reasons(monkeypatch):
    mask = ab.BlockDiagonalCausalMask.from_seqlens([3, 5], [4, 4], device="cpu")
    with fake_gpu(monkeypatch):
        q, k, v = cuda_qkv(mk=7)
        bias = torch.randn(2, 4, 16, 7, device="cuda", dtype=torch.float16)
        assert cutlass.FwOp.not_supported_reasons(fmha.Inputs(q, k, v, bias)) == [
            "attn_bias.stride(-2) % 8 != 0 (attn_bias.stride() = (448, 112, 7, 1))",
            "HINT: To use an `attn_bias` with a sequence length that is not a multiple of 8, you need to ensure "
            "memory is aligned by slicing a bigger tensor. Example: use `attn_bias = torch.zeros([1, 1, 5, 8])"
            "[:,:,:,:5]` instead of `torch.zeros([1, 1, 5, 5])`",
        ]
        aligned = torch.randn(2, 4, 16, 8, device="cuda", dtype=torch.float16)[..., :7]
        assert cutlass.FwOp.not_supported_reasons(fmha.Inputs(q, k, v, aligned)) == []
        aligned32 = torch.randn(2, 4, 16, 8, device="cuda")[..., :7]
        assert cutlass.FwOp.not_supported_reasons(fmha.Inputs(q, k, v, aligned32)) == [
            "attn_bias.dtype (torch.float32) != query.dtype (torch.float16)"
        ]
        q20 = torch.randn(2, 16, 4, 40, device="cuda", dtype=torch.float16)[..., :20]
        assert cutlass.FwOp.not_supported_reasons(fmha.Inputs(q20, q20, q20)) == [
            f"{name}.shape[-1] % 8 != 0" for name in ("query", "key", "value")
        ]
        strided = q.transpose(-1, -2).contiguous().transpose(-1, -2)
        assert flash.FwOp.not_supported_reasons(fmha.Inputs(strided, k, v))[-1] == (
            "query.stride(-1) > 1 (query.stride() = (4096, 256, 1, 4)) - you should call `.contiguous()` on the input"
        )
        q9, k_, v_ = cuda_qkv(mq=9)
        assert flash.FwOp.not_supported_reasons(fmha.Inputs(q9, k_, v_, ab.LowerTriangularMask())) == [
            "Only support LowerTriangularMask if equal number of keys and queries"
        ]
        varlen = fmha.Inputs(*cuda_qkv(b=1, mq=8, mk=8), mask.to("cuda"))
        assert flash.FwOp.not_supported_reasons(varlen) == [
            "Only support BlockDiagonalCausalMask if equal numbers of keys and queries"
        ]
        g_h = torch.randn(1, 8, 4, 2, 64, device="cuda", dtype=torch.float16).transpose(2, 3)
        assert flash.FwOp.not_supported_reasons(fmha.Inputs(g_h, g_h, g_h))[0].startswith(
            "query.stride(2) != query.shape[3] * query.stride(3)"
        )


def test_flash_declines_causal_varlen_metadata_that_may_diverge_while_capturing(monkeypatch):
    """A CUDA graph replays the kernels chosen at capture: FA2, bottom-right causal, would go on serving a
    BlockDiagonalCausalMask whose equal query and key lengths in-place updates made unequal (top-left: silently
    wrong). While capturing it declines the mask unless queries and keys share one metadata, so that the dispatcher
    picks a kernel that serves any lengths."""
    separate = ab.BlockDiagonalCausalMask.from_seqlens([3, 5], [3, 5], device="cpu")
    shared = ab.BlockDiagonalCausalMask.from_seqlens([3, 5], device="cpu")
    with fake_gpu(monkeypatch):
        q, k, v = cuda_qkv(b=1, mq=8, mk=8)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        for capturing, mask, declined in ((False, separate, False), (True, shared, False), (True, separate, True)):
            monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda capturing=capturing: capturing)
            for op in (flash.FwOp, flash.BwOp):
                reasons = op.not_supported_reasons(fmha.Inputs(q, k, v, mask.to("cuda")))
                assert reasons == (
                    [
                        "BlockDiagonalCausalMask in a CUDA graph capture: its query and key lengths, equal now, are "
                        "separate metadata that in-place updates may make unequal (build it with kv_seqlen=None to "
                        "share one)"
                    ]
                    if declined
                    else []
                ), (op, capturing, mask is shared)


def test_cutlass_declines_queries_that_see_no_key(monkeypatch):
    """PyTorch's memory-efficient kernels get rows that see no key wrong (RESULTS.md, thirty-fifth session), so
    they decline inputs with such rows, and varlen masks while capturing (in-place updates may empty a sequence's
    keys); other kernels serve them."""
    no_key = (
        "a query sees no key (a varlen sequence without keys, or more queries than keys causal from the bottom "
        "right): this kernel gets such inputs wrong"
    )
    bottom_right, padded = ab.LowerTriangularFromBottomRightMask(), ab.BlockDiagonalCausalWithOffsetPaddedKeysMask
    cases = [  # (mq, mk, mask, some query sees no key)
        (9, 8, bottom_right, True),
        (8, 9, bottom_right, False),
        (9, 8, bottom_right.make_local_attention(3), True),
        (9, 8, ab.LowerTriangularMask(), False),  # top-left: every query sees the first key
        (8, 8, ab.BlockDiagonalCausalMask.from_seqlens([3, 5], [0, 8], device="cpu"), True),
        (8, 8, ab.BlockDiagonalCausalMask.from_seqlens([0, 8], [3, 5], device="cpu"), False),  # no queries there
        (2, 8, padded.from_seqlens([1, 1], 4, [0, 3], device="cpu"), True),
        (4, 8, padded.from_seqlens([3, 1], 4, [2, 3], device="cpu"), True),  # 3 queries on 2 keys, bottom-right
        (4, 8, padded.from_seqlens([3, 1], 4, [3, 1], device="cpu"), False),
    ]
    varlen = ab.BlockDiagonalCausalMask.from_seqlens([3, 5], [4, 4], device="cpu")  # (its host lists made here)
    with fake_gpu(monkeypatch):
        for mq, mk, mask, declined in cases:
            b = 1 if isinstance(mask, ab.VARLEN_BIASES) else 2
            inp = fmha.Inputs(*cuda_qkv(b=b, mq=mq, mk=mk), mask.to("cuda") if b == 1 else mask)
            assert common.queries_without_keys(inp) == declined, mask
            for op in (cutlass.FwOp, cutlass.BwOp):
                assert (no_key in op.not_supported_reasons(inp)) == declined, (op, mask)
        # (the tensors made first: with CUDA "initialized", FakeTensorMode asks the missing driver for the device)
        captured_varlen = fmha.Inputs(*cuda_qkv(b=1, mq=8, mk=8), varlen.to("cuda"))
        captured_causal = fmha.Inputs(*cuda_qkv(), ab.LowerTriangularMask())
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert cutlass.FwOp.not_supported_reasons(captured_varlen) == [
            "varlen mask in a CUDA graph capture: in-place updates may leave a sequence without keys, which this "
            "kernel gets wrong"
        ]
        assert cutlass.FwOp.not_supported_reasons(captured_causal) == []


# ------------------------------------------------------------------------------------ priority lists


def _decoding(b=2, heads=8, mq=1, mk=512, grouped=False, dim=64):
    """MQA decoding inputs: K/V heads expanded with stride 0."""
    shape = (b, mq, 2, heads // 2, dim) if grouped else (b, mq, heads, dim)
    q = torch.randn(*shape)
    kv_shape = (*shape[:-2], 1, dim)
    k = torch.randn(b, mk, *kv_shape[2:]).expand(b, mk, *shape[2:])
    return q, k, k


def test_priority_lists(monkeypatch):
    fw, ref = dispatch._dispatch_fw_priority_list, torch_reference.FwOp
    inp = fmha.Inputs(*_decoding(mq=40))
    assert fw(inp, False) == [flash3.FwOp, cudnn.FwOp, flash.FwOp, cutlass.FwOp, triton_splitk.FwOp, ref]
    assert dispatch._dispatch_bw_priority_list() == [
        flash3.BwOp,
        cudnn.BwOp,
        flash.BwOp,
        cutlass.BwOp,
        triton_flash.BwOp,
        torch_reference.BwOp,
    ]
    assert triton_flash.BwOp not in dispatch._dispatch_bw_priority_list("cpu"), "the interpreter is for tests"
    assert triton_flash.FwOp not in fw(inp, False), "CPU inputs: the reference, never the interpreter"
    decoding = fmha.Inputs(*_decoding())
    # One query a sequence: cuDNN's GQA and FlashAttention-2 before split-K (the spec: flash alone)
    assert fw(decoding, False) == [cudnn.FwOp, flash.FwOp, triton_splitk.FwOp, cutlass.FwOp, ref]
    assert fw(decoding, True)[0] is flash3.FwOp, "no reordering when the backward follows"
    assert fw(fmha.Inputs(*_decoding(grouped=True)), False)[:3] == [cudnn.FwOp, flash.FwOp, triton_splitk.FwOp]
    assert fw(fmha.Inputs(*_decoding(dim=256)), False)[:2] == [flash.FwOp, triton_splitk.FwOp], "cuDNN: K <= 128"
    assert fw(fmha.Inputs(*_decoding(b=8)), False)[0] is flash3.FwOp, "B·H = 64: enough parallelism"
    assert fw(fmha.Inputs(*_decoding(mk=255)), False)[0] is flash3.FwOp
    # 2 to 32 queries a sequence (16 past head dim 128): split-K first at any parallelism, the rest in order
    for mq, dim, b in ((2, 64, 2), (4, 128, 64), (32, 128, 8), (16, 256, 8)):
        assert fw(fmha.Inputs(*_decoding(b=b, mq=mq, dim=dim)), False) == [
            triton_splitk.FwOp, flash3.FwOp, cudnn.FwOp, flash.FwOp, cutlass.FwOp, ref
        ], (mq, dim, b)  # fmt: skip
    for mq, dim, mk in ((33, 64, 512), (17, 256, 512), (4, 64, 255), (4, 64, 0)):
        assert fw(fmha.Inputs(*_decoding(b=8, mq=mq, dim=dim, mk=mk)), False)[0] is flash3.FwOp, (mq, dim, mk)
    assert fw(fmha.Inputs(*_decoding(b=0, mq=4)), False)[0] is flash3.FwOp, "no sequence"
    # Sequences packed by the mask (varlen, paged): split-K first (the spec: flash, unless a BlockDiagonalMask), for
    # up to 32 queries and 256 keys or more a sequence, however many in all
    splitk_first = [triton_splitk.FwOp, flash3.FwOp, cudnn.FwOp, flash.FwOp, cutlass.FwOp, ref]
    for each, sequences in ((1, 2), (1, 40), (2, 2), (32, 2)):
        lengths = [100] * (sequences - 1) + [256]
        padded = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([each] * sequences, 256, lengths)
        q, k, v = _decoding(b=1, mq=each * sequences, mk=256 * sequences)
        assert fw(fmha.Inputs(q, k, v, padded), False) == splitk_first, (each, sequences)
    tables = torch.zeros(40, 4, dtype=torch.int32)
    paged = ab.PagedBlockDiagonalPaddedKeysMask.from_seqlens([1] * 40, [256] * 40, tables, 64, device="cpu")
    assert fw(fmha.Inputs(*_decoding(b=1, mq=40), paged), False) == splitk_first
    for each, keys in ((33, 256), (2, 255)):
        padded = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([each, 1], 256, [keys, 100])
        assert fw(fmha.Inputs(*_decoding(b=1, mq=each + 1), padded), False)[0] is flash3.FwOp, (each, keys)
    q, k, v = _decoding(b=1, mq=2)
    packed = ab.BlockDiagonalMask.from_seqlens([1, 1], [256, 256], device="cpu").make_causal_from_bottomright()
    assert fw(fmha.Inputs(q, k, v, packed), False) == [
        triton_splitk.FwOp,
        flash3.FwOp,
        cudnn.FwOp,
        flash.FwOp,
        cutlass.FwOp,
        ref,
    ]
    dispatch._set_use_fa3(False)
    try:
        assert not dispatch._get_use_fa3()
        assert fw(inp, False) == [cudnn.FwOp, flash.FwOp, cutlass.FwOp, triton_splitk.FwOp, ref]
        assert dispatch._dispatch_bw_priority_list()[0] is cudnn.BwOp
    finally:
        dispatch._set_use_fa3(True)
    monkeypatch.setattr(arch, "hip_version", lambda: (6, 4))
    assert fw(inp, False) == [ck.FwOp, flydsl.FwOp, triton_splitk.FwOp, ref]
    assert fw(decoding, False) == [triton_splitk.FwOp, ck.FwOp, flydsl.FwOp, ref]
    assert fw(fmha.Inputs(*_decoding(b=8, mq=4)), False)[0] is ck.FwOp, "the spec's rule: B·H = 64"
    assert dispatch._dispatch_bw_priority_list() == [ck.BwOp, triton_flash.BwOp, torch_reference.BwOp]
    monkeypatch.setattr(flash_mtia.FwOp, "OPERATOR", object())
    assert fw(inp, False)[-2:] == [flash_mtia.FwOp, ref], "MTIA kernels come before the reference"


# ------------------------------------------------------------------------- choices on a faked GPU


def test_forward_choice_on_faked_gpu(monkeypatch):
    causal = ab.LowerTriangularMask()
    with fake_gpu(monkeypatch, capability=(8, 0)):
        assert dispatch._dispatch_fw(fmha.Inputs(*cuda_qkv()), False) is flash.FwOp, "cudnn: Hopper and newer"
        # Off Hopper PyTorch's memory-efficient kernels come before MSLK's Triton ones (not tuned there).
        assert dispatch._dispatch_fw(fmha.Inputs(*cuda_qkv(mk=24), causal), False) is cutlass.FwOp, "Mq != Mk"
        assert dispatch._dispatch_bw_priority_list()[-3:] == [cutlass.BwOp, triton_flash.BwOp, torch_reference.BwOp]
    with fake_gpu(monkeypatch):
        assert dispatch._dispatch_fw(fmha.Inputs(*cuda_qkv()), False) is cudnn.FwOp
        assert dispatch._dispatch_fw(fmha.Inputs(*cuda_qkv(), causal), False) is cudnn.FwOp
        # Hopper, 16 bits: MSLK's Triton kernels before PyTorch's memory-efficient ones where measured faster,
        # forwards alone and training from head dim 128.
        assert dispatch._dispatch_fw_priority_list(fmha.Inputs(*cuda_qkv()), False) == [
            flash3.FwOp, cudnn.FwOp, flash.FwOp, triton_flash.FwOp, cutlass.FwOp, triton_splitk.FwOp,
            torch_reference.FwOp,
        ]  # fmt: skip
        assert dispatch._dispatch_bw_priority_list("cuda", triton_first=True) == [
            flash3.BwOp, cudnn.BwOp, flash.BwOp, triton_flash.BwOp, cutlass.BwOp, torch_reference.BwOp
        ]  # fmt: skip
        mq_ne_mk = fmha.Inputs(*cuda_qkv(mk=24), causal)
        assert dispatch._dispatch_fw(mq_ne_mk, False) is triton_flash.FwOp, "Mq != Mk"
        assert dispatch._dispatch_fw(mq_ne_mk, True) is cutlass.FwOp, "training at head dim 64"
        assert dispatch._dispatch_bw(mq_ne_mk, None) is cutlass.BwOp
        training = fmha.Inputs(*cuda_qkv(mk=24, k=128), causal)
        assert dispatch._dispatch_fw(training, True) is triton_flash.FwOp, "training at head dim 128"
        assert dispatch._dispatch_bw(training, None) is triton_flash.BwOp
        with monkeypatch.context() as switched:  # upstream's switch keeps the GPU off MSLK's Triton kernels
            switched.setenv("XFORMERS_FORCE_DISABLE_TRITON", "1")
            assert dispatch._dispatch_fw(training, True) is cutlass.FwOp
            assert dispatch._dispatch_bw(training, None) is cutlass.BwOp
            assert "XFORMERS_FORCE_DISABLE_TRITON is set" in triton_flash.FwOp.not_supported_reasons(training)
            switched.setenv("XFORMERS_ENABLE_TRITON", "1")
            assert dispatch._dispatch_fw(training, True) is triton_flash.FwOp
        assert dispatch._dispatch_fw(fmha.Inputs(*cuda_qkv(k=512)), False) is cutlass.FwOp, "head dim > 256"
        with monkeypatch.context() as compiling:
            compiling.setattr(torch.compiler, "is_compiling", lambda: True)
            assert dispatch._dispatch_fw(training, True) is triton_flash.FwOp, "compiled graphs call the same ops"
        for k in (136, 256):  # cuDNN's kernels past head dim 128: Hopper's
            wide = fmha.Inputs(*cuda_qkv(k=k), causal)
            assert dispatch._dispatch_fw(wide, True) is cudnn.FwOp, f"head dim {k}"
            assert dispatch._dispatch_bw(wide, None) is cudnn.BwOp, f"head dim {k}"
        local = ab.LowerTriangularFromBottomRightLocalAttentionMask(4)
        assert dispatch._dispatch_fw(fmha.Inputs(*cuda_qkv(), local), False) is flash.FwOp, "window"
        assert dispatch._dispatch_fw(fmha.Inputs(*cuda_qkv(), p=0.1), False) is flash.FwOp, "dropout"
        assert dispatch._dispatch_fw(fmha.Inputs(*cuda_qkv(dtype=torch.float32)), False) is cutlass.FwOp
        bias = torch.randn(2, 4, 16, 16, device="cuda", dtype=torch.float16)
        assert dispatch._dispatch_fw(fmha.Inputs(*cuda_qkv(), bias), False) is triton_flash.FwOp
        monkeypatch.setattr(flash3.FwOp, "OPERATOR", object())  # as if flash_attn_3 were wrapped
        assert dispatch.fa3_available()
        assert dispatch._dispatch_fw(fmha.Inputs(*cuda_qkv()), False) is flash3.FwOp
        dispatch._set_use_fa3(False)
        try:
            assert dispatch._dispatch_fw(fmha.Inputs(*cuda_qkv()), False) is cudnn.FwOp
        finally:
            dispatch._set_use_fa3(True)
    with fake_gpu(monkeypatch, capability=(10, 0)):
        # Blackwell: cutlass is capped at SM90, so fp32 falls to MSLK's Triton kernel (spec §14.3's gap), as do
        # deterministic backward passes, which no kernel before it offers there.
        fp32 = fmha.Inputs(*cuda_qkv(dtype=torch.float32))
        assert dispatch._dispatch_fw(fp32, False) is triton_flash.FwOp
        assert dispatch._dispatch_bw(fp32, None) is triton_flash.BwOp
        assert dispatch._dispatch_fw_priority_list(fp32, False)[-2:] == [triton_flash.FwOp, torch_reference.FwOp]
        assert dispatch._dispatch_fw(fmha.Inputs(*cuda_qkv(k=128)), False) is cudnn.FwOp
        wide = fmha.Inputs(*cuda_qkv(k=256))
        assert cudnn.FwOp.not_supported_reasons(wide) == ["query.shape[-1] > 128 needs Hopper (SM90) here"]
        assert cudnn.BwOp.not_supported_reasons(wide) == ["query.shape[-1] > 128 needs Hopper (SM90) here"]


def test_few_pairs_forward_before_cudnn_on_faked_gpu(monkeypatch):
    """Attention over up to 256 (batch x head) pairs of 4096 rows or more with a causal mask, up to 128 without one,
    on Hopper: MSLK's Gluon forward before cuDNN's (measured faster there), the backward cuDNN's; more pairs, shorter
    rows, small problems, other masks, head dim 64 and dropout keep their kernels."""
    causal, bottom_right = ab.LowerTriangularMask(), ab.LowerTriangularFromBottomRightMask()

    def qkv(m=8192, heads=(8,), k=128):
        return cuda_qkv(b=1, mq=m, mk=m, heads=heads, k=k, dtype=torch.bfloat16)

    with fake_gpu(monkeypatch):
        few = qkv()
        for mask in (causal, bottom_right):
            assert dispatch._dispatch_fw(fmha.Inputs(*few, mask), False) is triton_flash.FwOp
            assert dispatch._dispatch_fw(fmha.Inputs(*few, mask), True) is triton_flash.FwOp, "training"
            assert dispatch._dispatch_bw(fmha.Inputs(*few, mask), None) is cudnn.BwOp
        assert dispatch._dispatch_fw(fmha.Inputs(*qkv(heads=(2, 8)), causal), False) is triton_flash.FwOp, "BMGHK"
        assert dispatch._dispatch_fw(fmha.Inputs(*qkv(m=65536, heads=(1,)), causal), False) is triton_flash.FwOp
        for m, heads in ((4096, (48,)), (4096, (256,)), (8192, (64,)), (4096, (4, 16))):
            assert dispatch._dispatch_fw(fmha.Inputs(*qkv(m=m, heads=heads), causal), False) is triton_flash.FwOp
        for m, heads in ((8192, (8,)), (16384, (64,)), (4096, (128,)), (4096, (4, 32))):
            no_mask = fmha.Inputs(*qkv(m=m, heads=heads))
            assert dispatch._dispatch_fw(no_mask, True) is triton_flash.FwOp, f"no mask, {m} rows, {heads} heads"
            assert dispatch._dispatch_bw(no_mask, None) is cudnn.BwOp
        for inputs, why in (
            (fmha.Inputs(*qkv(m=4096, heads=(129,))), "no mask, 129 pairs"),
            (fmha.Inputs(*qkv(m=2048, heads=(128,))), "no mask, 2048 rows"),
            (fmha.Inputs(*qkv(m=4096, heads=(16,))), "no mask, 16 · 2^24 scores: the host's time decides"),
            (fmha.Inputs(*qkv(m=4096, heads=(257,)), causal), "257 pairs"),
            (fmha.Inputs(*qkv(m=2048, heads=(256,)), causal), "2048 rows"),
            (fmha.Inputs(*qkv(m=4096, heads=(16,)), causal), "16 · 2^24 scores: the host's time decides"),
            (fmha.Inputs(*qkv(k=64), causal), "head dim 64: no Gluon forward"),
        ):
            assert dispatch._dispatch_fw(inputs, False) is cudnn.FwOp, why
        assert dispatch._dispatch_fw(fmha.Inputs(*few, causal, p=0.1), False) is flash.FwOp, "dropout"
        q, k, v = few
        transposed = fmha.Inputs(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, causal)
        assert not triton_flash.gluon_forward_before_cudnn(transposed), "rows TMA cannot read"
        window = fmha.Inputs(*qkv(m=16384, heads=(4,)), ab.LocalAttentionFromBottomRightMask(4096, 0))
        assert not triton_flash.gluon_forward_before_cudnn(window), "a window"
        assert not triton_flash.gluon_forward_before_cudnn(fmha.Inputs(*qkv(m=16384, heads=(0,)))), "no pairs"
    with fake_gpu(monkeypatch, capability=(10, 0)):
        assert not triton_flash.gluon_forward_before_cudnn(fmha.Inputs(*qkv(), causal)), "Hopper only"


def test_causal_backward_before_cudnn_on_faked_gpu(monkeypatch):
    """Causal attention of 2^30 to 2^33 scores of 4096 rows or more on Hopper: MSLK's Gluon backward before cuDNN's
    (measured faster there); smaller and larger problems, shorter rows, other masks, head dim 64, dropout and the
    deterministic mode keep cuDNN's or their own."""
    causal, bottom_right = ab.LowerTriangularMask(), ab.LowerTriangularFromBottomRightMask()

    def qkv(m=4096, heads=(64,), k=128):
        return cuda_qkv(b=1, mq=m, mk=m, heads=heads, k=k, dtype=torch.bfloat16)

    with fake_gpu(monkeypatch):
        # 2^30, 2^31, 2^30, 2^31, 2^30, 2^33 scores
        for m, heads in ((4096, (64,)), (4096, (128,)), (8192, (16,)), (8192, (4, 8)), (16384, (4,)), (16384, (32,))):
            for mask in (causal, bottom_right):
                inputs = fmha.Inputs(*qkv(m, heads), mask)
                assert dispatch._dispatch_bw(inputs, None) is triton_flash.BwOp, (m, heads)
                assert dispatch._dispatch_fw(inputs, True) is triton_flash.FwOp, (m, heads)
        for inputs, why in (
            (fmha.Inputs(*qkv(heads=(63,)), causal), "below 2^30 scores: the host's time decides"),
            (fmha.Inputs(*qkv(heads=(513,)), causal), "past 2^33 scores: parity"),
            (fmha.Inputs(*qkv(m=2048, heads=(256,)), causal), "2048 rows"),
            (fmha.Inputs(*qkv()), "no mask"),
            (fmha.Inputs(*qkv(k=64), causal), "head dim 64"),
        ):
            assert dispatch._dispatch_bw(inputs, None) is cudnn.BwOp, why
        assert dispatch._dispatch_bw(fmha.Inputs(*qkv(), causal, p=0.1), None) is flash.BwOp, "dropout"
        q, k, v = qkv()
        transposed = fmha.Inputs(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, causal)
        assert not triton_flash.gluon_backward_before_cudnn(transposed), "rows TMA cannot read"
        torch.use_deterministic_algorithms(True)
        try:
            assert not triton_flash.gluon_backward_before_cudnn(fmha.Inputs(*qkv(), causal)), "deterministic"
        finally:
            torch.use_deterministic_algorithms(False)
    with fake_gpu(monkeypatch, capability=(10, 0)):
        assert not triton_flash.gluon_backward_before_cudnn(fmha.Inputs(*qkv(), causal)), "Hopper only"


def test_cudnn_past_head_dim_128_on_cpu_inputs():
    """CPU inputs past head dim 128 pinned to cuDNN: declined with their reasons, no GPU asked about (none need be
    visible)."""
    q = torch.randn(1, 8, 2, 256, dtype=torch.float16)
    for op in (cudnn.FwOp, cudnn.BwOp):
        reasons = op.not_supported_reasons(fmha.Inputs(q, q, q))
        assert reasons == ["device=cpu (supported: {'cuda'})", "query.shape[-1] > 128 needs Hopper (SM90) here"]
    with pytest.raises(ValueError, match="needs Hopper"):
        fmha.memory_efficient_attention(q, q, q, op=fmha.MemoryEfficientAttentionCudnnOp)


def test_cudnn_kernel_calls_on_faked_gpu(monkeypatch):
    """BMHK and BMGHK through PyTorch's fake cuDNN kernels: [B, H, M, K] views in, output, LSE and gradients
    back in the inputs' layouts."""
    with fake_gpu(monkeypatch):
        for heads in ((4,), (2, 3)):
            q, k, v = cuda_qkv(mq=16, mk=24, heads=heads)
            inp = fmha.Inputs(q, k, v)
            out, ctx = cudnn.FwOp.apply(inp, needs_gradient=True)
            assert out.shape == q.shape and ctx.lse.shape == (2, *heads, 16)
            grads = cudnn.BwOp.apply(ctx, inp, torch.randn_like(out))
            assert (grads.dq.shape, grads.dk.shape, grads.dv.shape) == (q.shape, k.shape, v.shape)
        q, k, v = cuda_qkv()
        # 8 bytes off a 16-byte boundary: FlashAttention-2 and CUTLASS stopped on it, cuDNN got it wrong (H200).
        off = torch.randn(4 + q.numel(), device="cuda", dtype=q.dtype)[4:].view(q.shape)
        for op in (cudnn.FwOp, cudnn.BwOp, flash.FwOp, flash.BwOp, cutlass.FwOp, cutlass.BwOp):
            reasons = op.not_supported_reasons(fmha.Inputs(off, k, v))
            assert "query does not start on a 16-byte boundary (8 bytes past one)" in reasons, op
        with monkeypatch.context() as compiling:  # Inductor copies misaligned inputs; Dynamo cannot trace the check
            compiling.setattr(torch.compiler, "is_compiling", lambda: True)
            assert cudnn.FwOp.not_supported_reasons(fmha.Inputs(off, k, v)) == []
        # K/V expanded over the heads (MQA/GQA): the forward reads one head a group (cuDNN's GQA), and so does the
        # backward where autograd sums the heads' gradients (kv_grads_summed: dK/dV a K/V head), else it declines
        # them; K/V expanded over anything else, or K alone, still get the reason.
        seen, kernel, kernel_bw = [], cudnn.FwOp.OPERATOR, cudnn.BwOp.OPERATOR
        monkeypatch.setattr(cudnn.FwOp, "OPERATOR", lambda *a, **kw: seen.append(a[:3]) or kernel(*a, **kw))
        monkeypatch.setattr(cudnn.BwOp, "OPERATOR", lambda *a, **kw: seen.append(a[1:4]) or kernel_bw(*a, **kw))
        for heads in ((4,), (2, 3)):
            q, k, v = cuda_qkv(heads=heads)
            key, value = (t[..., :1, :].expand(t.shape) for t in (k, v))
            gqa = fmha.Inputs(q, key, value)
            assert cudnn.FwOp.not_supported_reasons(gqa) == []
            assert "stride of 0" in " ".join(cudnn.BwOp.not_supported_reasons(gqa))
            out, ctx = cudnn.FwOp.apply(gqa, needs_gradient=True)
            assert out.shape == q.shape and ctx.lse.shape == (2, *heads, 16)
            kv_heads = 1 if len(heads) == 1 else heads[0]
            kernel_shapes = [(2, math.prod(heads), 16, 64), *[(2, kv_heads, 16, 64)] * 2]
            assert [t.shape for t in seen.pop()] == kernel_shapes
            summed = fmha.Inputs(q, key, value, kv_grads_summed=True)
            assert cudnn.BwOp.not_supported_reasons(summed) == []
            grads = cudnn.BwOp.apply(ctx, summed, torch.randn_like(out))
            assert [t.shape for t in seen.pop()] == kernel_shapes
            assert grads.dq.shape == q.shape and grads.dk.shape == grads.dv.shape == (*k.shape[:-2], 1, 64)
            for other in ((key, v), (k[:1].expand(k.shape), v[:1].expand(v.shape))):
                assert "stride of 0" in " ".join(cudnn.FwOp.not_supported_reasons(fmha.Inputs(q, *other)))
        # One query and one key: cuDNN's backward raised a RuntimeError (the H200, torch 2.11); declined instead.
        single = fmha.Inputs(*cuda_qkv(mq=1, mk=1))
        assert cudnn.FwOp.not_supported_reasons(single) == []
        assert cudnn.BwOp.not_supported_reasons(single) == ["s_q = s_kv = 1 is not supported"]


def test_triton_before_flash_on_faked_gpu(monkeypatch):
    """On Hopper, what cuDNN declines and FlashAttention-2 takes (windows, varlen, bottom-right causality over more
    keys than queries) goes to MSLK's kernels where they are measured faster: forwards at head dims 64-256, training
    at 64 and 128, sequences of 128 queries or more, 2^27 scores or more unless a CUDA graph is being captured; not
    with dropout, at other head dims or before Hopper."""
    window = ab.LowerTriangularFromBottomRightLocalAttentionMask(1024)
    varlen_masks = {  # (made before faking: their metadata is read from real tensors)
        (n, each): ab.BlockDiagonalCausalMask.from_seqlens([each] * n, device="cpu")
        for n, each in ((8, 2048), (32, 512), (256, 64))
    }

    def varlen(sequences, each):
        return varlen_masks[sequences, each].to("cuda")

    def inputs(mask, b=4, mq=4096, mk=4096, heads=(16,), k=128, p=0.0, dtype=torch.bfloat16):
        return fmha.Inputs(*cuda_qkv(b=b, mq=mq, mk=mk, heads=heads, k=k, dtype=dtype), mask, p)

    def chosen(inp):
        """(the forward alone, the forward and the backward of training)"""
        return dispatch._dispatch_fw(inp, False), dispatch._dispatch_fw(inp, True), dispatch._dispatch_bw(inp, None)

    triton_ops = (triton_flash.FwOp, triton_flash.FwOp, triton_flash.BwOp)
    flash_ops = (flash.FwOp, flash.FwOp, flash.BwOp)
    with fake_gpu(monkeypatch):
        for inp, why in (
            (inputs(window), "window"),
            (inputs(window, k=64, dtype=torch.float16), "window, head dim 64, fp16"),
            (inputs(ab.LocalAttentionFromBottomRightMask(512, 512)), "local"),
            (inputs(window, heads=(8, 4)), "GQA"),
            (inputs(ab.LowerTriangularFromBottomRightMask(), mq=1024), "bottom-right, more keys than queries"),
            (inputs(varlen(8, 2048), b=1, mq=16384, mk=16384), "varlen 8 x 2048"),
        ):
            assert chosen(inp) == triton_ops, why
        for inp, why in (
            (inputs(window, p=0.1), "dropout"),
            (inputs(window, k=96), "head dim 96"),
            (inputs(varlen(32, 512), b=1, mq=16384, mk=16384), "varlen 32 x 512: 2^26 scores, the host's time decides"),
            (inputs(window, b=1, heads=(4,)), "2^24 scores"),
            (inputs(varlen(256, 64), b=1, mq=16384, mk=16384, heads=(256,)), "sequences of 64 queries"),
        ):
            assert chosen(inp) == flash_ops, why
        bias = torch.randn(4, 16, 4096, 4096, device="cuda", dtype=torch.bfloat16)
        assert chosen(inputs(bias, k=64))[1:] == (cutlass.FwOp, cutlass.BwOp), "what FA2 declines keeps its order"
        wide = inputs(window, b=2, k=256)
        assert chosen(wide) == (triton_flash.FwOp, flash.FwOp, flash.BwOp), "forward alone at head dim 256"
        monkeypatch.setattr(triton_flash, "capturing_cuda_graph", lambda inp: True)
        assert chosen(inputs(varlen(32, 512), b=1, mq=16384, mk=16384)) == triton_ops, "captured: the kernels decide"
    with fake_gpu(monkeypatch, capability=(8, 0)):
        assert chosen(inputs(window)) == flash_ops, "Hopper only"


def test_gqa_training_backward_on_faked_gpu(monkeypatch):
    """GQA training on Hopper: K/V expanded over the heads whose gradients autograd sums (kv_grads_summed) go to
    cuDNN's own GQA backward; expanded leaves, which get a gradient a head, to MSLK's Triton backward."""
    with fake_gpu(monkeypatch):
        q, k, v = cuda_qkv(heads=(8, 4), k=128, dtype=torch.bfloat16)
        key, value = (t[..., :1, :].expand(t.shape) for t in (k, v))
        for summed, backward in ((True, cudnn.BwOp), (False, triton_flash.BwOp)):
            inp = fmha.Inputs(q, key, value, ab.LowerTriangularMask(), kv_grads_summed=summed)
            assert dispatch._dispatch_bw(inp, None) is backward, summed
    with fake_gpu(monkeypatch, capability=(8, 0)):
        # Before Hopper, FlashAttention-2's own GQA where gradients a K/V head will do; expanded leaves of BMGHK,
        # which get a gradient a query head, are not mergeable into its one head dim (nor does cutlass read stride 0):
        # MSLK's Triton backward serves them.
        q, k, v = cuda_qkv(heads=(8, 4), k=128, dtype=torch.bfloat16)
        key, value = (t[..., :1, :].expand(t.shape) for t in (k, v))
        for summed, backward in ((True, flash.BwOp), (False, triton_flash.BwOp)):
            inp = fmha.Inputs(q, key, value, ab.LowerTriangularMask(), kv_grads_summed=summed)
            assert dispatch._dispatch_bw(inp, None) is backward, summed
        unmerged = fmha.Inputs(q, key, value, ab.LowerTriangularMask())
        assert flash.BwOp.not_supported_reasons(unmerged) == [
            f"{name}.stride(2) != {name}.shape[3] * {name}.stride(3) ({name}.stride() = (65536, 4096, 512, 0, 1)): "
            "BMGHK needs G and H mergeable into one head dim (or K/V expanded over H with stride 0, in a backward "
            "where autograd sums their heads' gradients)"
            for name in ("key", "value")
        ]
        assert flash.BwOp.not_supported_reasons(fmha.Inputs(q, k, v, ab.LowerTriangularMask())) == [], "BMGHK"


def test_alignment_read_from_the_data_pointer():
    """A buffer that starts off a 16-byte boundary (torch.frombuffer, DLPack) has storage offset 0, yet the kernels
    that read 16 bytes at a time get the reason, and the backward's out and grad an aligned copy."""
    shape = (2, 16, 4, 64)
    raw = bytearray(2 * math.prod(shape) + 32)
    base = torch.frombuffer(raw, dtype=torch.uint8).data_ptr() % 16
    off = torch.frombuffer(raw, dtype=torch.bfloat16, offset=(8 - base) % 16, count=math.prod(shape)).view(shape)
    assert off.storage_offset() == 0 and off.data_ptr() % 16 == 8
    reasons = []
    common.check_16_byte_aligned(reasons, "query", off)
    assert reasons == ["query does not start on a 16-byte boundary (8 bytes past one)"]
    copy = common.aligned(off)
    assert copy.data_ptr() % 16 == 0 and torch.equal(copy, off)
    common.check_16_byte_aligned(reasons, "query", copy)
    assert len(reasons) == 1, "an aligned copy passes"


def test_backward_choice_follows_the_lse_layout(monkeypatch):
    mask = ab.BlockDiagonalCausalMask.from_seqlens([3, 5, 8], device="cpu")
    with fake_gpu(monkeypatch, capability=(8, 0)):
        inp = fmha.Inputs(*cuda_qkv(b=1, mq=16, mk=16), mask.to("cuda"))
        assert dispatch._dispatch_bw(inp, varlen_lse_packed=True) is flash.BwOp
        assert dispatch._dispatch_bw(inp, varlen_lse_packed=False) is cutlass.BwOp
        monkeypatch.setattr(cutlass.BwOp, "OPERATOR", None)
        assert dispatch._dispatch_bw(inp, varlen_lse_packed=False) is torch_reference.BwOp, "reads either layout"
        monkeypatch.setattr(torch_reference.BwOp, "SUPPORTED_DEVICES", frozenset({"cpu"}))
        with pytest.raises(NotImplementedError) as info:
            dispatch._dispatch_bw(inp, varlen_lse_packed=False)
        assert f"`{flash.BwOp.NAME}` is not supported because:\n    LSE is in padded format\n" in str(info.value)
        assert str(info.value).startswith("No operator found for `memory_efficient_attention_backward` with inputs:")


def test_search_skips_backends_that_cannot_fit(monkeypatch):
    """Backends not built here (flash3 without its package) or not for the device (mtia) are not asked for their
    reasons while the dispatcher searches: that would cost host time on every call. The error still lists them."""
    asked = []
    for op in (flash3.FwOp, flash_mtia.FwOp, cudnn.FwOp):
        reasons = op.not_supported_reasons.__func__
        monkeypatch.setattr(
            op, "not_supported_reasons", classmethod(lambda cls, d, f=reasons: asked.append(cls) or f(cls, d))
        )
    with fake_gpu(monkeypatch):
        inp = fmha.Inputs(*cuda_qkv())
        ops = [flash3.FwOp, flash_mtia.FwOp, cudnn.FwOp, torch_reference.FwOp]
        assert not flash3.FwOp.is_available()
        assert dispatch._run_priority_list("memory_efficient_attention_forward", ops, inp) is cudnn.FwOp
        assert asked == [cudnn.FwOp]
        with pytest.raises(NotImplementedError) as info:
            dispatch._run_priority_list("memory_efficient_attention_forward", ops[:2], inp)
    text = str(info.value)
    assert f"`{flash3.FwOp.NAME}` is not supported because:\n    operator wasn't built\n" in text
    assert f"`{flash_mtia.FwOp.NAME}` is not supported because:\n    device=cuda (supported: {{'mtia'}})\n" in text


def test_backward_checks_its_operator_once(monkeypatch):
    """A backward is checked once, in the forward (dispatched, or pinned: on the forward's inputs, output_dtype
    included), not again in the backward."""
    asked = []
    reasons = torch_reference.BwOp.not_supported_reasons.__func__
    monkeypatch.setattr(
        torch_reference.BwOp, "not_supported_reasons", classmethod(lambda cls, d: asked.append(cls) or reasons(cls, d))
    )
    for op in (None, (torch_reference.FwOp, torch_reference.BwOp)):
        q, k, v = (testing.randn(1, 9, 2, 16).requires_grad_() for _ in "qkv")
        out = fmha.memory_efficient_attention(q, k, v, op=op)
        assert len(asked) == 1
        out.backward(testing.randn(*out.shape))
        assert len(asked) == 1 and q.grad is not None
        asked.clear()


def test_kernel_calls_on_faked_gpu(monkeypatch):
    """The API down to the ATen kernels on fake CUDA tensors: PyTorch's fake implementations of the kernels check
    our arguments (names, ranks, layouts) and give the output, LSE and gradient shapes."""
    padded = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([1, 2], 8, [5, 8], device="cpu")
    varlen = ab.BlockDiagonalMask.from_seqlens([3, 5], [4, 9], device="cpu").make_causal_from_bottomright()
    with fake_gpu(monkeypatch):
        for dtype, op in ((torch.float16, flash), (torch.float32, cutlass)):
            q, k, v = (t.requires_grad_() for t in cuda_qkv(mk=24, dtype=dtype))
            bias = torch.randn(2, 4, 16, 24, device="cuda", dtype=dtype, requires_grad=op is cutlass)
            mask = bias if op is cutlass else ab.LowerTriangularFromBottomRightMask().make_local_attention(4)
            out = fmha.memory_efficient_attention(q, k, v, mask, op=(op.FwOp, op.BwOp))  # through _fMHA
            assert out.shape == q.shape and out.dtype == dtype and out.grad_fn is not None
            inp = fmha.Inputs(q, k, v, mask)
            out, ctx = op.FwOp.apply(inp, needs_gradient=True)
            grads = op.BwOp.apply(ctx, inp, out)
            assert (grads.dq.shape, grads.dk.shape, grads.dv.shape) == (q.shape, k.shape, v.shape)
            assert grads.db is None if op is flash else grads.db.shape == bias.shape
            q, k, v = cuda_qkv(b=1, mq=8, mk=13, dtype=dtype)
            out, lse = fmha.memory_efficient_attention_forward_requires_grad(q, k, v, varlen.to("cuda"), op=op.FwOp)
            assert lse.shape == ((1, 4, 8) if op is flash else (2, 4, 5)), "packed or padded varlen LSE"
            dq, _, _ = fmha.memory_efficient_attention_backward(out, out, lse, q, k, v, varlen.to("cuda"), op=op.BwOp)
            assert dq.shape == q.shape
            q, k, v = cuda_qkv(b=1, mq=3, mk=16, dtype=dtype)
            out, lse = fmha.memory_efficient_attention_forward_requires_grad(q, k, v, padded.to("cuda"), op=op.FwOp)
            assert out.shape == q.shape
        q = torch.randn(2, 3, 2, 4, 64, device="cuda", dtype=torch.float16)
        kv = torch.randn(2, 40, 2, 1, 64, device="cuda", dtype=torch.float16).expand(2, 40, 2, 4, 64)
        q_mqa = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.float16)
        kv_mqa = torch.randn(2, 512, 1, 64, device="cuda", dtype=torch.float16).expand(2, 512, 8, 64)
        out, lse = fmha.memory_efficient_attention_forward_requires_grad(q, kv, kv, op=flash.FwOp)
        assert out.shape == q.shape and lse.shape == (2, 2, 4, 3)
        out, lse = fmha.memory_efficient_attention_forward_requires_grad(q_mqa, kv_mqa, kv_mqa, op=flash.FwOp)
        assert out.shape == q_mqa.shape and lse.shape == (2, 8, 1)
        # PyTorch's CUTLASS kernel got K/V heads expanded with stride 0 wrong (a sequence of one query; the H200)
        for op in (cutlass.FwOp, cutlass.BwOp):
            assert (
                "key is expanded with a stride of 0" in op.not_supported_reasons(fmha.Inputs(q_mqa, kv_mqa, kv_mqa))[0]
            )


@pytest.mark.parametrize("keys", [24, 32], ids=["keys_24", "keys_32"])
def test_cutlass_backward_fake_pads_the_bias_gradient_rows(monkeypatch, keys):
    """PyTorch's memory-efficient backward allocates the bias gradient in rows of 16-element multiples, cut to Mk
    (its meta kernel says so): the fake kernel of our wrapper gives that layout (test_cutlass_backward_opcheck_gpu
    compares it with the kernel itself)."""
    with fake_gpu(monkeypatch):
        q, k, v = cuda_qkv(mq=16, mk=keys, dtype=torch.float32)
        bias = torch.randn(2, 4, 16, keys, device="cuda")
        lse, seed = torch.empty(2, 4, 32, device="cuda"), torch.empty((), dtype=torch.int64, device="cuda")
        grads = cutlass._backward_kernel(
            q, q, k, v, bias, q, None, None, 16, keys, lse, 0.0, seed, seed, 0, True, 0.1, None
        )
        assert grads[3].shape == bias.shape and grads[3].stride() == (4 * 16 * 32, 16 * 32, 32, 1)


@pytest.mark.gpu
@testing.skipUnlessCuda()
def test_cutlass_backward_opcheck_gpu():
    """opcheck of the wrapped ATen backward with a bias gradient of Mk % 16 != 0 and non-dense q/k/v: the fake
    kernel's strides are the kernel's."""
    q, k, v = (t[..., :32] for t in (testing.randn(2, m, 4, 48, device="cuda") for m in (16, 33, 33)))
    bias = testing.randn(2, 4, 16, 40, device="cuda")[..., :33].requires_grad_()  # rows 16-byte aligned
    inp = fmha.Inputs(q, k, v, bias)
    out, ctx = cutlass.FwOp.apply(inp, needs_gradient=True)
    seed = offset = torch.empty((), dtype=torch.int64, device="cuda")
    lse = ctx.get_padded_lse(cutlass._LSE_ALIGNMENT)
    args = (out, q, k, v, bias, out, None, None, 16, 33, lse, 0.0, seed, offset, 0, True, 0.2, None)
    torch.library.opcheck(torch.ops.mslk_cutlass.fmha_bwd.default, args, test_utils=("test_faketensor",))


def test_pinned_backward_conflicts():
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    out, lse = torch.zeros(1, 8, 2, 16), torch.zeros(3, 2, 32)
    mask = ab.BlockDiagonalMask.from_seqlens([2, 3, 3], device="cpu")
    inp = fmha.Inputs(q, k, v, mask)
    forced = fmha.Context(lse=lse, out=out, op_bw=cutlass.BwOp)
    with pytest.raises(ValueError) as info:
        fmha._backward_op(inp, cutlass.FwOp, flash.BwOp, forced)
    assert str(info.value) == (
        f"Specified op_bw={flash.BwOp.NAME}, but forward op can only run with op_bw=cutlassB-pt. Please set op_bw=None."
    )
    with pytest.raises(ValueError, match="because they use different format of logsumexp"):
        fmha._backward_op(inp, cutlass.FwOp, flash.BwOp, fmha.Context(lse=lse, out=out))
    assert fmha._backward_op(inp, cutlass.FwOp, None, fmha.Context(lse=lse, out=out)) is torch_reference.BwOp


# ---------------------------------------------------------------------------------- inputs helpers


def test_inputs_helpers():
    q, k, v = (torch.randn(2, 5, 8) for _ in range(3))
    inp = fmha.Inputs(q.half(), k.half(), v.half(), torch.zeros(2, 5, 5), is_partial=True)
    assert inp.get_output_dtype() == torch.float32 and inp.scale_float == 8**-0.5
    assert fmha.Inputs(q.double(), k.double(), v.double(), is_partial=True).get_output_dtype() == torch.float64
    assert [t.shape for t in inp.get_qkv_in_bmghk()] == [(2, 5, 1, 1, 8)] * 3
    assert inp.normalize_bmhk() == (2, 5, 8) and inp.query.shape == (2, 5, 1, 8)
    assert inp.attn_bias.shape == (2, 1, 5, 5) and [t.shape for t in inp.get_qkv_in_bmghk()] == [(2, 5, 1, 1, 8)] * 3
    assert common.bmk2bmhk(torch.randn(6, 5, 8), 3).shape == (2, 5, 3, 8)
    ctx = fmha.Context(lse=torch.zeros(2, 3, 33), out=torch.zeros(1))
    padded = ctx.get_padded_lse(32)
    assert padded.shape == (2, 3, 64) and (padded[..., 33:] == math.inf).all()
    assert common.causal_window(ab.LowerTriangularMask()) == ("top-left", -1, 0)
    assert common.causal_window(ab.LowerTriangularFromBottomRightLocalAttentionMask(4)) == ("bottom-right", 3, 0)
    assert common.causal_window(ab.LocalAttentionFromBottomRightMask(2, 5)) == (None, 2, 5)
    local = ab.BlockDiagonalMask.from_seqlens([3], device="cpu").make_local_attention(2)
    assert common.causal_window(local) == ("top-left", 1, 0)
    gappy = ab.BlockDiagonalCausalWithOffsetGappyKeysMask.from_seqlens([1, 1], [0, 5, 9], [3, 4], device="cpu")
    assert common.causal_window(gappy) == ("bottom-right", -1, 0)
    # Paged masks: their unpaged kind's rule (before, every paged mask read as no causality)
    tables = torch.arange(4, dtype=torch.int32).view(2, 2)
    paged = ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens([3, 1], [2, 5], tables, 4)
    assert common.causal_window(paged) == ("bottom-right", -1, 0)
    assert common.queries_without_keys(fmha.Inputs(*(torch.randn(1, 4, 1, 8) for _ in "qkv"), paged))  # 3 on 2 keys
    assert common.causal_window(ab.PagedBlockDiagonalPaddedKeysMask.from_seqlens([3, 1], [2, 5], tables, 4)) == (
        None, -1, -1,
    )  # fmt: skip
    window = ab.PagedBlockDiagonalCausalLocalPaddedKeysMask.from_seqlens_local([1, 1], [2, 5], tables, 4, 3)
    assert common.causal_window(window) == ("bottom-right", 2, 0)
    gappy_paged = ab.PagedBlockDiagonalCausalWithOffsetGappyKeysMask.from_seqlens([1, 1], [1, 0], [3, 4], tables, 4)
    assert common.causal_window(gappy_paged) == ("bottom-right", -1, 0)
    args = common.varlen_args(gappy)
    assert args.seqstart_k.tolist() == [0, 5, 9] and args.seqlen_k.tolist() == [3, 4] and args.max_seqlen_k == 4
    assert common.varlen_args(ab.LowerTriangularMask()) is None
