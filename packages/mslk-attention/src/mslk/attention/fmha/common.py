"""What every attention backend shares (spec A-16, A-17, §4): the inputs of a call (`Inputs` and its quantized
variants), the forward context the backward needs (`Context`), the gradients, FP8 scaled tensors, and the operator
base classes whose `not_supported_reasons` give the reason strings users see when no backend fits.

Layouts: BMK [B, M, K] (one head, legacy), BMHK [B, M, H, K], BMGHK [B, M, G, H, K] (grouped-query attention: K/V
expanded over H by the caller, usually with stride 0). Backends receive BMHK or BMGHK (`Inputs.normalize_bmhk`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from mslk.attention.fmha import attn_bias as ab
from mslk.core import arch

# -------------------------------------------------------------------------------------- mask catalogue

# Spec §3 IDs of the masks, so that each backend's bias list reads like its row of the spec's §2.3 table.
_BIAS_BY_ID: dict[str, type] = {
    "None": type(None),
    "T": torch.Tensor,
    "B01": ab.LowerTriangularMask,
    "B02": ab.LowerTriangularMaskWithTensorBias,
    "B03": ab.LowerTriangularFromBottomRightMask,
    "B04": ab.LowerTriangularFromBottomRightLocalAttentionMask,
    "B05": ab.LocalAttentionFromBottomRightMask,
    "B06": ab.BlockDiagonalMask,
    "B07": ab.BlockDiagonalCausalMask,
    "B08": ab.BlockDiagonalCausalFromBottomRightMask,
    "B09": ab.BlockDiagonalCausalLocalAttentionMask,
    "B10": ab.BlockDiagonalCausalLocalAttentionFromBottomRightMask,
    "B11": ab.BlockDiagonalPaddedKeysMask,
    "B12": ab.BlockDiagonalCausalWithOffsetPaddedKeysMask,
    "B13": ab.BlockDiagonalLocalAttentionPaddedKeysMask,
    "B14": ab.BlockDiagonalCausalLocalAttentionPaddedKeysMask,
    "B15": ab.PagedBlockDiagonalPaddedKeysMask,
    "B16": ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask,
    "B17": ab.PagedBlockDiagonalCausalLocalPaddedKeysMask,
    "B18": ab.BlockDiagonalGappyKeysMask,
    "B19": ab.BlockDiagonalCausalWithOffsetGappyKeysMask,
    "B20": ab.BlockDiagonalLocalAttentionFromBottomRightGappyKeysMask,
    "B21": ab.PagedBlockDiagonalGappyKeysMask,
    "B22": ab.PagedBlockDiagonalCausalWithOffsetGappyKeysMask,
}


def rocm_build() -> bool:
    """PyTorch built for ROCm: its "cuda" devices are AMD GPUs. (A build question: asking it neither initialises
    CUDA nor trips torch.compile.)"""
    return arch.hip_version() is not None


def bias_types(ids: str) -> frozenset[type]:
    """The bias classes named by spec IDs: "None T B01 B03-B10" (ranges inclusive)."""
    types = set()
    for item in ids.split():
        first, _, last = item.partition("-")
        if not last:
            types.add(_BIAS_BY_ID[first])
            continue
        for i in range(int(first[1:]), int(last[1:]) + 1):
            types.add(_BIAS_BY_ID[f"B{i:02d}"])
    return frozenset(types)


def bias_type(attn_bias: Any) -> type:
    """The type operators are matched on: exact for masks (a subclass is another mask), torch.Tensor for any
    tensor (nn.Parameter, fake tensors under torch.compile)."""
    return torch.Tensor if isinstance(attn_bias, torch.Tensor) else type(attn_bias)


def tensor_bias(attn_bias: Any) -> torch.Tensor | None:
    """The dense additive part of a bias: a tensor bias itself, or the tensor of LowerTriangularMaskWithTensorBias."""
    if isinstance(attn_bias, torch.Tensor):
        return attn_bias
    if isinstance(attn_bias, ab.LowerTriangularMaskWithTensorBias):
        return attn_bias._bias
    return None


def varlen_num_sequences(attn_bias: Any) -> int | None:
    """Number of sequences packed in a varlen batch (B = 1); None for the other biases."""
    if isinstance(attn_bias, ab.VARLEN_BIASES):
        return len(attn_bias.q_seqinfo.seqstart_py) - 1
    return None


def varlen_lse_packed(lse: torch.Tensor, inp: Inputs) -> bool | None:
    """The layout of the LSE of a varlen batch of several sequences: packed [1, (G,) H, ΣMq] (True) or padded
    [nseq, (G,) H, >= max Mq] (False); None for other batches, whose LSE is [B, (G,) H, >= Mq] (the two layouts
    agree there). ValueError otherwise: a backward kernel reads the LSE by these shapes."""
    nseq = varlen_num_sequences(inp.attn_bias)
    heads = tuple(inp.query.shape[2:-1])
    if nseq is None or nseq <= 1:
        expected = (inp.query.shape[0], *heads)
        if tuple(lse.shape[:-1]) != expected or lse.shape[-1] < inp.query.shape[1]:
            raise ValueError(
                f"Wrong LSE shape {tuple(lse.shape)} for query.shape = {tuple(inp.query.shape)}: expected "
                f"({', '.join(map(str, expected))}, >= {inp.query.shape[1]})"
            )
        return None
    if tuple(lse.shape) == (1, *heads, inp.query.shape[1]):
        return True
    if tuple(lse.shape[:-1]) == (nseq, *heads) and lse.shape[-1] >= inp.attn_bias.q_seqinfo.max_seqlen:
        return False
    raise ValueError(
        f"Wrong LSE shape {tuple(lse.shape)} for a varlen batch of {nseq} sequences (query.shape = "
        f"{tuple(inp.query.shape)}): expected packed {(1, *heads, inp.query.shape[1])} or padded "
        f"({nseq}, {', '.join(map(str, heads))}, >= {inp.attn_bias.q_seqinfo.max_seqlen})"
    )


def causal_window(attn_bias: Any) -> tuple[str | None, int, int]:
    """How a kernel with causal and sliding-window support expresses a mask: (causal alignment "top-left",
    "bottom-right" or None, window_left, window_right), the window bounding d = j − i − s to
    [−window_left, window_right] (−1: unbounded; s = 0 for top-left, nk − nq for bottom-right). A paged mask
    (B15-B17, B21, B22) is its unpaged kind's rule over the logical keys (its fields hold the window)."""
    kind = attn_bias._UNPAGED if isinstance(attn_bias, ab._Paged) else type(attn_bias)
    if issubclass(kind, ab._WindowFromBottomRight):  # B04, B10, B14, B17: s − w < j − i <= s
        return "bottom-right", attn_bias._window_size - 1, 0
    if issubclass(kind, ab._CausalFromBottomRight):  # B03, B08, B12, B16, B19, B22
        return "bottom-right", -1, 0
    if issubclass(kind, ab._LocalFromBottomRight):  # B05, B13, B20
        return None, attn_bias.window_left, attn_bias.window_right
    if issubclass(kind, ab.BlockDiagonalCausalLocalAttentionMask):  # B09: i − w < j <= i
        return "top-left", attn_bias._window_size - 1, 0
    if issubclass(kind, (ab.LowerTriangularMask, ab.BlockDiagonalCausalMask)):  # B01, B02, B07
        return "top-left", -1, 0
    return None, -1, -1


