"""The same training step written the way each library's users write it.

Every variant is built by ``VARIANTS[name](loss_fn, tx)`` and returns a :class:`Variant`:
``init(params) -> state`` and ``step(state, batch) -> (state, loss)``, with ``state`` a
pytree holding params, optimizer state and whatever loss-scale state the library keeps.
Every call builds NEW function objects, so a fresh jit never reuses an older trace.

- ``plain_optax``: no loss scaling; the reference every ratio is taken against.
- ``jmp``: ``jmp.DynamicLossScale`` with ``jmp.all_finite`` and ``jmp.select_tree`` over
  params and optimizer state (the pattern of jmp's README).
- ``flax_dynamic_scale``: ``flax.training.dynamic_scale.DynamicScale.value_and_grad``,
  then ``jnp.where(is_fin, new, old)`` leaf by leaf (the pattern of Flax's examples).
- ``optax_apply_if_finite``: ``optax.apply_if_finite`` (a ``lax.cond``) with a static loss
  scale, since optax has no dynamic loss scale of its own.
- ``jaxamp``: ``jaxamp.loss_scaling(tx, jaxamp.DynamicLossScale())``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jmp
import optax
from flax.training.dynamic_scale import DynamicScale

import jaxamp

INITIAL_SCALE = 2.0**15

LossFn = Callable[[Any, Any], jax.Array]


class Variant(NamedTuple):
    init: Callable[[Any], Any]
    step: Callable[[Any, Any], tuple[Any, jax.Array]]


def plain_optax(loss_fn: LossFn, tx: optax.GradientTransformation) -> Variant:
    def init(params):
        return params, tx.init(params)

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return Variant(init, step)


def jmp_pattern(loss_fn: LossFn, tx: optax.GradientTransformation) -> Variant:
    def init(params):
        # jmp's loss scale is carried as its two arrays: jmp.DynamicLossScale's
        # __post_init__ rejects the placeholders jax.jit(...).lower() unflattens it with.
        loss_scale = jmp.DynamicLossScale(jnp.float32(INITIAL_SCALE))
        return params, tx.init(params), (loss_scale.loss_scale, loss_scale.counter)

    def step(state, batch):
        params, opt_state, (scale, counter) = state
        loss_scale = jmp.DynamicLossScale(scale, counter)

        def scaled_loss(p):
            return loss_scale.scale(loss_fn(p, batch))

        loss, grads = jax.value_and_grad(scaled_loss)(params)
        loss = loss_scale.unscale(loss)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return (params, opt_state, (loss_scale.loss_scale, loss_scale.counter)), loss

    return Variant(init, step)


def flax_dynamic_scale(loss_fn: LossFn, tx: optax.GradientTransformation) -> Variant:
    def init(params):
        return params, tx.init(params), DynamicScale(scale=jnp.float32(INITIAL_SCALE))

    def step(state, batch):
        params, opt_state, dynamic_scale = state
        grad_fn = dynamic_scale.value_and_grad(loss_fn)
        dynamic_scale, is_fin, loss, grads = grad_fn(params, batch)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = functools.partial(jnp.where, is_fin)
        params = jax.tree.map(keep, new_params, params)
        opt_state = jax.tree.map(keep, new_opt_state, opt_state)
        return (params, opt_state, dynamic_scale), loss

    return Variant(init, step)


def optax_apply_if_finite(loss_fn: LossFn, tx: optax.GradientTransformation) -> Variant:
    guarded = optax.apply_if_finite(tx, max_consecutive_errors=5)
    scale = jnp.float32(INITIAL_SCALE)

    def init(params):
        return params, guarded.init(params)

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(lambda p: loss_fn(p, batch) * scale)(params)
        grads = jax.tree.map(lambda g: g / scale, grads)
        updates, opt_state = guarded.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss / scale

    return Variant(init, step)


def jaxamp_loss_scaling(loss_fn: LossFn, tx: optax.GradientTransformation) -> Variant:
    scaled_tx = jaxamp.loss_scaling(tx, jaxamp.DynamicLossScale(loss_scale=INITIAL_SCALE))

    def init(params):
        return params, scaled_tx.init(params)

    def step(state, batch):
        params, opt_state = state
        loss_scale = jaxamp.get_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: loss_scale.scale(loss_fn(p, batch)))(params)
        updates, opt_state = scaled_tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state), loss_scale.unscale(loss)

    return Variant(init, step)


VARIANTS: dict[str, Callable[[LossFn, optax.GradientTransformation], Variant]] = {
    "plain_optax": plain_optax,
    "jmp": jmp_pattern,
    "flax_dynamic_scale": flax_dynamic_scale,
    "optax_apply_if_finite": optax_apply_if_finite,
    "jaxamp": jaxamp_loss_scaling,
}
REFERENCE = "plain_optax"
