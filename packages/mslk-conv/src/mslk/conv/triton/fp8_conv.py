"""FP8 3-D convolution (spec C-01): f8f8bf16_conv.

    out[n, z, p, q, k] = bf16(scale · Σ_{t, r, s, c} x[n, z·sd − pd + t·dd, p·sh − ph + r·dh, q·sw − pw + s·dw, c]
                                                     · w[k, t, r, s, c])        (x zero outside)

x is the FP8 e4m3 activation [N, D, H, W, C] (NDHWC) and w the filter [K, T, R, S, C] (KTRSC), both quantized
tensorwise (`quantize_fp8_tensor`), `scale` the one-element fp32 product of their scales. Either may instead be
given as an NCDHW (KCTRS) tensor in channels_last_3d memory, the layout PyTorch's Conv3d modules keep: the same
bytes, read as NDHWC (a tensor that fits both, such as a pointwise filter [K, C, 1, 1, 1], is read the way its
channels agree with the other operand's, in the other's layout first; where both layouts agree, as NDHWC). The
output is bf16 [N, Z, P, Q, K], or its NCDHW view (channels_last_3d memory) when the activation came as NCDHW.

The reference library runs this on Blackwell only (CUTLASS, SM100). Here one Triton kernel runs it on any GPU with
FP8 products (Ada, Hopper and newer): an implicit GEMM of [N·Z·P·Q, T·R·S·C] gathered activation rows by the
[K, T·R·S·C] filter, a program a tile of output positions by output channels, stepping over the filter taps and
blocks of C; a tap's rows outside the input (padding) load zeros. Any strides are read. The sums are fp32; on
Hopper the FP8 products' accumulator keeps fewer bits between promotions, as in Triton's FP8 GEMMs (relative error
3.1e-3 at C = 512 over 3 x 3 x 3 taps against bf16 rounding's 1.7e-3, RESULTS.md).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mslk.core import arch, formats, launch, registry, testing

WHERE = "f8f8bf16_conv"


def _readings(t: torch.Tensor) -> list[tuple[torch.Tensor, bool]]:
    """The ways to read t as [N, D, H, W, C]: (view, whether it came as NCDHW in channels_last_3d memory). A
    tensor contiguous in both senses (a pointwise filter [K, C, 1, 1, 1], as torch.nn.Conv3d keeps it, or C = 1)
    has both readings, NDHWC first."""
    if not t.is_contiguous(memory_format=torch.channels_last_3d):
        return [(t, False)]
    as_ncdhw = (t.permute(0, 2, 3, 4, 1), True)
    return [(t, False), as_ncdhw] if t.is_contiguous() else [as_ncdhw]


def _views(activation: torch.Tensor, filter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(NDHWC activation, KTRSC filter, whether the activation came as NCDHW): the first readings of the two whose
    channels agree, both in one layout before mixed ones (else the first ones, which validation then rejects). With
    one channel both readings fit an NCDHW activation and a KCTRS filter: read as NCDHW, only the KCTRS reading of
    the filter gives its taps in order (a KTRSC one once swapped them)."""
    pairs = [(x, w, x_ncdhw, w_ncdhw) for x, x_ncdhw in _readings(activation) for w, w_ncdhw in _readings(filter)]
    pairs.sort(key=lambda pair: pair[2] != pair[3])  # a stable sort: NDHWC stays first within each kind
    x, w, ncdhw, _ = next((pair for pair in pairs if pair[0].shape[-1] == pair[1].shape[-1]), pairs[0])
    return x, w, ncdhw


def _output_size(size: int, pad: int, taps: int, stride: int, dilation: int) -> int:
    return (size + 2 * pad - ((taps - 1) * dilation + 1)) // stride + 1


def _output_shape(x, w, padding, stride, dilation) -> tuple[int, ...]:
    """[N, Z, P, Q, K] of NDHWC x and KTRSC w (ints one by one: this runs on every call)."""
    (n, d, h, width, _), (k, t, r, s, _) = x.shape, w.shape
    return (
        n,
        _output_size(d, padding[0], t, stride[0], dilation[0]),
        _output_size(h, padding[1], r, stride[1], dilation[1]),
        _output_size(width, padding[2], s, stride[2], dilation[2]),
        k,
    )


