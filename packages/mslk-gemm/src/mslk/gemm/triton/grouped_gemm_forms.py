"""The other layouts of the grouped GEMM family (spec G-04, G-05, G-07..G-11; grouped_gemm.py has the kernel
and the MoE path): the deprecated list forms (one tensor per group, run as one stacked problem), the deprecated
padded `_dynamic` forms ([G, M, K] with a valid row count per group) and torch._scaled_grouped_mm's offsets
forms (2D x 3D, 3D x 2D, 2D x 2D, 3D x 3D), all on the grouped kernel.
"""

from __future__ import annotations

import functools

import torch

from mslk.core import arch, formats, registry, testing
from mslk.gemm.triton.fp8_gemm import k_contiguous, quantize_rows
from mslk.gemm.triton.grouped_gemm import (
    K_GROUPED,
    PADDED,
    ROWWISE,
    _check_16bit,
    _check_fp8,
    _check_rowwise,
    _check_sizes,
    _group_bounds,
    _k_grouped_reference,
    _per_group,
    _run_grouped,
    _stacked_reference,
    _weights,
)

# ------------------------------------------------------------------ deprecated list forms (G-04/05/09/10)


def _check_lists(where: str, X, W) -> None:
    if len(X) != len(W) or not X:
        raise ValueError(f"{where}: expected two equally long, non-empty lists X and W, got {len(X)} and {len(W)}")
    n_k = tuple(W[0].shape)
    if any(w.dim() != 2 or tuple(w.shape) != n_k for w in W) or any(x.dim() != 2 or x.shape[1] != n_k[1] for x in X):
        raise ValueError(
            f"{where}: expected X[i] [M_i, K] and W[i] [N, K] with one N and K for all groups, got X "
            f"{[tuple(x.shape) for x in X]} and W {[tuple(w.shape) for w in W]}"
        )
    registry.check_devices(where, **{f"X[{i}]": x for i, x in enumerate(X)}, **{f"W[{i}]": w for i, w in enumerate(W)})


def _list_sizes(X) -> list[int]:
    return [x.shape[0] for x in X]


def _list_reference(X, W, x_scale=None, w_scale=None):
    """fp32 [ΣM_i, N] of the lists (rowwise scales: one tensor per group)."""
    sizes = _list_sizes(X)
    bounds = _group_bounds(torch.tensor(sizes), sum(sizes))
    if x_scale is not None:
        x_scale, w_scale = torch.cat([s.reshape(-1) for s in x_scale]), torch.stack([s.reshape(-1) for s in w_scale])
    return _stacked_reference(torch.cat(X), torch.stack(W), bounds, x_scale, w_scale)


def _list_triton(X, W, x_scale=None, w_scale=None):
    """bf16 [ΣM_i, N] of the lists through the stacked kernel: X concatenated, W stacked (a copy, which the
    deprecated list forms pay on every call), the sizes known on the host."""
    x, w = torch.cat(X), torch.stack(W)
    sizes = torch.tensor(_list_sizes(X), dtype=torch.int64).to(x.device)
    out = torch.empty((x.shape[0], w.shape[1]), dtype=torch.bfloat16, device=x.device)
    if x_scale is None:
        return _run_grouped(x, w, out, sizes)
    x_scale, w_scale = torch.cat([s.reshape(-1) for s in x_scale]), torch.stack([s.reshape(-1) for s in w_scale])
    return _run_grouped(x, w, out, sizes, a_scale=x_scale, b_scale=w_scale, scales=ROWWISE)


def _split(out, X) -> list[torch.Tensor]:
    """The per-group outputs, each its own tensor (a custom op's outputs may not alias one another)."""
    return [part.clone() for part in out.split(_list_sizes(X))]


