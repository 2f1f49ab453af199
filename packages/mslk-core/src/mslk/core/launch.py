"""Host-side arithmetic of kernel launchers, in plain Python, and the zeroed buffers their kernels keep zeroed.

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


# Int32 buffers that are all zero between kernels (spin locks, barrier counters: the kernels using them leave them
# zero), kept from call to call so that a call needs no memset launch. One per device, stream and use: kernels of
# one stream run one after another, so no two kernels use a buffer at the same time (a grid barrier's counter
# must not be shared). A kept buffer is never freed (the last one is used): kernels still running may hold its
# address. They grow by doubling, so they add up to at most twice the largest.
_kept: dict[tuple[torch.device, int, str], list[torch.Tensor]] = {}


def kept_zeros(device: torch.device, use: str, numel: int) -> torch.Tensor:
    """At least `numel` zeros on device for `use` on the current stream, which `use` must leave zero. While a
    CUDA graph is being captured: a new buffer, not kept (allocated during the capture, it belongs to the
    graph's memory pool and the graph zeroes it on each replay), so that graphs share none with other work."""
    stream = 0
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(numel, dtype=torch.int32, device=device)
        stream = torch.cuda.current_stream(device).stream_id
    kept = _kept.setdefault((device, stream, use), [])
    if not kept or kept[-1].numel() < numel:
        kept.append(torch.zeros(max(numel, 2 * kept[-1].numel() if kept else 1024), dtype=torch.int32, device=device))
    return kept[-1]
