"""An opt-in guard so a run cannot skip steps silently for days.

When every step overflows (a NaN in the data, a diverged model, a forward pass
that overflows at any scale), loss scaling keeps skipping and the scale sits at
its minimum. ``loss_scaling(..., max_consecutive_skips=N)`` stores ``N`` in the
state (``skip_limit``), and:

- inside ``jit``, the step that reaches the limit warns: a host callback behind a
  ``lax.cond`` branch taken only then, so a healthy step transfers nothing;
- outside ``jit``, :func:`check_skips` raises :class:`TooManySkippedSteps`, an
  exception the caller can catch. (Raised from inside the callback it would reach
  the caller as JAX's ``JaxRuntimeError``, which ``except TooManySkippedSteps``
  does not catch.)
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._checks import check_int_in_range
from jaxamp._loss_scaling._scales import DynamicLossScale, NoOpLossScale
from jaxamp._loss_scaling._state import LossScalingState, loss_scaling_state

__all__ = [
    "TooManySkippedSteps",
    "check_max_consecutive_skips",
    "check_skips",
    "skip_limit",
    "warn_at_skip_limit",
]


class TooManySkippedSteps(RuntimeError):
    """Too many steps in a row were skipped (``loss_scaling(..., max_consecutive_skips=N)``).

    Raised by :func:`jaxamp.check_skips` outside ``jit``, so ``except
    jaxamp.TooManySkippedSteps`` catches it.
    """


def check_max_consecutive_skips(value: Any) -> int | None:
    """Validates the ``max_consecutive_skips`` option of ``loss_scaling``."""
    if value is None:
        return None
    return check_int_in_range(value, "max_consecutive_skips", "None or an int >= 1")


def skip_limit(limit: int | None) -> jax.Array | None:
    """The ``skip_limit`` field of a fresh state."""
    return None if limit is None else jnp.asarray(limit, jnp.int32)


def check_skips(opt_state: Any) -> None:
    """Raises :class:`TooManySkippedSteps` once too many steps in a row were skipped.

    Call it outside ``jax.jit`` on the optimizer state after a step (every step,
    or every few: it reads two int32 scalars from the device). The limit is the
    ``max_consecutive_skips`` given to :func:`jaxamp.loss_scaling`.

    Args:
      opt_state: an optimizer state holding a ``loss_scaling`` state (``nnx.Optimizer``'s
        ``opt_state`` too).

    Raises:
      TooManySkippedSteps: the last ``max_consecutive_skips`` (or more) steps were skipped.
      ValueError: the state was built without ``max_consecutive_skips``.
      TypeError: called inside ``jit`` (the counters are traced there).

    >>> import warnings, jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.loss_scaling(optax.sgd(0.1), max_consecutive_skips=2)
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> jaxamp.check_skips(state)  # nothing skipped: returns None
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")  # the step that reaches the limit warns
    ...     for _ in range(2):
    ...         _, state = tx.update({"w": jnp.array([jnp.nan, 0.0])}, state)
    >>> try:
    ...     jaxamp.check_skips(state)
    ... except jaxamp.TooManySkippedSteps as err:
    ...     print(str(err)[:48])
    jaxamp.loss_scaling skipped 2 steps in a row (th
    """
    state = loss_scaling_state(opt_state)
    if state.skip_limit is None:
        raise ValueError(
            "check_skips needs a limit: build the optimizer with "
            "jaxamp.loss_scaling(inner, max_consecutive_skips=N)."
        )
    try:
        consecutive, limit = int(state.consecutive_skips), int(state.skip_limit)
    except jax.errors.ConcretizationTypeError:
        raise TypeError(
            "check_skips reads the skip counter on the host: call it outside jax.jit, on "
            "the optimizer state the jitted step returned."
        ) from None
    if consecutive >= limit:
        raise TooManySkippedSteps(_message(consecutive, limit, state.loss_scale))


def _scale_sentence(loss_scale: Any) -> str:
    """What the loss scale did, in words that fit its kind."""
    if isinstance(loss_scale, NoOpLossScale):
        return "No loss scaling was in use (NoOpLossScale), so the scale did not cause this."
    value = float(np.asarray(loss_scale.loss_scale))
    if isinstance(loss_scale, DynamicLossScale):
        floor = loss_scale.min_loss_scale
        return f"The loss scale has shrunk to {value:g} (min_loss_scale={floor:g})."
    return f"The loss scale is static at {value:g}."


def _message(consecutive: int, limit: int, loss_scale: Any) -> str:
    return (
        f"jaxamp.loss_scaling skipped {consecutive} steps in a row (the limit is "
        f"max_consecutive_skips={limit}): every gradient had an inf or NaN, so the params "
        f"have not changed since. {_scale_sentence(loss_scale)} A scale cannot fix a NaN "
        "that comes from the data or the forward pass: check the inputs, the loss and the "
        "learning rate (jaxamp.numerics_report finds the op), or keep a layer in float32; "
        "raise max_consecutive_skips if long runs of overflow are expected."
    )


def _warn(consecutive: Any, limit: Any, loss_scale: Any) -> None:
    message = _message(int(consecutive), int(limit), loss_scale)
    warnings.warn(
        f"{message} Call jaxamp.check_skips(opt_state) outside jit to raise "
        "jaxamp.TooManySkippedSteps.",
        RuntimeWarning,
        stacklevel=1,
    )


def warn_at_skip_limit(state: LossScalingState, limit: int) -> None:
    """Warns from the host on the step whose skip count reaches ``limit`` (once per run)."""
    jax.lax.cond(
        state.consecutive_skips == limit,
        lambda: jax.debug.callback(_warn, state.consecutive_skips, limit, state.loss_scale),
        lambda: None,
    )
