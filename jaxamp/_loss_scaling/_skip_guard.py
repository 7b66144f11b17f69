"""An opt-in guard so a run cannot skip steps silently for days.

When every step overflows (a NaN in the data, a diverged model, a forward pass
that overflows at any scale), loss scaling keeps skipping and the scale sits at
its minimum. ``loss_scaling(..., max_consecutive_skips=N)`` turns that into an
error: a host callback, reached only through a ``lax.cond`` branch that is taken
when the limit is hit, so a healthy step transfers nothing to the host.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxamp._checks import check_int_in_range

__all__ = ["TooManySkippedSteps", "check_max_consecutive_skips", "guard_consecutive_skips"]


class TooManySkippedSteps(RuntimeError):
    """Raised (through JAX's runtime, at the next sync) when too many steps in a row were skipped.

    Inside ``jax.jit`` JAX re-raises it as a ``jax.errors.JaxRuntimeError`` (also a
    ``RuntimeError``) whose message contains this error's message.
    """


def check_max_consecutive_skips(value: Any) -> int | None:
    """Validates the ``max_consecutive_skips`` option of ``loss_scaling``."""
    if value is None:
        return None
    return check_int_in_range(value, "max_consecutive_skips", "None or an int >= 1")


def _raise(consecutive: Any, loss_scale: Any, limit: int) -> None:
    raise TooManySkippedSteps(
        f"jaxamp.loss_scaling skipped {int(consecutive)} steps in a row (the limit is "
        f"max_consecutive_skips={limit}): every gradient had an inf or NaN, so the params "
        f"have not changed since. The loss scale is now {float(loss_scale):g}. A scale "
        "cannot fix a NaN that comes from the data or the forward pass: check the inputs, "
        "the loss and the learning rate, or keep a layer in float32; raise "
        "max_consecutive_skips if long runs of overflow are expected."
    )


def guard_consecutive_skips(consecutive: jax.Array, loss_scale: jax.Array, limit: int) -> None:
    """Raises :class:`TooManySkippedSteps` from the host once ``consecutive`` reaches ``limit``."""
    jax.lax.cond(
        consecutive >= limit,
        lambda: jax.debug.callback(_raise, consecutive, loss_scale, limit),
        lambda: None,
    )
