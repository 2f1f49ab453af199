"""Token routing (spec M-01): `index_shuffling` sorts the tokens of a batch by the experts they are routed to.

Unlike the reference library's kernel it takes any number of experts, any top_k up to E, and its results are
deterministic: a token's top-k experts are its k highest scores, ties to the lower expert index (NaN counts as
the highest score, -0 equals +0), and inside an expert's segment the tokens are in ascending order. The PyTorch
implementation serves every device; on a GPU one Triton launch (no host sync) serves E up to 4096 and top_k
up to 8: each program finds the top-k of its tokens and their histogram over the experts, waits at a grid
barrier for the others, takes its first position in each expert's segment from all the histograms, and places
its pairs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mslk.core import arch, launch, registry, testing
from mslk.moe.common import check_valid_token_count, kept_zeros, valid_rows


def _bounds(routing_scores, expert_index_start, expert_index_end) -> tuple[int, int]:
    experts = routing_scores.shape[1]
    start = 0 if expert_index_start is None else expert_index_start
    return start, experts if expert_index_end is None else expert_index_end


def _validate(routing_scores, expert_index_start=None, expert_index_end=None, valid_token_count=None, top_k=1):
    where = "index_shuffling"
    if routing_scores.dim() != 2 or routing_scores.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(
            f"{where}: routing_scores must be bfloat16 or float32 [T, E], got {tuple(routing_scores.shape)} "
            f"{routing_scores.dtype}"
        )
    experts = routing_scores.shape[1]
    if not 1 <= top_k <= experts:
        raise ValueError(f"{where}: top_k must be in [1, E={experts}], got {top_k}")
    start, end = _bounds(routing_scores, expert_index_start, expert_index_end)
    if not 0 <= start <= end <= experts:
        raise ValueError(
            f"{where}: need 0 <= expert_index_start <= expert_index_end <= E={experts}, got {start}, {end}"
        )
    check_valid_token_count(where, valid_token_count)
    registry.check_devices(where, routing_scores=routing_scores, valid_token_count=valid_token_count)


def top_experts(routing_scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T, top_k]: each token's experts by descending score, a stable sort that puts NaN first and keeps equal
    scores in expert order (index_shuffling's routing, which BaselineMoE follows to route as MetaShufflingMoE)."""
    return torch.sort(routing_scores.float(), dim=1, descending=True, stable=True).indices[:, :top_k]


def _index_shuffling(routing_scores, expert_index_start=None, expert_index_end=None, valid_token_count=None, top_k=1):
    tokens, experts = routing_scores.shape
    device = routing_scores.device
    start, end = _bounds(routing_scores, expert_index_start, expert_index_end)
    chosen = top_experts(routing_scores, top_k)  # [T, k]
    token = torch.arange(tokens, device=device)[:, None].expand(tokens, top_k)
    valid = (chosen >= start) & (chosen < end)
    valid_tokens = valid_rows(tokens, valid_token_count, device)
    if valid_tokens is not None:
        valid &= valid_tokens[:, None]
    # Selected (token, expert) pairs first, by expert then token; the rest after them (their slots are unused).
    local = chosen - start
    key = torch.where(valid, local * tokens + token, (end - start) * tokens + token).flatten()
    order = torch.argsort(key, stable=True)
    expert_indices = local.flatten()[order].to(torch.int32)
    token_indices = token.flatten()[order].to(torch.int32)
    counts = torch.zeros(experts + 2, dtype=torch.int32, device=device)
    selected = valid.flatten()
    counts[:experts].index_add_(0, chosen.flatten(), selected.to(torch.int32))
    counts[experts].fill_(tokens)  # a fill, not a host-to-device copy (CUDA graphs)
    counts[experts + 1] = selected.sum()
    return counts, expert_indices, token_indices


def _fake(routing_scores, expert_index_start=None, expert_index_end=None, valid_token_count=None, top_k=1):
    tokens, experts = routing_scores.shape
    ints = {"dtype": torch.int32, "device": routing_scores.device}
    return torch.empty(experts + 2, **ints), torch.empty(tokens * top_k, **ints), torch.empty(tokens * top_k, **ints)


def _samples(device):
    yield registry.Sample((torch.softmax(testing.randn(37, 8, device=device), -1),))
    scores = testing.randn(64, 20, device=device).to(torch.bfloat16)
    yield registry.Sample((scores, 4, 12, torch.tensor([50], device=device), 2))