def _list_ops(prefix: str, args: str, fp8: bool, samples) -> tuple[registry.Op, registry.Op]:
    """`{prefix}_grouped` (-> Tensor[]) and `{prefix}_grouped_cat` (-> Tensor) over one validation, reference and
    kernel."""

    def validate(where, X, W, x_scale=None, w_scale=None):
        _check_lists(where, X, W)
        if not fp8:
            for x, w in zip(X, W, strict=True):
                _check_16bit(where, x, w)
            return
        if not len(X) == len(x_scale) == len(w_scale):
            raise ValueError(f"{where}: expected one x_scale and w_scale per group, got {len(x_scale)}, {len(w_scale)}")
        for i, (xq, wq, xs, ws) in enumerate(zip(X, W, x_scale, w_scale, strict=True)):
            _check_fp8(where, xq, wq)
            formats.Rowwise().check(xq, xs, role=f"{where}: x_scale[{i}]")
            formats.Rowwise().check(wq, ws, role=f"{where}: w_scale[{i}]")

    def cat_fake(X, *args):
        return X[0].new_empty((sum(_list_sizes(X)), args[0][0].shape[0]), dtype=torch.bfloat16)

    def reference(X, W, *scales):
        return _list_reference(X, W, *scales).to(torch.bfloat16)

    ops = []
    for name, listed in ((f"{prefix}_grouped", True), (f"{prefix}_grouped_cat", False)):
        finish = _split if listed else lambda out, X: out
        op = registry.Op(
            f"mslk::{name}({args}) -> Tensor{'[]' if listed else ''}",
            domain="gemm",
            reference=lambda X, W, *scales, finish=finish: finish(reference(X, W, *scales), X),
            fake=lambda X, *args, finish=finish: finish(cat_fake(X, *args), X),
            samples=samples,
            validate=functools.partial(validate, name),
            tolerance=1e-2,
        )
        op.backend("triton", available=registry.triton_missing, requires=arch.fp8_e4m3_missing if fp8 else None)(
            lambda X, W, *scales, finish=finish: finish(_list_triton(X, W, *scales), X)
        )
        ops.append(op)
    return ops[0], ops[1]


def _list_samples(device, fp8: bool):
    for sizes, n, k in (([5, 0, 11], 24, 64), ([3], 40, 48)):
        x = [testing.randn(m, k, device=device) for m in sizes]
        w = [testing.randn(n, k, device=device) for _ in sizes]
        if fp8:
            xq, xs = zip(*map(quantize_rows, x), strict=True)
            wq, ws = zip(*map(quantize_rows, w), strict=True)
            yield registry.Sample((list(xq), list(wq), list(xs), list(ws)))
        else:
            yield registry.Sample(([t.bfloat16() for t in x], [t.bfloat16() for t in w]))


bf16bf16bf16_grouped_op, bf16bf16bf16_grouped_cat_op = _list_ops(
    "bf16bf16bf16", "Tensor[] X, Tensor[] W", False, functools.partial(_list_samples, fp8=False)
)
f8f8bf16_rowwise_grouped_op, f8f8bf16_rowwise_grouped_cat_op = _list_ops(
    "f8f8bf16_rowwise",
    "Tensor[] XQ, Tensor[] WQ, Tensor[] x_scale, Tensor[] w_scale",
    True,
    functools.partial(_list_samples, fp8=True),
)


def bf16bf16bf16_grouped(X, W) -> list[torch.Tensor]:
    """Deprecated list form (spec G-09): X[i] [M_i, K] · W[i]ᵀ, W[i] [N, K] (one N and K), bf16/fp16 -> a list
    of [M_i, N]. Stacks W and copies the outputs apart on every call: prefer bf16bf16bf16_grouped_stacked."""
    return torch.ops.mslk.bf16bf16bf16_grouped(X, W)


def bf16bf16bf16_grouped_cat(X, W) -> torch.Tensor:
    """Deprecated (spec G-10): bf16bf16bf16_grouped's outputs concatenated, [ΣM_i, N]."""
    return torch.ops.mslk.bf16bf16bf16_grouped_cat(X, W)