@dataclass(frozen=True)
class VarlenArgs:
    """The sequence metadata varlen kernels take: sequence b's queries are rows [seqstart_q[b], seqstart_q[b+1])
    and its keys rows [seqstart_k[b], seqstart_k[b] + seqlen_k[b]) (seqlen_k None: up to seqstart_k[b+1])."""

    seqstart_q: torch.Tensor  # int32 [nseq + 1]
    seqstart_k: torch.Tensor  # int32 [nseq + 1]
    max_seqlen_q: int
    max_seqlen_k: int
    seqlen_k: torch.Tensor | None  # int32 [nseq], padded and gappy keys
    # The most keys a sequence may hold while kernels launched with this metadata replay from a CUDA graph:
    # max_seqlen_k, or the padding of padded keys, whose lengths from_seqlens_padded_inplace may grow up to it.
    key_capacity: int

    @property
    def num_sequences(self) -> int:
        return self.seqstart_q.numel() - 1


def varlen_args(attn_bias: Any) -> VarlenArgs | None:
    """The varlen metadata of a block-diagonal mask (B06-B14, B18-B20); None for the other biases."""
    if not isinstance(attn_bias, ab._BlockDiagonal):
        return None
    q, k = attn_bias.q_seqinfo, attn_bias.k_seqinfo
    seqlen, capacity = getattr(k, "seqlen", None), getattr(k, "padding", k.max_seqlen)
    return VarlenArgs(q.seqstart, k.seqstart, q.max_seqlen, k.max_seqlen, seqlen, capacity)


