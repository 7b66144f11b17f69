"""Dynamic loss scaling as an optax transformation that skips non-finite steps."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._casting import is_floating
from jaxamp._finite import all_finite, select, select_tree
from jaxamp._loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jaxamp._skip_guard import check_max_consecutive_skips, guard_consecutive_skips

__all__ = [
    "AccumulationState",
    "LossScalingState",
    "get_loss_scale",
    "loss_scaling",
    "loss_scaling_metrics",
]

_INT32_MAX = jnp.iinfo(jnp.int32).max
_GRAD_REDUCTIONS = (None, "mean", "sum")


class AccumulationState(NamedTuple):
    """Gradient accumulation inside :func:`loss_scaling` (``accumulation_steps > 1``).

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
    """State of :func:`loss_scaling`.

    Attributes:
      loss_scale: the current loss scale (a jaxamp loss-scale pytree).
      inner_state: the wrapped transformation's state.
      skipped_steps: steps skipped so far (int32, saturates at 2**31 - 1); with
        gradient accumulation a step is a whole window.
      consecutive_skips: steps skipped in a row up to now (int32, saturating);
        0 after a finite step.
      accumulation: an :class:`AccumulationState` when ``accumulation_steps > 1``,
        else ``None``.
    """

    loss_scale: Any
    inner_state: Any
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    accumulation: AccumulationState | None = None


def _saturating_increment(count: jax.Array) -> jax.Array:
    return select(count < _INT32_MAX, count + 1, count)


def _wide(x: Any) -> Any:
    """``x`` in float32 when it is a 16-bit float, else unchanged."""
    if is_floating(x) and jnp.dtype(x.dtype).itemsize < 4:
        return x.astype(jnp.float32)
    return x


def _check_axis_name(axis_name: Any) -> None:
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if axis_name is not None and not all(isinstance(n, str) and n for n in names):
        raise TypeError(
            "axis_name must be None, a mapped axis name (str) or a tuple of them; "
            f"got {type(axis_name).__name__}: {axis_name!r}."
        )


