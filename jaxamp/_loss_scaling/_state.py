"""The state of :func:`jaxamp.loss_scaling`, and finding it inside any optimizer state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

__all__ = [
    "AccumulationState",
    "LossScalingState",
    "get_loss_scale",
    "loss_scaling_metrics",
    "loss_scaling_state",
    "loss_scaling_states",
]


class AccumulationState(NamedTuple):
    """Gradient accumulation inside :func:`jaxamp.loss_scaling` (``accumulation_steps > 1``).

    Attributes:
      mini_step: micro-batches accumulated so far in this window (int32).
      window_finite: whether every micro-batch of this window was finite (bool).
      grad_sum: the sum of this window's unscaled gradients, float32 for 16-bit
        leaves (each leaf's own dtype otherwise).
    """

    mini_step: jax.Array
    window_finite: jax.Array
    grad_sum: Any


class LossScalingState(NamedTuple):
    """State of :func:`jaxamp.loss_scaling`.

    Attributes:
      loss_scale: the current loss scale (a jaxamp loss-scale pytree).
      inner_state: the wrapped transformation's state.
      skipped_steps: steps skipped so far (int32, saturates at 2**31 - 1); with
        gradient accumulation a step is a whole window.
      consecutive_skips: steps skipped in a row up to now (int32, saturating);
        0 after a finite step.
      accumulation: an :class:`AccumulationState` when ``accumulation_steps > 1``,
        else ``None``.
      skip_limit: ``max_consecutive_skips`` (int32) when ``loss_scaling`` was given
        one, else ``None``; :func:`jaxamp.check_skips` compares it with
        ``consecutive_skips`` outside ``jit``.
    """

    loss_scale: Any
    inner_state: Any
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    accumulation: AccumulationState | None = None
    skip_limit: jax.Array | None = None


def loss_scaling_states(opt_state: Any) -> list[LossScalingState]:
    """Every :class:`LossScalingState` inside ``opt_state``, as stored (possibly empty)."""

    def is_leaf(x):
        return isinstance(x, LossScalingState)

    return [x for x in jax.tree.leaves(opt_state, is_leaf=is_leaf) if is_leaf(x)]


def loss_scaling_state(opt_state: Any) -> LossScalingState:
    """The one :class:`LossScalingState` inside ``opt_state``, with plain arrays.

    Raises:
      ValueError: ``opt_state`` contains no loss-scaling state, or several.
    """
    found = loss_scaling_states(opt_state)
    if not found:
        raise ValueError(
            "no jaxamp loss-scaling state found in opt_state "
            f"({type(opt_state).__name__}); build the optimizer with "
            "jaxamp.loss_scaling(inner) and pass its state (or a state that contains it)."
        )
    if len(found) > 1:
        raise ValueError(f"opt_state holds {len(found)} loss-scaling states; expected exactly one.")
    return _unwrap_variables(found[0])


def _unwrap_variables(state: LossScalingState) -> LossScalingState:
    # flax.nnx.Optimizer wraps each array of its opt_state in a Variable; give
    # users plain arrays back without importing flax.
    # Duck typing on the class, so that no deprecated property is touched.
    def is_variable(x):
        return callable(getattr(type(x), "get_value", None)) and not isinstance(x, jax.Array)

    def unwrap(x):
        return x.get_value() if is_variable(x) else x

    return jax.tree.map(unwrap, state, is_leaf=is_variable)


def get_loss_scale(opt_state: Any) -> Any:
    """The loss scale inside ``opt_state``, however deeply it is nested.

    Works for the state of ``jaxamp.loss_scaling`` itself and for any state that
    contains it (``optax.chain``, ``optax.MultiSteps``, ``inject_hyperparams``,
    tuples and dicts, ``flax.nnx.Optimizer.opt_state``).

    Raises:
      ValueError: ``opt_state`` contains no loss-scaling state, or several.
    """
    return loss_scaling_state(opt_state).loss_scale


def loss_scaling_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """Scalars to log: the loss scale and counts of skipped steps.

    Returns a dict with ``loss_scale`` (float32), ``skipped_steps`` and
    ``consecutive_skips`` (int32), and ``last_step_skipped`` (bool).
    """
    state = loss_scaling_state(opt_state)
    return {
        "loss_scale": state.loss_scale.loss_scale,
        "skipped_steps": state.skipped_steps,
        "consecutive_skips": state.consecutive_skips,
        "last_step_skipped": state.consecutive_skips > 0,
    }
