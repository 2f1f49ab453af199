"""`triton_flash`: MSLK's own flash attention in Triton, forward (NAME `mslkF-triton`) and backward (`mslkB-triton`).

One program computes a block of BLOCK_M queries of one (sequence, group, head) with the online softmax in fp32
(exp2 of scores pre-multiplied by scale · log2 e), walking only the key blocks its mask can reach: causal and
sliding-window masks (top-left or bottom-right aligned) bound the key range of the block, so no tile is spent on
masked keys. Varlen batches (block-diagonal masks, padded or gappy keys) read their sequences' bounds from the
mask's seqstart / seqlen tensors on the device. BMGHK and stride-0 expanded K/V (grouped-query attention) are
read through their strides, never copied (only an operand not contiguous along the head dim is: a column-major
view, the expanded gradient of `out.sum()`); a tensor bias (any strides, broadcast ones too) is added to the
scores, and the backward gives its gradient. Dropout draws Philox numbers keyed by a seed (drawn on the device
by torch's generator) and each weight's position, so the backward replays them (`dropout_mask` gives the mask). fp32
inputs use IEEE fp32 products (no TF32), which the backends inside PyTorch do not offer on every GPU. Output
in the query's dtype or `output_dtype`; LSE [B, (G,) H, Mq] natural log, varlen packed [1, (G,) H, ΣMq].

On Hopper (SM90) the forward reads K and V tiles through TMA tensor descriptors where their layout allows (16-bit,
aligned rows, no stride-0 GQA expansion, no padded or gappy keys), which frees the registers that address math
takes otherwise, and a tensor bias's tiles too where TMA reads them (`_bias_view`); the interior key blocks of a
causal or windowed range skip the mask. At head dim 128 without a mask or with a causal one (and a tensor bias that
TMA reads, or none; no dropout, varlen or left window) the forward is triton_flash_hopper_fwd's warp-specialized
Gluon kernel (1.03-1.14x this module's from 512 keys; 1.02-1.04x with a bias).

`BwOp` is the matching backward, from any forward's output and LSE: after one prologue launch (delta, zeros in dQ's
fp32 sum and in varlen's dK/dV rows outside every sequence), one pass over key blocks that writes dK and dV and adds
dQ's shares in fp32 (TMA reduce-add on Hopper, atomics elsewhere), or, under torch.use_deterministic_algorithms,
two passes without atomics. On Hopper, Q, dO, K and V tiles come through
2D TMA descriptors where their rows allow (not varlen), and at head dims 64 and 128 without dropout, padded keys or
a bias gradient the one-pass backward is triton_flash_hopper's warp-specialized Gluon kernel (1.10-1.40x this
module's; varlen 1.41-1.47x; with a tensor bias 1.57x). The dispatcher (dispatch.py) tries them after cuDNN and
flash on Hopper (elsewhere after all of PyTorch's kernels), and the forward before cuDNN on attention over up to
256 (batch x head) pairs of 4096 rows or more with a causal mask, up to 128 without one, where it is measured faster
(`gluon_forward_before_cudnn`; B=4 M=4096 H=16 1.05-1.06x causal, 1.02-1.03x without a mask); on the H200 it beats
FlexAttention on sliding windows, tensor biases and varlen (RESULTS.md).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mslk.attention.fmha import attn_bias as ab
from mslk.attention.fmha._triton import available
from mslk.attention.fmha.common import (
    AttentionBwOpBase,
    AttentionFwOpBase,
    Context,
    Gradients,
    Inputs,
    VarlenArgs,
    bias_types,
    capturing_cuda_graph,
    causal_window,
    kv_expanded,
    kv_heads,
    tensor_bias,
    varlen_args,
)
from mslk.core import arch, launch, registry, testing

_LOG2E = 1.4426950408889634
_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
_TMA_HEAD_DIMS = (64, 128, 256)


@triton.jit
def _sequence(b, seqstart_q_ptr, seqstart_k_ptr, seqlen_k_ptr, Mq, Mk, VARLEN: tl.constexpr,
              HAS_SEQLEN_K: tl.constexpr):  # fmt: skip
    """(q_start, q_len, k_start, k_len, batch) of sequence b: its query rows [q_start, q_start + q_len) and key
    rows [k_start, k_start + k_len) of batch `batch` (varlen: batch 0 holds every sequence)."""
    if VARLEN:
        q_start = tl.load(seqstart_q_ptr + b)
        q_len = tl.load(seqstart_q_ptr + b + 1) - q_start
        k_start = tl.load(seqstart_k_ptr + b)
        if HAS_SEQLEN_K:
            k_len = tl.load(seqlen_k_ptr + b)
        else:
            k_len = tl.load(seqstart_k_ptr + b + 1) - k_start
        return q_start, q_len, k_start, k_len, 0
    return 0, Mq, 0, Mk, b


@triton.jit
def _visible(rows, cols, q_len, k_len, shift, window_left, window_right):
    """[BLOCK_M, BLOCK_N]: whether query i sees key j, i + shift - window_left <= j <= i + shift + window_right
    (a window of -1 is unbounded), both in their sequence."""
    d = cols[None, :] - rows[:, None] - shift
    visible = (rows < q_len)[:, None] & (cols < k_len)[None, :] & ((d >= -window_left) | (window_left < 0))
    return visible & ((d <= window_right) | (window_right < 0))


@triton.jit
def _key_range(first_row, q_len, k_len, shift, window_left, window_right, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):  # fmt: skip
    """[lo, hi) of the keys that the queries [first_row, first_row + BLOCK_M) may see, lo on a block; hi >= lo (an
    empty range when they see none, so that the unmasked range inside it is empty too)."""
    last_row = tl.minimum(first_row + BLOCK_M, q_len) - 1
    lo = tl.where(window_left >= 0, tl.maximum(first_row + shift - window_left, 0) // BLOCK_N * BLOCK_N, 0)
    hi = tl.where(window_right >= 0, tl.minimum(last_row + shift + window_right + 1, k_len), k_len)
    return lo, tl.maximum(hi, lo)


@triton.jit
def _load_rows(base, first, rows, n, stride, width_range, width, UPCAST: tl.constexpr):
    """Rows first + rows (those < n) of a [rows, width] operand, zeros elsewhere; fp32 when UPCAST (the Triton
    interpreter multiplies bf16 dot operands as raw integers)."""
    x = tl.load(
        base + (first + rows).to(tl.int64)[:, None] * stride + width_range[None, :],
        mask=(rows < n)[:, None] & (width_range < width)[None, :], other=0.0,
    )  # fmt: skip
    return x.to(tl.float32) if UPCAST else x


@triton.jit
def _scores(q, k, rows, cols, bias_ptr, stride_bm, stride_bn, q_len, k_len, qk_scale, HAS_BIAS: tl.constexpr,
            IEEE: tl.constexpr):  # fmt: skip
    """scale · q·kᵀ (+ the tensor bias) in log2 units, [BLOCK_M, BLOCK_N]."""
    s = _dot(q, k.T, None, IEEE) * qk_scale
    if HAS_BIAS:
        bias = tl.load(
            bias_ptr + rows.to(tl.int64)[:, None] * stride_bm + cols.to(tl.int64)[None, :] * stride_bn,
            mask=(rows < q_len)[:, None] & (cols < k_len)[None, :], other=0.0,
        )  # fmt: skip
        s += bias.to(tl.float32) * 1.4426950408889634
    return s


@triton.jit
def _bias_head(batch, g, h, stride_bb, stride_bg, stride_bh):
    """(batch element, group, head) of a head's tiles in a bias descriptor (`_bias_view`): 0 along a broadcast
    dimension (stride 0), which the descriptor holds as one element."""
    return tl.where(stride_bb == 0, 0, batch), tl.where(stride_bg == 0, 0, g), tl.where(stride_bh == 0, 0, h)


@triton.jit
def _head_offset(batch, g, h, stride_b, stride_g, stride_h, WIDE: tl.constexpr):
    """Elements from a tensor's start to (batch element, group, head)'s rows. In int64 when WIDE (`_past_int32`:
    a product can then pass 2**31, e.g. a [B, H, Mq, Mk] bias at H=16 Mq=Mk=16384), else in int32, which the
    backward runs faster with (3% at head dim 64)."""
    if WIDE:  # (one return statement: Triton wants one type for all of them, also under a constexpr if)
        batch, g, h = tl.cast(batch, tl.int64), tl.cast(g, tl.int64), tl.cast(h, tl.int64)
    return batch * stride_b + g * stride_g + h * stride_h


@triton.jit
def _kept(seed, head, rows, cols, Mk, p_drop):
    """[BLOCK_M, BLOCK_N] dropout keep mask of attention weights (tensor rows and key columns of one batch
    element, group and head `head`): Philox keyed by seed + head, counter row · Mk + column, so that the
    forward, the backward and `dropout_mask` draw the same numbers."""
    offsets = rows.to(tl.int64)[:, None] * Mk + cols[None, :]
    return tl.rand(seed + head, offsets) >= p_drop


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a · b in fp32 (acc None: zeros), accumulated by the tensor-core instruction itself: IEEE fp32
    products for fp32 operands (no TF32), tensor cores for 16-bit ones."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _unmasked_key_range(lo, hi, first_row, q_len, k_len, shift, window_left, window_right, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):  # fmt: skip
    """[full_lo, full_hi) inside [lo, hi), on blocks from lo: the key blocks that every query of the block
    [first_row, first_row + BLOCK_M) sees whole, so their scores need no mask. The last row bounds the left
    window edge, the first row the right edge (causal: the diagonal)."""
    last_row = tl.minimum(first_row + BLOCK_M, q_len) - 1
    seen_by_all = tl.where(window_left >= 0, last_row + shift - window_left, lo)
    full_lo = tl.minimum(lo + tl.cdiv(tl.maximum(seen_by_all - lo, 0), BLOCK_N) * BLOCK_N, hi)
    end = tl.minimum(tl.where(window_right >= 0, first_row + shift + window_right + 1, k_len), k_len)
    return full_lo, tl.maximum(lo + tl.maximum(end - lo, 0) // BLOCK_N * BLOCK_N, full_lo)


@triton.jit
def _attend(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, batch, g, h, bias_base, bias_desc, bias_at,
            start_col, end_col, rows, q_start, q_len, k_start, k_len, stride_km, stride_vm, stride_bm, stride_bn, dk,
            dv, K, Kv, Mk, qk_scale, shift, window_left, window_right, seed, head, p_drop, MASKED: tl.constexpr,
            DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_IN_EXP: tl.constexpr, IEEE: tl.constexpr,
            UPCAST: tl.constexpr, TMA: tl.constexpr, BIAS_TMA: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, BLOCK_KV: tl.constexpr):  # fmt: skip
    """The online softmax of the forward over the key blocks [start_col, end_col); only MASKED blocks evaluate
    the mask (the interior of a causal or windowed range is seen whole). TMA: K and V tiles come through tensor
    descriptors (zeros past the tensor's rows and head dim), which frees the registers of the address math.
    BIAS_TMA: so do the bias tiles, from (batch element, group, head, first row) `bias_at`: the pipeliner then
    stages them in shared memory like K and V, where pointer loads of them left the scores in a layout of their
    own (a shared-memory round trip of every score tile, 2.2x slower at B=2 M=4096 H=16 K=128)."""
    for start in range(start_col, end_col, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        if TMA:
            k = k_desc.load([batch, k_start + start, g, h, 0]).reshape(BLOCK_N, BLOCK_K)
            v = v_desc.load([batch, k_start + start, g, h, 0]).reshape(BLOCK_N, BLOCK_KV)
            if MASKED:  # rows past the sequence's keys (varlen: the next sequence's, or NaN past the last one)
                v = tl.where((cols < k_len)[:, None], v, 0.0)
        else:
            k = _load_rows(k_base, k_start, cols, k_len, stride_km, dk, K, UPCAST)
            v = _load_rows(v_base, k_start, cols, k_len, stride_vm, dv, Kv, UPCAST)
        if SCALE_IN_EXP:  # raw q·kᵀ, scaled inside the exponent (one FFMA a score; the scale is positive)
            s = _dot(q, k.T, None, IEEE)
            scale = qk_scale
        elif BIAS_TMA:
            at = [bias_at[0], bias_at[1], bias_at[2], bias_at[3], start]
            bias = bias_desc.load(at).reshape(rows.shape[0], BLOCK_N)
            s = _dot(q, k.T, None, IEEE) * qk_scale + bias.to(tl.float32) * 1.4426950408889634
            scale = 1.0
        else:
            s = _scores(q, k, rows, cols, bias_base, stride_bm, stride_bn, q_len, k_len, qk_scale, HAS_BIAS, IEEE)
            scale = 1.0
        if MASKED:
            s = tl.where(_visible(rows, cols, q_len, k_len, shift, window_left, window_right), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row without keys so far stays at zero
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s * scale - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:  # the row sums keep every weight; the values see the dropped, rescaled ones
            kept = _kept(seed, head, q_start + rows, k_start + cols, Mk, p_drop)
            p = tl.where(kept, p / (1.0 - p_drop), 0.0)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _tile_block(tile, blocks, section, heads):
    """(rank, sequence·group·head) of tile `tile`, one of `blocks` per head of `heads`. The heads go in sections of
    `section`, and a section's tiles rank by rank across its heads, rank 0 first: the block that a causal mask gives
    the most work. The last tiles to start are then short ones, and the heads running at once (a section or two)
    share their rows in L2."""
    per_section = section * blocks
    first_head = tile // per_section * section
    width = tl.minimum(section, heads - first_head)  # the last section may be narrower
    in_section = tile % per_section
    return in_section // width, first_head + in_section % width


@triton.jit
def _program_block(blocks, section):
    """_tile_block of this program, one program a tile."""
    return _tile_block(tl.program_id(0), blocks, section, tl.num_programs(0) // blocks)


def _heads_per_section(blocks: int, device: torch.device) -> int:
    """The `section` of `_program_block`: a power of two, a section about a wave of programs (one per SM; 4 under
    the interpreter, so that tests see sections). H200, B=4 M=4096 H=16 K=128 causal, TFLOP/s (RESULTS.md):
    forward 453 -> 489, backward 309 -> 325 against head by head; half or twice the section: slower."""
    programs = arch.sm_count(device) if device.type == "cuda" else 4
    return 1 << (max(1, programs // blocks).bit_length() - 1)


@triton.jit
def _flash_forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, bias_ptr, seqstart_q_ptr, seqstart_k_ptr, seqlen_k_ptr, k_desc, v_desc,
    bias_desc, G, H, Mq, Mk, K: tl.constexpr, Kv: tl.constexpr, qk_scale, window_left, window_right, seed_ptr, p_drop,
    stride_qb, stride_qm, stride_qg, stride_qh,
    stride_kb, stride_km, stride_kg, stride_kh,
    stride_vb, stride_vm, stride_vg, stride_vh,
    stride_ob, stride_om, stride_og, stride_oh,
    stride_lb, stride_lg, stride_lh,
    stride_bb, stride_bg, stride_bh, stride_bm, stride_bn, blocks, section,
    DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_IN_EXP: tl.constexpr, VARLEN: tl.constexpr,
    HAS_SEQLEN_K: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    TMA: tl.constexpr, BIAS_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_KV: tl.constexpr,
):  # fmt: skip
    seed = 0
    if DROPOUT:  # read on the device: each replay of a CUDA graph, each compiled call, draws its own
        seed = tl.load(seed_ptr)
    rank, pid_bgh = _program_block(blocks, section)
    pid_m = blocks - 1 - rank  # the last query blocks see the most keys under a causal mask
    b, g, h = pid_bgh // (G * H), (pid_bgh // H) % G, pid_bgh % H
    q_start, q_len, k_start, k_len, batch = _sequence(
        b, seqstart_q_ptr, seqstart_k_ptr, seqlen_k_ptr, Mq, Mk, VARLEN, HAS_SEQLEN_K
    )
    if pid_m * BLOCK_M < q_len:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # positions in the sequence
        dk = tl.arange(0, BLOCK_K)
        dv = tl.arange(0, BLOCK_KV)
        q_base = q_ptr + _head_offset(batch, g, h, stride_qb, stride_qg, stride_qh, True)
        q = _load_rows(q_base, q_start, rows, q_len, stride_qm, dk, K, UPCAST)
        k_base = k_ptr + _head_offset(batch, g, h, stride_kb, stride_kg, stride_kh, True)
        v_base = v_ptr + _head_offset(batch, g, h, stride_vb, stride_vg, stride_vh, True)
        bias_base = bias_ptr  # None without a bias
        if HAS_BIAS:
            bias_base = bias_ptr + _head_offset(batch, g, h, stride_bb, stride_bg, stride_bh, True)
        first_row = pid_m * BLOCK_M
        bias_b, bias_g, bias_h = _bias_head(batch, g, h, stride_bb, stride_bg, stride_bh)
        bias_at = (bias_b, bias_g, bias_h, first_row)

        shift = k_len - q_len if BOTTOM_RIGHT else 0
        lo, hi = _key_range(first_row, q_len, k_len, shift, window_left, window_right, BLOCK_M, BLOCK_N)
        full_lo, full_hi = _unmasked_key_range(
            lo, hi, first_row, q_len, k_len, shift, window_left, window_right, BLOCK_M, BLOCK_N
        )
        head = (batch * G + g) * H + h

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_KV], dtype=tl.float32)
        for part in tl.static_range(3):  # masked left edge, unmasked interior, masked right edge
            start_col = lo if part == 0 else (full_lo if part == 1 else full_hi)
            end_col = full_lo if part == 0 else (full_hi if part == 1 else hi)
            acc, m_i, l_i = _attend(
                acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, batch, g, h, bias_base, bias_desc, bias_at,
                start_col, end_col, rows, q_start, q_len, k_start, k_len, stride_km, stride_vm, stride_bm, stride_bn,
                dk, dv, K, Kv, Mk, qk_scale, shift, window_left, window_right, seed, head, p_drop, part != 1, DROPOUT,
                HAS_BIAS, SCALE_IN_EXP, IEEE, UPCAST, TMA, BIAS_TMA, BLOCK_N, BLOCK_K, BLOCK_KV,
            )  # fmt: skip

        has_keys = l_i > 0.0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        out_base = out_ptr + _head_offset(batch, g, h, stride_ob, stride_og, stride_oh, True)
        tl.store(
            out_base + (q_start + rows).to(tl.int64)[:, None] * stride_om + dv[None, :],
            out.to(out_ptr.dtype.element_ty), mask=(rows < q_len)[:, None] & (dv < Kv)[None, :],
        )  # fmt: skip
        lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
        lse_base = lse_ptr + _head_offset(batch, g, h, stride_lb, stride_lg, stride_lh, True)
        tl.store(lse_base + q_start + rows, lse, mask=rows < q_len)


@triton.jit
def _zero_rows(ptr, row_starts, mask, width, BLOCK: tl.constexpr):
    """Zeros in the first `width` elements of the rows that start at `row_starts` ([BLOCK_M] element offsets),
    where `mask`."""
    cols = tl.arange(0, BLOCK)
    zeros = tl.zeros((row_starts.shape[0], BLOCK), dtype=ptr.dtype.element_ty)
    tl.store(ptr + row_starts[:, None] + cols[None, :], zeros, mask=mask[:, None] & (cols < width)[None, :])


@triton.jit
def _backward_prologue_kernel(out_ptr, do_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, seqstart_k_ptr, sequences,
                              G, H, KV_H, Mq, Mk, K, Kv,
                              stride_ob, stride_om, stride_og, stride_oh,
                              stride_gb, stride_gm, stride_gg, stride_gh,
                              stride_db, stride_dg, stride_dh,
                              ZERO_DQ: tl.constexpr, ZERO_KEYS_OUTSIDE: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KV: tl.constexpr):  # fmt: skip
    """What the backward needs before its main pass, in one launch: delta = rowsum(dO ∘ O) in fp32 [B, G, H, Mq]
    (dS = P ∘ (dP − delta)), one read of each; with ZERO_DQ zeros in dQ's fp32 sum (contiguous [B, Mq, G, H, K]),
    which the main pass adds to; with ZERO_KEYS_OUTSIDE zeros in the rows of dK and dV (contiguous
    [B, Mk, G, KV_H, K] and [.., Kv], KV_H = H or 1) outside the varlen sequences' keys [seqstart_k[0],
    seqstart_k[sequences]), which no program of the main pass writes (a mask updated in place to fewer rows leaves
    some). One grid axis (the others take at most 65535 programs): blocks of BLOCK_M rows, head by head."""
    blocks = tl.cdiv(tl.maximum(Mq, Mk) if ZERO_KEYS_OUTSIDE else Mq, BLOCK_M)
    pid_bgh = tl.program_id(0) // blocks
    b, g, h = pid_bgh // (G * H), (pid_bgh // H) % G, pid_bgh % H
    rows = (tl.program_id(0) % blocks * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_KV)
    mask = (rows < Mq)[:, None] & (cols < Kv)[None, :]
    o = tl.load(out_ptr + _head_offset(b, g, h, stride_ob, stride_og, stride_oh, True)
                + rows[:, None] * stride_om + cols[None, :], mask=mask, other=0.0)  # fmt: skip
    do = tl.load(do_ptr + _head_offset(b, g, h, stride_gb, stride_gg, stride_gh, True)
                 + rows[:, None] * stride_gm + cols[None, :], mask=mask, other=0.0)  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + _head_offset(b, g, h, stride_db, stride_dg, stride_dh, True) + rows, delta, mask=rows < Mq)
    head = g.to(tl.int64) * H + h  # of G·H heads a row
    if ZERO_DQ:
        _zero_rows(dq_ptr, ((b * Mq + rows) * G * H + head) * K, rows < Mq, K, BLOCK_K)
    if ZERO_KEYS_OUTSIDE:
        outside = (rows < tl.load(seqstart_k_ptr)) | (rows >= tl.load(seqstart_k_ptr + sequences))
        outside &= (rows < Mk) & (h < KV_H)
        key_rows = (b * Mk + rows) * G * KV_H + g.to(tl.int64) * KV_H + h
        _zero_rows(dk_ptr, key_rows * K, outside, K, BLOCK_K)
        _zero_rows(dv_ptr, key_rows * Kv, outside, Kv, BLOCK_KV)


@triton.jit
def _lse2(lse):
    """The backward's LSE in log2 units, +inf for a query without any key (LSE −inf: masked whole, or by a tensor
    bias of −inf), whose weights exp2(s − LSE) are then 0 for every score, −inf included (where −inf − (−inf) would
    give NaN, in unmasked blocks too)."""
    lse2 = lse * 1.4426950408889634
    return tl.where(lse2 == float("-inf"), float("inf"), lse2)


@triton.jit
def _dkdv_over_queries(
    dk, dv, k, v, q_base, do_base, q_desc, do_desc, dq_base, dq_desc, lse_ptr, delta_ptr, stat_base, bias_base,
    db_base, start_row, end_row, cols, q_row0, head_col, q_start, q_len, k_start, k_len, stride_qm, stride_om,
    stride_gqm, stride_bm, stride_bn, stride_dbm, stride_dbn, dk_range, dv_range, K, Kv, Mk, qk_scale, sm_scale,
    shift, window_left, window_right, seed, head, p_drop, MASKED: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, ATOMIC_DQ: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KV: tl.constexpr,
):  # fmt: skip
    """dK and dV of the key block `cols` over the query blocks [start_row, end_row), in transposed tiles (rows:
    keys, columns: queries) so that Pᵀ and dSᵀ feed the dK/dV products without a transpose; only MASKED blocks
    evaluate the mask. ATOMIC_DQ: each block's dQ share, scale · dS·K, is added to the fp32 dQ in place (TMA
    reduce-add of the tile, or atomics). TMA: Q and dO tiles come through [B·M, G·H·K] tensor descriptors, from row
    q_row0 + start and column head_col · K."""
    for start in range(start_row, end_row, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        if TMA:
            q = q_desc.load([q_row0 + start, head_col * K])
            do = do_desc.load([q_row0 + start, head_col * Kv])
        else:
            q = _load_rows(q_base, q_start, rows, q_len, stride_qm, dk_range, K, UPCAST)
            do = _load_rows(do_base, q_start, rows, q_len, stride_om, dv_range, Kv, UPCAST)
        in_sequence = rows < q_len
        lse2 = _lse2(tl.load(lse_ptr + stat_base + rows, mask=in_sequence, other=0.0))
        delta = tl.load(delta_ptr + stat_base + rows, mask=in_sequence, other=0.0)
        s = _scores(k, q, cols, rows, bias_base, stride_bn, stride_bm, k_len, q_len, qk_scale, HAS_BIAS, IEEE)
        p = tl.exp2(s - lse2[None, :])
        if MASKED:
            p = tl.where(_visible(cols, rows, k_len, q_len, -shift, window_right, window_left), p, 0.0)
        dp = _dot(v, do.T, None, IEEE)
        p_dropped = p
        if DROPOUT:
            kept = _kept(seed, head, q_start + rows, k_start + cols, Mk, p_drop).T
            p_dropped = tl.where(kept, p / (1.0 - p_drop), 0.0)
            dp = tl.where(kept, dp / (1.0 - p_drop), 0.0)
        dv = _dot(p_dropped.to(do.dtype), do, dv, IEEE)
        ds = p * (dp - delta[None, :])
        dk = _dot(ds.to(q.dtype), q, dk, IEEE)
        if ATOMIC_DQ:
            # dQᵀ = Kᵀ·dSᵀ: both operands as they are in shared memory (no transpose of dS in registers)
            dq = _dot(k.T, ds.to(k.dtype), None, IEEE).T * sm_scale
            if TMA:
                dq_desc.atomic_add([q_row0 + start, head_col * K], dq)
            else:
                tl.atomic_add(dq_base + (q_start + rows).to(tl.int64)[:, None] * stride_gqm + dk_range[None, :], dq,
                              mask=in_sequence[:, None] & (dk_range < K)[None, :], sem="relaxed")  # fmt: skip
        if BIAS_GRAD:  # dbias = dS, written once per (query, key)
            tl.store(db_base + rows.to(tl.int64)[None, :] * stride_dbm + cols[:, None] * stride_dbn,
                     ds.to(db_base.dtype.element_ty), mask=in_sequence[None, :] & (cols < k_len)[:, None])  # fmt: skip
    return dk, dv


@triton.jit
def _flash_backward_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, bias_ptr, dbias_ptr,
    seqstart_q_ptr, seqstart_k_ptr, seqlen_k_ptr, q_desc, do_desc, dq_desc, k_desc, v_desc,
    G, H, Mq, Mk, K: tl.constexpr, Kv: tl.constexpr, qk_scale, sm_scale, window_left, window_right, seed_ptr,
    p_drop,
    stride_qb, stride_qm, stride_qg, stride_qh,
    stride_kb, stride_km, stride_kg, stride_kh,
    stride_vb, stride_vm, stride_vg, stride_vh,
    stride_ob, stride_om, stride_og, stride_oh,
    stride_lb, stride_lg, stride_lh,
    stride_gqb, stride_gqm, stride_gqg, stride_gqh,
    stride_gkb, stride_gkm, stride_gkg, stride_gkh,
    stride_gvb, stride_gvm, stride_gvg, stride_gvh,
    stride_bb, stride_bg, stride_bh, stride_bm, stride_bn,
    stride_dbb, stride_dbg, stride_dbh, stride_dbm, stride_dbn, blocks, section,
    DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, DQ_PASS: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, VARLEN: tl.constexpr, HAS_SEQLEN_K: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, WIDE: tl.constexpr, TMA: tl.constexpr, TMA_KV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KV: tl.constexpr,
):  # fmt: skip
    """Attention backward from the forward's LSE and delta = rowsum(dO ∘ O). With P = exp(S − LSE): dV = Pᵀ·dO,
    dS = P ∘ (dO·Vᵀ − delta), dQ = scale · dS·K, dK = scale · dSᵀ·Q. Programs (key block, sequence·group·head)
    loop over the query blocks that see their keys and write dK and dV; with ATOMIC_DQ they also add dQ's shares
    (one pass, 5 products a tile). Deterministic mode: DQ_PASS programs (query block, ...) loop over their
    visible key blocks and write dQ, then the dK/dV programs run without ATOMIC_DQ. The dK/dV programs write the
    bias gradient dS (each (query, key) once)."""
    seed = 0
    if DROPOUT:  # read on the device: each replay of a CUDA graph, each compiled call, draws its own
        seed = tl.load(seed_ptr)
    rank, pid_bgh = _program_block(blocks, section)
    pid = blocks - 1 - rank if DQ_PASS else rank  # the most work under a causal mask: last queries, first keys
    b, g, h = pid_bgh // (G * H), (pid_bgh // H) % G, pid_bgh % H
    q_start, q_len, k_start, k_len, batch = _sequence(
        b, seqstart_q_ptr, seqstart_k_ptr, seqlen_k_ptr, Mq, Mk, VARLEN, HAS_SEQLEN_K
    )
    batch = tl.cast(batch, tl.int64)
    shift = k_len - q_len if BOTTOM_RIGHT else 0
    dk_range = tl.arange(0, BLOCK_K)
    dv_range = tl.arange(0, BLOCK_KV)
    q_base = q_ptr + _head_offset(batch, g, h, stride_qb, stride_qg, stride_qh, WIDE)
    do_base = do_ptr + _head_offset(batch, g, h, stride_ob, stride_og, stride_oh, WIDE)
    k_base = k_ptr + _head_offset(batch, g, h, stride_kb, stride_kg, stride_kh, WIDE)
    v_base = v_ptr + _head_offset(batch, g, h, stride_vb, stride_vg, stride_vh, WIDE)
    dq_base = dq_ptr + _head_offset(batch, g, h, stride_gqb, stride_gqg, stride_gqh, WIDE)
    # LSE and delta share a layout
    stat_base = _head_offset(batch, g, h, stride_lb, stride_lg, stride_lh, WIDE) + q_start
    head = (batch * G + g) * H + h  # keys the dropout's numbers
    head_col = g * H + h  # the head's column block in the [B·M, G·H·K] views of the descriptors
    bias_base = bias_ptr  # None without a bias
    db_base = dbias_ptr
    if HAS_BIAS:
        bias_base = bias_ptr + _head_offset(batch, g, h, stride_bb, stride_bg, stride_bh, WIDE)
    if BIAS_GRAD:
        db_base = dbias_ptr + _head_offset(batch, g, h, stride_dbb, stride_dbg, stride_dbh, WIDE)
    if DQ_PASS:
        if pid * BLOCK_M < q_len:
            rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
            q = _load_rows(q_base, q_start, rows, q_len, stride_qm, dk_range, K, UPCAST)
            do = _load_rows(do_base, q_start, rows, q_len, stride_om, dv_range, Kv, UPCAST)
            lse2 = _lse2(tl.load(lse_ptr + stat_base + rows, mask=rows < q_len, other=0.0))
            delta = tl.load(delta_ptr + stat_base + rows, mask=rows < q_len, other=0.0)
            lo, hi = _key_range(pid * BLOCK_M, q_len, k_len, shift, window_left, window_right, BLOCK_M, BLOCK_N)
            dq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
            for start in range(lo, hi, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                k = _load_rows(k_base, k_start, cols, k_len, stride_km, dk_range, K, UPCAST)
                v = _load_rows(v_base, k_start, cols, k_len, stride_vm, dv_range, Kv, UPCAST)
                visible = _visible(rows, cols, q_len, k_len, shift, window_left, window_right)
                s = _scores(q, k, rows, cols, bias_base, stride_bm, stride_bn, q_len, k_len, qk_scale, HAS_BIAS, IEEE)
                p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
                dp = _dot(do, v.T, None, IEEE)
                if DROPOUT:
                    kept = _kept(seed, head, q_start + rows, k_start + cols, Mk, p_drop)
                    dp = tl.where(kept, dp / (1.0 - p_drop), 0.0)
                ds = p * (dp - delta[:, None])
                dq = _dot(ds.to(k.dtype), k, dq, IEEE)
            tl.store(dq_base + (q_start + rows).to(tl.int64)[:, None] * stride_gqm + dk_range[None, :],
                     (dq * sm_scale).to(dq_ptr.dtype.element_ty),
                     mask=(rows < q_len)[:, None] & (dk_range < K)[None, :])  # fmt: skip
    else:
        first_col = pid * BLOCK_N
        if first_col < k_len:
            cols = first_col + tl.arange(0, BLOCK_N)
            if TMA_KV:
                k_row = (batch * Mk + k_start + first_col).to(tl.int32)
                k = k_desc.load([k_row, head_col * K])
                v = v_desc.load([k_row, head_col * Kv])
            else:
                k = _load_rows(k_base, k_start, cols, k_len, stride_km, dk_range, K, UPCAST)
                v = _load_rows(v_base, k_start, cols, k_len, stride_vm, dv_range, Kv, UPCAST)
            # Query j sees key i as key i sees query j under the mirrored mask (shift and windows swapped), so the
            # key-range helpers give the query blocks that see this key block and those that see it whole.
            lo, hi = _key_range(first_col, k_len, q_len, -shift, window_right, window_left, BLOCK_N, BLOCK_M)
            full_lo, full_hi = _unmasked_key_range(
                lo, hi, first_col, k_len, q_len, -shift, window_right, window_left, BLOCK_N, BLOCK_M
            )
            if first_col + BLOCK_N > k_len:  # columns past the sequence's keys (another sequence's under TMA)
                full_lo, full_hi = hi, hi
            q_row0 = (batch * Mq + q_start).to(tl.int32)  # of the sequence's first query in the [B·M, ...] views
            dk = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_KV], dtype=tl.float32)
            for part in tl.static_range(3):  # masked first query blocks, unmasked interior, masked last ones
                start_row = lo if part == 0 else (full_lo if part == 1 else full_hi)
                end_row = full_lo if part == 0 else (full_hi if part == 1 else hi)
                dk, dv = _dkdv_over_queries(
                    dk, dv, k, v, q_base, do_base, q_desc, do_desc, dq_base, dq_desc, lse_ptr, delta_ptr, stat_base,
                    bias_base, db_base, start_row, end_row, cols, q_row0, head_col, q_start, q_len, k_start, k_len,
                    stride_qm, stride_om, stride_gqm, stride_bm, stride_bn, stride_dbm, stride_dbn, dk_range,
                    dv_range, K, Kv, Mk, qk_scale, sm_scale, shift, window_left, window_right, seed, head, p_drop,
                    part != 1, DROPOUT, HAS_BIAS, BIAS_GRAD, ATOMIC_DQ, IEEE, UPCAST, TMA, BLOCK_M, BLOCK_K, BLOCK_KV,
                )  # fmt: skip
            dk_base = dk_ptr + _head_offset(batch, g, h, stride_gkb, stride_gkg, stride_gkh, WIDE)
            tl.store(dk_base + (k_start + cols).to(tl.int64)[:, None] * stride_gkm + dk_range[None, :],
                     (dk * sm_scale).to(dk_ptr.dtype.element_ty),
                     mask=(cols < k_len)[:, None] & (dk_range < K)[None, :])  # fmt: skip
            dv_base = dv_ptr + _head_offset(batch, g, h, stride_gvb, stride_gvg, stride_gvh, WIDE)
            tl.store(dv_base + (k_start + cols).to(tl.int64)[:, None] * stride_gvm + dv_range[None, :],
                     dv.to(dv_ptr.dtype.element_ty),
                     mask=(cols < k_len)[:, None] & (dv_range < Kv)[None, :])  # fmt: skip


@triton.jit
def _dropout_mask_kernel(mask_ptr, seed_ptr, G, H, Mq, Mk, p_drop, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One grid axis (the others take at most 65535 programs): [BLOCK_M, BLOCK_N] tiles, row by row, head by head."""
    seed = tl.load(seed_ptr)
    col_blocks = tl.cdiv(Mk, BLOCK_N)
    per_head = tl.cdiv(Mq, BLOCK_M) * col_blocks
    pid = tl.program_id(0)
    head = pid // per_head
    rows = pid % per_head // col_blocks * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid % col_blocks * BLOCK_N + tl.arange(0, BLOCK_N)
    kept = _kept(seed, head, rows, cols, Mk, p_drop)
    ptrs = mask_ptr + (head.to(tl.int64) * Mq + rows.to(tl.int64)[:, None]) * Mk + cols[None, :]
    tl.store(ptrs, kept, mask=(rows < Mq)[:, None] & (cols < Mk)[None, :])


