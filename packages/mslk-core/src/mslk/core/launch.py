"""Host-side arithmetic of kernel launchers, in plain Python.

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions in Triton 3.7, whose call from the host
costs about 5 us (their wrapper unwraps every argument): several per launch add up on small inputs.
"""

from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for non-negative a and positive b."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def no_products(out: torch.Tensor, k: int) -> bool:
    """Whether a GEMM into out over a reduction of length k needs no kernel: out is empty, or k == 0 (out is
    zeroed here, as the empty sum)."""
    if out.numel() == 0:
        return True
    if k == 0:
        out.zero_()
        return True
    return False