index_shuffling_op = registry.Op(
    "mslk::index_shuffling(Tensor routing_scores, int? expert_index_start=None, int? expert_index_end=None, "
    "Tensor? valid_token_count=None, int top_k=1) -> (Tensor, Tensor, Tensor)",
    domain="moe",
    reference=_index_shuffling,
    fake=_fake,
    samples=_samples,
    validate=_validate,
    reference_devices=("cpu", "cuda"),
)


_MAX_TRITON_EXPERTS = 4096  # one program holds a token block's scores of every expert
_MAX_TRITON_TOP_K = 8
BARRIER = "index_shuffling grid barrier"  # kept_zeros: the kernel's grid barrier state


@triton.jit
def _route_block(
    scores_ptr, pair_expert_ptr, tokens, T, E, start, stride_t, stride_e, valid_count,
    E_LOCAL: tl.constexpr, TOP_K: tl.constexpr, E_PAD: tl.constexpr, BINS: tl.constexpr,
):  # fmt: skip
    """Top-k experts of the tokens [BLOCK_T]: pair_expert[t·k + j] = local index of token t's j-th expert.
    Returns the block's histogram of its selected pairs (expert in the range, token before the count) over the
    local experts 0..E_LOCAL-1."""
    experts = tl.arange(0, E_PAD)[None, :]  # [1, E_PAD]
    in_range = (tokens < T)[:, None] & (experts < E)
    v = tl.load(scores_ptr + tokens.to(tl.int64)[:, None] * stride_t + experts * stride_e, mask=in_range, other=0.0)
    v = v.to(tl.float32)
    v = tl.where(v == v, v + 0.0, float("nan"))  # one NaN, and -0 made +0: equal scores get equal keys
    bits = v.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # integers ordered as the floats, NaN above +inf
    key = tl.where(in_range, key, -2147483648)  # [BLOCK_T, E_PAD]
    bins = tl.zeros([BINS], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, 1)[:, None]
        chosen = tl.min(tl.where(key == best, experts, E_PAD), 1)  # [BLOCK_T]: the lowest expert of the best
        key = tl.where(experts == chosen[:, None], -2147483648, key)
        local = chosen - start
        tl.store(pair_expert_ptr + tokens * TOP_K + j, local, mask=tokens < T)
        selected = (local >= 0) & (local < E_LOCAL) & (tokens < valid_count) & (tokens < T)
        bins += tl.histogram(tl.where(selected, local, 0), BINS, mask=selected)
    return bins


@triton.jit
def _grid_barrier(state_ptr, programs):
    """Every program of the launch (all resident at once: a cooperative launch) gets here before any goes on.
    state_ptr [2] int32: arrivals (0 between barriers: the last to arrive resets it) and a generation number
    that the last to arrive advances, which releases the others."""
    tl.debug_barrier()  # the program's stores come before its arrival
    generation = tl.atomic_add(state_ptr + 1, 0, sem="acquire")
    if tl.atomic_add(state_ptr, 1, sem="acq_rel") == programs - 1:
        tl.atomic_xchg(state_ptr, 0, sem="relaxed")
        tl.atomic_add(state_ptr + 1, 1, sem="release")
    else:
        while tl.atomic_add(state_ptr + 1, 0, sem="acquire") == generation:
            pass
    tl.debug_barrier()


