"""Tests of tools/compat.py on temporary copies of the repository layout."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "compat.py"

# tools/ is no package, so load the script by path.
_spec = importlib.util.spec_from_file_location("compat", SCRIPT)
compat = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compat)

CONFIG = compat.load_toml(REPO / "compat.toml")
LINE = CONFIG["release"]["line"]
INTERNAL = compat.line_range(LINE)  # e.g. ">=1.3,<1.4"
META_TORCH = CONFIG["torch"]["meta"]
TESTED_TORCH = CONFIG["torch"]["tested"]
PYTHON = CONFIG["release"]["python"]
HINT = "; run `python tools/compat.py write-readme`"


def readme(block: str) -> str:
    return f"# MSLK\n\nIntro.\n\n{block}\n\nMore text.\n"


def table_block(table: str) -> str:
    return f"{compat.BEGIN}\n{table}\n{compat.END}"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of compat.toml and every packages/*/pyproject.toml, plus a README with the generated table."""
    shutil.copy(REPO / "compat.toml", tmp_path / "compat.toml")
    for pyproject in (REPO / "packages").glob("*/pyproject.toml"):
        dest = tmp_path / "packages" / pyproject.parent.name
        dest.mkdir(parents=True)
        shutil.copy(pyproject, dest / "pyproject.toml")
    (tmp_path / "README.md").write_text(readme(table_block(compat.render_table(CONFIG))))
    return tmp_path


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def pyproject(root: Path, name: str) -> Path:
    return root / "packages" / name / "pyproject.toml"


def run(capsys, *argv: str) -> tuple[int, list[str], str]:
    rc = compat.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err


def check(capsys, root: Path) -> tuple[int, list[str]]:
    rc, lines, _ = run(capsys, "check", "--root", str(root))
    return rc, lines


def test_real_repo_disagrees_at_most_about_readme():
    problems = compat.check(REPO)
    assert [p for p in problems if not p.startswith("README.md: ")] == []


def test_consistent_tree_passes(capsys, tree):
    assert check(capsys, tree) == (0, [])


def test_specifier_order_does_not_matter(capsys, tree):
    reordered = ",".join(reversed(TESTED_TORCH.split(",")))
    assert reordered != TESTED_TORCH
    edit(pyproject(tree, "mslk-attention"), f'"torch{TESTED_TORCH}"', f'"torch{reordered}"')
    assert check(capsys, tree) == (0, [])


def test_wrong_version(capsys, tree):
    version = CONFIG["packages"]["mslk-gemm"]
    edit(pyproject(tree, "mslk-gemm"), f'version = "{version}"', f'version = "{version}.post1"')
    assert check(capsys, tree) == (
        1,
        [
            f"packages/mslk-gemm/pyproject.toml: project.version: "
            f"found '{version}.post1', compat.toml implies '{version}'"
        ],
    )


@pytest.mark.parametrize(
    ("package", "old", "new", "message"),
    [
        (
            "mslk-core",
            f'requires-python = "{PYTHON}"',
            'requires-python = ">=3.9"',
            f"project.requires-python: found '>=3.9', compat.toml implies '{PYTHON}'",
        ),
        (
            "mslk-moe",
            f'"mslk-core{INTERNAL}"',
            f'"mslk-core>={LINE}"',
            f"project.dependencies[mslk-core]: found 'mslk-core>={LINE}', compat.toml implies 'mslk-core{INTERNAL}'",
        ),
        (
            "mslk-core",
            f'"torch{TESTED_TORCH}"',
            '"torch"',
            f"project.dependencies[torch]: found 'torch', compat.toml implies 'torch{TESTED_TORCH}'",
        ),
        (
            "mslk",
            f'"torch{META_TORCH}"',
            f'"torch{TESTED_TORCH}"',
            f"project.dependencies[torch]: found 'torch{TESTED_TORCH}', compat.toml implies 'torch{META_TORCH}'",
        ),
        (
            "mslk",
            f'    "mslk-conv{INTERNAL}",\n',
            "",
            f"project.dependencies[mslk-conv]: found nothing, compat.toml implies 'mslk-conv{INTERNAL}'",
        ),
    ],
    ids=["requires-python", "core-range-in-domain", "torch-in-core", "torch-pin-in-meta", "meta-missing-domain"],
)
def test_wrong_pin_is_caught(capsys, tree, package, old, new, message):
    edit(pyproject(tree, package), old, new)
    assert check(capsys, tree) == (1, [f"packages/{package}/pyproject.toml: {message}"])


def test_meta_depends_on_something_else(capsys, tree):
    edit(pyproject(tree, "mslk"), "dependencies = [\n", 'dependencies = [\n    "numpy>=1.24",\n')
    assert check(capsys, tree) == (
        1,
        ["packages/mslk/pyproject.toml: project.dependencies[numpy]: found 'numpy>=1.24', compat.toml implies nothing"],
    )


def test_extra_package_dir(capsys, tree):
    (tree / "packages" / "mslk-extra").mkdir()
    assert check(capsys, tree) == (
        1,
        [
            "packages/mslk-extra: directory: found a package directory, "
            "compat.toml implies none ([packages] does not list mslk-extra)"
        ],
    )


def test_missing_package_dir(capsys, tree):
    shutil.rmtree(tree / "packages" / "mslk-conv")
    assert check(capsys, tree) == (
        1,
        [
            "packages/mslk-conv/pyproject.toml: file: found nothing, "
            "compat.toml implies it exists ([packages] lists mslk-conv)"
        ],
    )


