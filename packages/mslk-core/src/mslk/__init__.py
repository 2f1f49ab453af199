"""MSLK: fused GPU kernels for transformer workloads.

`import mslk` makes the `torch.ops.mslk.*` ops of every installed domain package available: each domain
(mslk-attention, mslk-gemm, mslk-quantize, mslk-moe, mslk-conv) declares itself in the `mslk.domains`
entry-point group and is imported here. A domain that is not installed gives an error naming the package
to install.
"""

# Domain wheels install their `mslk/<domain>/` folders anywhere on sys.path; this joins them to one package.
__path__ = __import__("pkgutil").extend_path(__path__, __name__)

from mslk.core import domains as _domains
from mslk.core import env as _env
from mslk.core.version import package_version as _package_version

open_source: bool = True
__version__: str = _package_version("mslk") or _package_version("mslk-core") or "0+unknown"
# The reference library's build variant: ours is one build whatever the platform, Triton kernels plus native
# libraries that load where their vendor libraries do (mslk-gemm's cuBLAS GEMMs; `mslk env` says which loaded).
__variant__: str = "triton"
__target__: str = "default"
# True where no native library loads (MSLK_PYTHON_ONLY=1), as the reference library's python_only builds.
_python_only: bool = _env.PYTHON_ONLY.enabled()

_domains.load_installed()
_domains.install_missing_domain_hook()


def __getattr__(name: str):
    return _domains.module_attribute(name)