@triton.jit
def _index_shuffling_kernel(
    scores_ptr, pair_expert_ptr, histogram_ptr, barrier_ptr, valid_count_ptr, counts_ptr, expert_indices_ptr,
    token_indices_ptr, T, E, start, stride_t, stride_e, blocks_per_program,
    E_LOCAL: tl.constexpr, HAS_COUNT: tl.constexpr, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr,
    PLACE_T: tl.constexpr, E_PAD: tl.constexpr, BINS: tl.constexpr, GROUPS: tl.constexpr, PAIRS: tl.constexpr,
    ROWS: tl.constexpr, UNROLL: tl.constexpr, COUNTS_PAD: tl.constexpr,
):  # fmt: skip
    """The whole op in one launch; program p takes the token blocks [p, p + 1) · blocks_per_program.
    1. The top-k of its tokens (pair_expert) and the histogram of its selected pairs (histogram row p).
    2. After a grid barrier, from all programs' histograms: where its first pair of each expert goes (experts
       back to back, programs in order inside an expert; then the pairs not selected, also in program order);
       program 0 writes counts.
    3. Its pairs at their positions, PLACE_T tokens at a time: a pair goes after the earlier pairs of its group
       (its expert, or the pairs not selected), in token order, then top-k order."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    # Cut to T in 64 bits: an int64 count past 2^31 (all tokens) once wrapped to a negative or small int32.
    valid_count = tl.minimum(tl.load(valid_count_ptr).to(tl.int64), T).to(tl.int32) if HAS_COUNT else T
    first_block = pid * blocks_per_program
    block_tokens = tl.arange(0, BLOCK_T)
    own = tl.zeros([BINS], dtype=tl.int32)
    for block in range(first_block, first_block + blocks_per_program):
        own += _route_block(
            scores_ptr, pair_expert_ptr, block * BLOCK_T + block_tokens, T, E, start, stride_t, stride_e,
            valid_count, E_LOCAL, TOP_K, E_PAD, BINS,
        )  # fmt: skip
    bins = tl.arange(0, BINS)
    tl.store(histogram_ptr + pid * E_LOCAL + bins, own, mask=bins < E_LOCAL)
    _grid_barrier(barrier_ptr, programs)
    # The program's first pairs to place, loaded now so that this load overlaps the histogram reads below.
    p = tl.arange(0, PAIRS)  # a power of two >= PLACE_T · TOP_K
    first_pair = first_block * BLOCK_T * TOP_K
    end_pair = tl.minimum(first_pair + blocks_per_program * BLOCK_T * TOP_K, T * TOP_K)
    next_local = tl.load(
        pair_expert_ptr + first_pair + p, mask=(p < PLACE_T * TOP_K) & (first_pair + p < end_pair), other=0
    )

    # All programs' histograms, summed elementwise first and reduced once: no reduction between the loads of
    # the UNROLL steps, so that they go out together (.cg: from L2, where the other programs wrote).
    rows = tl.arange(0, ROWS)[:, None]
    all_tile = tl.zeros([ROWS, BINS], dtype=tl.int32)
    before_tile = tl.zeros([ROWS, BINS], dtype=tl.int32)
    for r0 in range(0, programs, ROWS * UNROLL):
        for u in tl.static_range(UNROLL):
            row = r0 + u * ROWS + rows
            mask = (row < programs) & (bins < E_LOCAL)[None, :]
            h = tl.load(histogram_ptr + row * E_LOCAL + bins[None, :], mask=mask, other=0, cache_modifier=".cg")
            all_tile += h
            before_tile += tl.where(row < pid, h, 0)
    totals = tl.sum(all_tile, 0)
    before = tl.sum(before_tile, 0)  # the experts' selected pairs of programs before this one
    selected_total = tl.sum(totals, 0)
    position = tl.cumsum(totals, 0) - totals + before  # [BINS]: where the program's next pair of an expert goes
    # Pairs not selected follow all selected ones; the programs before this one hold min(first_pair, T · k) pairs.
    unselected_position = selected_total + tl.minimum(first_pair, T * TOP_K) - tl.sum(before, 0)
    if pid == 0:
        tl.store(counts_ptr + start + bins, totals, mask=bins < E_LOCAL)
        e = tl.arange(0, COUNTS_PAD)
        others = tl.where(e == E, T, tl.where(e == E + 1, selected_total, 0))  # experts outside the range: 0
        tl.store(counts_ptr + e, others, mask=((e < start) | (e >= start + E_LOCAL)) & (e < E + 2))

    # Where the next pair of each group goes: experts 0..E_LOCAL-1, then group E_LOCAL, the pairs not selected.
    groups = tl.arange(0, GROUPS)
    position = tl.where(groups < E_LOCAL, tl.gather(position, tl.minimum(groups, BINS - 1), 0), unselected_position)
    for pair0 in range(first_pair, end_pair, PLACE_T * TOP_K):
        local = next_local
        following = pair0 + PLACE_T * TOP_K + p
        next_local = tl.load(pair_expert_ptr + following, mask=(p < PLACE_T * TOP_K) & (following < end_pair), other=0)
        pair = pair0 + p
        in_range = (p < PLACE_T * TOP_K) & (pair < end_pair)  # a prefix of p: the pairs out of range come last
        token = pair // TOP_K
        group = tl.where((local >= 0) & (local < E_LOCAL) & (token < valid_count), local, E_LOCAL)
        earlier = (group[None, :] == group[:, None]) & (p[None, :] < p[:, None])  # [PAIRS, PAIRS]
        slot = tl.gather(position, group, 0) + tl.sum(earlier.to(tl.int32), 1)
        tl.store(expert_indices_ptr + slot, local, mask=in_range)
        tl.store(token_indices_ptr + slot, token, mask=in_range)
        position += tl.histogram(group, GROUPS, mask=in_range)


def _index_shuffling_supports(routing_scores, expert_index_start=None, expert_index_end=None, valid_token_count=None,
                              top_k=1):  # fmt: skip
    reasons = []
    if routing_scores.shape[1] > _MAX_TRITON_EXPERTS:
        reasons.append(f"E = {routing_scores.shape[1]} > {_MAX_TRITON_EXPERTS} experts")
    if top_k > _MAX_TRITON_TOP_K:
        reasons.append(f"top_k = {top_k} > {_MAX_TRITON_TOP_K}")
    return reasons


@index_shuffling_op.backend("triton", available=registry.triton_missing, supports=_index_shuffling_supports)
def _index_shuffling_triton(routing_scores, expert_index_start=None, expert_index_end=None, valid_token_count=None,
                            top_k=1):  # fmt: skip
    tokens, experts = routing_scores.shape
    device = routing_scores.device
    start, end = _bounds(routing_scores, expert_index_start, expert_index_end)
    ints = {"dtype": torch.int32, "device": device}
    counts = torch.empty(experts + 2, **ints)
    expert_indices, token_indices = torch.empty(tokens * top_k, **ints), torch.empty(tokens * top_k, **ints)
    e_pad = launch.next_power_of_2(experts)
    # At most one program per SM, so that all are resident for the grid barrier (the interpreter runs
    # programs one after another: one program there).
    max_programs = 1 if testing.interpreting() else arch.sm_count(device)
    # Placement takes 32 pairs at a time: it compares pairs with pairs, work that grows as the square (H200,
    # graph, T=16384 E=16 top-8: 17.0 us in steps of 32 pairs, 25.8 of 64, 31.5 of 128; T=16384 E=128 top-1:
    # 14.3 / 14.2 / 15.3). The top-k: blocks of about a program's share of the tokens, at most 16384 scores.
    place_t = 32 // launch.next_power_of_2(top_k)  # top_k <= 8
    block_t = max(1, min(16384 // e_pad, max(place_t, launch.next_power_of_2(launch.cdiv(tokens, max_programs)))))
    place_t = min(place_t, block_t)
    n_blocks = launch.cdiv(tokens, block_t)
    programs = max(1, min(n_blocks, max_programs))
    blocks_per_program = launch.cdiv(n_blocks, programs)
    # 8 warps for blocks of 16384 scores (T=16384 E=128 top-1: 15.3 us against 15.8 on 4), 4 for smaller ones
    # (T=16384 E=16 top-8: 31.7 against 33.7 on 8; T=2048 E=256 top-8: 16.7 against 17.9).
    warps = 8 if block_t * e_pad >= 16384 else 4
    local, bins = end - start, launch.next_power_of_2(end - start)
    # Histogram tiles of 16 counts a thread, up to 4 loaded at once.
    rows = max(1, min(launch.next_power_of_2(programs), 512 * warps // bins))
    workspace = torch.empty(tokens * top_k + programs * local, **ints)
    launch.fast(_index_shuffling_kernel)[(programs,)](
        routing_scores, workspace, workspace[tokens * top_k :], kept_zeros(device, BARRIER, 2),
        counts if valid_token_count is None else valid_token_count, counts, expert_indices, token_indices, tokens,
        experts, start, *routing_scores.stride(), blocks_per_program, E_LOCAL=local,
        HAS_COUNT=valid_token_count is not None, TOP_K=top_k, BLOCK_T=block_t, PLACE_T=place_t, E_PAD=e_pad,
        BINS=bins, GROUPS=launch.next_power_of_2(local + 1), PAIRS=launch.next_power_of_2(place_t * top_k),
        ROWS=rows, UNROLL=min(launch.cdiv(programs, rows), 4), COUNTS_PAD=launch.next_power_of_2(experts + 2),
        num_warps=warps, launch_cooperative_grid=True,
    )  # fmt: skip
    return counts, expert_indices, token_indices


def index_shuffling(
    routing_scores: torch.Tensor,
    expert_index_start: int | None = None,
    expert_index_end: int | None = None,
    valid_token_count: torch.Tensor | None = None,
    top_k: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route tokens to their top_k experts and group them by expert (spec M-01).

    routing_scores [T, E] (bf16/fp32); experts [expert_index_start, expert_index_end) are kept (default all);
    tokens at or past valid_token_count (a one-element tensor) are skipped. Returns int32
    `(counts [E+2], expert_indices [T·k], token_indices [T·k])`: counts[e] tokens for each kept expert e (0 for
    the others), counts[E] = T, counts[E+1] = S the number of selected (token, expert) pairs; the first S
    entries of the index arrays list them by expert (local index e − start) then token, the rest is unused.
    """
    return torch.ops.mslk.index_shuffling(
        routing_scores, expert_index_start, expert_index_end, valid_token_count, top_k
    )