def queries_without_keys(inp: Inputs) -> bool:
    """Whether some query sees no key at all: a varlen sequence with queries but no keys, or causality from the
    bottom right with more queries than keys (its first nq − nk rows)."""
    bottom_right = causal_window(inp.attn_bias)[0] == "bottom-right"
    bias = inp.attn_bias
    if isinstance(bias, ab.VARLEN_BIASES):
        lengths = zip(bias.q_seqinfo.lengths(), bias.k_seqinfo.lengths(), strict=True)
    else:
        lengths = [(inp.query.shape[1], inp.key.shape[1])]
    return any(nq > 0 and (nk == 0 or (bottom_right and nk < nq)) for nq, nk in lengths)


def capturing_cuda_graph(inp: Inputs) -> bool:
    """Whether this call is being captured in a CUDA graph, whose replays keep the kernels chosen now while
    in-place updates change a varlen mask's lengths."""
    # No CUDA context, no capture: the check stays off GPU-less machines, where "cuda" tensors are fake. Nor is
    # torch.compile's tracing a capture (its CUDA graphs, if any, are taken of the compiled code later).
    if inp.device.type != "cuda" or torch.compiler.is_compiling() or not torch.cuda.is_initialized():
        return False
    return torch.cuda.is_current_stream_capturing()


# ------------------------------------------------------------------------------------------------ inputs


def _shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str:
    return f"  query.shape: {query.shape}\n  key.shape  : {key.shape}\n  value.shape: {value.shape}"


