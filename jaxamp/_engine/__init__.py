"""The jaxpr engine under autocast, precision_report and numerics_report.

How it works and how to extend it: README.md in this folder. ``_compat`` (the
parameters of higher-order primitives per JAX version) is used as a module:
``from jaxamp._engine import _compat as compat``.
"""

from jaxamp._engine._contractions import MATMUL_PRIMITIVES, ConvAxes, DotDims, conv_axes, dot_dims
from jaxamp._engine._interpreter import eval_jaxpr
from jaxamp._engine._trace import flatten_call, is_array, trace
from jaxamp._engine._visit import walk

__all__ = [
    "MATMUL_PRIMITIVES",
    "ConvAxes",
    "DotDims",
    "conv_axes",
    "dot_dims",
    "eval_jaxpr",
    "flatten_call",
    "is_array",
    "trace",
    "walk",
]