def _validate(activation, filter, scale, padding, stride, dilation):
    formats.check_fp8_data(activation, role=f"{WHERE}: activation", producer="quantize_fp8_tensor")
    formats.check_fp8_data(filter, role=f"{WHERE}: filter", producer="quantize_fp8_tensor")
    if activation.dim() != 5 or filter.dim() != 5:
        raise ValueError(
            f"{WHERE}: expected a 5-D activation [N, D, H, W, C] (or NCDHW in channels_last_3d memory) and filter "
            f"[K, T, R, S, C] (or KCTRS in channels_last_3d memory), got {tuple(activation.shape)} and "
            f"{tuple(filter.shape)}"
        )
    x, w, _ = _views(activation, filter)
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(
            f"{WHERE}: the activation has {x.shape[-1]} channels and the filter {w.shape[-1]} (as NDHWC / KTRSC: "
            f"{tuple(x.shape)} and {tuple(w.shape)})"
        )
    for name, values, least in (("padding", padding, 0), ("stride", stride, 1), ("dilation", dilation, 1)):
        if len(values) != 3 or any(v < least for v in values):
            raise ValueError(f"{WHERE}: {name} must be 3 ints [d, h, w], each at least {least}, got {list(values)}")
    out = _output_shape(x, w, padding, stride, dilation)
    if any(size < 1 for size in out[1:4]):
        raise ValueError(
            f"{WHERE}: the output would have no positions ([Z, P, Q] = {list(out[1:4])}): input [D, H, W] = "
            f"{list(x.shape[1:4])} with padding {list(padding)} is smaller than the dilated filter "
            f"{[(taps - 1) * d + 1 for taps, d in zip(w.shape[1:4], dilation, strict=True)]}"
        )
    problems = formats.Tensorwise().problems(activation, scale)
    if problems or scale.dtype != torch.float32:
        raise formats.ScaleFormatError(
            f"{WHERE}: scale must be one float32 value (the activation's and filter's tensorwise scales multiplied) "
            f"on the activation's device; got {'; '.join(problems) or scale.dtype}"
        )
    registry.check_devices(WHERE, activation=activation, filter=filter, scale=scale)


def _as_given(out: torch.Tensor, ncdhw: bool) -> torch.Tensor:
    """out [N, Z, P, Q, K] as the activation came: NDHWC, or the NCDHW view."""
    return out.permute(0, 4, 1, 2, 3) if ncdhw else out


def _reference(activation, filter, scale, padding, stride, dilation):
    """float64 convolution of the FP8 values (exact sums), times the scale, rounded once to bf16."""
    x, w, ncdhw = _views(activation, filter)
    shape = _output_shape(x, w, padding, stride, dilation)
    if 0 in shape or x.shape[-1] == 0:  # conv3d takes no empty batch, filter or channels: sums of nothing are 0
        return _as_given(torch.zeros(shape, dtype=torch.bfloat16, device=x.device), ncdhw)
    x, w = x.double().permute(0, 4, 1, 2, 3), w.double().permute(0, 4, 1, 2, 3)
    out = torch.nn.functional.conv3d(x, w, stride=stride, padding=padding, dilation=dilation) * scale.double()
    return _as_given(out.permute(0, 2, 3, 4, 1).to(torch.bfloat16).contiguous(), ncdhw)


