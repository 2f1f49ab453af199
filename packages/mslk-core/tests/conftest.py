"""Test ops for the registry, the `mslk` command and the Triton tiers (namespace mslk_selftest)."""

import itertools

import pytest
import torch
import triton
import triton.language as tl

from mslk.core import registry, testing

_names = itertools.count()


@triton.jit
def _scale_rows_kernel(x_ptr, scale_ptr, out_ptr, n_cols, stride_x, stride_scale, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask).to(tl.float32)
    s = tl.load(scale_ptr + row * stride_scale)
    tl.store(out_ptr + row * stride_out + cols, (x * s).to(out_ptr.dtype.element_ty), mask=mask)


def scale_rows_reference(x, scale):
    return (x.float() * scale[:, None]).to(x.dtype)


def scale_rows_triton(x, scale):
    out = testing.empty_poisoned(*x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        grid = (x.shape[0], triton.cdiv(x.shape[1], 64))
        _scale_rows_kernel[grid](x, scale, out, x.shape[1], x.stride(0), scale.stride(0), out.stride(0), BLOCK=64)
    return out


def scale_rows_supports(x, scale):
    reasons = []
    if x.dim() != 2:
        reasons.append(f"x.dim() == {x.dim()} (supported: 2)")
    elif x.stride(-1) != 1:
        reasons.append(f"x.stride(-1) > 1 ({x.stride()}) - you should call .contiguous()")
    if scale.dtype != torch.float32:
        reasons.append(f"scale.dtype={scale.dtype} (supported: torch.float32)")
    return reasons


def scale_rows_samples(device):
    for rows, cols in [(3, 5), (17, 130)]:
        yield registry.Sample(
            (testing.randn(rows, cols, device=device, dtype=torch.bfloat16), testing.randn(rows, device=device))
        )


def make_scale_rows_op(*, fake=None, reference=scale_rows_reference, devices=("cuda",), available=None, validate=None):
    """A fresh op `mslk_selftest::scale_rows_N(Tensor x, Tensor scale) -> Tensor` with a Triton backend."""
    op = registry.Op(
        f"mslk_selftest::scale_rows_{next(_names)}(Tensor x, Tensor scale) -> Tensor",
        domain="selftest",
        reference=reference,
        fake=fake or (lambda x, scale: torch.empty_like(x)),
        samples=scale_rows_samples,
        validate=validate,
    )
    op.backend("triton", devices=devices, supports=scale_rows_supports, available=available)(scale_rows_triton)
    return op


@pytest.fixture
def fresh_ops(monkeypatch):
    """Ops made in a test leave the registry afterwards (their torch schemas stay, under unique names)."""
    monkeypatch.setattr(registry, "OPS", dict(registry.OPS))
    return make_scale_rows_op


@pytest.fixture
def fresh_add_into_op(fresh_ops):
    return make_add_into_op


def _add_into(out, x, factor=1.0):
    out.add_(factor * x)


def make_add_into_op(factor):
    """A fresh op `mslk_selftest::add_into_N(Tensor(a!) out, Tensor x) -> ()` (writes into `out`), with reference
    `out += x` and a CPU kernel `out += factor · x`."""
    op = registry.Op(
        f"mslk_selftest::add_into_{next(_names)}(Tensor(a!) out, Tensor x) -> ()",
        domain="selftest",
        reference=_add_into,
        fake=lambda out, x: None,
        samples=lambda device: [
            registry.Sample((testing.randn(4, 6, device=device), testing.randn(4, 6, device=device)))
        ],
    )
    op.backend("cpu_kernel", devices=("cpu",))(lambda out, x: _add_into(out, x, factor))
    return op
