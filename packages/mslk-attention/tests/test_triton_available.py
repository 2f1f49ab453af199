"""fmha._triton.available.is_triton_available (spec §4): the platform, GPU and environment rules, with the GPU and
Triton stood in for."""

import re

import pytest

from mslk.attention.fmha._triton import available
from mslk.core import arch


@pytest.fixture
def machine(monkeypatch):
    """A Linux machine with Triton and an SM90 GPU, no switch set; the test changes what it checks."""
    monkeypatch.setattr(available.sys, "platform", "linux")
    monkeypatch.setattr(available.registry, "triton_missing", lambda: None)
    monkeypatch.setattr(arch, "has_gpu", lambda: True)
    monkeypatch.setattr(arch, "capability", lambda device=None: (9, 0))
    monkeypatch.delenv("XFORMERS_FORCE_DISABLE_TRITON", raising=False)
    monkeypatch.delenv("XFORMERS_ENABLE_TRITON", raising=False)
    return monkeypatch


def test_available_on_a_recent_gpu(machine):
    assert available.is_triton_available()
    machine.setattr(arch, "capability", lambda device=None: (8, 0))
    assert available.is_triton_available()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda m: m.setattr(available.sys, "platform", "win32"), "Windows"),
        (lambda m: m.setattr(arch, "has_gpu", lambda: False), "no CUDA or ROCm device"),
        (lambda m: m.setattr(arch, "capability", lambda device=None: (7, 5)), r"capability \(7, 5\) is below"),
        (lambda m: m.setenv("XFORMERS_FORCE_DISABLE_TRITON", "1"), "XFORMERS_FORCE_DISABLE_TRITON"),
    ],
    ids=["windows", "no-gpu", "sm75", "force-disable"],
)
def test_unavailable_and_why_and_the_override(machine, change, reason):
    change(machine)
    assert not available.is_triton_available()
    assert re.search(reason, available.triton_unavailable_reason())
    machine.setenv("XFORMERS_ENABLE_TRITON", "1")
    assert available.is_triton_available()


def test_never_without_triton(machine):
    machine.setattr(available.registry, "triton_missing", lambda: "triton is not available (ImportError: no)")
    machine.setenv("XFORMERS_ENABLE_TRITON", "1")
    assert not available.is_triton_available()
    assert "ImportError" in available.triton_unavailable_reason()


def test_switch_off_values_change_nothing(machine):
    machine.setenv("XFORMERS_FORCE_DISABLE_TRITON", "0")
    assert available.is_triton_available()
