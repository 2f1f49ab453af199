import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mslk.core import formats
from mslk.core.formats import (
    MX,
    NVFP4,
    Blockwise,
    Groupwise,
    Rowwise,
    ScaleFormatError,
    Tensorwise,
    identify,
)


def f32(*shape):
    return torch.rand(*shape) + 0.5


def test_tensorwise():
    x = torch.empty(7, 33)
    Tensorwise().check(x, f32(()))
    Tensorwise().check(x, f32(1))
    with pytest.raises(ScaleFormatError, match=r"expected a tensorwise scale .* quantize_fp8_tensor"):
        Tensorwise().check(x, f32(7))


def test_rowwise_any_rank():
    Rowwise().check(torch.empty(7, 33), f32(7))
    Rowwise().check(torch.empty(2, 5, 33), f32(2, 5))
    Rowwise().check(torch.empty(2, 5, 33), f32(10))  # flat [M] for 3-D activations
    with pytest.raises(ScaleFormatError) as info:
        Rowwise().check(torch.empty(7, 33), f32(()), role="x_scale")
    text = str(info.value)
    assert text.startswith(
        "x_scale: expected a rowwise scale for data of shape (7, 33), as produced by quantize_fp8_row"
    )
    assert "shape () (expected (7,))" in text
    assert "The scale passed is a tensorwise scale (from quantize_fp8_tensor)." in text


def test_rowwise_dtype_device_and_strides():
    x = torch.empty(4, 8)
    with pytest.raises(ScaleFormatError, match=r"dtype torch.bfloat16 \(expected torch.float32\)"):
        Rowwise().check(x, f32(4).bfloat16())
    with pytest.raises(ScaleFormatError, match="expected contiguous"):
        Rowwise().check(x, f32(8)[::2])
    with pytest.raises(ScaleFormatError, match="device meta"):
        Rowwise().check(x, torch.empty(4, device="meta"))


def test_blockwise_shapes_and_layout():
    x = torch.empty(300, 520)
    assert Blockwise(128, 128).expected_shape((300, 520)) == (3, 5)
    assert Blockwise(128, 128, k_major=False).expected_shape((300, 520)) == (5, 3)
    Blockwise(128, 128).check(x, f32(3, 5))
    with pytest.raises(ScaleFormatError) as info:
        Blockwise(128, 128).check(x, f32(5, 3).t())  # right shape, column-major strides
    assert "expected contiguous" in str(info.value)
    with pytest.raises(ScaleFormatError) as info:
        Blockwise(128, 128).check(x, f32(300), role="x_scale")
    assert "quantize_fp8_block(x, 128, 128)" in str(info.value)
    assert "The scale passed is a rowwise scale" in str(info.value)
    with pytest.raises(ScaleFormatError, match="need 2-D data"):
        Blockwise(128, 128).check(torch.empty(2, 3, 4), f32(1, 1))


def test_groupwise_m_major_and_divisibility():
    x = torch.empty(5, 256)
    Groupwise(128).check(x, f32(2, 5))
    Groupwise(128, k_major=True).check(x, f32(5, 2))
    with pytest.raises(ScaleFormatError) as info:
        Groupwise(128).check(x, f32(5, 2))
    assert "The scale passed is a groupwise(128, k_major=True) scale" in str(info.value)
    with pytest.raises(ScaleFormatError, match="K divisible by 128, got K=200"):
        Groupwise(128).check(torch.empty(5, 200), f32(2, 5))


def test_mx_plain_and_swizzled():
    # MXFP4 data packs two elements per byte: [M, K/2] uint8 for K = 256 -> 8 scales per row.
    data = torch.empty(130, 128, dtype=torch.uint8)
    e8m0 = torch.empty(130, 8, dtype=torch.uint8)
    MX(32, "plain").check(data, e8m0)
    padded = formats.swizzled_scale_shape(130, 8)
    assert padded == (256, 8)
    MX(32, "swizzled").check(data, torch.empty(256 * 8, dtype=torch.float8_e8m0fnu))
    MX(32, "swizzled").check(data, torch.empty(256, 8, dtype=torch.int8))
    with pytest.raises(ScaleFormatError) as info:
        MX(32, "swizzled").check(data, e8m0, role="x_scale")
    assert "expected a MXFP4(block 32, swizzled) scale" in str(info.value)
    assert "shape (130, 8) (expected (256, 8))" in str(info.value)
    MX(16, "plain").check(data, torch.empty(130, 16, dtype=torch.uint8))
    MX(32, "plain", element="fp8").check(
        torch.empty(4, 64, dtype=torch.float8_e4m3fn), torch.empty(4, 2, dtype=torch.uint8)
    )
    with pytest.raises(ScaleFormatError, match=r"dtype torch.float32 \(expected torch.uint8 or torch.int8"):
        MX(32, "plain").check(data, e8m0.float())