def f8f8bf16_rowwise_grouped(XQ, WQ, x_scale, w_scale) -> list[torch.Tensor]:
    """Deprecated list form (spec G-04): per group (XQ[i] · WQ[i]ᵀ) · x_scale[i] · w_scale[i] (rowwise FP8,
    quantize_fp8_row; one N and K) -> a list of bf16 [M_i, N]. Prefer f8f8bf16_rowwise_grouped_stacked."""
    return torch.ops.mslk.f8f8bf16_rowwise_grouped(XQ, WQ, x_scale, w_scale)


def f8f8bf16_rowwise_grouped_cat(XQ, WQ, x_scale, w_scale) -> torch.Tensor:
    """Deprecated (spec G-05): f8f8bf16_rowwise_grouped's outputs concatenated, bf16 [ΣM_i, N]."""
    return torch.ops.mslk.f8f8bf16_rowwise_grouped_cat(XQ, WQ, x_scale, w_scale)


# ------------------------------------------------------------------------ padded groups (G-07, G-11)


def _padded_reference(x, w, valid, x_scale=None, w_scale=None):
    """fp32 [G, M, N]: x[g, :valid[g]] · w[g]ᵀ (scaled), rows past valid[g] zero."""
    groups, m = x.shape[:2]
    bounds = [(g * m, min(max(v, 0), m)) for g, v in enumerate(valid)]
    out = _stacked_reference(x.reshape(groups * m, x.shape[-1]), w, bounds, x_scale, w_scale)
    return out.view(groups, m, w.shape[-2])


def _check_padded(where: str, X, W, zero_start_index_M) -> None:
    if X.dim() != 3 or W.dim() != 3 or X.shape[0] != W.shape[0] or X.shape[2] != W.shape[2]:
        raise ValueError(
            f"{where}: expected X [G, M, K] and W [G, N, K] with the same G and K, got {tuple(X.shape)} and "
            f"{tuple(W.shape)}"
        )
    _check_sizes(where, zero_start_index_M, X.shape[0], "zero_start_index_M")
    registry.check_devices(where, X=X, W=W, zero_start_index_M=zero_start_index_M)


def _run_padded(X, W, out, valid, **scales):
    """out [G, M, N] of X [G, M, K] and W [G, N, K]: group g's first valid[g] rows (all: valid None)."""
    groups, m, k = X.shape
    # (empty_like would keep a column-major out's strides, which the [G·M, N] view below cannot take)
    result = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
    _run_grouped(
        k_contiguous(X.reshape(groups * m, k)), _weights(W), result.view(groups * m, out.shape[-1]), valid,
        grouping=PADDED, rows=m, **scales,
    )  # fmt: skip
    return out if result is out else out.copy_(result)


def _validate_bf16_dynamic(X, W, zero_start_index_M):
    where = "bf16bf16bf16_grouped_dynamic"
    _check_padded(where, X, W, zero_start_index_M)
    _check_16bit(where, X, W)


def _dynamic_samples(device, fp8: bool):
    groups, m, n, k = 3, 20, 24, 64
    x, w = testing.randn(groups, m, k, device=device), testing.randn(groups, n, k, device=device)
    valid = torch.tensor([7, 0, 20], device=device)
    if fp8:
        (xq, xs), (wq, ws) = quantize_rows(x), quantize_rows(w)
        yield registry.Sample((xq, wq, xs, ws, valid))
    else:
        yield registry.Sample((x.bfloat16(), w.bfloat16(), valid))


bf16bf16bf16_grouped_dynamic_op = registry.Op(
    "mslk::bf16bf16bf16_grouped_dynamic(Tensor X, Tensor W, Tensor zero_start_index_M) -> Tensor",
    domain="gemm",
    reference=lambda X, W, zero_start_index_M: _padded_reference(X, W, zero_start_index_M.tolist()).to(torch.bfloat16),
    fake=lambda X, W, zero_start_index_M: X.new_empty((*X.shape[:2], W.shape[1]), dtype=torch.bfloat16),
    samples=functools.partial(_dynamic_samples, fp8=False),
    validate=_validate_bf16_dynamic,
    tolerance=1e-2,
)


