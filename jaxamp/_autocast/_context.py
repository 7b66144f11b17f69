"""``jaxamp.AutocastContext``: what a custom autocast rule is given to work with."""

from __future__ import annotations

from typing import Any

import jax.extend.core as jex
import numpy as np

from jaxamp._autocast._values import cast
from jaxamp._casting import canonical_float_dtype, is_floating
from jaxamp._engine import _compat as compat
from jaxamp._policy import Policy

__all__ = ["AutocastContext"]


class AutocastContext:
    """What a custom rule of :func:`jaxamp.autocast` receives as its first argument.

    A custom rule is a callable ``rule(context, eqn, *args) -> list of outputs``,
    passed as ``jaxamp.autocast(fun, policy, rules={primitive: rule})``. ``eqn``
    is the traced equation (a ``jax.extend.core.JaxprEqn``: ``eqn.primitive``,
    ``eqn.params``, and the traced avals in ``eqn.invars``/``eqn.outvars``);
    ``args`` are its operands as autocast has them, which may already be in
    another dtype than traced (an activation in the compute dtype). The rule
    returns one value per output of ``eqn``. An output in its traced dtype is
    treated like the operands (an activation stays one); an output in another
    dtype was moved there on purpose (the compute dtype makes it an activation,
    any other dtype pins it).

    Attributes:
      policy: the :class:`jaxamp.Policy` of the ``autocast`` call.
      compute_dtype: ``policy.compute_dtype`` as a ``numpy.dtype``.

    >>> import jax.numpy as jnp, jaxamp
    >>> seen = []
    >>> def tanh_in_float32(context, eqn, x):
    ...     seen.append(x.dtype)  # an activation: already in the compute dtype
    ...     y = context.bind(eqn, context.cast(x, jnp.float32))[0]
    ...     return [context.cast(y, context.compute_dtype)]
    >>> f = jaxamp.autocast(lambda w, x: jnp.tanh(x @ w), rules={"tanh": tanh_in_float32})
    >>> f(jnp.ones((4, 3)), jnp.ones((2, 4))).dtype, seen
    (dtype('float32'), [dtype(bfloat16)])
    """

    __slots__ = ("compute_dtype", "policy")

    def __init__(self, policy: Policy):
        self.policy = policy
        self.compute_dtype = np.dtype(policy.compute_dtype)

    @staticmethod
    def bind(eqn: jex.JaxprEqn, *args: Any) -> list[Any]:
        """Runs ``eqn`` as written on ``args``; returns the list of its outputs.

        The operands may have other floating dtypes than traced, when the
        primitive accepts them (most elementwise ones do, when all operands
        share one dtype).
        """
        return compat.bind_eqn(eqn, args)

    @staticmethod
    def cast(x: Any, dtype: Any) -> Any:
        """``x`` in the floating ``dtype`` if it is a floating array, else ``x`` unchanged.

        Integer, bool and complex values are never cast (as everywhere in
        autocast); NumPy values stay NumPy values (constants stay constants).
        """
        dtype = canonical_float_dtype(dtype, "dtype")
        return cast(x, dtype) if is_floating(x) else x

    def __repr__(self) -> str:
        return f"AutocastContext(policy={self.policy!r})"
