"""Versions of the installed MSLK distributions."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path


def package_version(distribution: str) -> str | None:
    """The installed version of `distribution`, or None when it is not installed.

    In a source checkout run through PYTHONPATH (the GPU machine) no metadata exists; mslk-core's version is
    then read from its pyproject.toml next to the source tree.
    """
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pass
    if distribution == "mslk-core":
        pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
        if pyproject.is_file():
            found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE)
            if found:
                return found.group(1)
    return None


def installed_distributions() -> dict[str, str]:
    """Every installed distribution whose name is `mslk` or starts with `mslk-`, with its version."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name == "mslk" or name.startswith("mslk-"):
            found[name] = dist.version
    return dict(sorted(found.items()))


def compatibility_problems() -> list[str]:
    """Where the installed torch and MSLK distributions break the ranges MSLK packages declare.

    The ranges in each distribution's metadata come from compat.toml (tools/compat.py checks that), so
    this is the verdict against compat.toml for what is actually installed.
    """
    from packaging.requirements import Requirement
    from packaging.version import Version

    installed = installed_distributions()
    problems = []
    for dist in installed:
        for text in importlib.metadata.requires(dist) or []:
            req = Requirement(text)
            name = req.name.lower().replace("_", "-")
            if name != "torch" and not name.startswith("mslk"):
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            have = installed.get(name) if name != "torch" else package_version("torch")
            if have is None:
                problems.append(f"{dist} needs {req}, which is not installed")
            elif not req.specifier.contains(Version(have), prereleases=True):
                problems.append(f"{dist} needs {req}, found {name} {have}")
    return problems


def source_compat_problems() -> list[str] | None:
    """In a source checkout without metadata: torch against compat.toml's [torch] tested range.
    None when there is no compat.toml to read (an installed copy) or no TOML reader (Python 3.10)."""
    compat = Path(__file__).resolve().parents[5] / "compat.toml"
    try:
        import tomllib
    except ImportError:
        return None
    if not compat.is_file():
        return None
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    tested = tomllib.loads(compat.read_text())["torch"]["tested"]
    torch_version = package_version("torch")
    if torch_version is None or not SpecifierSet(tested).contains(Version(torch_version), prereleases=True):
        return [f"torch {torch_version} is outside compat.toml's tested range {tested}"]
    return []
