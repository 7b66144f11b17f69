"""16-bit params and optimizer state: stochastic rounding and ``low_precision_optimizer``.

How it works and how to extend it: README.md in this folder.
"""

from jaxamp._low_precision._optimizer import LowPrecisionState, low_precision_optimizer
from jaxamp._low_precision._rounding import stochastic_round

__all__ = ["LowPrecisionState", "low_precision_optimizer", "stochastic_round"]
