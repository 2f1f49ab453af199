"""Discovery of the installed MSLK domain packages.

Each domain wheel declares itself in the `mslk.domains` entry-point group (`gemm = "mslk.gemm"`).
`import mslk` imports every declared domain, so its `torch.ops.mslk.*` ops are registered before the user
reaches for them. A domain that fails to import does not break `import mslk`: the failure is recorded,
warned about, and shown by `mslk env`. A known domain that is not installed gives an error naming the
package to install.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import sys
import traceback
import warnings

ENTRY_POINT_GROUP = "mslk.domains"

# The domains of the MSLK project and the distribution that ships each.
KNOWN_DOMAINS: dict[str, str] = {
    "attention": "mslk-attention",
    "gemm": "mslk-gemm",
    "quantize": "mslk-quantize",
    "moe": "mslk-moe",
    "conv": "mslk-conv",
}

# domain name -> module path, for the domains that imported; domain -> error text for those that failed.
loaded: dict[str, str] = {}
failed: dict[str, str] = {}


class DomainNotInstalledError(ModuleNotFoundError):
    pass


def not_installed_message(domain: str) -> str:
    dist = KNOWN_DOMAINS[domain]
    return (
        f"mslk.{domain} is not installed: it ships in the `{dist}` package. "
        f"Install it with `pip install {dist}` (or `pip install mslk` for every domain)."
    )


def declared() -> dict[str, str]:
    """domain -> module path of every installed domain: those declared by entry points, plus the known
    domains present on `mslk.__path__` without metadata (a source checkout on PYTHONPATH)."""
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    for domain in KNOWN_DOMAINS.keys() - found.keys():
        try:
            present = importlib.util.find_spec(f"mslk.{domain}") is not None
        except DomainNotInstalledError:
            present = False
        if present:
            found[domain] = f"mslk.{domain}"
    return found


def load_installed() -> None:
    for domain, module in declared().items():
        if domain in loaded or domain in failed:
            continue
        try:
            importlib.import_module(module)
        except Exception as exc:  # a broken domain must not take `import mslk` down with it
            failed[domain] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            warnings.warn(f"MSLK domain {domain!r} ({module}) failed to import: {failed[domain]}", stacklevel=3)
        else:
            loaded[domain] = module


class _MissingDomainFinder(importlib.abc.MetaPathFinder):
    """Last on sys.meta_path: reached only when no other finder found `mslk.<domain>`."""

    def find_spec(self, fullname, path, target=None):
        prefix, _, domain = fullname.partition(".")
        if prefix == "mslk" and domain in KNOWN_DOMAINS:
            raise DomainNotInstalledError(not_installed_message(domain), name=fullname)
        return None


def install_missing_domain_hook() -> None:
    if not any(isinstance(finder, _MissingDomainFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MissingDomainFinder())


def module_attribute(name: str):
    """`mslk.<name>` for a submodule not imported yet: import it, or say which package ships it."""
    if name in KNOWN_DOMAINS:
        try:
            return importlib.import_module(f"mslk.{name}")
        except DomainNotInstalledError as exc:
            raise AttributeError(str(exc)) from None
    raise AttributeError(f"module 'mslk' has no attribute {name!r}")
