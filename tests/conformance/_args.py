"""Argument lists for the functions the generic ``_sweep.CANDIDATES`` do not fit.

``SPECIFIC["namespace.name"]`` is a list of ``(args, kwargs)`` tried, in order,
before the generic candidates, in the same form: ``args[0]`` is the float32
value of the activation (the sweep feeds it as ``x @ w``), every later
``np.ndarray`` is a traced argument, anything else (ints, shapes, dimension
numbers, callables) is static and closed over at its position. The lists live
in one module per family of namespaces.

An entry may have a third element, ``call(fun, activation, *rest, **kwargs)``,
for functions whose activation is not their first argument (``select``,
``apply_along_axis``), that take no array (creation functions: the created
array is combined with the activation) or only integers (fed the activation
quantized); ``_args_numpy`` has the common ones.
"""

from __future__ import annotations

from tests.conformance import _args_lax, _args_numpy

SPECIFIC: dict[str, list[tuple]] = {**_args_numpy.SPECIFIC, **_args_lax.SPECIFIC}
