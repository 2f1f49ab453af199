"""Check that the packages and the README agree with compat.toml, the single source of version truth.

python tools/compat.py check [--root DIR]         exit 1 and print every disagreement, one per line
python tools/compat.py table [--root DIR]         print the README compatibility table
python tools/compat.py write-readme [--root DIR]  put that table between the README markers
"""

from __future__ import annotations

import argparse
import sys
from itertools import zip_longest
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parent.parent
CORE = "mslk-core"
META = "mslk"  # the meta-package; every other package except CORE is a domain package
BEGIN = "<!-- compat-table:begin -->"
END = "<!-- compat-table:end -->"
COLUMNS = (
    "MSLK",
    "PyTorch (meta-package pin)",
    "PyTorch (domain packages)",
    "Python",
    "CUDA",
    "CUDA archs",
    "ROCm",
    "ROCm archs",
)


def load_toml(path: Path) -> dict:
    with path.open("rb") as f:
        return tomllib.load(f)


def line_range(line: str) -> str:
    """The specifier that admits release line X.Y and nothing else: '>=X.Y,<X.(Y+1)'."""
    major, minor = line.split(".")
    return f">={line},<{major}.{int(minor) + 1}"


def describe_range(spec: str) -> str:
    """'>=A.B,<A.C' as 'A.B.x' (one minor) or 'A.B - A.(C-1)'; any other specifier verbatim."""
    specifiers = list(SpecifierSet(spec))
    if sorted(s.operator for s in specifiers) != ["<", ">="]:
        return spec
    bounds = {s.operator: Version(s.version) for s in specifiers}
    low, high = bounds[">="], bounds["<"]
    # Only plain 'A.B' bounds (no patch, pre-release or epoch) read as a range of minors.
    plain = all(str(v) == f"{v.major}.{v.minor}" for v in (low, high))
    if not plain or low.major != high.major or high.minor <= low.minor:
        return spec
    last = f"{high.major}.{high.minor - 1}"
    return f"{low}.x" if str(low) == last else f"{low} - {last}"


def render_table(compat: dict) -> str:
    release, torch = compat["release"], compat["torch"]
    row = (
        release["line"],
        describe_range(torch["meta"]),
        describe_range(torch["tested"]),
        release["python_versions"],
        release["cuda"],
        ", ".join(release["cuda_archs"]),
        release["rocm"],
        ", ".join(release["rocm_archs"]),
    )
    return "\n".join("| " + " | ".join(cells) + " |" for cells in (COLUMNS, ["---"] * len(COLUMNS), row))


def disagreement(file: str, field: str, found: str | None, implied: str | None) -> str:
    def show(value: str | None) -> str:
        return "nothing" if value is None else repr(value)

    return f"{file}: {field}: found {show(found)}, compat.toml implies {show(implied)}"


def check_dependencies(file: str, dependencies: list[str], expected: dict[str, str], only: bool) -> list[str]:
    """Every name of `expected` required exactly once, with that specifier; with `only`, nothing else."""
    found: dict[str, list[str]] = {}
    for text in dependencies:
        found.setdefault(canonicalize_name(Requirement(text).name), []).append(text)
    problems = []
    for name, spec in expected.items():
        texts = found.get(name, [])
        wanted = Requirement(f"{name}{spec}")
        # Requirement equality compares specifiers as sets and also rejects stray markers or extras.
        if len(texts) != 1 or Requirement(texts[0]) != wanted:
            field = f"project.dependencies[{name}]"
            problems.append(disagreement(file, field, "; ".join(texts) or None, f"{name}{spec}"))
    if only:
        for name in sorted(found.keys() - expected.keys()):
            field = f"project.dependencies[{name}]"
            problems.extend(disagreement(file, field, text, None) for text in found[name])
    return problems


