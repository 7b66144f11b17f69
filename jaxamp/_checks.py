"""Argument checks shared by the public functions, each with the project's message style.

Every check raises where the user called jaxamp: a ``TypeError`` for the wrong
kind of value, a ``ValueError`` for the right kind with a wrong value, with a
full sentence naming the argument, what it got and what is valid.
docs/errors.md lists the messages verbatim (tests/integration/test_reliability_bad_input.py
keeps it in step), so the wording here is part of the contract.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import numpy as np
import optax

__all__ = [
    "INT32_MAX",
    "check_bool",
    "check_callable",
    "check_int_in_range",
    "check_python_int",
    "check_static",
    "check_transformation",
    "is_int",
]

INT32_MAX = int(np.iinfo(np.int32).max)


def is_int(value: Any) -> bool:
    """Whether ``value`` is a Python or NumPy integer; bools are not integers here.

    >>> from jaxamp._checks import is_int
    >>> is_int(3), is_int(np.int64(3)), is_int(True), is_int(3.0)
    (True, True, False, False)
    """
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _bound(value: int) -> str:
    return "2**31 - 1" if value == INT32_MAX else str(value)


def check_int_in_range(
    value: Any, name: str, expected: str, low: int = 1, high: int = INT32_MAX
) -> int:
    """Returns ``value`` as an ``int`` in ``[low, high]``, or raises naming ``name``.

    Args:
      value: what the user passed.
      name: the argument's name.
      expected: what a valid value is, for the ``TypeError`` (``"an int"``).
      low: the smallest valid value.
      high: the largest valid value (default: int32's maximum, the counters' dtype).

    >>> from jaxamp._checks import check_int_in_range
    >>> check_int_in_range(0, "growth_interval", "an int")
    Traceback (most recent call last):
    ValueError: growth_interval must be in [1, 2**31 - 1]; got 0.
    """
    if not is_int(value):
        raise TypeError(f"{name} must be {expected}; got {type(value).__name__}: {value!r}.")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{_bound(low)}, {_bound(high)}]; got {value}.")
    return int(value)


def check_python_int(value: Any, name: str) -> int:
    """Returns ``value`` as an ``int`` (anything with ``__index__`` but a bool or a tracer)."""
    if isinstance(value, (bool, np.bool_, jax.core.Tracer)):
        raise TypeError(f"{name} must be a Python int; got {type(value).__name__}: {value!r}.")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be a Python int; got {type(value).__name__}: {value!r}."
        ) from None


def check_static(value: Any, name: str, expected: str, *, show_value: bool = False) -> None:
    """Raises a ``TypeError`` when static configuration got a traced value.

    Args:
      value: what the user passed.
      name: the argument's name.
      expected: what it must be instead, e.g. ``"a Python int"``.
      show_value: also print the tracer (its shape and dtype) in the message.
    """
    if isinstance(value, jax.core.Tracer):
        shown = f" ({value})" if show_value else ""
        raise TypeError(
            f"{name} is static configuration and must be {expected}, not a traced "
            f"value{shown}; pass it as a constant, outside jit."
        )


def check_callable(fun: Any, name: str = "fun") -> None:
    """Raises a ``TypeError`` unless ``fun`` is callable.

    >>> from jaxamp._checks import check_callable
    >>> check_callable(3)
    Traceback (most recent call last):
    TypeError: fun must be callable; got int: 3.
    """
    if not callable(fun):
        raise TypeError(f"{name} must be callable; got {type(fun).__name__}: {fun!r}.")


def check_transformation(value: Any, name: str) -> None:
    """Raises a ``TypeError`` unless ``value`` is an optax transformation.

    >>> from jaxamp._checks import check_transformation
    >>> check_transformation(3, "tx")
    Traceback (most recent call last):
    TypeError: tx must be an optax.GradientTransformation such as optax.adam(1e-3); got int: 3.
    """
    if not isinstance(value, optax.GradientTransformation):
        raise TypeError(
            f"{name} must be an optax.GradientTransformation such as optax.adam(1e-3); "
            f"got {type(value).__name__}: {value!r}."
        )


def check_bool(value: Any, name: str) -> bool:
    """Returns ``value`` as a ``bool`` when it is a Python or NumPy bool, else raises.

    >>> from jaxamp._checks import check_bool
    >>> check_bool(np.bool_(True), "flag")
    True
    >>> check_bool(1, "flag")
    Traceback (most recent call last):
    TypeError: flag must be True or False; got int: 1.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False; got {type(value).__name__}: {value!r}.")
    return bool(value)
