"""precision_plan: measure which low-bit products lose most, and keep those in 16 bits."""

from jaxamp._plan._api import precision_plan
from jaxamp._plan._types import PlanRow, PrecisionPlan

__all__ = ["PlanRow", "PrecisionPlan", "precision_plan"]
