"""INT4 helpers (spec Q-18, Q-19, Q-20): plain PyTorch, so tier T0 covers them on every device."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mslk.core import testing
from mslk.quantize.shuffle import int4_row_quantize, int4_row_quantize_zp, pack_int4, unpack_int4


def _per_element(s: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    """[G, N] group values -> [N, K]."""
    return s.t().repeat_interleave(group_size, dim=1)[:, :k]


@settings(deadline=None, max_examples=30)
@given(n=st.integers(1, 9), k=st.integers(1, 300), gs=st.sampled_from([32, 64, 128, 256]))
def test_asymmetric_round_trip(n, k, gs):
    x = testing.randn(n, k, std=3.0)
    q, scale, zero = int4_row_quantize_zp(x, gs)
    groups = -(-k // gs)
    assert q.dtype == torch.int8 and q.shape == (n, k) and scale.shape == zero.shape == (groups, n)
    assert q.min() >= -8 and q.max() <= 7
    back = q.float() * _per_element(scale, k, gs) + _per_element(zero, k, gs)
    assert ((back - x).abs() <= _per_element(scale, k, gs) / 2 + 1e-5).all()


@settings(deadline=None, max_examples=30)
@given(n=st.integers(1, 9), k=st.integers(1, 300), gs=st.sampled_from([32, 128]))
def test_symmetric_round_trip(n, k, gs):
    x = testing.randn(n, k, std=3.0)
    q, scale = int4_row_quantize(x, gs)
    per = _per_element(scale, k, gs)
    back = q.float() * per
    # Half a step of error, except above 7.5 steps, where +8 clamps to 7 (at most one step).
    err = (back - x).abs()
    inside = x / per <= 7.5
    assert (err[inside] <= per[inside] / 2 + 1e-5).all() and (err <= per + 1e-5).all()


def test_constant_and_zero_groups_do_not_divide_by_zero():
    q, scale, zero = int4_row_quantize_zp(torch.full((2, 64), 3.0), 32)
    assert torch.isfinite(scale).all()
    torch.testing.assert_close(
        q.float() * _per_element(scale, 64, 32) + _per_element(zero, 64, 32), torch.full((2, 64), 3.0)
    )
    q, scale = int4_row_quantize(torch.zeros(2, 64), 32)
    assert (q == 0).all() and torch.isfinite(scale).all()


def test_pack_nibble_order_and_round_trip():
    x = torch.tensor([[1, -2, 7, -8]], dtype=torch.int8)
    packed = pack_int4(x)
    assert packed.view(torch.uint8).tolist() == [[0xE1, 0x87]]
    assert torch.equal(unpack_int4(packed), x)
    y = torch.randint(-8, 8, (5, 64), dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(y)), y)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: pack_int4(torch.zeros(2, 3, dtype=torch.int8)), "K even"),
        (lambda: pack_int4(torch.zeros(2, 4)), "expected int8"),
        (lambda: int4_row_quantize(torch.zeros(2, 4, dtype=torch.int32)), "floating-point"),
        (lambda: int4_row_quantize_zp(torch.zeros(2, 3, 4)), "2-D"),
        (lambda: int4_row_quantize(torch.zeros(2, 4), 0), "group_size must be positive"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
