"""Fault injection for tests: put inf or NaN into a value on chosen steps.

These are ordinary traced JAX functions, so a jitted train step can carry a
fault plan (the step number is a traced int) without recompiling, and the same
step function runs with and without faults.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["inject_fault", "inject_fault_in_leaf"]


def _steps_array(at_steps: Any) -> jax.Array:
    if isinstance(at_steps, jax.Array):  # a fault plan computed inside jit
        if not jnp.issubdtype(at_steps.dtype, jnp.integer):
            raise TypeError(f"at_steps must hold integers; got dtype {at_steps.dtype}.")
        return at_steps.reshape(-1).astype(jnp.int32)
    steps = np.asarray(at_steps if not isinstance(at_steps, int) else [at_steps])
    if steps.ndim != 1 or not (steps.size == 0 or np.issubdtype(steps.dtype, np.integer)):
        raise TypeError(f"at_steps must be an int or a sequence of ints; got {at_steps!r}.")
    return jnp.asarray(steps, jnp.int32)


def inject_fault(
    x: Any,
    step: Any,
    at_steps: int | Sequence[int],
    value: float = float("inf"),
    index: int = 0,
) -> jax.Array:
    """Sets flat element ``index`` of ``x`` to ``value`` when ``step`` is in ``at_steps``.

    ``value`` is converted to ``x``'s dtype, so a finite value beyond that
    dtype's range becomes inf exactly as a real overflow would (70000 in float16).
    As with a real fault, gradients taken through the poisoned element are
    non-finite on the faulty steps (and untouched on the others).

    Args:
      x: a floating array (gradient, loss, activation).
      step: the current step, an int scalar (traced inside jit).
      at_steps: the step(s) on which to inject: an int, a sequence of ints, or an
        integer JAX array (which may be traced).
      value: what to write: ``inf``, ``-inf``, ``nan`` or a large finite number.
      index: which element of the flattened array.

    >>> import jax.numpy as jnp
    >>> from jaxamp.testing import inject_fault
    >>> inject_fault(jnp.ones(3, jnp.float16), step=2, at_steps=[2, 5], value=70000.0)
    Array([inf,  1.,  1.], dtype=float16)
    >>> inject_fault(jnp.ones(3), step=3, at_steps=[2, 5])
    Array([1., 1., 1.], dtype=float32)
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating array to receive a fault; got dtype {x.dtype}.")
    if not 0 <= index < max(x.size, 1) or x.size == 0:
        raise ValueError(f"index must be in [0, {x.size}) for x of shape {x.shape}; got {index}.")
    hit = jnp.isin(jnp.asarray(step, jnp.int32), _steps_array(at_steps))
    flat = x.reshape(-1)
    # float16(70000) is inf: let NumPy round the value into x's dtype, like a real overflow.
    with np.errstate(over="ignore"):
        bad = jnp.asarray(np.asarray(value, np.float64).astype(x.dtype))
    element = flat[index]
    # Like a real fault, the poison reaches the gradients too: d(poisoned)/d(element)
    # is bad * 0 = nan on a hit, and exactly 0 otherwise (no where-gradient NaN trap).
    bad = jnp.where(hit, bad, jnp.zeros_like(bad))
    poisoned = bad * (1 + 0 * element)
    return flat.at[index].set(jnp.where(hit, poisoned, element)).reshape(x.shape)


def inject_fault_in_leaf(
    tree: Any,
    leaf: int,
    step: Any,
    at_steps: int | Sequence[int],
    value: float = float("inf"),
    index: int = 0,
) -> Any:
    """:func:`inject_fault` applied to the ``leaf``-th leaf of ``tree`` (``jax.tree.leaves`` order).

    >>> import jax.numpy as jnp
    >>> from jaxamp.testing import inject_fault_in_leaf
    >>> grads = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    >>> inject_fault_in_leaf(grads, leaf=1, step=0, at_steps=0, value=float("nan"))["b"]
    Array([nan,  0.], dtype=float32)
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not 0 <= leaf < len(leaves):
        raise ValueError(f"leaf must be in [0, {len(leaves)}) for this tree; got {leaf}.")
    leaves[leaf] = inject_fault(leaves[leaf], step, at_steps, value, index)
    return jax.tree.unflatten(treedef, leaves)