def dropout_mask(seed: torch.Tensor | int, batch: int, groups: int, heads: int, mq: int, mk: int, p: float,
                 device) -> torch.Tensor:  # fmt: skip
    """The keep mask (bool [B, G, H, Mq, Mk], over the tensors' rows and key rows; varlen: B = 1) that the
    kernels draw for a dropout seed (a forward's Context.rng_state, or an int): what tests reproduce the dropped
    attention with."""
    mask = torch.empty((batch, groups, heads, mq, mk), dtype=torch.bool, device=device)
    if mask.numel():
        seed = torch.as_tensor(seed, dtype=torch.int32, device=device).reshape(1)
        grid = (launch.cdiv(mq, 16) * launch.cdiv(mk, 16) * batch * groups * heads,)
        launch.fast(_dropout_mask_kernel)[grid](mask, seed, groups, heads, mq, mk, p, BLOCK_M=16, BLOCK_N=16)
    return mask


def _tiles(
    q: torch.Tensor, head_block: int, kind: str, tma: bool = False, short_sequences: bool = False, bias: bool = False
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a pass (`kind`: "fwd", "dq" or "dkdv", whose BLOCK_M is the query
    step and BLOCK_N the key block of a program; `tma`: the forward reads K/V through tensor descriptors; `bias`: a
    tensor bias is read; `short_sequences`: varlen of at most 512 queries a sequence, where a program sees few key
    blocks and smaller, more programs win: 64 x 64 on 4 warps took 146 us against 185 for 128 x 128 at 32 x 512
    causal, B=1 H=16 K=128, and tied at 8 x 2048). Under the interpreter, small unequal tiles (slow per program;
    tests cover BLOCK_M != BLOCK_N). On Hopper (SM90) with 16-bit inputs, the fastest of sweeps on the H200 (bf16,
    B=4 M=4096 H=16 at K=128, B=8 K=64, B=2 K=256; RESULTS.md; larger blocks spill registers or overflow shared
    memory in the backward). Elsewhere (fp32's IEEE products, other GPUs, some with about 100 KiB of shared memory a
    block) square tiles that fit any of them: 64 (forward) and 32 (backward) up to head dim 128, half that above."""
    if not q.is_cuda:
        return (16, 32, 4, 2) if kind == "dkdv" else (32, 16, 4, 2)
    if q.dtype == torch.float32:
        return 16, 16, 4, 2
    if not arch.on_hopper(q):
        block = (64 if head_block <= 128 else 32) // (1 if kind == "fwd" else 2)
        return block, block, 4, 2
    if kind == "fwd" and tma:
        # A bias's tiles take shared memory too: the tiles without one asked 288 KiB at head dim 128 and 240 at 256,
        # of a Hopper block's 227 (OutOfResources on the H200). The fastest of a sweep (bf16 M=4096 H=16; RESULTS.md):
        # K=64 B=4 1007 us (8 warps: 1159), K=128 B=2 703 (64 x 64 tiles: 900), K=256 B=1 687 (64 x 64 on 8 warps,
        # which do not spill: 1334).
        if bias:
            return (128, 64, 4, 3) if head_block <= 64 else ((128, 64, 8, 3) if head_block <= 128 else (128, 64, 8, 2))
        if short_sequences and head_block <= 128:
            return 64, 64, 4, 3
        return (128, 64, 8, 3) if head_block <= 64 else ((128, 128, 8, 3) if head_block <= 128 else (64, 64, 4, 3))
    if kind == "dkdv":
        return (64, 64, 4, 3) if head_block <= 64 else ((64, 128, 8, 2) if head_block <= 128 else (32, 64, 8, 3))
    if head_block > 128:  # 32 x 32 dQ tiles overflow shared memory at head dim 256 under Triton 3.6
        return (128, 64, 8, 2) if kind == "fwd" else (16, 16, 4, 2)
    return 128, 64, 8, 3


def _tma_readable(*tensors: torch.Tensor, pointers: bool = True) -> bool:
    """Whether kernels may read these [B, M, G, H, K] tensors through TMA descriptors: NVIDIA Hopper (SM90, where it
    is tested and measured), 16-bit, head dims 64, 128 or 256 (others take the pointer path), 16-byte aligned rows
    and no stride 0 (K/V expanded for GQA). pointers=False leaves the data pointers unread (the dispatcher's
    question, which torch.compile asks of fake tensors): shapes and strides only."""
    # (loops, not generators: every dispatched call on Hopper asks, and again at launch)
    for t in tensors:
        if not t.is_cuda or t.element_size() != 2 or t.shape[-1] not in _TMA_HEAD_DIMS:
            return False
    if not arch.on_hopper(tensors[0]):
        return False
    for t in tensors:
        strides = t.stride()
        if strides[-1] != 1 or 0 in strides or (pointers and t.data_ptr() % 16):
            return False
        for stride in strides[:-1]:
            if stride % 8:
                return False
    return True


def _tile_descriptors(rows: int, *tensors_and_widths: tuple[torch.Tensor, int]) -> tuple:
    """TMA descriptors of [B, M, G, H, K] tensors (any strides TMA takes), one [rows, width] tile per load (zeros
    past each batch element's rows and the head dim)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return tuple(
        TensorDescriptor(t, list(t.shape), list(t.stride()), [1, rows, 1, 1, width]) for t, width in tensors_and_widths
    )


def _bias_view(bias: torch.Tensor | None, q: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """(shape, strides) of the [B, G, H, Mq, Mk] bias (`_bias_args`) for a TMA descriptor, where TMA can read it:
    q's dtype, keys next to each other, rows 16-byte aligned and not broadcast. A broadcast batch, group or head
    dimension (stride 0) becomes one element, which the kernels read at index 0 (TMA strides are nonzero multiples
    of 16 bytes). None otherwise: the kernels' pointer loads."""
    if bias is None or bias.dtype != q.dtype or bias.stride(-1) != 1 or bias.data_ptr() % 16:
        return None
    single = [n == 1 or s == 0 for n, s in zip(bias.shape, bias.stride(), strict=True)]
    if (bias.stride(-2) == 0 and bias.shape[-2] > 1) or any(
        s % (16 // bias.element_size()) for s, one in zip(bias.stride()[:-1], single, strict=False) if not one
    ):
        return None
    shape = [1 if one else n for n, one in zip(bias.shape, single, strict=True)]
    strides = [16 if one else s for s, one in zip(bias.stride()[:-1], single, strict=False)] + [1]
    return shape, strides


def _bias_descriptor(bias: torch.Tensor | None, q: torch.Tensor, block_m: int, block_n: int):
    """A TMA descriptor of the bias (`_bias_view`), one [block_m, block_n] tile per load (zeros past Mq and Mk), or
    None."""
    view = _bias_view(bias, q)
    if view is None:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(bias, *view, [1, 1, 1, block_m, block_n])


def _flat_rows(t: torch.Tensor) -> bool:
    """Whether a [B, M, G, H, K] tensor's rows are those of a [B·M, G·H·K] matrix (strides (M·s, s, H·K, K, 1)),
    which 2D tensor descriptors read."""
    b, m, g, h, k = t.shape
    stride_b, stride_m, stride_g, stride_h, _ = t.stride()  # (one call: t.stride(i) costs as much as t.stride())
    return (b == 1 or stride_b == m * stride_m) and (g == 1 or stride_g == h * k) and (h == 1 or stride_h == k)


def _row_descriptors(rows: int, *tensors_and_widths: tuple[torch.Tensor, int]) -> tuple:
    """TMA descriptors of [B, M, G, H, K] tensors (`_flat_rows`) as [B·M, G·H·K] matrices, one [rows, width] tile
    per load or reduce-add: a tile past a sequence's rows reaches the next one's rows (zeros past the tensor)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return tuple(
        TensorDescriptor(t, [t.shape[0] * t.shape[1], math.prod(t.shape[2:])], [t.stride(1), 1], [rows, width])
        for t, width in tensors_and_widths
    )


def _bmghk(t: torch.Tensor) -> torch.Tensor:
    """A [B, M, H, K] tensor as [B, M, 1, H, K] (a view), with elements next to each other along K, which the
    kernels' row loads and descriptors take for granted: a copy where they are not (a column-major view, or the
    expanded gradient of `out.sum()`, whose strides are all 0)."""
    t = t if t.stride(-1) == 1 else t.contiguous()
    return t if t.dim() == 5 else t.unsqueeze(2)


def _strides(*tensors: torch.Tensor) -> list[int]:
    """The (batch, row, group, head) strides of [B, M, G, H, K] tensors, one after the other."""
    return [stride for t in tensors for stride in t.stride()[:4]]


def _past_int32(*tensors: torch.Tensor | None) -> bool:
    """Whether an element of one of these tensors lies 2**31 or more elements past its start (the backward's WIDE)."""
    return any(
        t is not None and sum(max(n - 1, 0) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True)) >= 2**31
        for t in tensors
    )


def _bias_args(bias: torch.Tensor | None) -> list:
    """The tensor bias [B, (G,) H, Mq, Mk] (any strides, broadcast ones included) and its five strides, as the
    kernels take it (None and zeros without one)."""
    if bias is None:
        return [None, 0, 0, 0, 0, 0]
    bias = bias if bias.dim() == 5 else bias.unsqueeze(1)
    return [bias, *bias.stride()]


def _alignment(inp: Inputs) -> tuple[str | None, int, int]:
    """causal_window's (alignment, window_left, window_right) of the inputs' mask, a local window without causality
    aligned bottom-right like FlashAttention's. A window wider than all the rows (sys.maxsize as "unbounded") is cut
    to Mq + Mk, which reaches every key as well: the kernels' key ranges add it to row numbers in 32 bits."""
    alignment, window_left, window_right = causal_window(inp.attn_bias)
    if alignment is None and (window_left >= 0 or window_right >= 0):
        alignment = "bottom-right"
    widest = inp.query.shape[1] + inp.key.shape[1]
    return alignment, min(window_left, widest), min(window_right, widest)


def _varlen_fields(attn_bias) -> tuple:
    """varlen_args(attn_bias) as the launches take it: (seqstart_q, seqstart_k, seqlen_k, max_seqlen_q,
    max_seqlen_k, key_capacity), Nones and zeros when it is not varlen."""
    varlen = varlen_args(attn_bias)
    if varlen is None:
        return None, None, None, 0, 0, 0
    return (varlen.seqstart_q, varlen.seqstart_k, varlen.seqlen_k, varlen.max_seqlen_q, varlen.max_seqlen_k,
            varlen.key_capacity)  # fmt: skip


def _varlen(seqstart_q, seqstart_k, seqlen_k, max_seqlen_q, max_seqlen_k, key_capacity) -> VarlenArgs | None:
    """The VarlenArgs of _varlen_fields, or None."""
    if seqstart_q is None:
        return None
    return VarlenArgs(seqstart_q, seqstart_k, max_seqlen_q, max_seqlen_k, seqlen_k, key_capacity)


def _flash_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    seqstart_q: torch.Tensor | None,
    seqstart_k: torch.Tensor | None,
    seqlen_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    key_capacity: int,
    scale: float,
    p: float,
    seed: torch.Tensor | None,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    output_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's launches: out [B, Mq, G, H, Kv] and LSE [B, G, H, Mq] (fp32) of [B, M, (G,) H, K] inputs."""
    q, k, v = (_bmghk(t) for t in (query, key, value))
    batch, mq, groups, heads, dim = q.shape
    mk, dim_v = k.shape[1], v.shape[-1]
    out = torch.empty((batch, mq, groups, heads, dim_v), dtype=output_dtype, device=q.device)
    varlen = _varlen(seqstart_q, seqstart_k, seqlen_k, max_seqlen_q, max_seqlen_k, key_capacity)
    sequences = batch if varlen is None else varlen.num_sequences
    max_q = mq if varlen is None else varlen.max_seqlen_q
    lse = torch.empty((batch, groups, heads, mq), dtype=torch.float32, device=q.device)
    bias, *bias_strides = _bias_args(bias)
    gluon = _gluon_forward(q, k, v, bias, p, scale, varlen, window_left) if out.numel() and max_q else None
    if gluon is not None:  # Hopper, no mask or causal (with a bias or not): warpgroups that take turns
        gluon.run(q, k, v, out, lse, scale, window_right, bottom_right, bias)
    elif out.numel() and max_q:
        block_k, block_kv = launch.next_power_of_2(max(dim, 16)), launch.next_power_of_2(max(dim_v, 16))
        # Not with padded or gappy keys: a tile past a sequence's keys then reads rows that may hold anything,
        # NaN included, where the pointer path reads zeros.
        tma = _tma_readable(k, v) and (varlen is None or varlen.seqlen_k is None)
        short = varlen is not None and max_q <= 512
        block_m, block_n, warps, stages = _tiles(q, max(block_k, block_kv), "fwd", tma, short, bias is not None)
        blocks = launch.cdiv(max_q, block_m)
        descriptors = _tile_descriptors(block_n, (k, block_k), (v, block_kv)) if tma else None
        bias_desc = _bias_descriptor(bias, q, block_m, block_n) if tma else None
        launch.fast(_flash_forward_kernel)[(blocks * sequences * groups * heads,)](
            q, k, v, out, lse, bias, seqstart_q, seqstart_k, seqlen_k,
            *descriptors or (None, None), bias_desc,
            groups, heads, mq, mk, dim, dim_v, scale * _LOG2E, window_left, window_right, seed, p,
            *_strides(q, k, v, out), *lse.stride()[:3], *bias_strides, blocks,
            _heads_per_section(blocks, q.device), DROPOUT=p > 0.0,
            HAS_BIAS=bias is not None, SCALE_IN_EXP=bias is None and scale > 0.0,
            VARLEN=varlen is not None, HAS_SEQLEN_K=seqlen_k is not None,
            BOTTOM_RIGHT=bottom_right, IEEE=q.dtype == torch.float32,
            UPCAST=q.dtype == torch.bfloat16 and not q.is_cuda, TMA=descriptors is not None,
            BIAS_TMA=bias_desc is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_KV=block_kv,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    elif out.numel():
        out.zero_()
    if max_q == 0 or out.numel() == 0:
        lse.fill_(-math.inf)
    return out, lse


def _flash_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    grad: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    bias_requires_grad: bool,
    seqstart_q: torch.Tensor | None,
    seqstart_k: torch.Tensor | None,
    seqlen_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    key_capacity: int,
    scale: float,
    p: float,
    seed: torch.Tensor | None,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward's launches: dQ, dK, dV [B, M, G, H, K] of [B, M, (G,) H, K] inputs, and the bias's gradient
    (empty unless bias_requires_grad). K and V of one head for H query heads (GQA, where autograd takes dK and dV
    a K/V head: Inputs.kv_grads_summed) are read expanded over H, and their dK and dV are the heads' sums."""
    q, k, v, out, do = (_bmghk(t) for t in (query, key, value, out, grad))
    batch, mq, groups, heads, dim = q.shape
    heads_summed = k.shape[3] == 1 < heads
    if heads_summed:
        k, v = (t.expand(*t.shape[:3], heads, t.shape[4]) for t in (k, v))
    mk, dim_v = k.shape[1], v.shape[-1]
    varlen = _varlen(seqstart_q, seqstart_k, seqlen_k, max_seqlen_q, max_seqlen_k, key_capacity)
    sequences = batch if varlen is None else varlen.num_sequences
    # Key blocks up to the capacity: a CUDA graph replays this launch after padded keys grew in place.
    max_q, max_k = (mq, mk) if varlen is None else (varlen.max_seqlen_q, varlen.key_capacity)
    runs = bool(max_q and max_k and dim)
    db = torch.zeros(bias.shape, dtype=bias.dtype, device=q.device) if bias_requires_grad else q.new_empty(0)
    bias, *bias_strides = _bias_args(bias)
    gluon = _gluon_backward(q, k, v, do, bias, bias_requires_grad, p, varlen, deterministic) if runs else None
    # dK and dV a query head, summed over the heads after the kernels where K/V are one head's, unless the Gluon
    # kernel sums them itself.
    kernel_sums = heads_summed and gluon is not None and gluon.sums_heads(k, bias, varlen)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk, dv = (torch.empty((*t.shape[:3], 1 if kernel_sums else heads, t.shape[4]), dtype=t.dtype, device=t.device)
              for t in (k, v))  # fmt: skip
    # The one-pass backward sums dQ in fp32 (in dQ itself for fp32 inputs), from zeros (the prologue's).
    dq_sum = dq
    if not deterministic and dq.dtype != torch.float32:
        dq_sum = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    # Rows outside every varlen sequence, which no program writes, must read zero: the prologue zeroes the dK
    # and dV ones where the keys are not padded (it knows only the bounds of all sequences), fills the rest.
    keys_outside_in_prologue = runs and varlen is not None and varlen.seqlen_k is None
    if not runs:  # no kernel runs: zero gradients
        zeroed = [dq_sum, dk, dv]
    elif varlen is not None:
        zeroed = ([dq] if deterministic else []) + ([] if keys_outside_in_prologue else [dk, dv])
    else:
        zeroed = []
    for t in zeroed:
        t.zero_()
    if runs:
        lse = lse if lse.dim() == 4 else lse.unsqueeze(1)
        lse = lse[..., :mq].float().contiguous()  # some forwards pad the query dim
        delta = _backward_prologue(
            out, do, None if deterministic else dq_sum, dk, dv, varlen if keys_outside_in_prologue else None
        )
        if gluon is not None:  # the common case on Hopper: one pass, its products overlapped
            gluon.run(q, k, v, do, lse, delta, dq_sum, dk, dv, scale, window_left, window_right, bottom_right, varlen,
                      bias)  # fmt: skip
        else:
            db_args = _bias_args(db if bias_requires_grad else None)
            block_k, block_kv = launch.next_power_of_2(max(dim, 16)), launch.next_power_of_2(max(dim_v, 16))
            wide = _past_int32(q, k, v, do, lse, delta, dq_sum, dk, dv, bias, db_args[0])
            for dq_pass in (True, False) if deterministic else (False,):
                block_m, block_n, warps, stages = _tiles(q, max(block_k, block_kv), "dq" if dq_pass else "dkdv")
                # Not varlen: a tile past a sequence's rows would read the next one's (no harm), or, past the
                # last sequence, rows a mask updated in place no longer covers, NaN included, which reach the
                # products (the pointer path reads zeros).
                tma = not dq_pass and varlen is None
                descriptors = (None, None, None)
                if tma and _tma_readable(q, do) and _flat_rows(q) and _flat_rows(do):
                    # dq_sum's is used only by the one-pass backward
                    descriptors = _row_descriptors(block_m, (q, block_k), (do, block_kv), (dq_sum, block_k))
                kv_descriptors = (None, None)
                if tma and _tma_readable(k, v) and _flat_rows(k) and _flat_rows(v):
                    kv_descriptors = _row_descriptors(block_n, (k, block_k), (v, block_kv))
                blocks = launch.cdiv(max_q, block_m) if dq_pass else launch.cdiv(max_k, block_n)
                launch.fast(_flash_backward_kernel)[(blocks * sequences * groups * heads,)](
                    q, k, v, do, lse, delta, dq_sum, dk, dv, bias, db_args[0], seqstart_q, seqstart_k, seqlen_k,
                    *descriptors, *kv_descriptors,
                    groups, heads, mq, mk, dim, dim_v, scale * _LOG2E, scale, window_left,
                    window_right, seed, p, *_strides(q, k, v, do), *lse.stride()[:3],
                    *_strides(dq_sum, dk, dv), *bias_strides, *db_args[1:], blocks,
                    _heads_per_section(blocks, q.device), DROPOUT=p > 0.0,
                    HAS_BIAS=bias is not None, BIAS_GRAD=bias_requires_grad, DQ_PASS=dq_pass,
                    ATOMIC_DQ=not deterministic, VARLEN=varlen is not None, HAS_SEQLEN_K=seqlen_k is not None,
                    BOTTOM_RIGHT=bottom_right, IEEE=q.dtype == torch.float32,
                    UPCAST=q.dtype == torch.bfloat16 and not q.is_cuda,
                    WIDE=wide,
                    TMA=descriptors[0] is not None, TMA_KV=kv_descriptors[0] is not None,
                    BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_KV=block_kv, num_warps=warps,
                    num_stages=stages,
                )  # fmt: skip
    if dq_sum is not dq:
        dq.copy_(dq_sum)
    if heads_summed and not kernel_sums:
        dk, dv = dk.sum(3, keepdim=True), dv.sum(3, keepdim=True)
    return dq, dk, dv, db


# The launches as torch ops, opaque to torch.compile, which would otherwise trace into them and have Inductor
# compile the kernels itself (it failed to compile the fp32 forward).
_flash_forward_op = torch.library.custom_op("mslk_triton::flash_attention_forward", _flash_forward, mutates_args=())
_flash_backward_op = torch.library.custom_op("mslk_triton::flash_attention_backward", _flash_backward,
                                             mutates_args=())  # fmt: skip


@_flash_forward_op.register_fake
def _flash_forward_fake(query, key, value, *args):
    output_dtype = args[-1]
    q = _bmghk(query)
    batch, mq, groups, heads, _ = q.shape
    out = q.new_empty((batch, mq, groups, heads, value.shape[-1]), dtype=output_dtype)
    return out, q.new_empty((batch, groups, heads, mq), dtype=torch.float32)


@_flash_backward_op.register_fake
def _flash_backward_fake(query, key, value, out, grad, lse, bias, bias_requires_grad, *args):
    dq, dk, dv = (torch.empty_like(_bmghk(t), memory_format=torch.contiguous_format) for t in (query, key, value))
    return dq, dk, dv, bias.new_empty(bias.shape) if bias_requires_grad else query.new_empty(0)


def _launches(op, launch_function):
    """The op while torch.compile traces, else the launch function itself (eager calls skip the op's dispatch)."""
    return op if torch.compiler.is_compiling() else launch_function


def _switch_reasons(reasons: list[str], d: Inputs) -> list[str]:
    """reasons, and on a GPU the environment's switch (XFORMERS_FORCE_DISABLE_TRITON) when it is off."""
    off = available.switched_off() if d.query.device.type == "cuda" else None
    return reasons if off is None else [*reasons, off]


class FwOp(AttentionFwOpBase):
    """MSLK's Triton flash-attention forward (see the module docstring)."""

    OPERATOR = _flash_forward_kernel if registry.triton_missing() is None else None
    NOT_BUILT_REASON = registry.triton_missing() or ""
    NAME = "mslkF-triton"
    # cpu only under the Triton interpreter (tests), which triton.jit picks at import as this does: a CPU tensor
    # otherwise reached Triton's launcher and failed there ("0 active drivers").
    SUPPORTED_DEVICES = frozenset({"cuda", "cpu"} if testing.interpreting() else {"cuda"})
    CUDA_MINIMUM_COMPUTE_CAPABILITY = (8, 0)
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MAX_K = 256
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None T B01-B14 B18-B20")
    SUPPORTS_DROPOUT = True
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_DIFFERENT_VALUE_EMBED = True
    SUPPORTS_OUTPUT_DTYPE = True
    SUPPORTS_PARTIAL = True
    SUPPORTS_BMGHK = True
    VARLEN_LSE_PACKED = True

    @classmethod
    def not_supported_reasons(cls, d: Inputs) -> list[str]:
        return _switch_reasons(super().not_supported_reasons(d), d)

    @classmethod
    def apply(cls, inp: Inputs, needs_gradient: bool) -> tuple[torch.Tensor, Context | None]:
        alignment, window_left, window_right = _alignment(inp)
        # The dropout seed: drawn on the device by torch's generator (torch.manual_seed reproduces it), which CUDA
        # graphs and torch.compile redraw each call; below 2**31 - heads, so that the kernels' seed + head fits.
        seed = None
        if inp.p > 0.0:
            heads = inp.query.shape[0] * math.prod(inp.query.shape[2:-1])
            seed = torch.randint(0, 2**31 - 1 - heads, (1,), dtype=torch.int32, device=inp.query.device)
        out, lse = _launches(_flash_forward_op, _flash_forward)(
            inp.query, inp.key, inp.value, tensor_bias(inp.attn_bias), *_varlen_fields(inp.attn_bias),
            inp.scale_float, inp.p, seed, window_left, window_right, alignment == "bottom-right",
            inp.get_output_dtype(),
        )  # fmt: skip
        if inp.query.dim() == 4:
            out, lse = out[:, :, 0], lse[:, 0]
        if not needs_gradient:
            return out, None
        if inp.p > 0.0:  # only this backward replays the dropout
            return out, Context(lse=lse, out=out, op_bw=BwOp, rng_state=seed)
        return out, Context(lse=lse, out=out)


class BwOp(AttentionBwOpBase):
    """MSLK's Triton flash-attention backward, from the output and LSE of any forward in the packed varlen layout:
    one pass that adds dQ's shares with fp32 atomics, or, under torch.use_deterministic_algorithms, two passes
    without atomics (one writes dQ, another dK and dV). K/V expanded over the heads whose gradients autograd takes a
    K/V head (Inputs.kv_grads_summed) get dK/dV of that head, the query heads' sum (in the Gluon kernel on Hopper)."""

    OPERATOR = _flash_backward_kernel if registry.triton_missing() is None else None
    NOT_BUILT_REASON = registry.triton_missing() or ""
    NAME = "mslkB-triton"
    SUPPORTED_DEVICES = FwOp.SUPPORTED_DEVICES
    CUDA_MINIMUM_COMPUTE_CAPABILITY = FwOp.CUDA_MINIMUM_COMPUTE_CAPABILITY
    SUPPORTED_DTYPES = _DTYPES
    SUPPORTED_MAX_K = 256
    # Not the gappy masks (B18-B20): their sequences may share key rows, whose gradients would then need sums
    # across programs.
    SUPPORTED_ATTN_BIAS_TYPES = bias_types("None T B01-B14")
    SUPPORTS_ATTN_BIAS_GRAD = True
    SUPPORTS_DROPOUT = True
    SUPPORTS_CUSTOM_SCALE = True
    SUPPORTS_DIFFERENT_VALUE_EMBED = True
    SUPPORTS_BMGHK = True
    VARLEN_LSE_PACKED = True

    @classmethod
    def not_supported_reasons(cls, d: Inputs) -> list[str]:
        return _switch_reasons(super().not_supported_reasons(d), d)

    @classmethod
    def apply(cls, ctx: Context, inp: Inputs, grad: torch.Tensor) -> Gradients:
        if inp.p > 0.0 and ctx.rng_state is None:
            raise ValueError("dropout backward: the context holds no seed (rng_state) of triton_flash.FwOp's forward")
        alignment, window_left, window_right = _alignment(inp)
        bias = tensor_bias(inp.attn_bias)
        bias_grad = bias is not None and bias.requires_grad
        # An output of another dtype (a partial's fp32 one) and its gradient: the kernels multiply in the inputs'.
        out, grad = ctx.out.to(inp.query.dtype), grad.to(inp.query.dtype)
        # K/V whose gradients autograd takes a K/V head: one head, dK and dV summed over the query heads
        key, value = kv_heads(inp) if inp.kv_grads_summed else (inp.key, inp.value)
        dq, dk, dv, db = _launches(_flash_backward_op, _flash_backward)(
            inp.query, key, value, out, grad, ctx.lse, bias, bias_grad,
            *_varlen_fields(inp.attn_bias), inp.scale_float, inp.p, ctx.rng_state, window_left, window_right,
            alignment == "bottom-right", torch.are_deterministic_algorithms_enabled(),
        )  # fmt: skip
        if inp.query.dim() == 4:
            dq, dk, dv = dq[:, :, 0], dk[:, :, 0], dv[:, :, 0]
        return Gradients(dq, dk, dv, db if bias_grad else None)


# Keys from which the Gluon forward is measured faster than the Triton kernel (H200, K=128: 1.14x at 512 keys,
# 1.03-1.15x from 1024 to 16384, causal or not; RESULTS.md, twenty-second session). Fewer not measured.
_GLUON_FORWARD_MIN_KEYS = 512


def _gluon_forward(q, k, v, bias, p, scale, varlen, window_left, pointers=True):
    """triton_flash_hopper_fwd where its Gluon forward serves these [B, M, G, H, K] inputs and is measured faster
    (no mask or a causal one, top-left or bottom-right, and a [B, G, H, Mq, Mk] tensor bias that TMA reads or none;
    at least _GLUON_FORWARD_MIN_KEYS keys), else None. Not with a left window (sliding windows: 0.96x the Triton
    kernel), dropout or varlen. pointers: as _tma_readable's."""
    if window_left >= 0 or p > 0.0 or varlen is not None:
        return None
    if bias is not None and _bias_view(bias, q) is None:
        return None
    if k.shape[1] < _GLUON_FORWARD_MIN_KEYS:
        return None
    from mslk.attention.fmha import triton_flash_hopper_fwd  # (imports this module)

    return triton_flash_hopper_fwd if triton_flash_hopper_fwd.supports(q, k, v, scale, pointers) else None


# Where the Gluon forward is measured faster than cuDNN's (H200, bf16/fp16, K=128; RESULTS.md, forty-third to
# forty-sixth and forty-ninth sessions): its persistent programs take query blocks head by head, in pairs of equal
# causal work, and keep every SM busy to the end, where cuDNN's grid leaves some idle at its tail. Causal: 1.04-1.47x
# cuDNN's forward with 1-16 pairs of 8192-65536 rows, 1.02-1.06x with 24-256 pairs of 4096-8192 rows; with 256-512
# pairs of 2048 rows 0.95-0.96x. No mask: 1.01-1.05x with 8-128 pairs of 4096-32768 rows (0.99x in one run of 13),
# 1.00x with 192 pairs of 4096, 0.96x with 256; 0.95-1.00x at 1024-2048 rows. Below about 2^29 scores the host's time
# decides.
# Forward+backward (cuDNN's backward) 0.99-1.04x.
_CAUSAL_PAIRS = 256  # at most
_NO_MASK_PAIRS = 128
_MIN_ROWS = 4096
_MIN_SCORES = 2**29
_CAUSAL = bias_types("B01 B03")
# Where the Gluon backward is measured faster than cuDNN's (H200, bf16, K=128, causal, 4096-32768 rows; RESULTS.md,
# forty-seventh session): its kernels (delta, backward, dQ to 16 bits) take 5-13% less time than cuDNN's with 8-64
# (batch x head) pairs and about as long with 256, but its host time (Python, which autograd runs on a thread of its
# own) is two to six times SDPA's. Forward + backward (MSLK's forward) against SDPA cuDNN: 1.00-1.07x at 2^30 scores
# (0.86-0.98x at two of four shapes in a run whose host was slow) and 0.99-1.03x at 2^31, where cuDNN's backward gives
# 1.00-1.04x and 0.99-1.03x; below, the host's time decides (0.84-1.01x at 2^29). Since its delta is read later
# (fiftieth session: 2.5-3.5% faster), also from 2^31 to 2^33: 1.009-1.059x where cuDNN's backward gives 0.999-1.033x
# (five shapes, one of them in two runs); 2^34 (1 x 16 x 32768) 1.039x against 1.037x.
_BACKWARD_MIN_SCORES = 2**30
_BACKWARD_MAX_SCORES = 2**33


def gluon_forward_before_cudnn(inp: Inputs) -> bool:
    """Whether MSLK's forward comes before cuDNN's for these inputs (the dispatcher asks on Hopper, 16-bit): as many
    keys as queries, no dropout, no mask or a causal one (top-left or bottom-right), over at most _CAUSAL_PAIRS or
    _NO_MASK_PAIRS (batch x head) pairs of _MIN_ROWS rows or more, _MIN_SCORES scores in all; operands the Gluon
    forward takes (their shapes and strides: a data pointer off 16 bytes, seen at launch, takes the Triton kernel
    instead)."""
    causal = type(inp.attn_bias) in _CAUSAL
    if not (causal or inp.attn_bias is None) or inp.p > 0.0:  # first: the dispatcher asks on every Hopper call
        return False
    q = inp.query
    mq, mk = q.shape[1], inp.key.shape[1]
    pairs = _pairs(q)
    most = _CAUSAL_PAIRS if causal else _NO_MASK_PAIRS
    if mq != mk or mq < _MIN_ROWS or not 0 < pairs <= most or pairs * mq * mk < _MIN_SCORES:
        return False
    return _gluon_forward(*_five_dim_views(inp), None, 0.0, inp.scale_float, None, -1, pointers=False) is not None


def gluon_backward_before_cudnn(inp: Inputs) -> bool:
    """Whether MSLK's backward comes before cuDNN's for these inputs (the dispatcher asks on Hopper, 16-bit): as many
    keys as queries, _MIN_ROWS or more, a causal mask (top-left or bottom-right) over _BACKWARD_MIN_SCORES to
    _BACKWARD_MAX_SCORES scores, head dim 128, no dropout nor deterministic mode, operands the Gluon backward takes
    (their shapes and strides; the output's gradient, unknown yet, is checked at launch, where one TMA cannot read
    takes the Triton kernel). Not K/V expanded over the heads: cuDNN's own GQA sums their gradients in the kernel."""
    if type(inp.attn_bias) not in _CAUSAL or inp.p > 0.0 or torch.are_deterministic_algorithms_enabled():
        return False
    if kv_expanded(inp):
        return False
    q = inp.query
    mq, mk = q.shape[1], inp.key.shape[1]
    scores = _pairs(q) * mq * mk
    if mq != mk or mq < _MIN_ROWS or q.shape[-1] != 128:
        return False
    if not _BACKWARD_MIN_SCORES <= scores <= _BACKWARD_MAX_SCORES:
        return False
    from mslk.attention.fmha import triton_flash_hopper  # (imports this module)

    q, k, v = _five_dim_views(inp)
    return triton_flash_hopper.supports(q, k, v, q, pointers=False)


# Where MSLK's kernels are measured faster than FlashAttention-2's, which serves what cuDNN's decline (H100, bf16 and
# fp16; RESULTS.md, seventy-first session): sliding windows, varlen, bottom-right causality over more keys than
# queries, GQA with those, forward 1.08-2.22x at head dims 64-256, forward + backward 1.06-1.80x at 64 and 128 (0.97x:
# varlen at 64). Not: forward + backward at head dim 256 (0.75x), dropout (0.34-0.46x: the Triton kernel's RNG), and
# eager calls under about 2^27 scores, where the host's time decides (varlen 32 x 512 x 16 heads: forward 0.92x,
# forward + backward 0.71x; in a CUDA graph the forward 1.54x).
_BEFORE_FLASH_HEAD_DIMS = {False: (64, 128, 256), True: (64, 128)}  # by needs_gradient
_BEFORE_FLASH_MIN_QUERIES = 128  # a sequence, on average: not decoding
_BEFORE_FLASH_MIN_SCORES = 2**27


def before_flash(inp: Inputs, needs_gradient: bool) -> bool:
    """Whether MSLK's kernels come before FlashAttention-2's for these inputs (the dispatcher asks for the inputs
    cuDNN's decline): Hopper, 16-bit, no dropout, the head dims measured, sequences of _BEFORE_FLASH_MIN_QUERIES
    queries or more, _BEFORE_FLASH_MIN_SCORES scores or more unless a CUDA graph is being captured."""
    q = inp.query
    if inp.p > 0.0 or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] != inp.value.shape[-1]:
        return False
    if q.shape[-1] not in _BEFORE_FLASH_HEAD_DIMS[needs_gradient] or not arch.on_hopper(q):
        return False
    bias = inp.attn_bias  # (its sequences read from the host list: no VarlenArgs built on this hot path)
    sequences = len(bias.q_seqinfo.seqstart_py) - 1 if isinstance(bias, ab._BlockDiagonal) else 1
    if q.shape[1] < _BEFORE_FLASH_MIN_QUERIES * sequences:
        return False
    return capturing_cuda_graph(inp) or _visible_scores(inp, sequences) >= _BEFORE_FLASH_MIN_SCORES


def _visible_scores(inp: Inputs, sequences: int) -> float:
    """About how many scores the mask keeps over all (batch x head) pairs, from the shapes: the queries, each seeing
    its sequence's keys (on average), half of them under causality, at most its window's."""
    keys = inp.key.shape[1] / sequences
    causal, window_left, window_right = causal_window(inp.attn_bias)
    if window_left >= 0:
        keys = min(keys, window_left + 1 + max(window_right, 0))
    elif causal is not None:
        keys /= 2
    return _pairs(inp.query) * inp.query.shape[1] * keys


def _pairs(q: torch.Tensor) -> int:
    """The (batch x head) pairs of a [B, M, (G,) H, K] query: B·(G·)H."""
    return math.prod((q.shape[0], *q.shape[2:-1]))


def _five_dim_views(inp: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query, key and value as [B, M, G, H, K] views (no copy, unlike _bmghk: the dispatcher's rules only look)."""
    return tuple(t if t.dim() == 5 else t.unsqueeze(2) for t in (inp.query, inp.key, inp.value))


def _gluon_backward(q, k, v, do, bias, bias_grad, p, varlen, deterministic):
    """triton_flash_hopper where its Gluon backward serves these [B, M, G, H, K] inputs (Hopper's common case: no
    dropout or padded keys, the one-pass mode; a [B, G, H, Mq, Mk] tensor bias that TMA reads, without gradient and
    not with varlen), else None."""
    if deterministic or p > 0.0 or not q.is_cuda:
        return None
    if varlen is not None and varlen.seqlen_k is not None:
        return None
    if bias is not None and (bias_grad or varlen is not None or _bias_view(bias, q) is None):
        return None
    from mslk.attention.fmha import triton_flash_hopper  # (imports this module)

    return triton_flash_hopper if triton_flash_hopper.supports(q, k, v, do) else None


def _backward_prologue(
    out: torch.Tensor,
    do: torch.Tensor,
    dq_sum: torch.Tensor | None,
    dk: torch.Tensor,
    dv: torch.Tensor,
    varlen: VarlenArgs | None,
) -> torch.Tensor:
    """delta = rowsum(dO ∘ O) in fp32, [B, G, H, Mq] like the LSE, from [B, Mq, G, H, Kv] output and its gradient;
    in the same launch zeros in dQ's fp32 sum (unless None) and, given varlen (sequences without padded keys), in
    the rows of dK and dV outside its sequences. dq_sum, dk and dv are contiguous [B, M, G, H, K] (dK and dV: or of one
    head a group)."""
    batch, mq, groups, heads, dim_v = out.shape
    mk, dim = dk.shape[1], dk.shape[-1]
    delta = torch.empty((batch, groups, heads, mq), dtype=torch.float32, device=out.device)
    block_m = 64 if out.is_cuda else 16
    blocks = launch.cdiv(mq if varlen is None else max(mq, mk), block_m)
    launch.fast(_backward_prologue_kernel)[(blocks * batch * groups * heads,)](
        out, do, delta, dq_sum, dk, dv, *(None, 0) if varlen is None else (varlen.seqstart_k, varlen.num_sequences),
        groups, heads, dk.shape[3], mq, mk, dim, dim_v, *_strides(out, do), *delta.stride()[:3],
        ZERO_DQ=dq_sum is not None, ZERO_KEYS_OUTSIDE=varlen is not None, BLOCK_M=block_m,
        BLOCK_K=launch.next_power_of_2(max(dim, 16)), BLOCK_KV=launch.next_power_of_2(max(dim_v, 16)),
    )  # fmt: skip
    return delta
