"""MXFP6 (E2M3) helpers (spec Q-23): plain PyTorch, tier T0."""

import pytest
import torch

from mslk.core import testing
from mslk.quantize.mx_mixed_dtype_utils import (
    E2M3_DECODE,
    E2M3_MAX,
    dequantize_mx6_e2m3,
    pack_fp6_e2m3,
    quantize_bf16_to_mx6_e2m3,
    unpack_fp6_e2m3,
)


def test_decode_table():
    assert len(E2M3_DECODE) == 32 and E2M3_DECODE[-1] == E2M3_MAX == 7.5
    assert E2M3_DECODE[:9] == (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
    assert list(E2M3_DECODE) == sorted(E2M3_DECODE)


def test_every_representable_value_round_trips_and_ties_go_even():
    grid = torch.tensor(E2M3_DECODE)
    x = torch.cat([grid, -grid])[None]  # [1, 64]
    codes, scales = quantize_bf16_to_mx6_e2m3(x, block_size=64)
    assert (scales == 127).all(), "amax 7.5 needs scale 2^0"
    assert torch.equal(dequantize_mx6_e2m3(codes, scales, 64), x)
    # 1.0625 lies halfway between 1.0 (code 8, even) and 1.125 (code 9): it goes to 1.0.
    tie = torch.full((1, 32), 1.0625)
    tie[0, 0] = 7.5
    codes, scales = quantize_bf16_to_mx6_e2m3(tie)
    assert dequantize_mx6_e2m3(codes, scales)[0, 1].item() == 1.0


def test_round_trip_error_and_scales():
    x = testing.randn(4, 96, std=5.0)
    codes, scales = quantize_bf16_to_mx6_e2m3(x)
    assert codes.shape == x.shape and scales.shape == (4, 3) and codes.max() < 64
    amax = x.unflatten(-1, (3, 32)).abs().amax(-1)
    assert torch.equal(scales.int() - 127, torch.ceil(torch.log2(amax.double() / 7.5)).int())
    testing.assert_rel_close(dequantize_mx6_e2m3(codes, scales), x, 0.05)
    zeros = quantize_bf16_to_mx6_e2m3(torch.zeros(1, 32))
    assert (zeros[0] == 0).all() and (zeros[1] == 0).all()


def test_scales_are_exact_past_a_power_of_two():
    """amax one fp32 ulp past 7.5 · 2^k needs 2^(k+1): fp32's amax / 7.5 rounded back to 2^k for most k (byte 131
    for 120 + ulp, not 132)."""
    powers = torch.arange(-10, 10, dtype=torch.float64)
    amax = (7.5 * 2.0**powers).float().nextafter(torch.tensor(torch.inf))
    x = torch.zeros(len(amax), 32)
    x[:, 0] = amax
    _, scales = quantize_bf16_to_mx6_e2m3(x)
    assert scales[:, 0].tolist() == (powers + 128).int().tolist()


def test_nan_and_inf_blocks_get_the_nan_scale():
    """OCP MX: a block holding NaN or ±Inf gets scale 0xFF and dequantizes to NaN; the other blocks are untouched
    (a NaN block had come back finite: 4.1e-38 for its 1.0s)."""
    x = torch.ones(3, 32)
    x[0, 3], x[1, 3] = torch.nan, torch.inf
    codes, scales = quantize_bf16_to_mx6_e2m3(x)
    assert scales[:, 0].tolist() == [255, 255, 125]
    back = dequantize_mx6_e2m3(codes, scales)
    assert back[:2].isnan().all() and torch.equal(back[2], x[2])


def test_pack_layout():
    codes = torch.tensor([[1, 2, 3, 63]], dtype=torch.uint8)
    packed = pack_fp6_e2m3(codes)
    word = 1 | (2 << 6) | (3 << 12) | (63 << 18)
    assert packed.tolist() == [[word & 0xFF, (word >> 8) & 0xFF, word >> 16]]
    many = torch.randint(0, 64, (5, 128), dtype=torch.uint8)
    assert pack_fp6_e2m3(many).shape == (5, 96) and torch.equal(unpack_fp6_e2m3(pack_fp6_e2m3(many)), many)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: quantize_bf16_to_mx6_e2m3(torch.ones(2, 40)), "multiple of 32"),
        (lambda: quantize_bf16_to_mx6_e2m3(torch.ones(2, 32, dtype=torch.int32)), "float tensor"),
        (lambda: pack_fp6_e2m3(torch.ones(2, 6, dtype=torch.uint8)), "K % 4 == 0"),
        (lambda: unpack_fp6_e2m3(torch.ones(2, 4, dtype=torch.uint8)), "multiple of 3 bytes"),
        (lambda: quantize_bf16_to_mx6_e2m3(torch.ones(2, 32), 0), "block_size must be a positive int"),
    ],
)
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