def _stored_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements of a view: dimensions expanded with stride 0 count once."""
    return t.element_size() * math.prod(size for size, stride in zip(t.shape, t.stride(), strict=True) if stride)


@dataclass
class Inputs:
    """The arguments of one attention call. BMK inputs become BMHK (H = 1) in `normalize_bmhk`. `kv_grads_summed`:
    K and V are expanded over the heads with stride 0 and autograd sums their heads' gradients anyway (`_fMHA`), so a
    backward may return dK and dV summed over the heads that share them ([..., 1, K]), as cuDNN's own GQA does."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_bias: torch.Tensor | ab.AttentionBias | None = None
    p: float = 0.0
    scale: float | None = None
    output_dtype: torch.dtype | None = None
    is_partial: bool = False
    quantize_pv_to_fp8: bool = False
    quantize_qk_to_fp8: bool = False
    use_fp32_scales: bool = False
    num_splits: int = 0
    kv_grads_summed: bool = False

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def scale_float(self) -> float:
        return self.query.shape[-1] ** -0.5 if self.scale is None else self.scale

    @property
    def nbytes(self) -> int:
        """Bytes of query, key, value and a tensor bias (stride-0 expansions count once)."""
        bias = tensor_bias(self.attn_bias)
        return sum(_stored_bytes(t) for t in (self.query, self.key, self.value, bias) if t is not None)

    def get_output_dtype(self) -> torch.dtype:
        """`output_dtype`, else float32 for partial attention (it is merged later) unless the query is float64,
        else the query's dtype. Only backends with SUPPORTS_OUTPUT_DTYPE honour it."""
        if self.output_dtype is not None:
            return self.output_dtype
        if self.is_partial and self.query.dtype is not torch.float64:
            return torch.float32
        return self.query.dtype

    def is_quantized(self) -> bool:
        """K/V packed as int32 (int4 / FP8 rows), FP8 scales, or a request to quantize inside the kernel."""
        return (
            self.value.dtype == torch.int32
            or isinstance(self, (InputsFp8, InputsMXFp8))
            or self.quantize_pv_to_fp8
            or self.quantize_qk_to_fp8
        )

    @property
    def value_head_dim(self) -> int:
        """The values' head dim: value's last dim, or query's where K/V come packed in int32 (int4 / FP8 rows)."""
        return self.query.shape[-1] if self.value.dtype == torch.int32 else self.value.shape[-1]

    def normalize_bmhk(self) -> tuple[int, ...]:
        """BMK [B, M, K] -> BMHK [B, M, 1, K] (a 3-D tensor bias [B, Mq, Mk] -> [B, 1, Mq, Mk]), in place.
        Returns the output shape in the caller's layout (query's shape with the values' head dim)."""
        output_shape = (*self.query.shape[:-1], self.value_head_dim)
        if self.query.dim() == 3:
            self.query, self.key, self.value = (t.unsqueeze(2) for t in (self.query, self.key, self.value))
            if isinstance(self.attn_bias, torch.Tensor):
                self.attn_bias = self.attn_bias.unsqueeze(1)
        return output_shape

    def get_qkv_in_bmghk(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """query, key, value as 5-D views [B, M, G, H, K]."""
        if self.query.dim() == 5:
            return self.query, self.key, self.value
        if self.query.dim() == 4:
            return self.query.unsqueeze(2), self.key.unsqueeze(2), self.value.unsqueeze(2)
        return self.query[:, :, None, None], self.key[:, :, None, None], self.value[:, :, None, None]

    def validate_inputs(self) -> None:
        """Raise ValueError on inputs no backend should see (spec §4): ranks, devices, dtypes, shapes, bias."""
        q, k, v = self.query, self.key, self.value
        if q.dim() not in (3, 4, 5) or k.dim() != q.dim() or v.dim() != q.dim():
            raise ValueError(f"Query/Key/Value should all have BMGHK, BMHK or BMK shape.\n{_shapes(q, k, v)}")
        if k.device != q.device or v.device != q.device:
            raise ValueError(
                "Query/Key/Value should all be on the same device\n"
                f"  query.device: {q.device}\n  key.device  : {k.device}\n  value.device: {v.device}"
            )
        bias = self.attn_bias
        bias_t = tensor_bias(bias)
        bias_device = bias.q_seqinfo.seqstart.device if isinstance(bias, ab.VARLEN_BIASES) else None
        if bias_t is not None:
            bias_device = bias_t.device
        if bias_device is not None and bias_device != q.device:
            raise ValueError(
                "Attention bias and Query/Key/Value should be on the same device\n"
                f"  query.device: {q.device}\n  attn_bias   : {bias_device}"
            )
        quantized_kv = k.dtype == v.dtype == torch.int32
        if not quantized_kv and not q.dtype == k.dtype == v.dtype:
            raise ValueError(
                "Query/Key/Value should either all have the same dtype, or (in the quantized case) Key/Value "
                f"should have dtype torch.int32\n  query.dtype: {q.dtype}\n  key.dtype  : {k.dtype}\n"
                f"  value.dtype: {v.dtype}"
            )
        if q.shape[-1] == 0:  # no scores (and the default scale 1/sqrt(K) is undefined)
            raise ValueError(f"Query/Key need a head dim of at least 1\n{_shapes(q, k, v)}")
        if q.dim() == 3 and not (
            bias is None or isinstance(bias, torch.Tensor) or type(bias) is ab.LowerTriangularMask
        ):
            raise ValueError(
                f"Please provide inputs in BMHK format rather than BMK when using bias type `{type(bias).__name__}`"
            )
        if bias_t is not None and not bias_t.dtype.is_floating_point:  # (SDPA's bool masks mean "keep")
            raise ValueError(
                f"attn_bias: a tensor bias is added to the scores and must be floating point, got {bias_t.dtype} "
                "(for a boolean mask, pass torch.zeros_like(mask, dtype=query.dtype).masked_fill(~mask, -inf))"
            )
        if self.output_dtype is not None and not self.output_dtype.is_floating_point:
            raise ValueError(f"output_dtype must be a floating-point dtype, got {self.output_dtype}")
        if bias_t is not None:
            expected = (q.shape[0], *q.shape[2:-1], q.shape[1], k.shape[1])  # [B, (G, H,) Mq, Mk]
            if tuple(bias_t.shape) != expected:
                raise ValueError(
                    f"Invalid shape for attention bias: {bias_t.shape} (expected {expected})\n{_shapes(q, k, v)}"
                )
        if isinstance(bias, ab.VARLEN_BIASES):
            if any(t.shape[0] != 1 for t in (q, k, v)):
                raise ValueError(f"Expected batch_size=1 when using block-diagonal bias\n{_shapes(q, k, v)}")
            # Kernels trust the sequence metadata: rows it names past the tensors would be read out of bounds.
            # (Paged masks name logical keys, in pages of a pool of whole pages; the page ids in the table, values on
            # the device, only the reference checks: reading them would wait for the GPU.)
            if isinstance(bias, ab._Paged) and k.shape[1] % bias.page_size:
                raise ValueError(
                    f"{type(bias).__name__}: the K/V pool must be whole pages, but key.shape[1] = {k.shape[1]} is "
                    f"not a multiple of page_size = {bias.page_size} (a page past the last whole one reads past it)"
                )
            q_rows = bias.q_seqinfo.seqstart_py[-1]
            k_ends = [end for _, end in bias.k_seqinfo.intervals()] if isinstance(bias, ab._BlockDiagonal) else []
            k_rows = max(k_ends) if k_ends else 0  # (not max's default=, which torch.compile rejects)
            if q_rows != q.shape[1] or k_rows > k.shape[1]:
                raise ValueError(
                    f"{type(bias).__name__} describes {q_rows} queries and keys up to row {k_rows}, but "
                    f"query.shape[1] = {q.shape[1]} and key.shape[1] = {k.shape[1]}"
                )
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"Invalid dropout probability: p={self.p}")
        key_dim = v.shape[-1] if quantized_kv else q.shape[-1]
        heads = tuple(q.shape[2:-1])  # (), (H,) or (G, H)
        batch, mkv = q.shape[0], k.shape[1]
        if k.shape != (batch, mkv, *heads, key_dim) or v.shape != (batch, mkv, *heads, v.shape[-1]):
            raise ValueError(
                f"Incompatible shapes for attention inputs:\n{_shapes(q, k, v)}\n"
                "HINT: We don't support broadcasting, please use `expand` yourself before calling "
                "`memory_efficient_attention` if you need to"
            )


