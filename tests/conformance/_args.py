"""Argument lists for the functions the generic ``_sweep.CANDIDATES`` do not fit.

``SPECIFIC["namespace.name"]`` is a list of ``(args, kwargs)`` tried, in order,
before the generic candidates, in the same form: ``args[0]`` is the float32
value of the activation (the sweep feeds it as ``x @ w``), every later
``np.ndarray`` is a traced argument, anything else (ints, shapes, dimension
numbers, callables) is static and closed over at its position. An entry
``(args, kwargs, call)`` calls the function as ``call(fun, *args, **kwargs)``
(``_sweep.Case.call``): for a function whose activation is not its first
argument (a predicate, a loop body, a named axis, an integer view). The lists
live in one module per family of namespaces.
"""

from __future__ import annotations

from tests.conformance import _args_lax, _args_numpy

SPECIFIC: dict[str, list[tuple[tuple, dict]]] = {**_args_numpy.SPECIFIC, **_args_lax.SPECIFIC}
