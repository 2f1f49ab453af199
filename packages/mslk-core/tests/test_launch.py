"""Host-side launch arithmetic (mslk.core.launch) against Triton's own helpers."""

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