def expected_dependencies(compat: dict, name: str) -> tuple[dict[str, str], bool]:
    """What package `name` must depend on, and whether that must be all it depends on."""
    tested, internal = compat["torch"]["tested"], line_range(compat["release"]["line"])
    if name == META:
        others = {other: internal for other in compat["packages"] if other != META}
        return {"torch": compat["torch"]["meta"], **others}, True
    if name == CORE:
        return {"torch": tested}, False
    return {CORE: internal, "torch": tested}, False


def check_package(root: Path, compat: dict, name: str) -> list[str]:
    file = f"packages/{name}/pyproject.toml"
    if not (root / file).is_file():
        return [f"{file}: file: found nothing, compat.toml implies it exists ([packages] lists {name})"]
    project = load_toml(root / file).get("project", {})
    problems = [
        disagreement(file, f"project.{key}", project.get(key), want)
        for key, want in (
            ("name", name),
            ("version", compat["packages"][name]),
            ("requires-python", compat["release"]["python"]),
        )
        if project.get(key) != want
    ]
    expected, only = expected_dependencies(compat, name)
    return problems + check_dependencies(file, project.get("dependencies", []), expected, only)


def check_packages(root: Path, compat: dict) -> list[str]:
    problems = []
    line = compat["release"]["line"]
    for name, version in compat["packages"].items():
        if not version.startswith(line + "."):
            implied = f"a version of release line {line} ({line}.*)"
            problems.append(f"compat.toml: packages.{name}: found {version!r}, compat.toml implies {implied}")
        problems.extend(check_package(root, compat, name))
    for path in sorted((root / "packages").iterdir()):
        if path.is_dir() and not path.name.startswith(".") and path.name not in compat["packages"]:
            problems.append(
                f"packages/{path.name}: directory: found a package directory, "
                f"compat.toml implies none ([packages] does not list {path.name})"
            )
    return problems


def find_block(lines: list[str]) -> tuple[int, int] | None:
    """Indices of the begin and end marker lines, when there is exactly one of each, in that order."""
    begins = [i for i, line in enumerate(lines) if line.strip() == BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(begins) == 1 and len(ends) == 1 and begins[0] < ends[0]:
        return begins[0], ends[0]
    return None


def check_readme(root: Path, compat: dict) -> list[str]:
    path = root / "README.md"
    markers = f"one {BEGIN} line, then one {END} line"
    if not path.is_file():
        return [f"README.md: file: found nothing, compat.toml implies a compat table between {markers}"]
    lines = path.read_text().split("\n")
    block = find_block(lines)
    if block is None:
        return [f"README.md: compat-table markers: found none or misplaced, compat.toml implies {markers}"]
    begin, end = block
    found, implied = lines[begin + 1 : end], render_table(compat).split("\n")
    return [
        disagreement("README.md", f"line {begin + 2 + i} (compat table)", have, want)
        + "; run `python tools/compat.py write-readme`"
        for i, (have, want) in enumerate(zip_longest(found, implied))
        if have != want
    ]


def check(root: Path) -> list[str]:
    compat = load_toml(root / "compat.toml")
    return check_packages(root, compat) + check_readme(root, compat)


def write_readme(root: Path) -> None:
    path = root / "README.md"
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    lines = path.read_text().split("\n")
    block = find_block(lines)
    if block is None:
        raise ValueError(f"{path} needs one {BEGIN} line, then one {END} line")
    begin, end = block
    table = render_table(load_toml(root / "compat.toml")).split("\n")
    path.write_text("\n".join([*lines[: begin + 1], *table, *lines[end:]]))


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root (default: this checkout)")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("check", parents=[common], help="report every disagreement with compat.toml")
    commands.add_parser("table", parents=[common], help="print the README compatibility table")
    commands.add_parser("write-readme", parents=[common], help="write the table into README.md")
    args = parser.parse_args(argv)

    if args.command == "table":
        print(render_table(load_toml(args.root / "compat.toml")))
        return 0
    if args.command == "write-readme":
        try:
            write_readme(args.root)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    problems = check(args.root)
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