# ------------------------------------------------------------------- expert-parallel regrouping (M-09, M-10)
# After the all-to-all of expert parallelism, the tokens of EP ranks arrive rank by rank, each rank's tokens
# grouped by expert (token_counts [EP, E]); combine_shuffling regroups them expert by expert for experts
# [start, end), split_shuffling puts the experts' outputs back in rank order. A rank's tokens start at
# rank · T/EP when is_padded, else right after the previous rank's.


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t viewed as integers of its element size (the copy moves bits, whatever the dtype)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _chunks(tokens, token_counts, expert_start, expert_end, is_padded):
    """For the chunks (expert e in [start, end), rank r), in that order: (their sizes, their first row in the
    rank-ordered layout, the end of the rows their rank may use there, the number of kept experts). The
    expert-ordered layout is the chunks back to back. Counts that do not fit the tokens (negative ones count as
    0; rows past T, or past a rank's slab of T/EP rows when padded) are cut there, as no GPU may index past T."""
    ranks, experts = token_counts.shape
    start = 0 if expert_start is None else expert_start
    end = experts if expert_end is None else expert_end
    rows = tokens.shape[0]
    counts = token_counts.to(torch.int64).clamp(min=0)
    within_rank = torch.cumsum(counts, 1) - counts  # offset of expert e inside rank r's tokens
    if is_padded:
        slab = rows // max(ranks, 1)  # (EP = 0 too)
        rank_start = torch.arange(ranks, device=counts.device) * slab
        rank_end = rank_start + slab
    else:
        totals = counts.sum(1)
        rank_start = torch.cumsum(totals, 0) - totals
        rank_end = torch.full_like(rank_start, rows)
    sizes = counts[:, start:end].t().reshape(-1)  # (e, r) order
    rank_rows = (rank_start[:, None] + within_rank)[:, start:end].t().reshape(-1)
    limits = rank_end.clamp(max=rows)[None, :].expand(end - start, ranks).reshape(-1)
    return sizes, rank_rows, limits, end - start


