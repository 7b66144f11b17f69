"""autocast: torch.autocast for JAX, by re-running a function's jaxpr with dtype rules.

How it works and how to extend it: README.md in this folder.
"""

from jaxamp._autocast._api import autocast
from jaxamp._autocast._caster import UnknownPrimitiveWarning
from jaxamp._autocast._context import AutocastContext
from jaxamp._autocast._rules import AUTOCAST_RULES

__all__ = ["AUTOCAST_RULES", "AutocastContext", "UnknownPrimitiveWarning", "autocast"]
