"""Tests of tools/wgmma_hazards.py on small hand-written SASS loops."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "wgmma_hazards.py"
_spec = importlib.util.spec_from_file_location("wgmma_hazards", SCRIPT)  # tools/ is no package
wgmma_hazards = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wgmma_hazards)


def sass(*body: str) -> str:
    """A kernel: a prologue, then a loop of `body` closed by a backward branch, then an exit."""
    lines = ["        /*0000*/                   MOV R1, c[0x0][0x28] ;", ".L_x_1:"]
    lines += [f"        /*{16 * (i + 1):04x}*/                   {text} ;" for i, text in enumerate(body)]
    lines += [f"        /*{16 * (len(body) + 1):04x}*/               @P0 BRA `(.L_x_1) ;", "        /*0ff0*/  EXIT ;"]
    return "\n".join(lines)


STEP = [
    "LDS.U8 R88, [R9+0x20000]",  # the next step's bytes, into a register the second product reads
    "PRMT R104, R88, 0x7610, R104",
    "WARPGROUP.ARRIVE",
    "HGMMA.64x128x16.F32.BF16 R24, R104, gdesc[UR24], R24, gsb0",
    "WARPGROUP.DEPBAR.LE gsb0, 0x1",
    "HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR24], R24, gsb0",
    "WARPGROUP.DEPBAR.LE gsb0, 0x1",
]


def races(text: str) -> list[str]:
    (loop, *_) = wgmma_hazards.mma_loops(*wgmma_hazards.instructions(text))
    return wgmma_hazards.races(loop)


def test_a_product_running_into_the_next_turn_is_a_race():
    found = races(sass(*STEP))
    assert len(found) == 1 and found[0].startswith("'LDS.U8 R88") and "R24, R88" in found[0]


def test_waiting_for_all_products_at_the_end_is_no_race():
    assert races(sass(*STEP, "WARPGROUP.DEPBAR.LE gsb0, 0x0")) == []


def test_wide_writes_and_products_from_shared_memory():
    # IMAD.WIDE writes R86 and R87: R87 is the first product's; a shared-memory product (gdesc A) reads none.
    body = ["WARPGROUP.ARRIVE", "HGMMA.64x128x16.F32.BF16 R24, R84, gdesc[UR24], R24, gsb0",
            "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], gdesc[UR24], R24, gsb0", "IMAD.WIDE R86, R19, 0x2, R4",
            "STS.128 [R84], R4", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]  # fmt: skip
    found = races(sass(*body))
    assert len(found) == 1 and found[0].startswith("'IMAD.WIDE R86")


def test_a_wait_that_leaves_more_groups_running_than_there_are():
    # three groups running, a wait that lets five run: the first product still reads R88-R91
    body = ["WARPGROUP.ARRIVE", "HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR24], R24, gsb0",
            "HGMMA.64x128x16.F32.BF16 R24, R92, gdesc[UR24], R24, gsb0",
            "HGMMA.64x128x16.F32.BF16 R24, R96, gdesc[UR24], R24, gsb0",
            "WARPGROUP.DEPBAR.LE gsb0, 0x5", "MOV R89, RZ", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]  # fmt: skip
    found = races(sass(*body))
    assert len(found) == 1 and found[0].startswith("'MOV R89")


def test_main_exit_status(tmp_path, capsys):
    racy, safe = tmp_path / "racy.sass", tmp_path / "safe.sass"
    racy.write_text(sass(*STEP))
    safe.write_text(sass(*STEP, "WARPGROUP.DEPBAR.LE gsb0, 0x0"))
    assert wgmma_hazards.main([str(racy)]) == 1
    assert wgmma_hazards.main([str(safe)]) == 0
    assert "no race" in capsys.readouterr().out
    no_loop = tmp_path / "none.sass"
    no_loop.write_text("        /*0000*/  EXIT ;")
    assert wgmma_hazards.main([str(no_loop)]) == 0
    assert wgmma_hazards.main([]) == 2
    assert capsys.readouterr().err.startswith("python tools/wgmma_hazards.py KERNEL.sass")