def test_version_outside_release_line(capsys, tree):
    version = CONFIG["packages"]["mslk-quantize"]
    major, minor = LINE.split(".")
    outside = f"{major}.{int(minor) + 1}.0"
    # Move both compat.toml and the pyproject, so that only the release-line rule can object.
    edit(tree / "compat.toml", f'mslk-quantize = "{version}"', f'mslk-quantize = "{outside}"')
    edit(pyproject(tree, "mslk-quantize"), f'version = "{version}"', f'version = "{outside}"')
    assert check(capsys, tree) == (
        1,
        [
            f"compat.toml: packages.mslk-quantize: found '{outside}', "
            f"compat.toml implies a version of release line {LINE} ({LINE}.*)"
        ],
    )


def test_readme_table_disagrees(capsys, tree):
    row = compat.render_table(CONFIG).split("\n")[2]
    torch_cell = f"| {compat.describe_range(META_TORCH)} |"
    edited = row.replace(torch_cell, "| 2.0.x |")
    assert edited != row
    edit(tree / "README.md", row, edited)
    # The row is README line 8: four lines of text, the begin marker, the header, the separator.
    assert check(capsys, tree) == (
        1,
        [f"README.md: line 8 (compat table): found {edited!r}, compat.toml implies {row!r}{HINT}"],
    )


def test_readme_markers_missing(capsys, tree):
    (tree / "README.md").write_text(readme(compat.render_table(CONFIG)))
    rc, lines = check(capsys, tree)
    assert rc == 1
    assert lines == [
        f"README.md: compat-table markers: found none or misplaced, "
        f"compat.toml implies one {compat.BEGIN} line, then one {compat.END} line"
    ]


def test_readme_missing(capsys, tree):
    (tree / "README.md").unlink()
    rc, lines = check(capsys, tree)
    assert rc == 1
    assert len(lines) == 1
    assert lines[0].startswith("README.md: file: found nothing, compat.toml implies a compat table")


def test_every_disagreement_is_reported(capsys, tree):
    edit(pyproject(tree, "mslk-gemm"), f'requires-python = "{PYTHON}"', 'requires-python = ">=3.9"')
    (tree / "packages" / "mslk-extra").mkdir()
    (tree / "README.md").unlink()
    rc, lines = check(capsys, tree)
    assert rc == 1
    assert [line.split(":")[0] for line in lines] == [
        "packages/mslk-gemm/pyproject.toml",
        "packages/mslk-extra",
        "README.md",
    ]


CURRENT_COMPAT = """\
[release]
line = "1.3"
python = ">=3.10"
python_versions = "3.10 - 3.14"
cuda = "13.0, 13.2"
cuda_archs = ["8.0", "9.0a", "10.0a", "12.0a"]
rocm = "7.1, 7.2"
rocm_archs = ["gfx942", "gfx950"]

[torch]
meta = ">=2.13,<2.14"
tested = ">=2.11,<2.14"

[packages]
mslk-core = "1.3.0"
"""


def test_table(capsys, tmp_path):
    (tmp_path / "compat.toml").write_text(CURRENT_COMPAT)
    rc, lines, _ = run(capsys, "table", "--root", str(tmp_path))
    assert rc == 0
    assert lines == [
        "| MSLK | PyTorch (meta-package pin) | PyTorch (domain packages) | Python | CUDA | CUDA archs "
        "| ROCm | ROCm archs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        "| 1.3 | 2.13.x | 2.11 - 2.13 | 3.10 - 3.14 | 13.0, 13.2 | 8.0, 9.0a, 10.0a, 12.0a | 7.1, 7.2 "
        "| gfx942, gfx950 |",
    ]


def test_table_of_this_repo_runs_as_a_script():
    result = subprocess.run([sys.executable, str(SCRIPT), "table"], capture_output=True, text=True, check=True)
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    assert lines[2].startswith(f"| {LINE} | ")


@pytest.mark.parametrize(
    ("spec", "described"),
    [
        (">=2.13,<2.14", "2.13.x"),
        (">=2.11,<2.14", "2.11 - 2.13"),
        ("<2.14,>=2.11", "2.11 - 2.13"),
        (">=2.11", ">=2.11"),
        (">=2.11,<3.0", ">=2.11,<3.0"),
        (">=2.11.1,<2.14", ">=2.11.1,<2.14"),
        (">=2.14,<2.14", ">=2.14,<2.14"),
        ("==2.13.*", "==2.13.*"),
        (">=2.11,!=2.12,<2.14", ">=2.11,!=2.12,<2.14"),
    ],
)
def test_describe_range(spec, described):
    assert compat.describe_range(spec) == described


def test_write_readme_round_trip(capsys, tree):
    (tree / "README.md").write_text(readme(table_block("| stale | table |")))
    assert check(capsys, tree)[0] == 1
    rc, _, _ = run(capsys, "write-readme", "--root", str(tree))
    assert rc == 0
    assert check(capsys, tree) == (0, [])
    assert (tree / "README.md").read_text() == readme(table_block(compat.render_table(CONFIG)))


def test_write_readme_needs_markers(capsys, tree):
    text = readme("no table here")
    (tree / "README.md").write_text(text)
    rc, _, err = run(capsys, "write-readme", "--root", str(tree))
    assert rc == 1
    assert compat.BEGIN in err
    assert (tree / "README.md").read_text() == text
