"""Dynamic loss scaling as an optax transformation that skips non-finite steps."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxamp._finite import all_finite
from jaxamp._loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale

__all__ = ["LossScalingState", "get_loss_scale", "loss_scaling", "loss_scaling_metrics"]

_INT32_MAX = jnp.iinfo(jnp.int32).max


class LossScalingState(NamedTuple):
    """State of :func:`loss_scaling`.

    Attributes:
      loss_scale: the current loss scale (a jaxamp loss-scale pytree).
      inner_state: the wrapped transformation's state.
      skipped_steps: steps skipped so far (int32, saturates at 2**31 - 1).
      consecutive_skips: steps skipped in a row up to now (int32, saturating);
        0 after a finite step.
    """

    loss_scale: Any
    inner_state: Any
    skipped_steps: jax.Array
    consecutive_skips: jax.Array


def _saturating_increment(count: jax.Array) -> jax.Array:
    return jnp.where(count < _INT32_MAX, count + 1, count).astype(jnp.int32)


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: Any = None,
    *,
    axis_name: str | tuple[str, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with loss scaling and skipping of non-finite steps.

    ``update`` takes the gradients of the SCALED loss (``loss * loss_scale``):
    it unscales them (in float32 for 16-bit leaves; each leaf keeps its dtype),
    checks once over all leaves that they are finite, adjusts the loss scale kept
    in the state, and applies ``inner`` only on a finite step. On a skipped step
    the updates are exact zeros and ``inner``'s state comes back bit-identical.
    Unlike ``optax.apply_if_finite`` it never gives up and applies NaNs.

    Args:
      inner: the optimizer to protect (clipping inside it sees unscaled grads).
      loss_scale: the initial loss scale; ``None`` means ``DynamicLossScale()``.
      axis_name: for ``shard_map``/``pmap`` code: the mapped axis (or axes) over
        which the finite flag is combined, so every device skips together. Not
        needed under ``jax.jit`` with sharded arrays, where the check is global.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; extra keyword arguments of
      ``update`` reach ``inner``.

    >>> import jax, jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.loss_scaling(optax.sgd(0.1), jaxamp.DynamicLossScale(loss_scale=4.0))
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> scaled_grads = {"w": jnp.array([4.0, jnp.inf])}
    >>> updates, state = tx.update(scaled_grads, state, params)
    >>> updates["w"], float(jaxamp.get_loss_scale(state).loss_scale)
    (Array([0., 0.], dtype=float32), 2.0)
    """
    if loss_scale is None:
        loss_scale = DynamicLossScale()
    if not isinstance(loss_scale, (NoOpLossScale, StaticLossScale, DynamicLossScale)):
        raise TypeError(
            "loss_scale must be a jaxamp.NoOpLossScale, StaticLossScale or "
            f"DynamicLossScale; got {type(loss_scale).__name__}: {loss_scale!r}."
        )
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            "inner must be an optax.GradientTransformation such as optax.adam(1e-3); "
            f"got {type(inner).__name__}: {inner!r}."
        )
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        zero = jnp.zeros((), jnp.int32)
        return LossScalingState(loss_scale, inner.init(params), zero, zero)

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, LossScalingState):
            raise TypeError(
                "state must be the LossScalingState returned by this transformation's "
                f"init; got {type(state).__name__}."
            )
        grads = state.loss_scale.unscale(updates)
        finite = all_finite(grads)
        if axis_name is not None:
            # A skip anywhere is a skip everywhere: min over the devices' flags.
            finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(bool)

        def apply(operands):
            grads, inner_state = operands
            return inner.update(grads, inner_state, params, **extra_args)

        # lax.cond rather than computing both and selecting: the skip branch costs
        # nothing, and XLA's compile time stays flat in the number of leaves.
        out_shape = jax.eval_shape(apply, (grads, state.inner_state))

        def skip(operands):
            _, inner_state = operands
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape[0])
            return zeros, inner_state

        new_updates, inner_state = jax.lax.cond(finite, apply, skip, (grads, state.inner_state))
        skipped = _saturating_increment(state.skipped_steps)
        consecutive = _saturating_increment(state.consecutive_skips)
        new_state = LossScalingState(
            loss_scale=state.loss_scale.adjust(finite),
            inner_state=inner_state,
            skipped_steps=jnp.where(finite, state.skipped_steps, skipped),
            consecutive_skips=jnp.where(finite, jnp.zeros_like(consecutive), consecutive),
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _find_states(opt_state: Any) -> list[LossScalingState]:
    def is_leaf(x):
        return isinstance(x, LossScalingState)

    return [x for x in jax.tree.leaves(opt_state, is_leaf=is_leaf) if is_leaf(x)]


def _find_state(opt_state: Any) -> LossScalingState:
    found = _find_states(opt_state)
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
    def unwrap(x):
        return x.value if hasattr(x, "value") and not isinstance(x, jax.Array) else x

    return jax.tree.map(unwrap, state, is_leaf=lambda x: hasattr(x, "value"))


def get_loss_scale(opt_state: Any) -> Any:
    """The loss scale inside ``opt_state``, however deeply it is nested.

    Works for the state of ``jaxamp.loss_scaling`` itself and for any state that
    contains it (``optax.chain``, ``optax.MultiSteps``, ``inject_hyperparams``,
    tuples and dicts, ``flax.nnx.Optimizer.opt_state``).

    Raises:
      ValueError: ``opt_state`` contains no loss-scaling state, or several.
    """
    return _find_state(opt_state).loss_scale


def loss_scaling_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """Scalars to log: the loss scale and counts of skipped steps.

    Returns a dict with ``loss_scale`` (float32), ``skipped_steps`` and
    ``consecutive_skips`` (int32), and ``last_step_skipped`` (bool).
    """
    state = _find_state(opt_state)
    return {
        "loss_scale": state.loss_scale.loss_scale,
        "skipped_steps": state.skipped_steps,
        "consecutive_skips": state.consecutive_skips,
        "last_step_skipped": state.consecutive_skips > 0,
    }
