"""Dynamic loss scaling as an optax transformation that skips non-finite steps."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxamp._casting import is_floating, widen
from jaxamp._checks import check_transformation, is_int
from jaxamp._loss_scaling._finite import all_finite, check_float_grads, select, select_tree
from jaxamp._loss_scaling._reduction import reduce_grads
from jaxamp._loss_scaling._scales import DynamicLossScale, LossScale
from jaxamp._loss_scaling._skip_guard import (
    check_max_consecutive_skips,
    skip_limit,
    warn_at_skip_limit,
)
from jaxamp._loss_scaling._state import AccumulationState, LossScalingState

__all__ = ["loss_scaling", "raw_grads_checkable"]

_GRAD_REDUCTIONS = (None, "mean", "sum")


@dataclasses.dataclass(frozen=True)
class _Config:
    """What :func:`loss_scaling` closes over: the validated options."""

    inner: optax.GradientTransformationExtraArgs
    axis_name: str | tuple[str, ...] | None
    grad_reduction: str | None
    accumulation_steps: int
    max_consecutive_skips: int | None
    # inner takes float32 grads for 16-bit params (low_precision_optimizer):
    # unscaling back into float16 would flush what the scale protected.
    float32_grads: bool = False


def _check_loss_scale(loss_scale: Any) -> Any:
    if loss_scale is None:
        return DynamicLossScale()
    if not isinstance(loss_scale, LossScale):
        raise TypeError(
            "loss_scale must be a jaxamp.NoOpLossScale, StaticLossScale or "
            f"DynamicLossScale; got {type(loss_scale).__name__}: {loss_scale!r}."
        )
    return loss_scale


def _check_axis_name(axis_name: Any) -> None:
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if axis_name is not None and not all(isinstance(n, str) and n for n in names):
        raise TypeError(
            "axis_name must be None, a mapped axis name (str) or a tuple of them; "
            f"got {type(axis_name).__name__}: {axis_name!r}."
        )


def _make_config(
    inner: Any,
    axis_name: Any,
    grad_reduction: Any,
    accumulation_steps: Any,
    max_consecutive_skips: Any,
) -> _Config:
    _check_inner(inner)
    _check_axis_name(axis_name)
    if grad_reduction not in _GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction must be None, 'mean' or 'sum'; got {grad_reduction!r}.")
    if grad_reduction is not None and axis_name is None:
        raise ValueError(
            f"grad_reduction={grad_reduction!r} needs axis_name (the shard_map/pmap "
            "axis to reduce the gradients over); got axis_name=None."
        )
    if not is_int(accumulation_steps) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be an int >= 1; got {accumulation_steps!r}.")
    return _Config(
        inner=optax.with_extra_args_support(inner),
        axis_name=axis_name,
        grad_reduction=grad_reduction,
        accumulation_steps=int(accumulation_steps),
        max_consecutive_skips=check_max_consecutive_skips(max_consecutive_skips),
        float32_grads=getattr(inner, "takes_float32_grads", False) is True,
    )


def _check_inner(inner: Any) -> None:
    check_transformation(
        inner,
        "inner",
        multi_steps=(
            "Use loss_scaling(tx, accumulation_steps=k) to accumulate gradients (the loss "
            "scale then stays constant over the window), or pass the MultiSteps' "
            ".gradient_transformation()."
        ),
    )


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
    it unscales them (in float32 for 16-bit leaves; each leaf keeps its dtype,
    except that :func:`jaxamp.low_precision_optimizer` as ``inner`` gets the
    grads of 16-bit params in float32, so that small float16 gradients are not
    flushed to zero on the way),
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
        default) there and ``lax.pmean`` the loss instead; a gradient that does
        not vary over ``axis_name`` there raises a ``ValueError`` (reducing it
        again would scale the update by the device count).
      accumulation_steps: micro-batches per optimizer step (default 1).
      max_consecutive_skips: opt-in guard against skipping silently forever:
        once this many steps in a row were skipped, the step warns (a
        ``RuntimeWarning``, from a host callback that only that step makes) and
        :func:`jaxamp.check_skips` called on the state outside ``jit`` raises
        :class:`jaxamp.TooManySkippedSteps`. ``None`` (default): no guard.

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
    loss_scale = _check_loss_scale(loss_scale)
    config = _make_config(
        inner, axis_name, grad_reduction, accumulation_steps, max_consecutive_skips
    )

    def init_fn(params):
        accumulation = None
        if config.accumulation_steps > 1:
            accumulation = _init_accumulation(params)
        # Copies, so that donating the state never deletes the user's scale.
        scale = jax.tree.map(lambda x: jnp.array(x, copy=True), loss_scale)
        inner, limit = config.inner.init(params), skip_limit(config.max_consecutive_skips)
        return LossScalingState(scale, inner, _zero_count(), _zero_count(), accumulation, limit)

    def update_fn(updates, state, params=None, **extra_args):
        _check_state(state)
        check_float_grads(updates, "updates (the gradients)")
        single = config.accumulation_steps == 1
        keep_dtype = single and not config.float32_grads
        grads = _unscale(updates, state.loss_scale, config, keep_dtype=keep_dtype)
        finite = _finite_flag(updates, grads, state.loss_scale, config)
        if single:
            new_updates, new_state = _step(config, grads, finite, state, params, extra_args)
        else:
            new_updates, new_state = _accumulate(
                config, grads, updates, finite, state, params, extra_args
            )
        if config.max_consecutive_skips is not None:
            warn_at_skip_limit(new_state, config.max_consecutive_skips)
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _zero_count() -> jax.Array:
    # A fresh array per field: one array shared by two fields makes
    # jax.jit(..., donate_argnums=...) fail with "donate the same buffer twice".
    return jnp.zeros((), jnp.int32)


def _init_accumulation(params: Any) -> AccumulationState:
    if params is None:
        raise ValueError(
            "init(params) needs the params (not None) when accumulation_steps > 1: "
            "the gradient accumulator takes their shapes."
        )
    grad_sum = jax.tree.map(
        lambda p: jnp.zeros(jnp.shape(p), widen(p).dtype) if is_floating(p) else None,
        params,
    )
    return AccumulationState(_zero_count(), jnp.asarray(True), grad_sum)


def _check_state(state: Any) -> None:
    if not isinstance(state, LossScalingState):
        raise TypeError(
            "state must be the LossScalingState returned by this transformation's "
            f"init; got {type(state).__name__}."
        )


def _unscale(updates: Any, loss_scale: Any, config: _Config, *, keep_dtype: bool) -> Any:
    """The unscaled grads, all-reduced first when ``config.grad_reduction`` asks.

    ``keep_dtype=False`` keeps 16-bit grads in float32 after unscaling, so that the
    accumulator does not lose the small values the scale protected.
    """
    if config.grad_reduction is None:
        return loss_scale.unscale(updates if keep_dtype else jax.tree.map(widen, updates))
    return reduce_grads(
        updates, loss_scale, config.axis_name, config.grad_reduction, keep_dtype=keep_dtype
    )


def raw_grads_checkable(loss_scale: Any, grad_reduction: str | None) -> bool:
    """Whether the unscaled grads are finite exactly where the raw (scaled) ones are.

    The scale decides (``loss_scale.unscale_keeps_finiteness()``, see
    ``raw_grads_finite`` in ``_scales.py``), unless the grads are reduced: a
    reduced gradient is a different array from the raw one.
    """
    return grad_reduction is None and loss_scale.unscale_keeps_finiteness()


def _finite_flag(raw: Any, grads: Any, loss_scale: Any, config: _Config) -> jax.Array:
    """One bool for the step: every grad finite (on every device with ``axis_name``)."""
    if raw_grads_checkable(loss_scale, config.grad_reduction):
        finite = loss_scale.raw_grads_finite(raw)
    else:
        finite = all_finite(grads)
    if config.axis_name is not None:
        # A skip anywhere is a skip everywhere: min over the devices' flags.
        finite = jax.lax.pmin(finite.astype(jnp.int32), config.axis_name).astype(bool)
    return finite


def _masked_update(
    inner: Any, grads: Any, apply: jax.Array, inner_state: Any, params: Any, extra_args: Any
) -> tuple[Any, Any]:
    """``inner``'s update where ``apply`` holds, else zeros and the old state, by select.

    For steps that usually apply (skips are rare overflows): computing the update
    and selecting leaf by leaf compiles faster than ``lax.cond`` with many leaves,
    needs less temporary memory, and a GPU conditional reads its predicate back to
    the host every step where a select does not (BENCHMARKS.md, "Why the numbers
    are what they are").
    """
    new_updates, new_inner_state = inner.update(grads, inner_state, params, **extra_args)
    zeros = jax.tree.map(jnp.zeros_like, new_updates)
    return (
        select_tree(apply, new_updates, zeros),
        select_tree(apply, new_inner_state, inner_state),
    )


def _gated_update(
    inner: Any, grads: Any, apply: jax.Array, inner_state: Any, params: Any, extra_args: Any
) -> tuple[Any, Any]:
    """``inner``'s update where ``apply`` holds, else zeros and the old state, by ``lax.cond``.

    For steps that usually do not apply (an accumulation window applies once in
    ``k`` micro-steps): the conditional skips the update's work on the others.
    """

    def run(operands):
        grads, inner_state = operands
        return inner.update(grads, inner_state, params, **extra_args)

    out_shape = jax.eval_shape(run, (grads, inner_state))

    def skip(operands):
        _, inner_state = operands
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape[0])
        return zeros, inner_state

    return jax.lax.cond(apply, run, skip, (grads, inner_state))


def _step(
    config: _Config,
    grads: Any,
    finite: jax.Array,
    state: LossScalingState,
    params: Any,
    extra_args: Any,
) -> tuple[Any, LossScalingState]:
    """One optimizer step without accumulation: apply if finite, then move the state."""
    new_updates, inner_state = _masked_update(
        config.inner, grads, finite, state.inner_state, params, extra_args
    )
    return new_updates, _next_state(state, finite, inner_state)


def _accumulate(
    config: _Config,
    grads: Any,
    raw: Any,
    finite: jax.Array,
    state: LossScalingState,
    params: Any,
    extra_args: Any,
) -> tuple[Any, LossScalingState]:
    """One micro-step of an accumulation window; the window's last one applies its mean."""
    acc = state.accumulation
    if acc is None:
        raise TypeError(
            "state has no AccumulationState: it was not made by the init of a "
            "loss_scaling transformation with accumulation_steps > 1."
        )
    grad_sum = _add_finite(acc.grad_sum, grads, finite)
    window_finite = acc.window_finite & finite
    end = acc.mini_step == config.accumulation_steps - 1
    mean = _window_mean(grad_sum, grads, raw, config)
    new_updates, inner_state = _gated_update(
        config.inner, mean, end & window_finite, state.inner_state, params, extra_args
    )
    stepped = _next_state(state, window_finite, inner_state)
    # Inside a window only the accumulator moves; at its end, the scale and
    # the skip counters move once for the whole window.
    held = LossScalingState(
        loss_scale=select_tree(end, stepped.loss_scale, state.loss_scale),
        inner_state=inner_state,
        skipped_steps=select(end, stepped.skipped_steps, state.skipped_steps),
        consecutive_skips=select(end, stepped.consecutive_skips, state.consecutive_skips),
        skip_limit=state.skip_limit,
    )
    accumulation = AccumulationState(
        mini_step=select(end, jnp.zeros_like(acc.mini_step), acc.mini_step + 1),
        window_finite=end | window_finite,
        grad_sum=_map_sum(lambda s: select(end, jnp.zeros_like(s), s), grad_sum),
    )
    return new_updates, held._replace(accumulation=accumulation)


def _map_sum(fn: Any, grad_sum: Any, *rest: Any) -> Any:
    """``fn`` over the accumulator's leaves; its ``None`` leaves (non-floating) stay."""
    return jax.tree.map(
        lambda s, *r: None if s is None else fn(s, *r), grad_sum, *rest, is_leaf=_is_none
    )


def _is_none(x: Any) -> bool:
    return x is None


def _add_finite(grad_sum: Any, grads: Any, finite: jax.Array) -> Any:
    # A non-finite micro-batch is left out of the sum so that nothing
    # non-finite outlives its window; the window is skipped anyway.
    return _map_sum(lambda s, g: select(finite, s + widen(g), s), grad_sum, grads)


def _window_mean(grad_sum: Any, grads: Any, raw: Any, config: _Config) -> Any:
    """The window's mean gradient in each raw grad's own dtype (non-floating grads pass).

    In float32 for an ``inner`` that takes float32 grads (``config.float32_grads``).
    """
    steps = config.accumulation_steps

    def mean(s, g, u):
        if s is None:
            return g
        return s / steps if config.float32_grads else (s / steps).astype(u.dtype)

    return jax.tree.map(
        mean,
        grad_sum,
        grads,
        raw,
        is_leaf=_is_none,
    )


def _next_state(state: LossScalingState, finite: jax.Array, inner_state: Any) -> LossScalingState:
    """The state after a step: scale adjusted, skip counters moved (saturating at int32 max)."""
    skipped = optax.safe_increment(state.skipped_steps)
    consecutive = optax.safe_increment(state.consecutive_skips)
    return LossScalingState(
        loss_scale=state.loss_scale.adjust(finite),
        inner_state=inner_state,
        skipped_steps=select(finite, state.skipped_steps, skipped),
        consecutive_skips=select(finite, jnp.zeros_like(consecutive), consecutive),
        accumulation=state.accumulation,
        skip_limit=state.skip_limit,
    )