@bf16bf16bf16_grouped_dynamic_op.backend("triton", available=registry.triton_missing)
def _bf16_dynamic_triton(X, W, zero_start_index_M):
    out = torch.empty((*X.shape[:2], W.shape[1]), dtype=torch.bfloat16, device=X.device)
    return _run_padded(X, W, out, zero_start_index_M.contiguous())


def bf16bf16bf16_grouped_dynamic(X, W, zero_start_index_M) -> torch.Tensor:
    """Deprecated padded form (spec G-11): X [G, M, K] · W[g]ᵀ, W [G, N, K], bf16/fp16 -> [G, M, N], of which
    rows >= zero_start_index_M[g] (int32/int64 [G]) are zero and cost no GEMM work."""
    return torch.ops.mslk.bf16bf16bf16_grouped_dynamic(X, W, zero_start_index_M)


def _validate_fp8_dynamic(XQ, WQ, x_scale, w_scale, zero_start_index_M, zeroing_output_tensor=True):
    where = "f8f8bf16_rowwise_grouped_dynamic"
    _check_fp8(where, XQ, WQ)
    _check_padded(where, XQ, WQ, zero_start_index_M)
    formats.Rowwise().check(XQ, x_scale, role=f"{where}: x_scale")
    formats.Rowwise().check(WQ, w_scale, role=f"{where}: w_scale")


f8f8bf16_rowwise_grouped_dynamic_op = registry.Op(
    "mslk::f8f8bf16_rowwise_grouped_dynamic(Tensor XQ, Tensor WQ, Tensor x_scale, Tensor w_scale, "
    "Tensor zero_start_index_M, bool zeroing_output_tensor=True) -> Tensor",
    domain="gemm",
    reference=lambda XQ, WQ, x_scale, w_scale, zero_start_index_M, zeroing_output_tensor=True: _padded_reference(
        XQ, WQ, zero_start_index_M.tolist(), x_scale, w_scale
    ).to(torch.bfloat16),
    fake=lambda XQ, WQ, *args, **kwargs: XQ.new_empty((*XQ.shape[:2], WQ.shape[1]), dtype=torch.bfloat16),
    samples=functools.partial(_dynamic_samples, fp8=True),
    validate=_validate_fp8_dynamic,
    tolerance=1e-2,
)


@f8f8bf16_rowwise_grouped_dynamic_op.backend(
    "triton", available=registry.triton_missing, requires=arch.fp8_e4m3_missing
)
def _fp8_dynamic_triton(XQ, WQ, x_scale, w_scale, zero_start_index_M, zeroing_output_tensor=True):
    out = torch.empty((*XQ.shape[:2], WQ.shape[1]), dtype=torch.bfloat16, device=XQ.device)
    return _run_padded(
        XQ, WQ, out, zero_start_index_M.contiguous(), a_scale=x_scale.reshape(-1).contiguous(),
        b_scale=_per_group(w_scale, WQ.shape[0]).contiguous(), scales=ROWWISE, zero_fill=zeroing_output_tensor,
    )  # fmt: skip


def f8f8bf16_rowwise_grouped_dynamic(XQ, WQ, x_scale, w_scale, zero_start_index_M, zeroing_output_tensor=True):
    """Deprecated padded form (spec G-07): XQ [G, M, K], WQ [G, N, K] FP8, x_scale [G, M], w_scale [G, N]
    (quantize_fp8_row) -> bf16 [G, M, N]; rows >= zero_start_index_M[g] are not computed: zeros, or left as
    allocated (uninitialized) when zeroing_output_tensor=False."""
    return torch.ops.mslk.f8f8bf16_rowwise_grouped_dynamic(
        XQ, WQ, x_scale, w_scale, zero_start_index_M, zeroing_output_tensor
    )


# ------------------------------------------------------------------ torch._grouped_mm form (G-08)

_GROUPED_MM_FORMS = {
    (2, 3): "2D x 3D (offsets over XQ's rows)",
    (3, 2): "3D x 2D (offsets over WQ's columns)",
    (2, 2): "2D x 2D (offsets over K)",
    (3, 3): "3D x 3D (batched, no offsets)",
}