def test_mx_constructor_rejects_nonsense():
    with pytest.raises(ValueError, match="32 or 16"):
        MX(64)
    with pytest.raises(ValueError, match="element"):
        MX(32, element="fp5")
    with pytest.raises(ValueError, match="layout"):
        MX(32, layout="blocked")  # type: ignore[arg-type]


def test_bad_group_sizes_and_non_tensors_are_scale_format_errors():
    """Not ZeroDivisionError, a negative scale shape, IndexError or AttributeError from inside (0-dim data, None)."""
    for make in (Groupwise, formats.Int4Groupwise):
        for size in (0, -32, 1.5, True):
            with pytest.raises(ScaleFormatError, match=f"positive integer group_size, got {size!r}"):
                make(size)
    with pytest.raises(ScaleFormatError, match=r"blockwise scales need a positive integer block_m, got 1\.5"):
        Blockwise(1.5, 128)  # (was accepted: (3.0, 1) scale shapes)
    assert Groupwise(torch.tensor(32)).group_size == 32 and type(Groupwise(torch.tensor(32)).group_size) is int
    for fmt in (MX(32, "plain"), NVFP4(), formats.Int4Groupwise(128)):
        with pytest.raises(ScaleFormatError, match="got shape"):
            fmt.check(torch.zeros((), dtype=torch.uint8), torch.zeros(1))
    with pytest.raises(ScaleFormatError, match=r"got scale None \(expected a tensor\)"):
        Rowwise().check(f32(4, 8), None)
    with pytest.raises(ScaleFormatError, match="got None"):
        NVFP4.check_global_scale(None)
    with pytest.raises(ScaleFormatError, match="got None"):
        formats.check_fp8_data(None, role="xq", producer="quantize_fp8_row")


def test_nvfp4():
    data = torch.empty(3, 64, dtype=torch.uint8)  # K = 128 -> 8 scales of 16 -> padded to 8
    NVFP4().check(data, torch.empty(128, 8, dtype=torch.float8_e4m3fn))
    with pytest.raises(ScaleFormatError, match="NVFP4"):
        NVFP4().check(data, torch.empty(128, 8, dtype=torch.uint8))
    NVFP4.check_global_scale(torch.tensor([0.5]))
    with pytest.raises(ScaleFormatError, match="one fp32 value"):
        NVFP4.check_global_scale(torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match="NVFP4 is fixed"):
        NVFP4(block_size=32)


def test_platform_mx_layout(monkeypatch):
    monkeypatch.setattr(formats.arch, "is_rocm", lambda: True)
    assert formats.platform_mx_layout() == "plain"
    monkeypatch.setattr(formats.arch, "is_rocm", lambda: False)
    assert formats.platform_mx_layout() == "swizzled"


def test_check_fp8_data(monkeypatch):
    formats.check_fp8_data(torch.empty(2, 2, dtype=torch.float8_e4m3fn), role="XQ", producer="quantize_fp8_row")
    with pytest.raises(ScaleFormatError, match=r"XQ: expected torch.float8_e4m3fn data .* got torch.bfloat16"):
        formats.check_fp8_data(torch.empty(2, 2, dtype=torch.bfloat16), role="XQ", producer="quantize_fp8_row")
    monkeypatch.setattr(formats.arch, "fp8_dtype", lambda device=None: torch.float8_e4m3fnuz)
    with pytest.raises(ScaleFormatError, match=r"expected torch\.float8_e4m3fnuz"):
        formats.check_fp8_data(torch.empty(2, 2, dtype=torch.float8_e4m3fn), role="XQ", producer="quantize_fp8_row")


@given(
    m=st.integers(1, 600), k=st.integers(1, 600), bm=st.sampled_from([1, 32, 128, 256]), bk=st.sampled_from([32, 128])
)
def test_blockwise_shape_covers_every_element(m, k, bm, bk):
    rows, cols = Blockwise(bm, bk).expected_shape((m, k))
    assert (rows - 1) * bm < m <= rows * bm and (cols - 1) * bk < k <= cols * bk


@given(m=st.integers(1, 300), scale_cols=st.integers(1, 40))
def test_swizzled_shape_is_padded_to_tiles(m, scale_cols):
    rows, cols = formats.swizzled_scale_shape(m, scale_cols)
    assert rows % 128 == 0 and cols % 4 == 0 and 0 <= rows - m < 128 and 0 <= cols - scale_cols < 4


def test_identify_names_common_formats():
    x = torch.empty(300, 512)
    assert identify(x, f32(())) == Tensorwise()
    assert identify(x, f32(300)) == Rowwise()
    assert identify(x, f32(3, 4)) == Blockwise(128, 128)
    assert identify(x, f32(4, 300)) == Groupwise(128)
    assert identify(x, f32(7, 7)) is None
