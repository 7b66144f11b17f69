"""Helpers for testing mixed-precision code on CPU (public: ``jaxamp.testing``).

A thin re-export module: each helper lives in the private module of its concept.
"""

from jaxamp._communication_checks import assert_gathers_in, assert_reduces_in
from jaxamp._faults import inject_fault, inject_fault_in_leaf
from jaxamp._report import assert_matmuls_aligned, assert_matmuls_in

__all__ = [
    "assert_gathers_in",
    "assert_matmuls_aligned",
    "assert_matmuls_in",
    "assert_reduces_in",
    "inject_fault",
    "inject_fault_in_leaf",
]