def _grouped_mm_shapes(XQ, WQ, offsets) -> tuple[int, tuple[int, ...], int, int]:
    """(G, output shape, x_scale and w_scale sizes) of the form of XQ and WQ (torch._scaled_grouped_mm's)."""
    form = (XQ.dim(), WQ.dim())
    if form == (2, 3):
        return WQ.shape[0], (XQ.shape[0], WQ.shape[2]), XQ.shape[0], WQ.shape[0] * WQ.shape[2]
    if form == (3, 2):
        return XQ.shape[0], (XQ.shape[1], WQ.shape[1]), XQ.shape[0] * XQ.shape[1], WQ.shape[1]
    groups = (offsets.shape[0] if offsets.dim() == 1 else 0) if form == (2, 2) else XQ.shape[0]
    m, n = XQ.shape[-2], WQ.shape[-1]
    return groups, (groups, m, n), groups * m, groups * n


def _validate_grouped_mm(XQ, WQ, x_scale, w_scale, offsets, output):
    where = "f8f8bf16_rowwise_grouped_mm"
    _check_fp8(where, XQ, WQ)
    form = (XQ.dim(), WQ.dim())
    if form not in _GROUPED_MM_FORMS or XQ.shape[-1] != WQ.shape[-2] or (form == (3, 3) and XQ.shape[0] != WQ.shape[0]):
        raise ValueError(
            f"{where}: expected XQ and WQ [.., K, N] with the same K in one of the forms "
            f"{', '.join(_GROUPED_MM_FORMS.values())}; got {tuple(XQ.shape)} and {tuple(WQ.shape)}"
        )
    if (offsets is None) != (form == (3, 3)):
        raise ValueError(
            f"{where}: the {_GROUPED_MM_FORMS[form]} form {'takes no' if form == (3, 3) else 'needs'} offsets"
        )
    groups, out_shape, x_numel, w_numel = _grouped_mm_shapes(XQ, WQ, offsets)
    if offsets is not None:
        _check_sizes(where, offsets, groups, "offsets")
    registry.check_devices(where, XQ=XQ, WQ=WQ, offsets=offsets, output=output)
    _check_rowwise(where, "x_scale", x_scale, XQ, x_numel)
    _check_rowwise(where, "w_scale", w_scale, WQ, w_numel)
    registry.check_output(where, "output", output, out_shape, (torch.bfloat16,), XQ.device)


def _grouped_mm_reference(XQ, WQ, x_scale, w_scale, offsets, output):
    form = (XQ.dim(), WQ.dim())
    if form == (2, 3):
        out = _stacked_reference(XQ, WQ.mT, _group_bounds(offsets, XQ.shape[0], ends=True), x_scale, w_scale)
    elif form == (3, 2):
        out = _stacked_reference(WQ.T, XQ, _group_bounds(offsets, WQ.shape[1], ends=True), w_scale, x_scale).T
    elif form == (2, 2):
        out = _k_grouped_reference(XQ, WQ.T, _group_bounds(offsets, XQ.shape[1], ends=True), x_scale, w_scale)
    else:
        out = _padded_reference(XQ, WQ.mT, [XQ.shape[1]] * XQ.shape[0], x_scale, w_scale)
    return output.copy_(out)


def _grouped_mm_samples(device):
    x, xs = quantize_rows(testing.randn(37, 64, device=device))
    w, ws = quantize_rows(testing.randn(3, 24, 64, device=device))
    offsets = torch.tensor([10, 10, 30], dtype=torch.int32, device=device)
    yield registry.Sample(
        (x, w.mT, xs, ws, offsets, testing.empty_poisoned(37, 24, dtype=torch.bfloat16, device=device))
    )
    x3, xs3 = quantize_rows(testing.randn(3, 20, 64, device=device))
    yield registry.Sample(
        (x3, w.mT, xs3, ws, None, testing.empty_poisoned(3, 20, 24, dtype=torch.bfloat16, device=device))
    )


