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
