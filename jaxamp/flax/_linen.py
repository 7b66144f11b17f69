"""Flax Linen: a loss-scaled TrainState and a policy context with per-module overrides."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import optax
from flax import linen as nn
from flax.training import train_state

from jaxamp._casting import cast_floating
from jaxamp._checks import check_transformation
from jaxamp._loss_scaling import (
    get_loss_scale,
    loss_scaling,
    loss_scaling_state,
    loss_scaling_states,
    scaled_value_and_grad,
    select,
)
from jaxamp._resolve import resolve
from jaxamp.flax._overrides import check_all_matched, normalize_overrides, policy_for

__all__ = ["LossScaledTrainState", "linen_policy"]


class LossScaledTrainState(train_state.TrainState):
    """A Linen ``TrainState`` whose optimizer scales the loss and skips non-finite steps.

    ``create`` wraps ``tx`` in :func:`jaxamp.loss_scaling` (unless it already
    holds one). ``apply_gradients`` takes the grads of the SCALED loss (from
    :meth:`value_and_grad`); on a skipped step ``params``, ``step`` and the inner
    optimizer state stay bit-identical, so ``step`` counts applied updates, like
    optax's own step counters.

    >>> import jax, jax.numpy as jnp, optax, jaxamp
    >>> from flax import linen as nn
    >>> model = nn.Dense(2)
    >>> params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    >>> state = jaxamp.flax.LossScaledTrainState.create(
    ...     apply_fn=model.apply, params=params, tx=optax.sgd(0.1),
    ...     loss_scale=jaxamp.DynamicLossScale(loss_scale=2.0**10))
    >>> def loss_fn(params):
    ...     return (model.apply({"params": params}, jnp.ones((1, 3))) ** 2).mean()
    >>> loss, grads = state.value_and_grad(loss_fn)(state.params)
    >>> state = state.apply_gradients(grads=grads)
    >>> int(state.step), float(state.loss_scale.loss_scale)
    (1, 1024.0)
    """

    @classmethod
    def create(cls, *, apply_fn, params, tx, loss_scale: Any = None, **kwargs):
        """Like ``TrainState.create``; ``loss_scale`` defaults to ``DynamicLossScale()``."""
        check_transformation(tx, "tx")
        if loss_scaling_states(jax.eval_shape(tx.init, params)):
            if loss_scale is not None:
                raise ValueError(
                    "tx already contains jaxamp.loss_scaling; pass loss_scale to "
                    "loss_scaling, not to create (got both)."
                )
        else:
            tx = loss_scaling(tx, loss_scale)
        return super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)

    @property
    def loss_scale(self) -> Any:
        """The current loss scale (multiply the loss by it before differentiating)."""
        return get_loss_scale(self.opt_state)

    def value_and_grad(self, loss_fn, *, has_aux: bool = False, argnums=0):
        """``jax.value_and_grad`` of ``loss_fn`` times the current scale.

        Returns a function giving ``(loss, grads)`` (``((loss, aux), grads)`` with
        ``has_aux``): the true (unscaled) loss and the grads of the scaled loss,
        ready for :meth:`apply_gradients`.
        """
        return scaled_value_and_grad(loss_fn, self.loss_scale, has_aux=has_aux, argnums=argnums)

    def apply_gradients(self, *, grads, **kwargs):
        """Unscales ``grads``, and applies them only when they are all finite."""
        updates, new_opt_state = self.tx.update(grads, self.opt_state, self.params)
        new_params = optax.apply_updates(self.params, updates)
        new = loss_scaling_state(new_opt_state)
        # Applied: the step was finite and, when accumulating, it closed a window.
        applied = new.consecutive_skips == 0
        if new.accumulation is not None:
            applied = applied & (new.accumulation.mini_step == 0)
        return self.replace(
            step=select(applied, self.step + 1, self.step),
            params=new_params,
            opt_state=new_opt_state,
            **kwargs,
        )


@contextlib.contextmanager
def linen_policy(policy: Any, overrides: Mapping[Any, Any] | None = None) -> Iterator[None]:
    """Runs every Linen module under a policy, with per-class or per-path overrides.

    Inside the context, each module with a ``dtype`` field runs with its
    policy's compute dtype, its floating inputs cast to it, and (for modules
    with ``param_dtype``) creates its params in the policy's ``param_dtype``.
    Its policy is the matching override's or, for modules whose ``dtype`` was
    left at ``None``, ``policy``. Modules built with an explicit ``dtype`` keep
    it unless an override names them: a model that passes ``dtype=jnp.float32``
    to every layer (as Flax's lm1b and imagenet examples do) is unchanged; use
    :func:`jaxamp.autocast` on its apply function instead, which needs no
    change to the model. The root module's output (what ``model.apply``
    returns) is cast to ``policy.output_dtype``. Built on
    ``flax.linen.intercept_methods``: wrap both ``init`` and ``apply`` (inside
    or outside ``jax.jit``).

    Override keys match as in :func:`jaxamp.flax.set_policy`: a path string
    (``"head"``, ``"decoder/head"`` or ``"decoder.head"``) names a module at any
    depth of its scope path, and everything inside it; a class such as
    ``nn.LayerNorm`` its instances. When the context closes, a key that matched
    none of the modules that ran raises ValueError naming the closest paths
    (not checked when no module ran: a jitted call traced earlier runs none).

    Args:
      policy: anything :func:`jaxamp.autocast` accepts; a ``jaxamp.Float8Recipe``
        (or ``"mixed_float8"``) sets its 16-bit policy (``Float8Recipe.policy``):
        FP8 matmuls come from ``jaxamp.autocast``.
      overrides: ``{module class or path: policy}``, e.g. ``{nn.LayerNorm: "float32"}``.

    >>> import jax, jax.numpy as jnp, jaxamp
    >>> from flax import linen as nn
    >>> model = nn.Sequential([nn.Dense(8), nn.LayerNorm()])
    >>> x = jnp.ones((2, 4))
    >>> with jaxamp.flax.linen_policy("mixed_bfloat16", {nn.LayerNorm: "float32"}):
    ...     variables = model.init(jax.random.key(0), x)
    ...     y = model.apply(variables, x)
    >>> y.dtype, variables["params"]["layers_0"]["kernel"].dtype
    (dtype('float32'), dtype('float32'))
    """
    default, _ = resolve(policy)  # a Float8Recipe: its 16-bit policy
    pairs = normalize_overrides(overrides)
    seen: dict[tuple[type, tuple[str, ...]], tuple[Any, tuple[str, ...]]] = {}
    root_calls = [0]

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name == "setup":
            return next_fun(*args, **kwargs)
        path = tuple(module.scope.path) if module.scope is not None else ()
        seen.setdefault((type(module), path), (module, path))
        if path:
            return _call_module(module, path, default, pairs, next_fun, args, kwargs)
        root_calls[0] += 1
        try:
            out = _call_module(module, path, default, pairs, next_fun, args, kwargs)
        finally:
            root_calls[0] -= 1
        # The outermost root call is what apply returns; a root method calling
        # another root method keeps the inner value as it is.
        return cast_floating(out, default.output_dtype) if root_calls[0] == 0 else out

    with nn.intercept_methods(interceptor):
        yield
    # Nothing seen: every call hit a jit cache (traced in an earlier context), nothing to check.
    if seen:
        check_all_matched(pairs, seen.values())


def _call_module(module, path, default, pairs, next_fun, args, kwargs):
    """Calls one module method under its policy (modules without ``dtype`` run as they are)."""
    if not hasattr(module, "dtype"):
        return next_fun(*args, **kwargs)
    chosen = policy_for(module, path, None, pairs)
    if chosen is None:
        if module.dtype is not None:
            return next_fun(*args, **kwargs)
        chosen = default
    return _call_with_policy(module, chosen, next_fun, args, kwargs)


def _call_with_policy(module, chosen, next_fun, args, kwargs):
    """Calls one module method with its ``dtype`` (and ``param_dtype``) set to ``chosen``'s."""
    fields = {"dtype": chosen.compute_dtype}
    if hasattr(module, "param_dtype"):
        fields["param_dtype"] = chosen.param_dtype
    saved = {name: getattr(module, name) for name in fields}
    # Linen modules are frozen dataclasses; the fields are set for this call
    # only and restored after it, so the module object is unchanged outside.
    for name, value in fields.items():
        object.__setattr__(module, name, value)
    try:
        # Inputs too: "LayerNorm in float32" means its statistics see float32.
        args, kwargs = cast_floating((args, kwargs), chosen.compute_dtype)
        return next_fun(*args, **kwargs)
    finally:
        for name, value in saved.items():
            object.__setattr__(module, name, value)