def _expert_side(tokens, sizes, rank_rows, limits):
    """For each row of the expert-ordered side (chunks back to back, at least one chunk): its row on the
    rank-ordered side, and whether it is in a chunk at all with that row inside its rank's rows."""
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    ends = torch.cumsum(sizes, 0)
    chunk = torch.searchsorted(ends, rows, right=True).clamp(max=sizes.numel() - 1)
    rank_row = rank_rows[chunk] + rows - (ends - sizes)[chunk]
    return rank_row, (rows < ends[-1]) & (rank_row < limits[chunk])


def _validate_shuffle(where, tokens, token_counts, expert_start, expert_end):
    if tokens.dim() != 2 or token_counts.dim() != 2 or token_counts.dtype.is_floating_point:
        raise ValueError(
            f"{where}: expected tokens [T, D] and integer token_counts [EP, E], got {tuple(tokens.shape)} and "
            f"{tuple(token_counts.shape)} {token_counts.dtype}"
        )
    experts = token_counts.shape[1]
    start = 0 if expert_start is None else expert_start
    end = experts if expert_end is None else expert_end
    if not 0 <= start <= end <= experts:
        raise ValueError(f"{where}: need 0 <= expert_start <= expert_end <= E={experts}, got {start}, {end}")
    registry.check_devices(where, tokens=tokens, token_counts=token_counts)


def _combine(tokens, token_counts, expert_start=None, expert_end=None, is_padded=False):
    sizes, rank_rows, limits, kept = _chunks(tokens, token_counts, expert_start, expert_end, is_padded)
    out = tokens.new_zeros(tokens.shape)  # (contiguous, as the fake kernel says)
    if sizes.numel():
        rank_row, used = _expert_side(tokens, sizes, rank_rows, limits)  # each output row reads its rank-ordered row
        out = torch.where(used[:, None], tokens[torch.where(used, rank_row, 0)], out)
    counts = sizes.reshape(kept, token_counts.shape[0]).sum(1)
    return out, torch.cat([counts, counts.sum().reshape(1)]).to(torch.int32)


def _split(tokens, token_counts, expert_start=None, expert_end=None, is_padded=False, init_with_zeros=False):
    sizes, rank_rows, limits, _ = _chunks(tokens, token_counts, expert_start, expert_end, is_padded)
    rows = tokens.shape[0]
    out = tokens.new_zeros(rows + 1, tokens.shape[1])  # row `rows` takes the rows in no chunk
    if sizes.numel():
        rank_row, used = _expert_side(tokens, sizes, rank_rows, limits)  # each input row back to its rank-ordered row
        # (through integers of the element's size: index_copy_ has no CPU kernel for fp8 or uint16)
        _bits(out).index_copy_(0, torch.where(used, rank_row, rows), _bits(tokens))
    return out[:rows]