f8f8bf16_rowwise_grouped_mm_op = registry.Op(
    "mslk::f8f8bf16_rowwise_grouped_mm(Tensor XQ, Tensor WQ, Tensor x_scale, Tensor w_scale, Tensor? offsets, "
    "Tensor(a!) output) -> Tensor",
    out_arg="output",
    domain="gemm",
    reference=_grouped_mm_reference,
    fake=lambda XQ, WQ, x_scale, w_scale, offsets, output: output,
    samples=_grouped_mm_samples,
    validate=_validate_grouped_mm,
    tolerance=1e-2,
)


@f8f8bf16_rowwise_grouped_mm_op.backend("triton", available=registry.triton_missing, requires=arch.fp8_e4m3_missing)
def _grouped_mm_triton(XQ, WQ, x_scale, w_scale, offsets, output):
    form = (XQ.dim(), WQ.dim())
    groups = _grouped_mm_shapes(XQ, WQ, offsets)[0]
    xs, ws = x_scale.reshape(-1), w_scale.reshape(-1)
    rowwise = {"scales": ROWWISE, "fast_accum": True}
    if form == (2, 3):
        _run_grouped(
            k_contiguous(XQ), _weights(WQ.mT), output, offsets, ends=True, a_scale=xs, b_scale=_per_group(ws, groups),
            **rowwise,
        )  # fmt: skip
    elif form == (3, 2):  # the transposed problem: outᵀ [ΣN, M] = WQᵀ [ΣN, K] · XQ[g]ᵀ, groups along WQᵀ's rows
        _run_grouped(
            k_contiguous(WQ.T), _weights(XQ), output.T, offsets, ends=True, a_scale=ws,
            b_scale=_per_group(xs, groups), **rowwise,
        )  # fmt: skip
    elif form == (2, 2):  # K grouped: out[g] = XQ[:, K of g] · WQ[K of g, :] with scales per (group, row/col)
        _run_grouped(
            k_contiguous(XQ), _weights(WQ.T), output, offsets, grouping=K_GROUPED, ends=True, a_scale=xs,
            b_scale=_per_group(ws, groups), zero_fill=False, **rowwise,
        )  # fmt: skip
    else:
        _run_padded(XQ, _weights(WQ.mT), output, None, a_scale=xs, b_scale=_per_group(ws, groups), **rowwise)
    return output


def f8f8bf16_rowwise_grouped_mm(XQ, WQ, x_scale, w_scale, offsets, output) -> torch.Tensor:
    """Rowwise FP8 grouped GEMM in torch._scaled_grouped_mm's forms (spec G-08), into bf16 `output` (returned):

    - 2D x 3D: XQ [ΣM, K], WQ [G, K, N] (best: `wq.mT` of a contiguous [G, N, K]), offsets int32 [G] cumulative
      ends of the groups' rows -> [ΣM, N]; x_scale [ΣM], w_scale [G, N]. Rows past offsets[-1] come out zero.
    - 3D x 2D: XQ [G, M, K], WQ [K, ΣN], offsets over N -> [M, ΣN]; x_scale [G, M], w_scale [ΣN].
    - 2D x 2D: XQ [M, ΣK], WQ [ΣK, N], offsets over K -> [G, M, N] (empty groups give zeros); x_scale [G, M],
      w_scale [G, N] (each K slice quantized on its own).
    - 3D x 3D: XQ [G, M, K], WQ [G, K, N], offsets None -> [G, M, N]; x_scale [G, M], w_scale [G, N].

    Offsets are read on the device: each group ends at max(offsets[g], its start), clamped to the extent (so
    non-monotone offsets give empty groups, never reads out of bounds). The 2D x 2D form loads K slices that
    start anywhere element by element: it is correct for any offsets, but slow."""
    return torch.ops.mslk.f8f8bf16_rowwise_grouped_mm(XQ, WQ, x_scale, w_scale, offsets, output)
