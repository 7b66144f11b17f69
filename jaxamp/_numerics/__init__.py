"""``jaxamp.numerics_report``: the range of every floating op, the origin of inf/NaN, a loss scale.

See README.md in this folder for how it works and how to extend it.
"""

from jaxamp._numerics._api import numerics_report
from jaxamp._numerics._monitor import NumericsMonitor, numerics_monitor
from jaxamp._numerics._numerics_report import SAFETY_FACTOR, NumericsReport, OpStats

__all__ = [
    "SAFETY_FACTOR",
    "NumericsMonitor",
    "NumericsReport",
    "OpStats",
    "numerics_monitor",
    "numerics_report",
]