def _shuffle_samples(device):
    counts = torch.tensor([[3, 0, 2, 4], [1, 5, 0, 2]], device=device, dtype=torch.int32)
    tokens = testing.randn(20, 24, device=device, dtype=torch.bfloat16)
    yield registry.Sample((tokens, counts, 1, 3, True))
    yield registry.Sample((tokens[:17], counts))


combine_shuffling_op = registry.Op(
    "mslk::combine_shuffling(Tensor tokens, Tensor token_counts, int? expert_start=None, int? expert_end=None, "
    "bool? is_padded=False) -> (Tensor, Tensor)",
    domain="moe",
    reference=_combine,
    fake=lambda tokens, token_counts, expert_start=None, expert_end=None, is_padded=False: (
        tokens.new_empty(tokens.shape),
        token_counts.new_empty(
            ((token_counts.shape[1] if expert_end is None else expert_end) - (expert_start or 0)) + 1,
            dtype=torch.int32,
        ),
    ),
    samples=_shuffle_samples,
    validate=lambda tokens, token_counts, expert_start=None, expert_end=None, is_padded=False: _validate_shuffle(
        "combine_shuffling", tokens, token_counts, expert_start, expert_end
    ),
    reference_devices=("cpu", "cuda"),
)
split_shuffling_op = registry.Op(
    "mslk::split_shuffling(Tensor tokens, Tensor token_counts, int? expert_start=None, int? expert_end=None, "
    "bool? is_padded=False, bool? init_with_zeros=False) -> Tensor",
    domain="moe",
    reference=_split,
    fake=lambda tokens, *args, **kwargs: tokens.new_empty(tokens.shape),
    samples=_shuffle_samples,
    validate=lambda tokens, token_counts, expert_start=None, expert_end=None, is_padded=False, init_with_zeros=False: (
        _validate_shuffle("split_shuffling", tokens, token_counts, expert_start, expert_end)
    ),
    reference_devices=("cpu", "cuda"),
)


# On a GPU, two Triton launches (no host sync, graph safe) do either op. A one-program plan kernel lays the chunks
# out from token_counts in a table sorted by where each chunk's rows are written, and a copy kernel has every output
# row find its chunk there (a binary search), read its row on the other side, or write zeros: each output row is
# written once, each input row read at most once. The table of N (a power of two) chunks, int32 [4, N]: the end of
# a chunk's rows on the written side (a running total: what the search reads), the first of them, the end of
# those that are read (the cut of the counts that do not fit), and the read row minus the written row.
_MAX_TRITON_CHUNKS = 1 << 16  # of the counts tile [EP, E] rounded up to powers of two, held by one program


