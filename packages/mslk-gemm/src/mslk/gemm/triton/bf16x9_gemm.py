"""FP32 GEMM emulated with BF16 tensor-core products (spec G-42): `bf16x9_gemm(A, B, output=None)`.

    out [M, N] = A [M, K] · B [N, K]ᵀ        (fp32 in, fp32 out, fp32-level accuracy)

Each fp32 value splits exactly into three bf16 parts, x = hi + mid + lo (hi = bf16(x), mid = bf16(x - hi),
lo = bf16(x - hi - mid); each part holds the next 8 significant bits, with the sign absorbing the rounding).
The product A·Bᵀ is the sum of the nine products of parts; the Triton backend computes six of them on the
tensor cores, dropping lo·lo, lo·mid and mid·lo, which are 2^-24 of |A|·|B| or smaller (below fp32 rounding).

How (the Triton backend): a memory-bound pre-pass writes the parts of A and of B ([3, rows, K'] bf16, K' = K
padded with zeros to the K block: a workspace of 1.5x the inputs' bytes), then one bf16 GEMM walks the six
(A part, B part) pairs one after the other as if along a 6K'-long K dimension. That GEMM is a plain bf16 GEMM
with TMA loads, software-pipelined by Triton like one: splitting inside the GEMM's K loop instead would stage fp32 tiles
(2x the shared memory of bf16 ones) and put the split's ALU work and a register-to-shared copy of B's parts
between the loads and the MMAs. The pre-pass moves 10 bytes per input element: by bytes and FLOPs, about 7%
of the GEMM's time at 4096^3 and 3% at 8192^3.

Inputs must be finite and at most bf16's largest value (about 3.39e38) in magnitude: beyond, hi is infinite
and the result NaN where an fp32 GEMM gives infinities.

Accuracy: the pairs come smallest first (lo·hi ... hi·hi), so the small terms are summed while the sum is
small. The MMA accumulator is flushed into a second fp32 accumulator every FLUSH K steps: Hopper's MMA rounds
its sum towards zero, a bias that grows with the number of chained MMAs (about 1e-5 relative over the 6 x 512
MMAs of K = 8192 in a bit-level model, against 5e-7 when flushing every 8 steps of 64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mslk.core import launch, registry, testing
from mslk.gemm.triton.fp8_gemm import tile_coordinates

# The six (A part, B part) products summed, smallest first; parts are indexed hi = 0, mid = 1, lo = 2.
_PARTS = {"hi": 0, "mid": 1, "lo": 2}
PRODUCTS = (("lo", "hi"), ("hi", "lo"), ("mid", "mid"), ("mid", "hi"), ("hi", "mid"), ("hi", "hi"))


def _packed(side: int) -> int:
    """The part index of each product on one side (0: A, 1: B), two bits per product, first product lowest."""
    return sum(_PARTS[pair[side]] << (2 * i) for i, pair in enumerate(PRODUCTS))


@triton.jit
def _split_kernel(
    x_ptr, parts_ptr, R, K, KP, stride_r, stride_k, stride_part,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """parts[p, r, k] (bf16 [3, R, KP], rows KP apart) = the hi/mid/lo parts of x[r, k] (fp32, any strides);
    zeros for K <= k < KP."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(
        x_ptr + rows.to(tl.int64)[:, None] * stride_r + cols.to(tl.int64)[None, :] * stride_k,
        mask=(rows < R)[:, None] & (cols < K)[None, :],
        other=0.0,
    )  # [BLOCK_R, BLOCK_K] fp32
    # Round to nearest even; each difference is exact in fp32 (it has at most 16, then 8, significant bits).
    hi = x.to(tl.bfloat16)
    rest = x - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    out = parts_ptr + rows.to(tl.int64)[:, None] * KP + cols[None, :]
    mask = (rows < R)[:, None] & (cols < KP)[None, :]
    tl.store(out, hi, mask=mask)
    tl.store(out + stride_part, mid, mask=mask)
    tl.store(out + 2 * tl.cast(stride_part, tl.int64), lo, mask=mask)  # 2·R·KP can pass 2**31 when R·KP does not


