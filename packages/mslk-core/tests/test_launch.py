"""Host-side launch arithmetic (mslk.core.launch) against Triton's own helpers."""

import torch
import triton
from hypothesis import given
from hypothesis import strategies as st

from mslk.core import launch


@given(a=st.integers(0, 2**40), b=st.integers(1, 2**20))
def test_cdiv(a, b):
    assert launch.cdiv(a, b) == triton.cdiv(a, b) == -(-a // b)


@given(n=st.integers(1, 2**40))
def test_next_power_of_2(n):
    p = launch.next_power_of_2(n)
    assert p == triton.next_power_of_2(n) and p >= n and p & (p - 1) == 0 and (p == 1 or p // 2 < n)


def test_kept_zeros_grow_and_stay():
    """A larger request gets a larger buffer; the older ones stay allocated (graphs may hold them)."""
    device = torch.device("cpu")
    first = launch.kept_zeros(device, "test", 10)
    assert launch.kept_zeros(device, "test", 10) is first and first.numel() >= 10
    assert launch.kept_zeros(device, "another use", 10) is not first
    grown = launch.kept_zeros(device, "test", first.numel() + 1)
    kept = launch._kept[(device, 0, "test")]
    assert grown.numel() >= 2 * first.numel() and kept[-1] is grown and kept[-2] is first
    assert not grown.any()