@triton.jit
def _regroup_plan_kernel(
    counts_ptr, table_ptr, out_counts_ptr, EP, E, start, end, T, stride_r, stride_e,
    SPLIT: tl.constexpr, PADDED: tl.constexpr, R_PAD: tl.constexpr, E_PAD: tl.constexpr, N: tl.constexpr,
    DEPENDENT: tl.constexpr,
):  # fmt: skip
    """The table for combine_shuffling (written side: expert-ordered, chunks (e - start, r)) or split_shuffling
    (written side: rank-ordered, chunks (r, e)); combine's counts [end - start + 1]. DEPENDENT: the copy kernel
    is launched as this one's dependent, and may take its places at once (it waits for the table on the GPU)."""
    if DEPENDENT:
        gdc_launch_dependents()
    rank = tl.arange(0, R_PAD)
    r = rank[:, None]
    e = tl.arange(0, E_PAD)[None, :]
    n = tl.load(counts_ptr + r * stride_r + e * stride_e, mask=(r < EP) & (e < E), other=0).to(tl.int64)
    n = tl.maximum(n, 0)  # (negative counts count as 0)
    if PADDED:  # rank slabs of T / EP rows
        slab = T // tl.maximum(EP, 1)
        rank_start = rank.to(tl.int64) * slab
        rank_end = tl.minimum(rank_start + slab, T)
    else:  # ranks back to back
        totals = tl.sum(n, 1)
        rank_start = tl.cumsum(totals, 0) - totals
        rank_end = tl.zeros([R_PAD], dtype=tl.int64) + T
    src = rank_start[:, None] + tl.cumsum(n, 1) - n  # first row of chunk (r, e) on the rank-ordered side
    rank_end = rank_end[:, None]
    kept = (e >= start) & (e < end)
    size = tl.where(kept, n, 0)
    per_expert = tl.sum(size, 0)
    dst = (tl.cumsum(per_expert, 0) - per_expert)[None, :] + tl.cumsum(size, 0) - size  # ... expert-ordered side
    if SPLIT:  # rank side written: chunks cut to their rank's rows stay in (r, e) order
        first = tl.minimum(src, rank_end)
        ends = tl.minimum(src + n, rank_end)
        last = tl.where(kept, tl.maximum(tl.minimum(ends, src + T - dst), first), first)  # read rows < T
        offset = dst - src
        chunk = r * E_PAD + e
        written = (r >= 0) & (e >= 0)  # all of them
    else:  # expert side written, cut to T rows
        first = tl.minimum(dst, T)
        ends = tl.minimum(dst + size, T)
        last = tl.minimum(dst + tl.maximum(tl.minimum(size, rank_end - src), 0), T)  # read rows in their rank's
        offset = src - dst
        chunk = (e - start) * R_PAD + r
        written = kept
        experts = tl.arange(0, E_PAD)
        kept_expert = (experts >= start) & (experts < end)
        tl.store(out_counts_ptr + experts - start, per_expert.to(tl.int32), mask=kept_expert)
        tl.store(out_counts_ptr + end - start, tl.sum(per_expert, 0).to(tl.int32))
        rest = tl.arange(0, N)  # the table past the kept chunks: ends T, nothing read
        rest_mask = rest >= (end - start) * R_PAD
        tl.store(table_ptr + rest, T, mask=rest_mask)
        for column in tl.static_range(1, 4):
            tl.store(table_ptr + column * N + rest, 0, mask=rest_mask)
    offset = tl.where(last > first, offset, 0)  # (in int32 range where used)
    tl.store(table_ptr + chunk, ends.to(tl.int32), mask=written)
    tl.store(table_ptr + N + chunk, first.to(tl.int32), mask=written)
    tl.store(table_ptr + 2 * N + chunk, last.to(tl.int32), mask=written)
    tl.store(table_ptr + 3 * N + chunk, offset.to(tl.int32), mask=written)


@triton.jit
def _regroup_copy_kernel(
    in_ptr, out_ptr, table_ptr, T, D, stride_in, stride_in_d, stride_out,
    N: tl.constexpr, LOG_N: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, DEPENDENT: tl.constexpr,
):  # fmt: skip
    """Output rows [pid · ROWS, +ROWS): row i is in[i + offset] of the first chunk whose end passes i, if
    first <= i < last there, else zeros. DEPENDENT (launched as the plan kernel's dependent): wait for its table."""
    if DEPENDENT:
        gdc_wait()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    chunk = tl.zeros([ROWS], dtype=tl.int32)
    for s in tl.static_range(LOG_N):  # chunk = how many ends are <= the row (at most N - 1)
        probe = chunk + (N >> (s + 1))
        chunk = tl.where(tl.load(table_ptr + probe - 1) <= rows, probe, chunk)
    first = tl.load(table_ptr + N + chunk)
    last = tl.load(table_ptr + 2 * N + chunk)
    source = (rows + tl.load(table_ptr + 3 * N + chunk)).to(tl.int64)
    read = ((rows >= first) & (rows < last))[:, None]
    inside = (rows < T)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    for d0 in range(0, D, BLOCK_D):
        c = d0 + cols
        x = tl.load(in_ptr + source[:, None] * stride_in + c * stride_in_d, mask=read & (c < D), other=0)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + c, x, mask=inside & (c < D))


def _regroup_supports(tokens, token_counts, *args):
    reasons = []
    chunks = launch.next_power_of_2(token_counts.shape[0]) * launch.next_power_of_2(token_counts.shape[1])
    if chunks > _MAX_TRITON_CHUNKS:
        reasons.append(f"EP x E = {tuple(token_counts.shape)}: more than {_MAX_TRITON_CHUNKS} chunks (powers of 2)")
    if tokens.element_size() not in (1, 2, 4, 8):
        reasons.append(f"{tokens.dtype} tokens ({tokens.element_size()} bytes an element)")
    if tokens.shape[0] >= 2**31:
        reasons.append(f"T = {tokens.shape[0]} >= 2^31 rows")
    return reasons


def _table_size(token_counts: torch.Tensor, start: int, end: int, split: bool) -> int:
    """N, the chunks of the plan table (a power of two)."""
    r_pad, e_pad = (launch.next_power_of_2(n) for n in token_counts.shape)
    return r_pad * e_pad if split else launch.next_power_of_2((end - start) * r_pad)