@dataclass
class InputsFp8(Inputs):
    """Inputs with row-wise FP8 K/V (and optionally Q) packed as int32, with their scale and shift."""

    k_fp8_scale_shift: torch.Tensor | None = None
    v_fp8_scale_shift: torch.Tensor | None = None
    q_fp8_scale_shift: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        scales = (self.k_fp8_scale_shift, self.v_fp8_scale_shift, self.q_fp8_scale_shift)
        return super().nbytes + sum(_stored_bytes(t) for t in scales if t is not None)

    def normalize_bmhk(self) -> tuple[int, ...]:
        """As Inputs.normalize_bmhk, the scales (a scale a row: the tensors' shapes without the last dim) too."""
        if self.query.dim() == 3:
            self.k_fp8_scale_shift, self.v_fp8_scale_shift, self.q_fp8_scale_shift = (
                None if t is None else t.unsqueeze(2)
                for t in (self.k_fp8_scale_shift, self.v_fp8_scale_shift, self.q_fp8_scale_shift)
            )
        return super().normalize_bmhk()


@dataclass
class InputsMXFp8(Inputs):
    """Inputs in MX FP8 (e4m3 data, e8m0 scales per block of 32)."""

    k_fp8_scale: torch.Tensor | None = None
    v_fp8_scale: torch.Tensor | None = None
    q_fp8_scale: torch.Tensor | None = None


# ------------------------------------------------------------------------------------ forward / backward


@dataclass
class Context:
    """What the forward leaves for the backward. `op_bw` is set by a forward whose dropout randomness only its
    own backward can replay (`rng_state`); it then overrides the backward choice. `qkv_share_storage` (kept for
    callers of the reference API) asks a backward to write dq, dk, dv into one buffer; none of ours does."""

    lse: torch.Tensor
    out: torch.Tensor
    op_bw: type[AttentionBwOpBase] | None = None
    rng_state: Any = None
    qkv_share_storage: bool = False

    def get_padded_lse(self, pad_to: int) -> torch.Tensor:
        """The LSE with its last (query) dim padded to a multiple of `pad_to` with +inf (padding rows then get zero
        attention weights, exp(s − inf) = 0, in kernels that read whole blocks of queries)."""
        pad = -self.lse.shape[-1] % pad_to
        return torch.nn.functional.pad(self.lse, (0, pad), value=math.inf) if pad else self.lse


@dataclass
class Gradients:
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    db: torch.Tensor | None = None  # gradient of a tensor bias, when it requires one