@triton.jit
def _bf16x9_kernel(
    a_desc, b_desc, c_ptr, M, N, KP, stride_cm, stride_cn,
    A_PARTS: tl.constexpr, B_PARTS: tl.constexpr, N_PRODUCTS: tl.constexpr, FLUSH: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """C = Σ over the products of A[a part] · B[b part]ᵀ: a_desc / b_desc describe the parts as [3·M, KP] and
    [3·N, KP] bf16 (part p of row r at row p·M + r), KP a multiple of BLOCK_K. A_PARTS / B_PARTS pack each
    product's part index in 2 bits."""
    pid_m, pid_n = tile_coordinates(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_steps = KP // BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    mma = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # the tensor cores' chained accumulator
    # One loop over every (product, K step), so the pipeline never drains between products. A tile that runs
    # past the last row of a part reads the next part's first rows (or zeros past the last part): those
    # output rows are never stored.
    for step in range(N_PRODUCTS * k_steps):
        product = step // k_steps
        k = (step - product * k_steps) * BLOCK_K
        a = a_desc.load([((A_PARTS >> (2 * product)) & 3) * M + pid_m * BLOCK_M, k])
        b = b_desc.load([((B_PARTS >> (2 * product)) & 3) * N + pid_n * BLOCK_N, k])
        if UPCAST:  # the Triton interpreter multiplies bf16 operands as raw integers
            a, b = a.to(tl.float32), b.to(tl.float32)
        mma = tl.dot(a, b.T, mma)
        if step % FLUSH == FLUSH - 1:
            acc += mma
            mma = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc += mma
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols.to(tl.int64)[None, :] * stride_cn
    tl.store(c_ptrs, acc, mask=(rows < M)[:, None] & (cols < N)[None, :])


# 128 x 128 output tiles: two fp32 accumulators of 64 registers a thread on 8 warps (150 registers in all on
# sm_90, no spills; 128 x 256 needs 256 for the accumulators alone and spills). 128-deep K steps loaded by TMA,
# 3 stages of (128 + 128) · 128 · 2 B = 192 KiB of shared memory; the MMA chain is flushed every 1024 of K.
# H200, 8192^3: 11.2 ms (BLOCK_K 64, 4 stages: 11.8 ms; 128 x 256: 10.9 ms with spills; cp.async loads: 16.9 ms).
CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "FLUSH": 8, "num_stages": 3, "num_warps": 8}


_SPLIT_BLOCK = 64  # square tiles, so row-major and transposed (column-major) inputs both load whole lines


def split_parts(x: torch.Tensor, kp: int) -> torch.Tensor:
    """The hi/mid/lo bf16 parts of fp32 x [R, K] (any strides) as [3, R, kp], zero past K (kp >= K)."""
    r, k = x.shape
    parts = torch.empty((3, r, kp), dtype=torch.bfloat16, device=x.device)
    if parts.numel():
        grid = (launch.cdiv(r, _SPLIT_BLOCK), launch.cdiv(kp, _SPLIT_BLOCK))
        launch.fast(_split_kernel)[grid](
            x, parts, r, k, kp, x.stride(0), x.stride(1), parts.stride(0), BLOCK_R=_SPLIT_BLOCK, BLOCK_K=_SPLIT_BLOCK
        )
    return parts


def _run(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    (m, k), n = A.shape, B.shape[0]
    if launch.no_products(out, k):
        return out
    block_k = CONFIG["BLOCK_K"]
    kp = launch.cdiv(k, block_k) * block_k
    # Fresh, K-contiguous, 16-byte aligned rows: what a TMA descriptor needs (Triton lowers descriptor loads to
    # plain loads on GPUs without TMA).
    a_parts = TensorDescriptor(split_parts(A, kp), [3 * m, kp], [kp, 1], [CONFIG["BLOCK_M"], block_k])
    b_parts = TensorDescriptor(split_parts(B, kp), [3 * n, kp], [kp, 1], [CONFIG["BLOCK_N"], block_k])
    grid = (launch.cdiv(m, CONFIG["BLOCK_M"]) * launch.cdiv(n, CONFIG["BLOCK_N"]),)
    launch.fast(_bf16x9_kernel)[grid](
        a_parts, b_parts, out, m, n, kp, out.stride(0), out.stride(1),
        A_PARTS=_packed(0), B_PARTS=_packed(1), N_PRODUCTS=len(PRODUCTS), UPCAST=not out.is_cuda, **CONFIG,
    )  # fmt: skip
    return out


def _validate(A, B, output=None):
    where = "bf16x9_gemm"
    for name, t in (("A", A), ("B", B)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 2:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{where}: {name} must be a 2-D float32 tensor, got {got}")
    if A.shape[1] != B.shape[1]:
        raise ValueError(
            f"{where}: expected A [M, K] and B [N, K] with the same K, got {tuple(A.shape)} and {tuple(B.shape)}"
        )
    if A.device != B.device:
        raise ValueError(f"{where}: A and B must be on one device, got {A.device} and {B.device}")
    registry.check_output(where, "output", output, (A.shape[0], B.shape[0]), (torch.float32,), A.device)


def _reference(A, B, output=None):
    """A · Bᵀ in float64, rounded once to float32: what an exact fp32 GEMM returns."""
    result = (A.double() @ B.double().T).float()
    return result if output is None else output.copy_(result)


def _samples(device):
    yield registry.Sample((testing.randn(37, 100, device=device), testing.randn(24, 100, device=device)))
    b_t = testing.randn(72, 50, device=device)  # B given as a transposed view
    yield registry.Sample((testing.randn(5, 72, device=device, std=30.0), b_t.T))


bf16x9_gemm_op = registry.Op(
    "mslk::bf16x9_gemm(Tensor A, Tensor B, Tensor(a!)? output=None) -> Tensor",
    out_arg="output",
    domain="gemm",
    reference=_reference,
    fake=lambda A, B, output=None: A.new_empty((A.shape[0], B.shape[0])),
    samples=_samples,
    validate=_validate,
)


@bf16x9_gemm_op.backend("triton", available=registry.triton_missing)
def _triton(A, B, output=None):
    # The parts are written before the GEMM starts, so output may even overlap A or B.
    out = torch.empty((A.shape[0], B.shape[0]), dtype=torch.float32, device=A.device) if output is None else output
    return _run(A, B, out)


def bf16x9_gemm(A: torch.Tensor, B: torch.Tensor, output: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 `A [M, K] · B [N, K]ᵀ -> [M, N]` at fp32 accuracy on bf16 tensor cores (spec G-42); into `output`
    (float32 [M, N]) when given. Any strides; zero-size M, N or K gives an empty or zero result."""
    return torch.ops.mslk.bf16x9_gemm(A, B, output)