def _plan(token_counts, start, end, rows, is_padded, split, table, dependent=False):
    """Fill the plan table (int32 [4 · N]) for tokens of `rows` rows; combine's counts (split: an empty tensor).
    dependent: the next launch is the copy kernel's, as a dependent."""
    ranks, experts = token_counts.shape
    r_pad, e_pad = launch.next_power_of_2(ranks), launch.next_power_of_2(experts)
    counts = torch.empty(0 if split else end - start + 1, dtype=torch.int32, device=table.device)
    launch.fast(_regroup_plan_kernel)[(1,)](
        token_counts, table, counts, ranks, experts, start, end, rows, *token_counts.stride(), SPLIT=split,
        PADDED=bool(is_padded), R_PAD=r_pad, E_PAD=e_pad, N=table.numel() // 4, DEPENDENT=dependent,
        num_warps=8 if r_pad * e_pad >= 4096 else 4,
    )  # fmt: skip
    return counts


def _regroup_triton(tokens, token_counts, expert_start, expert_end, is_padded, split):
    """Triton combine_shuffling (split False: (tokens, counts)) or split_shuffling (split True: tokens)."""
    start = 0 if expert_start is None else expert_start
    end = token_counts.shape[1] if expert_end is None else expert_end
    rows, d = tokens.shape
    n = _table_size(token_counts, start, end, split)
    table = torch.empty(4 * n, dtype=torch.int32, device=tokens.device)
    # Where the GPU has dependent launches, the copy kernel's programs take their places while the plan runs.
    dependent = bool(rows and d) and launch.dependent_launch(tokens.device)
    counts = _plan(token_counts, start, end, rows, is_padded, split, table, dependent)
    out = torch.empty_like(tokens, memory_format=torch.contiguous_format)
    if rows and d:
        # Tiles of about 2048 elements, a row a program from D = 2048 on (H100, the bench shapes: the copy 2-7% faster
        # than on tiles of 4 x 1024 elements; 2-16 rows of 512-2048 elements, 4 or 8 warps, in between).
        block_d = min(launch.next_power_of_2(d), 2048)
        rows_a_program = 2048 // block_d
        launch.fast(_regroup_copy_kernel)[(launch.cdiv(rows, rows_a_program),)](
            _bits(tokens), _bits(out), table, rows, d, *tokens.stride(), out.stride(0), N=n,
            LOG_N=n.bit_length() - 1, ROWS=rows_a_program, BLOCK_D=block_d, DEPENDENT=dependent, num_warps=4,
            **launch.dependent_launch_options(dependent),
        )  # fmt: skip
    return out if split else (out, counts)


@combine_shuffling_op.backend("triton", available=registry.triton_missing, supports=_regroup_supports)
def _combine_triton(tokens, token_counts, expert_start=None, expert_end=None, is_padded=False):
    return _regroup_triton(tokens, token_counts, expert_start, expert_end, is_padded, split=False)


@split_shuffling_op.backend("triton", available=registry.triton_missing, supports=_regroup_supports)
def _split_triton(tokens, token_counts, expert_start=None, expert_end=None, is_padded=False, init_with_zeros=False):
    return _regroup_triton(tokens, token_counts, expert_start, expert_end, is_padded, split=True)


def combine_shuffling(
    tokens: torch.Tensor,
    token_counts: torch.Tensor,
    expert_start: int | None = None,
    expert_end: int | None = None,
    is_padded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Regroup tokens received from EP ranks expert by expert (spec M-09): tokens [T, D] rank by rank, each
    rank's grouped by expert (token_counts [EP, E]) -> (tokens [T, D] for experts [expert_start, expert_end),
    expert by expert and within an expert rank by rank, zeros after them; counts int32 [EG + 1], tokens per kept
    expert then their total)."""
    return torch.ops.mslk.combine_shuffling(tokens, token_counts, expert_start, expert_end, is_padded)


def split_shuffling(
    tokens: torch.Tensor,
    token_counts: torch.Tensor,
    expert_start: int | None = None,
    expert_end: int | None = None,
    is_padded: bool = False,
    init_with_zeros: bool = False,
) -> torch.Tensor:
    """The inverse of combine_shuffling (spec M-10): expert-ordered tokens [T, D] back to rank order, each chunk
    where combine_shuffling read it (is_padded: rank slabs of T/EP rows). Rows nothing is written to are zero
    whatever init_with_zeros says (the argument is accepted for compatibility)."""
    return torch.ops.mslk.split_shuffling(tokens, token_counts, expert_start, expert_end, is_padded, init_with_zeros)