def _fake(activation, filter, scale, padding, stride, dilation):
    x, w, ncdhw = _views(activation, filter)
    return _as_given(activation.new_empty(_output_shape(x, w, padding, stride, dilation), dtype=torch.bfloat16), ncdhw)


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, out_ptr, scale_ptr, M, K, C, D, H, W, Z, P, Q,
    stride_xn, stride_xd, stride_xh, stride_xw, stride_xc, stride_wk, stride_wt, stride_wr, stride_ws, stride_wc,
    pad_d, pad_h, pad_w, step_d, step_h, step_w, dil_d, dil_h, dil_w,
    T: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """out [M, K] bf16 (M = N·Z·P·Q output positions, contiguous) of one tile: positions by output channels
    (program id: position tile · channel tiles + channel tile, so that a position tile's programs run together
    and share its activation rows in L2). Steps over the taps (t, r, s) and, in each, C in blocks of BLOCK_C."""
    tiles_n = tl.cdiv(K, BLOCK_N)
    pid_m, pid_n = tl.program_id(0) // tiles_n, tl.program_id(0) % tiles_n
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    q = rows % Q
    p = (rows // Q) % P
    z = (rows // (Q * P)) % Z
    n = rows // (Q * P * Z)
    # A tap's input position of each output position: first + tap · dilation (outside the input: zeros).
    first_d, first_h, first_w = z * step_d - pad_d, p * step_h - pad_h, q * step_w - pad_w
    x_rows = x_ptr + n.to(tl.int64) * stride_xn
    w_rows = w_ptr + tl.where(cols < K, cols, 0).to(tl.int64)[:, None] * stride_wk
    cs = tl.arange(0, BLOCK_C)
    c_blocks = tl.cdiv(C, BLOCK_C)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(T * R * S * c_blocks):
        tap, c = step // c_blocks, (step % c_blocks) * BLOCK_C + cs
        t, r, s = tap // (R * S), (tap // S) % R, tap % S
        d, h, w = first_d + t * dil_d, first_h + r * dil_h, first_w + s * dil_w
        inside = (rows < M) & (d >= 0) & (d < D) & (h >= 0) & (h < H) & (w >= 0) & (w < W)
        offsets = d.to(tl.int64) * stride_xd + h.to(tl.int64) * stride_xh + w.to(tl.int64) * stride_xw
        a_ptrs = x_rows[:, None] + offsets[:, None] + c.to(tl.int64)[None, :] * stride_xc
        a = tl.load(a_ptrs, mask=inside[:, None] & (c < C)[None, :], other=0.0)
        b_ptrs = w_rows + (t * stride_wt + r * stride_wr + s * stride_ws) + c.to(tl.int64)[None, :] * stride_wc
        b = tl.load(b_ptrs, mask=(c < C)[None, :], other=0.0)
        acc = tl.dot(a, b.T, acc)
    out = (acc * tl.load(scale_ptr)).to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    tl.store(out_ptrs, out, mask=(rows < M)[:, None] & (cols < K)[None, :])


def _config(k: int, c: int) -> dict:
    """128 output positions a tile by up to 128 channels; blocks of C up to 128 (at least 32: FP8 products take
    32 deep). Three stages (96 KiB at 128 x 128 x 128), so that two programs share an SM: 0.98-1.25x the speed of
    four on the bench shapes (H100, RESULTS.md)."""
    block_n = min(128, max(16, launch.next_power_of_2(k)))
    return {
        "BLOCK_M": 128, "BLOCK_N": block_n, "BLOCK_C": min(128, max(32, launch.next_power_of_2(c))),
        "num_warps": 8 if block_n == 128 else 4, "num_stages": 3,
    }  # fmt: skip


def _run(activation, filter, scale, padding, stride, dilation) -> torch.Tensor:
    x, w, ncdhw = _views(activation, filter)
    shape = _output_shape(x, w, padding, stride, dilation)
    out = torch.empty(shape, dtype=torch.bfloat16, device=x.device)
    m, k, c = math.prod(shape[:4]), shape[-1], x.shape[-1]
    if launch.no_products(out, c):
        return _as_given(out, ncdhw)
    t, r, s = w.shape[1:4]
    cfg = _config(k, c)
    grid = (launch.cdiv(m, cfg["BLOCK_M"]) * launch.cdiv(k, cfg["BLOCK_N"]),)
    launch.fast(_conv_kernel)[grid](
        x, w, out, scale.reshape(()), m, k, c, *x.shape[1:4], *shape[1:4], *x.stride(), *w.stride(), *padding,
        *stride, *dilation, T=t, R=r, S=s, **cfg,
    )  # fmt: skip
    return _as_given(out, ncdhw)


def random_fp8(*shape: int, device="cpu") -> torch.Tensor:
    """Random FP8 e4m3 values (this platform's flavour) spread over about ±8 (samples, tests and benches)."""
    return testing.randn(*shape, device=device, std=3.0).to(arch.fp8_dtype(device))


def _samples(device):
    # (N, D, H, W, C, K, T, R, S, padding, stride, dilation, NCDHW)
    cases = (
        (2, 5, 6, 7, 24, 20, 3, 3, 3, [1, 1, 1], [1, 1, 1], [1, 1, 1], False),
        (1, 4, 9, 6, 40, 36, 2, 3, 1, [0, 2, 1], [2, 1, 3], [1, 2, 1], True),
        (3, 2, 3, 3, 70, 17, 1, 1, 1, [0, 0, 0], [1, 1, 1], [1, 1, 1], False),
    )
    for n, d, h, w, c, k, t, r, s, padding, stride, dilation, ncdhw in cases:
        x, f = random_fp8(n, d, h, w, c, device=device), random_fp8(k, t, r, s, c, device=device)
        if ncdhw:  # the same values as NCDHW / KCTRS in channels_last_3d memory
            x, f = x.permute(0, 4, 1, 2, 3), f.permute(0, 4, 1, 2, 3)
        scale = torch.rand((), device=device) * 1e-2 + 1e-3
        yield registry.Sample((x, f, scale, padding, stride, dilation), name=f"{n}x{d}x{h}x{w}x{c} k{k} {t}{r}{s}")


f8f8bf16_conv_op = registry.Op(
    "mslk::f8f8bf16_conv(Tensor activation, Tensor filter, Tensor scale, int[] padding, int[] stride, "
    "int[] dilation) -> Tensor",
    domain="conv",
    reference=_reference,
    fake=_fake,
    samples=_samples,
    validate=_validate,
    tolerance=1e-2,
)


f8f8bf16_conv_op.backend("triton", available=registry.triton_missing, requires=arch.fp8_e4m3_missing)(_run)


def f8f8bf16_conv(activation, filter, scale, padding, stride, dilation) -> torch.Tensor:
    """bf16 3-D convolution of FP8 e4m3 activation [N, D, H, W, C] by filter [K, T, R, S, C] (or NCDHW / KCTRS in
    channels_last_3d memory) times `scale` (one fp32 value: the two tensorwise scales multiplied); padding, stride
    and dilation are [d, h, w]. Output [N, Z, P, Q, K] (its NCDHW view for an NCDHW activation). See the module
    docstring."""
    return torch.ops.mslk.f8f8bf16_conv(activation, filter, scale, padding, stride, dilation)
