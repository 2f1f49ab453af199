"""Moving tokens to and from their experts' segments (spec M-02..M-05): `gather_scale_dense_tokens` (and
`gather_scale_quant_dense_tokens`, followed by rowwise FP8 quantization), `scatter_add_dense_tokens` on the
index arrays of index_shuffling, and the generic `scatter_add_along_first_dim`.

The plain-PyTorch implementations serve every device; on a GPU, Triton kernels (one program per row, no host
sync) serve rows with a contiguous last dim; the quantizing gather is one kernel, reading each row once. Any
hidden size D works (the reference library asserts D % 1024 == 0 past #SMs rows). Indices are not checked on the
host (that would need a sync): the kernels skip rows whose index is out of range (a gathered row comes out zero,
a scattered one adds nothing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mslk.core import arch, launch, registry, testing
from mslk.moe.common import check_valid_token_count, kept_zeros, row_quant_tiles, valid_rows
from mslk.quantize.triton.common import check_float_input, check_scale_ub, max_nan
from mslk.quantize.triton.fp8_quantize import quantize_fp8_row, row_factor_and_scale, to_levels


def _check_indices(where: str, name: str, indices: torch.Tensor, rows: int) -> None:
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64) or indices.shape[0] != rows:
        raise ValueError(f"{where}: {name} must be int32/int64 [{rows}], got {tuple(indices.shape)} {indices.dtype}")


# --------------------------------------------------------------------------------- gather and scale


def _validate_gather(
    x, token_indices, expert_indices, scores, valid_token_count=None, where="gather_scale_dense_tokens"
):
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"{where}: x must be floating-point [T, D], got {tuple(x.shape)} {x.dtype}")
    if scores.dim() != 2 or scores.shape[0] != x.shape[0] or not scores.dtype.is_floating_point:
        raise ValueError(f"{where}: scores must be floating-point [T={x.shape[0]}, E], got {tuple(scores.shape)}")
    _check_indices(where, "token_indices", token_indices, token_indices.shape[0] if token_indices.dim() else 0)
    _check_indices(where, "expert_indices", expert_indices, token_indices.shape[0])
    check_valid_token_count(where, valid_token_count)
    registry.check_devices(
        where, x=x, token_indices=token_indices, expert_indices=expert_indices, scores=scores,
        valid_token_count=valid_token_count,
    )  # fmt: skip


def _gather(x, token_indices, expert_indices, scores, valid_token_count=None):
    if not x.shape[0] or not scores.shape[1]:  # no row is readable
        return x.new_zeros(token_indices.shape[0], x.shape[1])
    tokens, experts = token_indices.long(), expert_indices.long()
    # Rows past the count, and indices outside x or scores (the kernel reads nothing there): zero rows.
    readable = (tokens >= 0) & (tokens < x.shape[0]) & (experts >= 0) & (experts < scores.shape[1])
    valid = valid_rows(tokens.shape[0], valid_token_count, x.device)
    if valid is not None:
        readable &= valid
    tokens, experts = tokens.where(readable, 0), experts.where(readable, 0)  # row 0 read in their place
    out = x[tokens].float() * scores[tokens, experts].float()[:, None]
    return torch.where(readable[:, None], out, 0.0).to(x.dtype)


def _gather_samples(device):
    x = testing.randn(40, 96, dtype=torch.bfloat16, device=device)
    scores = torch.softmax(testing.randn(40, 8, device=device), -1)
    tokens = torch.randint(0, 40, (50,), device=device, dtype=torch.int32)
    experts = torch.randint(0, 8, (50,), device=device, dtype=torch.int32)
    yield registry.Sample((x, tokens, experts, scores))
    yield registry.Sample((x, tokens, experts, scores, torch.tensor([33], device=device)))


gather_scale_dense_tokens_op = registry.Op(
    "mslk::gather_scale_dense_tokens(Tensor x, Tensor token_indices, Tensor expert_indices, Tensor scores, "
    "Tensor? valid_token_count=None) -> Tensor",
    domain="moe",
    reference=_gather,
    fake=lambda x, token_indices, *args: x.new_empty((token_indices.shape[0], x.shape[1])),
    samples=_gather_samples,
    validate=_validate_gather,
    reference_devices=("cpu", "cuda"),
)


_ROW_BLOCK = 2048  # elements of a row per loop step of the row kernels


def _row_block(d: int) -> int:
    return min(launch.next_power_of_2(max(d, 1)), _ROW_BLOCK)


def _contiguous_rows(*tensors: torch.Tensor) -> list[str]:
    return [f"{t.dim()}-D tensor with last-dim stride {t.stride(-1)}" for t in tensors if t.stride(-1) != 1]


@triton.jit
def _routed_row(
    i, token_ptr, expert_ptr, scores_ptr, valid_count_ptr, T, E, stride_st, stride_se, stride_token, stride_expert,
    HAS_COUNT: tl.constexpr,
):  # fmt: skip
    """(token (int64), whether its row is read, its score in fp32) of output row i: rows past the count or with an
    index outside x or scores read nothing (and score 0)."""
    token = tl.load(token_ptr + i * stride_token).to(tl.int64)
    expert = tl.load(expert_ptr + i * stride_expert).to(tl.int64)
    readable = (token >= 0) & (token < T) & (expert >= 0) & (expert < E)
    if HAS_COUNT:
        readable &= i < tl.load(valid_count_ptr)
    score = tl.load(scores_ptr + token * stride_st + expert * stride_se, mask=readable, other=0.0).to(tl.float32)
    return token, readable, score


@triton.jit
def _gather_scale_kernel(
    x_ptr, out_ptr, token_ptr, expert_ptr, scores_ptr, valid_count_ptr, T, E, D,
    stride_x, stride_out, stride_st, stride_se, stride_token, stride_expert, HAS_COUNT: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out[i] = x[token[i]] · scores[token[i], expert[i]], one program per output row i.

    H200, T=16384, D=5120 (RESULTS.md, forty-second session): 3791-3834 GB/s, rows in token order 3861-3874, against
    3984-4028 for torch.mul over the same contiguous bytes. Programs over (row, 1024-8192 columns) and persistent
    programs that fetch the next row's indices and score under this row's loads measured no faster (3167-3856)."""
    i = tl.program_id(0)
    token, readable, score = _routed_row(
        i, token_ptr, expert_ptr, scores_ptr, valid_count_ptr, T, E, stride_st, stride_se, stride_token,
        stride_expert, HAS_COUNT,
    )  # fmt: skip
    cols = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        x = tl.load(x_ptr + token * stride_x + d0 + cols, mask=readable & (d0 + cols < D), other=0.0)
        out = (x.to(tl.float32) * score).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + i.to(tl.int64) * stride_out + d0 + cols, out, mask=d0 + cols < D)


