"""Find register races of Hopper's warpgroup MMAs in SASS: an HGMMA / QGMMA that takes its A operand from
registers reads them while it runs, until a WARPGROUP.DEPBAR retires it; an instruction writing one of them
before that is a race (wrong outputs, no error).

python tools/wgmma_hazards.py KERNEL.sass     print each race; exit 1 when there is one

KERNEL.sass is `nvdisasm -c` output (docs/offline-compile.md says how to compile a kernel for sm_90a without a
GPU). Each loop holding warpgroup MMAs is read, twice around: a product still running at the loop's end may be
rewritten early in the next turn, which is how Triton's split register-A products raced in the INT4 GEMMs
(RESULTS.md, thirteenth session). A heuristic: a predicated write counts as a write, and register widths come
from the opcode's suffixes.
"""

from __future__ import annotations

import re
import sys
from typing import NamedTuple

_ADDRESS = re.compile(r"^\s*/\*[0-9a-f]+\*/\s*")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")
_DEPBAR = re.compile(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)")
_MMA = re.compile(r"^[HQ]GMMA\.")
_DEST = re.compile(r"^(?:@!?U?P\w+ )?([A-Z][A-Z0-9_.]*) (R\d+)\b")
_A_REGISTERS = 4  # an m64nNk16 bf16 / k32 FP8 A fragment: four registers a thread


class Product(NamedTuple):
    line: int  # index in the loop's instructions
    text: str
    registers: set[int]


def instructions(sass: str) -> tuple[list[str], dict[str, int]]:
    """The instructions (without addresses and the trailing ';') and the index each label stands before."""
    found, labels = [], {}
    for raw in sass.splitlines():
        label = _LABEL.match(raw)
        if label:
            labels[label.group(1)] = len(found)
        elif _ADDRESS.match(raw):
            found.append(_ADDRESS.sub("", raw).strip().rstrip(" ;").strip())
    return found, labels


def mma_loops(found: list[str], labels: dict[str, int]) -> list[list[str]]:
    """The bodies of the backward branches that hold a warpgroup MMA, innermost (shortest) first."""
    loops = []
    for end, text in enumerate(found):
        branch = _BRANCH.search(text)
        start = labels.get(branch.group(1)) if branch else None
        if start is not None and start <= end and any(_MMA.match(t) for t in found[start:end]):
            loops.append((end - start, start, end))
    return [found[start : end + 1] for _, start, end in sorted(loops)]


def _written(text: str) -> set[int]:
    """Registers an instruction writes (its first operand, when that is a register)."""
    dest = _DEST.match(text)
    if not dest or _MMA.match(dest.group(1)) or dest.group(1).startswith(("ST", "RED", "BRA")):
        return set()
    opcode, first = dest.group(1), int(dest.group(2)[1:])
    width = 4 if ".128" in opcode or (opcode.startswith("LDSM") and opcode.endswith(".4")) else 1
    if width == 1 and (".64" in opcode or ".WIDE" in opcode or (opcode.startswith("LDSM") and opcode.endswith(".2"))):
        width = 2
    return set(range(first, first + width))


def races(loop: list[str]) -> list[str]:
    """Each write to the A registers of a product that may still run, over two turns of the loop."""
    groups: list[list[Product]] = []  # committed groups, oldest first
    open_group: list[Product] = []
    found = []
    for turn in range(2):
        for line, text in enumerate(loop):
            if _MMA.match(text):
                operand = text.split(" ", 1)[1].split(",")[1].strip()
                if operand.startswith("R"):
                    first = int(operand[1:])
                    open_group.append(Product(line, text, set(range(first, first + _A_REGISTERS))))
                if "gsb0" in text:
                    groups.append(open_group)
                    open_group = []
                continue
            depbar = _DEPBAR.search(text)
            if depbar:
                keep = int(depbar.group(1), 16)
                groups = groups[max(len(groups) - keep, 0) :] if keep else []
                continue
            if turn == 0:  # the first turn only sets up the products still running at the loop's end
                continue
            written = _written(text)
            for product in (p for group in [*groups, open_group] for p in group):
                if written & product.registers:
                    found.append(
                        f"'{text}' (loop line {line}) rewrites a register of '{product.text}' (line {product.line})"
                    )
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(next(line for line in __doc__.splitlines() if line.startswith("python")), file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        loops = mma_loops(*instructions(f.read()))
    if not loops:
        print("no loop with warpgroup MMAs")
        return 0
    found = [race for loop in loops for race in races(loop)]
    print("\n".join(found) if found else f"no race in {len(loops)} loop(s) with warpgroup MMAs")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