class ScaledTensor(torch.Tensor):
    """Quantized data that carries its dequantization: `dequant_func(data, scale, original_dtype)`. The tensor
    itself is the quantized data (e.g. float8_e4m3fn); backends that take FP8 inputs read `unpack()`."""

    scale: torch.Tensor
    dequant_func: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
    original_dtype: torch.dtype
    # Ops on it (slicing, .to, ...) give plain tensors: they would not keep the scale in step.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dequant_func: Callable, original_dtype: torch.dtype):
        tensor = data.as_subclass(cls)
        tensor.scale, tensor.dequant_func, tensor.original_dtype = scale, dequant_func, original_dtype
        return tensor

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(quantized data as a plain tensor, scale)."""
        return self.as_subclass(torch.Tensor), self.scale

    def dequantize(self) -> torch.Tensor:
        data, scale = self.unpack()
        return self.dequant_func(data, scale, self.original_dtype)


def _dequantize_per_head(data: torch.Tensor, scale: torch.Tensor, original_dtype: torch.dtype) -> torch.Tensor:
    """data [B, M, (G,) H, K] · scale [B, (G,) H] (or a single value) -> original_dtype."""
    if scale.numel() > 1:
        scale = scale.unsqueeze(1).unsqueeze(-1)  # [B, 1, (G,) H, 1]
    return (data.float() * scale.float()).to(original_dtype)


def pack_fp8_tensorwise_per_head(
    x: torch.Tensor, scale: torch.Tensor | float, original_dtype: torch.dtype
) -> ScaledTensor:
    """FP8 `x` [B, M, (G,) H, K] with one dequantization scale per (batch, head), `scale` [B, (G,) H] (or one
    value for the whole tensor), as a ScaledTensor."""
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor([scale], dtype=torch.float32, device=x.device)
    if scale.numel() > 1 and tuple(scale.shape) != (x.shape[0], *x.shape[2:-1]):
        raise ValueError(
            f"pack_fp8_tensorwise_per_head: scale must be [B, (G,) H] = {(x.shape[0], *x.shape[2:-1])} or one "
            f"value, got {tuple(scale.shape)}"
        )
    return ScaledTensor(x, scale, _dequantize_per_head, original_dtype)


def bmk2bmhk(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B·H, M, K] (heads folded into the batch) -> [B, M, H, K]; BMHK and BMGHK tensors pass through."""
    if tensor.dim() != 3:
        return tensor
    batch, m, k = tensor.shape  # (no -1 in the reshape: ambiguous for an empty M or K)
    return tensor.reshape(batch // num_heads, num_heads, m, k).permute(0, 2, 1, 3)


def check_lastdim_alignment_stride1(reasons: list[str], name: str, x: torch.Tensor, alignment: int) -> None:
    """The reasons a kernel that loads `alignment` elements at a time cannot read `x` [..., M, K]."""
    if x.shape[-1] % alignment != 0:
        reasons.append(f"{name}.shape[-1] % {alignment} != 0")
    elif x.stride(-2) % alignment != 0:
        reasons.append(f"{name}.stride(-2) % {alignment} != 0 ({name}.stride() = {x.stride()})")
    if x.stride(-1) > 1:  # a stride of 0 happens when the last dim has size 1
        reasons.append(
            f"{name}.stride(-1) > 1 ({name}.stride() = {x.stride()}) - you should call `.contiguous()` on the input"
        )


def _bytes_past_16(x: torch.Tensor) -> int:
    """How many bytes x's first element lies past a 16-byte boundary: from a plain tensor's data pointer (buffers from
    DLPack or torch.frombuffer may start anywhere), else from the storage offset (fake tensors have no data pointer;
    the allocator aligns storages). Zero while torch.compile traces (Dynamo cannot trace either, and Inductor copies
    misaligned inputs before its graphs run)."""
    if torch.compiler.is_compiling():
        return 0
    if type(x) is torch.Tensor:  # 0.1 us; is_fake() would take 1.6 (the dispatcher asks up to nine times a call)
        return x.data_ptr() % 16
    return x.storage_offset() * x.element_size() % 16


def check_16_byte_aligned(reasons: list[str], name: str, x: torch.Tensor) -> None:
    """The reason a kernel that reads 16 bytes at a time cannot take x: it starts off a 16-byte boundary. On the
    H200 (torch 2.11, RESULTS.md, forty-third session) a query 8 bytes off stopped FlashAttention-2's and CUTLASS's
    kernels with "misaligned address" (which ends the CUDA context) and came out of cuDNN's 100% off."""
    if off := _bytes_past_16(x):
        reasons.append(f"{name} does not start on a 16-byte boundary ({off} bytes past one)")


def aligned(x: torch.Tensor) -> torch.Tensor:
    """x, or a copy of it that starts on a 16-byte boundary (the backward's out and grad, which no reason checks)."""
    return x.clone() if _bytes_past_16(x) else x


def kv_expanded(inp: Inputs) -> bool:
    """Whether K and V are expanded over their heads with stride 0 (MQA/GQA: one K/V head serves several query
    heads), which kernels with their own GQA read as one head a group."""
    return all(t.dim() >= 4 and t.shape[-2] > 1 and t.stride(-2) == 0 for t in (inp.key, inp.value))


def kv_heads(inp: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as kernels with their own MQA/GQA take them (FlashAttention's, cuDNN's, MSLK's backward): one head (a
    group) where they are expanded over the heads with stride 0, so that each K/V head is read once (no stride 0
    left)."""
    if not kv_expanded(inp):
        return inp.key, inp.value
    return inp.key[..., 0, :].unsqueeze(-2), inp.value[..., 0, :].unsqueeze(-2)


def check_not_expanded(reasons: list[str], name: str, x: torch.Tensor, heads_shared: bool = False) -> bool:
    """The reason a kernel cannot read `x` expanded with a stride of 0 (K/V heads broadcast for MQA/GQA); whether
    it is. heads_shared: but over its head dim (-2), which a kernel with its own GQA reads once (kv_heads)."""
    expanded = 0 in x.stride()[: -2 if heads_shared else -1]
    if expanded:
        reasons.append(f"{name} is expanded with a stride of 0 (stride() = {x.stride()})")
    return expanded


def _set_text(values) -> str:
    """A set as Python writes it, in a stable order (error texts must not change from run to run)."""
    return "{" + ", ".join(sorted(repr(v) for v in values)) + "}"


# ------------------------------------------------------------------------------------------- operators


class AttentionOpBase:
    """An attention kernel: what it supports (class attributes, spec §2.3) and why it cannot serve given inputs.
    Backends are used as classes (never instantiated)."""

    OPERATOR: ClassVar[Any] = None  # the kernel; None where this build has none (then `NOT_BUILT_REASON` says why)
    NOT_BUILT_REASON: ClassVar[str] = "no kernel in this build"
    NAME: ClassVar[str] = ""
    SUPPORTED_DEVICES: ClassVar[frozenset[str]] = frozenset()
    CUDA_MINIMUM_COMPUTE_CAPABILITY: ClassVar[tuple[int, int]] = (5, 0)
    CUDA_MAXIMUM_COMPUTE_CAPABILITY: ClassVar[tuple[int, int] | None] = None
    SUPPORTED_DTYPES: ClassVar[frozenset[torch.dtype]] = frozenset()
    SUPPORTED_MAX_K: ClassVar[float] = 0
    SUPPORTED_MIN_K: ClassVar[float] = 0
    SUPPORTED_ATTN_BIAS_TYPES: ClassVar[frozenset[type]] = frozenset({type(None)})
    SUPPORTS_DROPOUT: ClassVar[bool] = False
    SUPPORTS_CUSTOM_SCALE: ClassVar[bool] = False
    SUPPORTS_DIFFERENT_VALUE_EMBED: ClassVar[bool] = False
    SUPPORTS_OUTPUT_DTYPE: ClassVar[bool] = False
    SUPPORTS_PARTIAL: ClassVar[bool] = False
    SUPPORTS_BMGHK: ClassVar[bool] = False
    SUPPORTS_QUANTIZED_INPUTS: ClassVar[bool] = False  # int32-packed K/V, InputsFp8 / InputsMXFp8
    IS_DETERMINISTIC: ClassVar[bool] = True
    # LSE layout of varlen batches: packed [1, H, ΣMq] (True) or padded [nseq, H, max Mq] (False).
    VARLEN_LSE_PACKED: ClassVar[bool | None] = True
    ERROR_ATOL: ClassVar[dict[torch.dtype, float]] = {torch.float32: 3e-4, torch.half: 4e-3, torch.bfloat16: 2e-2}
    ERROR_RTOL: ClassVar[dict[torch.dtype, float]] = {torch.float32: 2e-5, torch.half: 4e-4, torch.bfloat16: 5e-3}
    _TEST_K: ClassVar[list[int]] = [32, 128]
    _TEST_BATCH_SIZES: ClassVar[list[int]] = [1, 300]

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when the kernel exists in this build (whatever the inputs), else why not."""
        return None if cls.OPERATOR is not None else cls.NOT_BUILT_REASON

    @classmethod
    def is_available(cls) -> bool:
        return cls.unavailable_reason() is None

    @classmethod
    def supports(cls, d: Inputs) -> bool:
        return not cls.not_supported_reasons(d)

    @classmethod
    def shape_not_supported_reasons(cls, Mq: int, Mkv: int, K: int, Kv: int) -> list[str]:
        reasons = []
        if not cls.SUPPORTS_DIFFERENT_VALUE_EMBED and K != Kv:
            reasons.append("query.shape[-1] != value.shape[-1]")
        if max(K, Kv) > cls.SUPPORTED_MAX_K:
            reasons.append(f"max(query.shape[-1], value.shape[-1]) > {cls.SUPPORTED_MAX_K}")
        if min(K, Kv) < cls.SUPPORTED_MIN_K:
            reasons.append(f"min(query.shape[-1], value.shape[-1]) < {cls.SUPPORTED_MIN_K}")
        return reasons

    @classmethod
    def not_supported_reasons(cls, d: Inputs) -> list[str]:
        """Why this operator cannot serve `d` (empty: it can). The texts are the ones users search for."""
        q = d.query
        reasons = cls.shape_not_supported_reasons(Mq=q.shape[1], Mkv=d.key.shape[1], K=q.shape[-1], Kv=d.value_head_dim)
        device_type = q.device.type
        if device_type not in cls.SUPPORTED_DEVICES:
            reasons.append(f"device={device_type} (supported: {_set_text(cls.SUPPORTED_DEVICES)})")
        nvidia_gpu = device_type == "cuda" and not rocm_build()
        capability = arch.capability(q.device) if nvidia_gpu else None
        if capability is not None:
            if capability < cls.CUDA_MINIMUM_COMPUTE_CAPABILITY:
                reasons.append(
                    f"requires device with capability >= {cls.CUDA_MINIMUM_COMPUTE_CAPABILITY} but your GPU has "
                    f"capability {capability} (too old)"
                )
            if cls.CUDA_MAXIMUM_COMPUTE_CAPABILITY is not None and capability > cls.CUDA_MAXIMUM_COMPUTE_CAPABILITY:
                reasons.append(
                    f"requires device with capability <= {cls.CUDA_MAXIMUM_COMPUTE_CAPABILITY} but your GPU has "
                    f"capability {capability} (too new)"
                )
        if q.dtype not in cls.SUPPORTED_DTYPES:
            reasons.append(f"dtype={q.dtype} (supported: {_set_text(cls.SUPPORTED_DTYPES)})")
        if bias_type(d.attn_bias) not in cls.SUPPORTED_ATTN_BIAS_TYPES:
            reasons.append(f"attn_bias type is {bias_type(d.attn_bias)}")
        if not cls.SUPPORTS_OUTPUT_DTYPE and d.output_dtype is not None and d.output_dtype is not q.dtype:
            reasons.append("Custom output dtype not supported")
        if d.is_partial and not cls.SUPPORTS_PARTIAL:
            reasons.append("Partial attention not supported")
        if d.p != 0.0 and not cls.SUPPORTS_DROPOUT:
            reasons.append("dropout > 0.0")
        if d.scale is not None and not cls.SUPPORTS_CUSTOM_SCALE:
            reasons.append("has custom scale")
        if d.is_quantized() and not cls.SUPPORTS_QUANTIZED_INPUTS:
            reasons.append("quantized inputs (int32 K/V, FP8 scales or quantize_*_to_fp8) not supported")
        if q.dtype is torch.bfloat16 and capability is not None and capability < (8, 0):
            reasons.append("bf16 is only supported on A100+ GPUs and MTIA")
        why_not_built = cls.unavailable_reason()
        if why_not_built is not None:
            reasons += ["operator wasn't built", why_not_built]
        if not cls.IS_DETERMINISTIC and torch.are_deterministic_algorithms_enabled():
            reasons.append("operator is non-deterministic, but torch.use_deterministic_algorithms is set")
        if not cls.SUPPORTS_BMGHK and q.dim() == 5:
            reasons.append("operator does not support BMGHK format")
        return reasons


class AttentionFwOpBase(AttentionOpBase):
    """A forward kernel: `apply(inp, needs_gradient) -> (out, Context or None)`, out [B, Mq, (G,) H, Kv]."""

    @classmethod
    def apply(cls, inp: Inputs, needs_gradient: bool) -> tuple[torch.Tensor, Context | None]:
        raise NotImplementedError(f"{cls.NAME}: {cls.unavailable_reason() or 'no forward kernel'}")


class AttentionBwOpBase(AttentionOpBase):
    """A backward kernel: `apply(ctx, inp, grad) -> Gradients`."""

    SUPPORTS_ATTN_BIAS_GRAD: ClassVar[bool] = False
    # A partial's output (fp32) and one of a custom output_dtype come with a gradient of their dtype: every backward
    # casts both to the inputs' dtype, which its kernel multiplies in.
    SUPPORTS_PARTIAL = True
    SUPPORTS_OUTPUT_DTYPE = True

    @classmethod
    def not_supported_reasons(cls, d: Inputs) -> list[str]:
        reasons = super().not_supported_reasons(d)
        dense = tensor_bias(d.attn_bias)
        if dense is not None and dense.requires_grad and not cls.SUPPORTS_ATTN_BIAS_GRAD:
            reasons.append("Computing the bias gradient is not supported (attn_bias.requires_grad = True)")
        return reasons

    @classmethod
    def apply(cls, ctx: Context, inp: Inputs, grad: torch.Tensor) -> Gradients:
        raise NotImplementedError(f"{cls.NAME}: {cls.unavailable_reason() or 'no backward kernel'}")


AttentionOp = tuple[type[AttentionFwOpBase] | None, type[AttentionBwOpBase] | None]