@gather_scale_dense_tokens_op.backend(
    "triton", available=registry.triton_missing, supports=lambda x, *args: _contiguous_rows(x)
)
def _gather_triton(x, token_indices, expert_indices, scores, valid_token_count=None):
    rows, d = token_indices.shape[0], x.shape[1]
    out = x.new_empty((rows, d))
    if rows and d:
        launch.fast(_gather_scale_kernel)[(rows,)](
            x, out, token_indices, expert_indices, scores, valid_token_count, x.shape[0], scores.shape[1], d,
            x.stride(0), out.stride(0), *scores.stride(), token_indices.stride(0), expert_indices.stride(0),
            HAS_COUNT=valid_token_count is not None,
            BLOCK_D=_row_block(d), num_warps=4,
        )  # fmt: skip
    return out


def gather_scale_dense_tokens(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: torch.Tensor,
    valid_token_count: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of x [T, D] in expert order, each scaled by its routing score (spec M-03): out [a, D] with
    `out[i] = x[token_indices[i]] · scores[token_indices[i], expert_indices[i]]` (fp32 math, x's dtype);
    rows at or past valid_token_count, and rows whose indices fall outside x or scores, are zero."""
    return torch.ops.mslk.gather_scale_dense_tokens(x, token_indices, expert_indices, scores, valid_token_count)


def _validate_gather_quant(x, token_indices, expert_indices, scores, scale_ub=None, valid_token_count=None):
    where = "gather_scale_quant_dense_tokens"
    _validate_gather(x, token_indices, expert_indices, scores, valid_token_count, where)
    check_float_input(where, "x", x)  # (what the quantizer takes)
    check_scale_ub(where, scale_ub, x)


def _gather_quant(x, token_indices, expert_indices, scores, scale_ub=None, valid_token_count=None):
    gathered = _gather(x, token_indices, expert_indices, scores, valid_token_count)
    return quantize_fp8_row(gathered, scale_ub, eps_opt=arch.FP8_EPS)


gather_scale_quant_dense_tokens_op = registry.Op(
    "mslk::gather_scale_quant_dense_tokens(Tensor x, Tensor token_indices, Tensor expert_indices, Tensor scores, "
    "Tensor? scale_ub=None, Tensor? valid_token_count=None) -> (Tensor, Tensor)",
    domain="moe",
    reference=_gather_quant,
    fake=lambda x, token_indices, *args: (
        x.new_empty((token_indices.shape[0], x.shape[1]), dtype=arch.fp8_dtype(x.device)),
        x.new_empty(token_indices.shape[0], dtype=torch.float32),
    ),
    samples=lambda device: [
        registry.Sample((*sample.args[:4], None, *sample.args[4:])) for sample in _gather_samples(device)
    ],
    validate=_validate_gather_quant,
    reference_devices=("cpu", "cuda"),
)


@triton.jit
def _scaled_piece(x_row, cols, D, readable, score):
    """A piece of x's row times its score in fp32, rounded to x's dtype (as gather_scale_dense_tokens' output
    that the unfused ops quantize), back in fp32."""
    x = tl.load(x_row + cols, mask=readable & (cols < D), other=0.0)
    return (x.to(tl.float32) * score).to(x.dtype).to(tl.float32)


@triton.jit
def _gather_scale_quant_kernel(
    x_ptr, xq_ptr, scale_ptr, token_ptr, expert_ptr, scores_ptr, valid_count_ptr, scale_ub_ptr, T, E, D,
    stride_x, stride_xq, stride_st, stride_se, stride_token, stride_expert, eps,
    HAS_COUNT: tl.constexpr, HAS_UB: tl.constexpr, QMAX: tl.constexpr, BLOCK_D: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
):  # fmt: skip
    """xq[i], scale[i]: row i of gather_scale_dense_tokens quantized rowwise to FP8 (quantize_fp8_row's rule), in
    one pass over x (the unfused ops write the gathered rows and read them again): one program per output row."""
    i = tl.program_id(0)
    token, readable, score = _routed_row(
        i, token_ptr, expert_ptr, scores_ptr, valid_count_ptr, T, E, stride_st, stride_se, stride_token,
        stride_expert, HAS_COUNT,
    )  # fmt: skip
    x_row = x_ptr + token * stride_x
    xq_row = xq_ptr + i.to(tl.int64) * stride_xq
    cols = tl.arange(0, BLOCK_D)
    if SINGLE_PASS:
        y = _scaled_piece(x_row, cols, D, readable, score)
        factor, scale = row_factor_and_scale(tl.reduce(tl.abs(y), 0, max_nan), eps, scale_ub_ptr, QMAX, HAS_UB)
        tl.store(xq_row + cols, to_levels(y, factor, QMAX).to(xq_ptr.dtype.element_ty), mask=cols < D)
    else:
        amax = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            amax = max_nan(amax, tl.abs(_scaled_piece(x_row, d0 + cols, D, readable, score)))
        factor, scale = row_factor_and_scale(tl.reduce(amax, 0, max_nan), eps, scale_ub_ptr, QMAX, HAS_UB)
        for d0 in range(0, D, BLOCK_D):
            q = to_levels(_scaled_piece(x_row, d0 + cols, D, readable, score), factor, QMAX)
            tl.store(xq_row + d0 + cols, q.to(xq_ptr.dtype.element_ty), mask=d0 + cols < D)
    tl.store(scale_ptr + i, scale)


@gather_scale_quant_dense_tokens_op.backend(
    "triton",
    available=registry.triton_missing,
    supports=lambda x, *args: _contiguous_rows(x),
    requires=arch.fp8_e4m3_missing,
)
def _gather_quant_triton(x, token_indices, expert_indices, scores, scale_ub=None, valid_token_count=None):
    rows, d = token_indices.shape[0], x.shape[1]
    xq = torch.empty((rows, d), dtype=arch.fp8_dtype(x.device), device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block_d, single_pass = row_quant_tiles(d)
        # 4 warps a row: H200, 16384 rows of 5120 (2048 x 8 of 7168) 78 (74) us, 81-153 with 8-32 warps (RESULTS.md)
        launch.fast(_gather_scale_quant_kernel)[(rows,)](
            x, xq, scale, token_indices, expert_indices, scores, valid_token_count, scale_ub, x.shape[0],
            scores.shape[1], d, x.stride(0), xq.stride(0), *scores.stride(), token_indices.stride(0),
            expert_indices.stride(0), arch.FP8_EPS, HAS_COUNT=valid_token_count is not None,
            HAS_UB=scale_ub is not None, QMAX=float(torch.finfo(xq.dtype).max), BLOCK_D=block_d,
            SINGLE_PASS=single_pass, num_warps=8 if block_d > 8192 else 4,
        )  # fmt: skip
    return xq, scale


def gather_scale_quant_dense_tokens(
    x: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    scores: torch.Tensor,
    scale_ub: torch.Tensor | None = None,
    valid_token_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gather_scale_dense_tokens then rowwise FP8 (spec M-04; two outputs, as the schema says): (xq [a, D] in
    this platform's FP8, dequantization scale fp32 [a]), quantize_fp8_row's with amax floored at 1e-12, as the
    reference's MoE kernels do."""
    return torch.ops.mslk.gather_scale_quant_dense_tokens(
        x, token_indices, expert_indices, scores, scale_ub, valid_token_count
    )


# --------------------------------------------------------------------------------------- scatter-add


def _check_added_dtype(where: str, dtype: torch.dtype) -> None:
    """The scatter-adds sum in fp32: wider or integer rows would come back rounded through it."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{where}: rows are added in fp32: bfloat16, float16 or float32 only, got {dtype}")


def _validate_scatter(out_tokens, in_tokens, token_indices, valid_token_count=None):
    where = "scatter_add_dense_tokens"
    if out_tokens.dim() != 2 or in_tokens.dim() != 2 or out_tokens.shape[1] != in_tokens.shape[1]:
        raise ValueError(
            f"{where}: expected out_tokens [T, D] and in_tokens [a, D], got {tuple(out_tokens.shape)} and "
            f"{tuple(in_tokens.shape)}"
        )
    if out_tokens.dtype != in_tokens.dtype:
        raise ValueError(f"{where}: out_tokens is {out_tokens.dtype} but in_tokens is {in_tokens.dtype}")
    _check_added_dtype(where, out_tokens.dtype)
    _check_indices(where, "token_indices", token_indices, in_tokens.shape[0])
    check_valid_token_count(where, valid_token_count)
    registry.check_devices(
        where, out_tokens=out_tokens, in_tokens=in_tokens, token_indices=token_indices,
        valid_token_count=valid_token_count,
    )  # fmt: skip


def _add_rows(out_tokens, rows, token_indices, adds):
    """out_tokens[token_indices[i]] += rows[i] (summed in fp32, rounded once) where adds[i] (None: every row) and the
    token lies in out_tokens, as the kernel's _scatter_row decides; the other rows add zero to token 0, whatever they
    hold, without reading anything on the host."""
    if not out_tokens.shape[0]:  # no token to add into
        return
    tokens = token_indices.long()
    in_range = (tokens >= 0) & (tokens < out_tokens.shape[0])
    adds = in_range if adds is None else adds & in_range
    values = torch.where(adds[:, None], rows.float(), 0.0)
    out_tokens.copy_(out_tokens.float().index_add_(0, tokens.where(adds, 0), values))


def _scatter(out_tokens, in_tokens, token_indices, valid_token_count=None):
    _add_rows(out_tokens, in_tokens, token_indices, valid_rows(in_tokens.shape[0], valid_token_count, in_tokens.device))


def _scatter_samples(device):
    out = testing.randn(30, 64, dtype=torch.bfloat16, device=device)
    tokens = torch.randint(0, 30, (45,), device=device, dtype=torch.int64)
    yield registry.Sample((out, testing.randn(45, 64, dtype=torch.bfloat16, device=device), tokens))
    yield registry.Sample(
        (out.float(), testing.randn(45, 64, device=device), tokens, torch.tensor([20], device=device))
    )


scatter_add_dense_tokens_op = registry.Op(
    "mslk::scatter_add_dense_tokens(Tensor(a!) out_tokens, Tensor in_tokens, Tensor token_indices, "
    "Tensor? valid_token_count=None) -> ()",
    domain="moe",
    reference=_scatter,
    fake=lambda *args: None,
    samples=_scatter_samples,
    validate=_validate_scatter,
    reference_devices=("cpu", "cuda"),
)


@triton.jit
def _scatter_row(
    i, token_ptr, stride_token, source_ptr, valid_count_ptr, T, HAS_SOURCE: tl.constexpr, HAS_COUNT: tl.constexpr
):  # fmt: skip
    """(target token, source row, whether row i adds anything) of the scatter-adds."""
    token = tl.load(token_ptr + i * stride_token).to(tl.int64)
    source = tl.load(source_ptr + i).to(tl.int64) if HAS_SOURCE else i.to(tl.int64)
    adds = (token >= 0) & (token < T) & (source >= 0)
    if HAS_COUNT:
        adds &= i < tl.load(valid_count_ptr)
    return token, source, adds


@triton.jit
def _multiplicity_kernel(
    token_ptr, stride_token, source_ptr, valid_count_ptr, multiplicity_ptr, rows, T,
    HAS_SOURCE: tl.constexpr, HAS_COUNT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """multiplicity[t] = the number of rows that add into token t."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    token, _, adds = _scatter_row(
        tl.minimum(i, rows - 1), token_ptr, stride_token, source_ptr, valid_count_ptr, T, HAS_SOURCE, HAS_COUNT
    )
    tl.atomic_add(multiplicity_ptr + token, 1, mask=adds & (i < rows), sem="relaxed")


@triton.jit
def _scatter_add_kernel(
    out_ptr, in_ptr, token_ptr, source_ptr, valid_count_ptr, multiplicity_ptr, lock_ptr, T, D, stride_out, stride_in,
    stride_token, HAS_SOURCE: tl.constexpr, HAS_COUNT: tl.constexpr, LOCKED: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out[token[i]] += in[source[i]], one program per row i, adding in fp32 and rounding once per row.
    LOCKED: the row reads, adds and writes its token under the token's spin lock (lock_ptr: 0 = free, and all
    free again when the kernel ends). Else by multiplicity (rows per token, counted before): a token that only
    this row adds into is read, added and written; one that several rows add into gets atomic adds in out's
    dtype. Either way rows adding into one token do so in no fixed order."""
    i = tl.program_id(0)
    token, source, adds = _scatter_row(
        i, token_ptr, stride_token, source_ptr, valid_count_ptr, T, HAS_SOURCE, HAS_COUNT
    )
    if adds:
        if LOCKED:
            while tl.atomic_cas(lock_ptr + token, 0, 1, sem="acquire") != 0:
                pass
            alone = True
        else:
            alone = tl.load(multiplicity_ptr + token) == 1
        cols = tl.arange(0, BLOCK_D)
        for d0 in range(0, D, BLOCK_D):
            mask = d0 + cols < D
            v = tl.load(in_ptr + source * stride_in + d0 + cols, mask=mask, other=0.0, eviction_policy="evict_first")
            out_cols = out_ptr + token * stride_out + d0 + cols
            if alone:  # .cg: from L2, where the previous holder of the lock wrote
                total = tl.load(out_cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32) + v.to(tl.float32)
                tl.store(out_cols, total.to(out_ptr.dtype.element_ty), mask=mask)
            else:
                tl.atomic_add(out_cols, v, mask=mask, sem="relaxed")
        if LOCKED:
            tl.debug_barrier()  # every thread's stores come before the release
            tl.atomic_xchg(lock_ptr + token, 0, sem="release")


def _scatter_add_supports(out_tokens, in_tokens, *args):
    reasons = _contiguous_rows(out_tokens, in_tokens)
    if torch.are_deterministic_algorithms_enabled():
        reasons.append("torch deterministic mode (rows adding into one token do so in no fixed order)")
    return reasons


SCATTER_LOCKS = "scatter-add token locks"  # kept_zeros: one spin lock per output token, 0 = free


def _run_scatter_add(out_tokens, in_rows, token_indices, valid_token_count=None, source_rows=None):
    """The scatter-add kernel: out_tokens[token_indices[i]] += in_rows[source_rows[i] (default i)]."""
    rows, d = token_indices.shape[0], in_rows.shape[-1]
    if not (rows and d):
        return
    tokens = out_tokens.shape[0]
    flags = {"HAS_SOURCE": source_rows is not None, "HAS_COUNT": valid_token_count is not None}
    # At most a row per token (top-1 routing) takes the locks: uncontended, they cost H200 about 1% against
    # 4.5% for counting first. More rows than tokens (top-k) means tokens with several rows, which would wait
    # on each other's locks: there, counting and atomic adds are faster (T=2048 D=5120 top-8: 2111 GB/s vs 1978).
    locks = kept_zeros(out_tokens.device, SCATTER_LOCKS, tokens) if rows <= tokens else None
    multiplicity = None
    if locks is None:
        multiplicity = torch.zeros(tokens, dtype=torch.int32, device=out_tokens.device)
        launch.fast(_multiplicity_kernel)[(launch.cdiv(rows, 1024),)](
            token_indices, token_indices.stride(0), source_rows, valid_token_count, multiplicity, rows, tokens,
            BLOCK=1024, **flags,
        )  # fmt: skip
    launch.fast(_scatter_add_kernel)[(rows,)](
        out_tokens, in_rows, token_indices, source_rows, valid_token_count, multiplicity, locks, tokens, d,
        out_tokens.stride(0), in_rows.stride(-2), token_indices.stride(0), LOCKED=locks is not None,
        BLOCK_D=_row_block(d), num_warps=4, **flags,
    )  # fmt: skip


scatter_add_dense_tokens_op.backend("triton", available=registry.triton_missing, supports=_scatter_add_supports)(
    _run_scatter_add
)


def scatter_add_dense_tokens(
    out_tokens: torch.Tensor,
    in_tokens: torch.Tensor,
    token_indices: torch.Tensor,
    valid_token_count: torch.Tensor | None = None,
) -> None:
    """`out_tokens[token_indices[i]] += in_tokens[i]` for the first valid_token_count rows (spec M-05), in place;
    a row whose token index lies outside out_tokens adds nothing (indices are not read on the host). Tokens that
    one row adds into are rounded once on every device; on a GPU, tokens that several rows add into
    get the rows added one by one in no fixed order, each rounded to out_tokens' dtype (as the reference
    library's atomic adds), while the PyTorch path (CPU, or torch deterministic mode) sums them in fp32 and
    rounds once."""
    torch.ops.mslk.scatter_add_dense_tokens(out_tokens, in_tokens, token_indices, valid_token_count)


# ------------------------------------------------------------------------- padded expert outputs (M-06)


def _validate_scatter_padded(in_tokens, token_counts, token_indices, out_tokens):
    where = "scatter_add_padded_tokens"
    if in_tokens.dim() != 3 or out_tokens.dim() != 2 or in_tokens.shape[2] != out_tokens.shape[1]:
        raise ValueError(
            f"{where}: expected in_tokens [EP, T_K, D] and out_tokens [T, D], got {tuple(in_tokens.shape)} and "
            f"{tuple(out_tokens.shape)}"
        )
    if in_tokens.dtype != out_tokens.dtype:
        raise ValueError(f"{where}: out_tokens is {out_tokens.dtype} but in_tokens is {in_tokens.dtype}")
    _check_added_dtype(where, out_tokens.dtype)
    ranks = in_tokens.shape[0]
    if ranks == 0:
        raise ValueError(f"{where}: in_tokens [EP, T_K, D] needs at least one rank, got {tuple(in_tokens.shape)}")
    if token_counts.dim() != 1 or token_counts.dtype.is_floating_point or token_counts.numel() % ranks:
        raise ValueError(
            f"{where}: token_counts must be integer [E] with E a multiple of EP={ranks}, got "
            f"{tuple(token_counts.shape)} {token_counts.dtype}"
        )
    _check_indices(where, "token_indices", token_indices, in_tokens.shape[1])
    registry.check_devices(
        where, in_tokens=in_tokens, token_counts=token_counts, token_indices=token_indices, out_tokens=out_tokens
    )


def _padded_source_rows(in_tokens: torch.Tensor, token_counts: torch.Tensor) -> torch.Tensor:
    """For each row i of the expert-ordered list (T_K rows): the row of in_tokens viewed as [EP·T_K, D] that
    holds its expert's output, rank·T_K + i (rank = expert // (E / EP)), or -1 past sum(token_counts)."""
    ranks, rows = in_tokens.shape[:2]
    i = torch.arange(rows, device=in_tokens.device)
    if token_counts.numel() == 0:
        return torch.full_like(i, -1)
    ends = torch.cumsum(token_counts.to(torch.int64), 0)
    expert = torch.searchsorted(ends, i, right=True)
    rank = expert.clamp(max=token_counts.numel() - 1) // (token_counts.numel() // ranks)
    return torch.where(i < ends[-1], rank * rows + i, -1)


def _scatter_padded(in_tokens, token_counts, token_indices, out_tokens):
    source = _padded_source_rows(in_tokens, token_counts)  # -1: a padding row, which adds nothing
    _add_rows(out_tokens, in_tokens.flatten(0, 1)[source.clamp(min=0)], token_indices, source >= 0)


def _scatter_padded_samples(device):
    counts = torch.tensor([3, 0, 4, 2], device=device, dtype=torch.int32)  # E = 4 experts on EP = 2 ranks
    tokens = torch.randperm(12, device=device).to(torch.int32)
    for dtype in (torch.bfloat16, torch.float32):
        yield registry.Sample(
            (
                testing.randn(2, 12, 40, dtype=dtype, device=device),
                counts,
                tokens,
                testing.randn(12, 40, dtype=dtype, device=device),
            )
        )


scatter_add_padded_tokens_op = registry.Op(
    "mslk::scatter_add_padded_tokens(Tensor in_tokens, Tensor token_counts, Tensor token_indices, "
    "Tensor(a!) out_tokens) -> ()",
    domain="moe",
    reference=_scatter_padded,
    fake=lambda *args: None,
    samples=_scatter_padded_samples,
    validate=_validate_scatter_padded,
    reference_devices=("cpu", "cuda"),
)


@scatter_add_padded_tokens_op.backend(
    "triton",
    available=registry.triton_missing,
    supports=lambda in_tokens, token_counts, token_indices, out_tokens: _scatter_add_supports(out_tokens, in_tokens),
)
def _scatter_padded_triton(in_tokens, token_counts, token_indices, out_tokens):
    source = _padded_source_rows(in_tokens, token_counts)
    _run_scatter_add(out_tokens, in_tokens.flatten(0, 1), token_indices, None, source)


def scatter_add_padded_tokens(
    in_tokens: torch.Tensor,
    token_counts: torch.Tensor,
    token_indices: torch.Tensor,
    out_tokens: torch.Tensor,
) -> None:
    """Scatter-add the experts' outputs of EP ranks (spec M-06), in place: in_tokens [EP, T_K, D] holds in
    in_tokens[r] the rows of rank r's experts at their positions in the expert-ordered list (experts
    r·E/EP .. (r+1)·E/EP - 1 of token_counts [E], back to back from row 0; the other rows are padding), and
    `out_tokens[token_indices[i]] += in_tokens[rank of row i's expert, i]` for i < sum(token_counts). Any T_K
    (the reference library needs T_K % T == 0); rounding as scatter_add_dense_tokens."""
    torch.ops.mslk.scatter_add_padded_tokens(in_tokens, token_counts, token_indices, out_tokens)


def _validate_scatter_first_dim(Dst, Src, Index):
    where = "scatter_add_along_first_dim"
    if Dst.dim() != 2 or Src.dim() != 2 or Dst.shape[1] != Src.shape[1] or Dst.dtype != Src.dtype:
        raise ValueError(
            f"{where}: expected Dst [T, D] and Src [a, D] of one dtype, got {tuple(Dst.shape)} {Dst.dtype} and "
            f"{tuple(Src.shape)} {Src.dtype}"
        )
    _check_added_dtype(where, Dst.dtype)
    _check_indices(where, "Index", Index, Src.shape[0])
    registry.check_devices(where, Dst=Dst, Src=Src, Index=Index)


def _scatter_first_dim(Dst, Src, Index):
    _add_rows(Dst, Src, Index, None)  # the kernel's rule: an index outside Dst adds nothing


scatter_add_along_first_dim_op = registry.Op(
    "mslk::scatter_add_along_first_dim(Tensor(a!) Dst, Tensor Src, Tensor Index) -> ()",
    domain="moe",
    reference=_scatter_first_dim,
    fake=lambda *args: None,
    samples=lambda device: [
        registry.Sample(
            (
                testing.randn(30, 64, dtype=torch.bfloat16, device=device),
                testing.randn(45, 64, dtype=torch.bfloat16, device=device),
                torch.randint(0, 30, (45,), device=device, dtype=torch.int32),
            )
        )
    ],
    validate=_validate_scatter_first_dim,
    reference_devices=("cpu", "cuda"),
)


scatter_add_along_first_dim_op.backend("triton", available=registry.triton_missing, supports=_scatter_add_supports)(
    _run_scatter_add
)


def scatter_add_along_first_dim(Dst: torch.Tensor, Src: torch.Tensor, Index: torch.Tensor) -> None:
    """`Dst[Index[i], :] += Src[i, :]` in place (spec M-02; the mutation is declared in the schema), in Dst's
    dtype, on any device; an index outside Dst adds nothing."""
    torch.ops.mslk.scatter_add_along_first_dim(Dst, Src, Index)