def _check_options(axis_name: Any, grad_reduction: Any, accumulation_steps: Any) -> None:
    _check_axis_name(axis_name)
    if grad_reduction not in _GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction must be None, 'mean' or 'sum'; got {grad_reduction!r}.")
    if grad_reduction is not None and axis_name is None:
        raise ValueError(
            f"grad_reduction={grad_reduction!r} needs axis_name (the shard_map/pmap "
            "axis to reduce the gradients over); got axis_name=None."
        )
    if (
        isinstance(accumulation_steps, (bool, np.bool_))
        or not isinstance(accumulation_steps, (int, np.integer))
        or accumulation_steps < 1
    ):
        raise ValueError(f"accumulation_steps must be an int >= 1; got {accumulation_steps!r}.")


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: Any = None,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    grad_reduction: str | None = None,
    accumulation_steps: int = 1,
    max_consecutive_skips: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with loss scaling and skipping of non-finite steps.

    ``update`` takes the gradients of the SCALED loss (``loss * loss_scale``):
    it unscales them (in float32 for 16-bit leaves; each leaf keeps its dtype),
    checks once over all leaves that they are finite, adjusts the loss scale kept
    in the state, and applies ``inner`` only on a finite step. On a skipped step
    the updates are exact zeros and ``inner``'s state comes back bit-identical.
    Unlike ``optax.apply_if_finite`` it never gives up and applies NaNs.

    Gradient accumulation: use ``accumulation_steps=k`` rather than wrapping in
    ``optax.MultiSteps``. The scale then stays constant for the ``k``
    micro-batches of a window (sum the micro-batches' unscaled grads in float32),
    and at the end of the window ``inner`` gets their mean, the finite check and
    the scale adjustment happen once, and one non-finite micro-batch skips the
    whole window. (``optax.MultiSteps`` around ``loss_scaling`` would see one
    window's inf left in its accumulator as NaN in every later window.)

    Args:
      inner: the optimizer to protect (clipping inside it sees unscaled grads).
      loss_scale: the initial loss scale; ``None`` means ``DynamicLossScale()``.
      axis_name: for ``shard_map``/``pmap`` code: the mapped axis (or axes) over
        which the finite flag is combined, so every device skips together. Not
        needed under ``jax.jit`` with sharded arrays, where the check is global.
      grad_reduction: ``"mean"`` or ``"sum"`` also all-reduces the gradients over
        ``axis_name`` (in float32 for 16-bit leaves, before unscaling, so that
        scaled float16 grads cannot overflow in the all-reduce), for code where
        each device holds its own grads: ``pmap``, ``shard_map(check_vma=False)``.
        Under ``shard_map``'s default ``check_vma=True`` JAX already sums the
        grads of replicated params in the backward pass: keep ``None`` (the
        default) there and ``lax.pmean`` the loss instead.
      accumulation_steps: micro-batches per optimizer step (default 1).
      max_consecutive_skips: opt-in guard: once this many steps in a row were
        skipped, raise :class:`jaxamp.TooManySkippedSteps` from a host callback
        (inside jit JAX reports it as a ``JaxRuntimeError`` at the next sync)
        instead of skipping silently forever. ``None`` (default) never raises.

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
    _check_options(axis_name, grad_reduction, accumulation_steps)
    max_consecutive_skips = check_max_consecutive_skips(max_consecutive_skips)
    accumulation_steps = int(accumulation_steps)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        # A fresh array per field: one array shared by two fields makes
        # jax.jit(..., donate_argnums=...) fail with "donate the same buffer twice".
        def zero():
            return jnp.zeros((), jnp.int32)

        accumulation = None
        if accumulation_steps > 1:
            if params is None:
                raise ValueError(
                    "init(params) needs the params (not None) when accumulation_steps > 1: "
                    "the gradient accumulator takes their shapes."
                )
            grad_sum = jax.tree.map(
                lambda p: jnp.zeros(jnp.shape(p), _wide(p).dtype) if is_floating(p) else None,
                params,
            )
            accumulation = AccumulationState(zero(), jnp.asarray(True), grad_sum)
        # Copies too, so that donating the state never deletes the user's scale.
        scale = jax.tree.map(lambda x: jnp.array(x, copy=True), loss_scale)
        return LossScalingState(scale, inner.init(params), zero(), zero(), accumulation)

    def reduce_and_unscale(updates, scale, keep_dtype):
        # keep_dtype=False keeps 16-bit grads in float32 after unscaling, so that
        # the accumulator does not lose the small values the scale protected.
        if grad_reduction is None:
            return scale.unscale(updates if keep_dtype else jax.tree.map(_wide, updates))
        reduce = jax.lax.pmean if grad_reduction == "mean" else jax.lax.psum

        def one(g):
            if not is_floating(g):
                return g
            unscaled = scale.unscale(reduce(_wide(g), axis_name))
            return unscaled.astype(g.dtype) if keep_dtype else unscaled

        return jax.tree.map(one, updates)

    def apply_or_skip(grads, apply_flag, inner_state, params, extra_args, usually_applies=False):
        def apply(operands):
            grads, inner_state = operands
            return inner.update(grads, inner_state, params, **extra_args)

        if usually_applies:
            # Skips are rare overflows: compute the update and select leaf by leaf.
            # Measured (benchmarks/, BENCHMARKS.md): compiles faster than lax.cond at
            # 1000 leaves, with less temp memory, and a GPU conditional reads its
            # predicate back to the host every step where a select does not.
            new_updates, new_inner_state = apply((grads, inner_state))
            zeros = jax.tree.map(jnp.zeros_like, new_updates)
            return (
                select_tree(apply_flag, new_updates, zeros),
                select_tree(apply_flag, new_inner_state, inner_state),
            )
        # Accumulation windows apply once per window: lax.cond skips the update's
        # work on the other micro-steps.
        out_shape = jax.eval_shape(apply, (grads, inner_state))

        def skip(operands):
            _, inner_state = operands
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape[0])
            return zeros, inner_state

        return jax.lax.cond(apply_flag, apply, skip, (grads, inner_state))

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, LossScalingState):
            raise TypeError(
                "state must be the LossScalingState returned by this transformation's "
                f"init; got {type(state).__name__}."
            )
        grads = reduce_and_unscale(updates, state.loss_scale, accumulation_steps == 1)
        finite = None if grad_reduction is not None else _raw_finite(state.loss_scale, updates)
        if finite is None:
            finite = all_finite(grads)
        if axis_name is not None:
            # A skip anywhere is a skip everywhere: min over the devices' flags.
            finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(bool)
        if accumulation_steps > 1:
            new_updates, new_state = accumulate(grads, updates, finite, state, params, extra_args)
        else:
            new_updates, inner_state = apply_or_skip(
                grads, finite, state.inner_state, params, extra_args, usually_applies=True
            )
            new_state = _next_state(state, finite, inner_state)
        if max_consecutive_skips is not None:
            guard_consecutive_skips(
                new_state.consecutive_skips, new_state.loss_scale.loss_scale, max_consecutive_skips
            )
        return new_updates, new_state

    def accumulate(grads, updates, finite, state, params, extra_args):
        acc = state.accumulation
        if acc is None:
            raise TypeError(
                "state has no AccumulationState: it was not made by the init of a "
                "loss_scaling transformation with accumulation_steps > 1."
            )
        # A non-finite micro-batch is left out of the sum so that nothing
        # non-finite outlives its window; the window is skipped anyway.
        grad_sum = jax.tree.map(
            lambda s, g: None if s is None else select(finite, s + _wide(g), s),
            acc.grad_sum,
            grads,
            is_leaf=lambda x: x is None,
        )
        window_finite = acc.window_finite & finite
        end = acc.mini_step == accumulation_steps - 1
        # inner gets the window's mean in each grad's own dtype.
        mean = jax.tree.map(
            lambda s, g, u: g if s is None else (s / accumulation_steps).astype(u.dtype),
            grad_sum,
            grads,
            updates,
            is_leaf=lambda x: x is None,
        )
        new_updates, inner_state = apply_or_skip(
            mean, end & window_finite, state.inner_state, params, extra_args
        )
        stepped = _next_state(state, window_finite, inner_state)
        # Inside a window only the accumulator moves; at its end, the scale and
        # the skip counters move once for the whole window.
        held = LossScalingState(
            loss_scale=select_tree(end, stepped.loss_scale, state.loss_scale),
            inner_state=inner_state,
            skipped_steps=select(end, stepped.skipped_steps, state.skipped_steps),
            consecutive_skips=select(end, stepped.consecutive_skips, state.consecutive_skips),
        )
        grad_sum = jax.tree.map(
            lambda s: None if s is None else select(end, jnp.zeros_like(s), s),
            grad_sum,
            is_leaf=lambda x: x is None,
        )
        accumulation = AccumulationState(
            mini_step=select(end, jnp.zeros_like(acc.mini_step), acc.mini_step + 1),
            window_finite=end | window_finite,
            grad_sum=grad_sum,
        )
        return new_updates, held._replace(accumulation=accumulation)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _raw_finite(loss_scale: Any, raw_grads: Any) -> jax.Array | None:
    """``all_finite`` of the unscaled grads, read from the raw ones; None where it can't be.

    Checking the raw grads lets the unscaling multiply fuse into the optimizer's
    kernels instead of being kept as one buffer per leaf for the check (fewer
    kernels to compile and run; BENCHMARKS.md). Unscaling multiplies by
    ``r = 1 / scale``. With ``scale >= 1``, ``0 <= r <= 1``: a finite ``g`` stays
    finite (``|g * r| <= |g|``, also after rounding back to a 16-bit dtype) and inf
    or NaN stays non-finite (``inf * r`` is inf, or NaN if ``r`` flushed to 0).
    A static scale's value is array state and may be below 1: not here.
    """
    if isinstance(loss_scale, NoOpLossScale):
        return all_finite(raw_grads)
    if isinstance(loss_scale, DynamicLossScale) and loss_scale.min_loss_scale >= 1.0:
        # The scale stays in [min_loss_scale, max] by construction, unless it was
        # built from an out-of-range array; then skip, and adjust() clamps it back
        # up to min_loss_scale.
        return all_finite(raw_grads) & (loss_scale.loss_scale >= 1.0)
    return None


def _next_state(state: LossScalingState, finite: jax.Array, inner_state: Any) -> LossScalingState:
    skipped = _saturating_increment(state.skipped_steps)
    consecutive = _saturating_increment(state.consecutive_skips)
    return LossScalingState(
        loss_scale=state.loss_scale.adjust(finite),
        inner_state=inner_state,
        skipped_steps=select(finite, state.skipped_steps, skipped),
        consecutive_skips=select(finite, jnp.zeros_like(consecutive), consecutive),
        accumulation=state.accumulation,
    )


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
