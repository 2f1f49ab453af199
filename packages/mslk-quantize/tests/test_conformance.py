"""Conformance of every op of mslk.quantize: opcheck and reference agreement on its samples (see mslk.core.testing)."""

from mslk.core.testing import domain_conformance

test_domain_loaded, test_op_conformance = domain_conformance("quantize")
