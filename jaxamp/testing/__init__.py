"""Helpers for testing mixed-precision code on CPU (public: ``jaxamp.testing``).

Every assertion jaxamp offers lives in this package, one module per concept:
``_matmuls.py`` (over :func:`jaxamp.precision_report`), ``_communication.py``
(over :func:`jaxamp.communication_report`) and ``_faults.py`` (inf/NaN injected
into a training step).
"""

from jaxamp.testing._communication import assert_gathers_in, assert_reduces_in
from jaxamp.testing._faults import inject_fault, inject_fault_in_leaf
from jaxamp.testing._matmuls import assert_matmuls_aligned, assert_matmuls_in

__all__ = [
    "assert_gathers_in",
    "assert_matmuls_aligned",
    "assert_matmuls_in",
    "assert_reduces_in",
    "inject_fault",
    "inject_fault_in_leaf",
]
