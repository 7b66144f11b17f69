"""Flax NNX: set a precision policy on a built model, with per-module overrides."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxamp._casting import cast_floating
from jaxamp._resolve import resolve
from jaxamp.flax._overrides import normalize_overrides, policy_for

__all__ = ["set_policy"]


def set_policy(
    model: nnx.Module, policy: Any, overrides: Mapping[Any, Any] | None = None
) -> nnx.Module:
    """Sets every NNX layer's ``dtype`` and ``param_dtype`` from a policy, in place.

    NNX layers (``Linear``, ``Conv``, ``Embed``, ``LayerNorm``, ``BatchNorm``,
    attention...) read ``self.dtype`` (the compute dtype) when called, so a
    built model can be switched to mixed precision. Each module gets
    ``overrides``' policy when one matches (a path string like ``"head"``, then
    a class like ``nnx.LayerNorm``), else ``policy``. Its own ``nnx.Param``
    variables are cast to that policy's ``param_dtype`` (integer and other
    non-float variables are untouched). Building layers with
    ``**policy.module_kwargs()`` does the same at construction time.

    Args:
      model: an ``nnx.Module``; modified in place and returned.
      policy: anything :func:`jaxamp.autocast` accepts, e.g. ``"mixed_bfloat16"``;
        a ``jaxamp.Float8Recipe`` (or ``"mixed_float8"``) sets its 16-bit policy
        (``Float8Recipe.policy``): FP8 matmuls come from ``jaxamp.autocast``.
      overrides: ``{module class or path: policy}``, e.g.
        ``{nnx.LayerNorm: "float32", "head": "float32"}``.

    Returns:
      ``model``.

    >>> import jax.numpy as jnp, jaxamp
    >>> from flax import nnx
    >>> rngs = nnx.Rngs(0)
    >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=rngs), nnx.LayerNorm(8, rngs=rngs))
    >>> model = jaxamp.flax.set_policy(model, "mixed_bfloat16", {nnx.LayerNorm: "float32"})
    >>> model.layers[0].dtype, model.layers[1].dtype, model.layers[0].kernel.dtype
    (dtype(bfloat16), dtype('float32'), dtype('float32'))
    >>> model(jnp.ones((2, 4))).dtype
    dtype('float32')
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module; got {type(model).__name__}: {model!r}.")
    default, _ = resolve(policy)  # a Float8Recipe: its 16-bit policy
    pairs = normalize_overrides(overrides)
    for path, module in nnx.iter_modules(model):
        if not hasattr(module, "dtype"):
            continue
        chosen = policy_for(module, "/".join(str(p) for p in path), default, pairs)
        module.dtype = chosen.compute_dtype
        if hasattr(module, "param_dtype"):
            module.param_dtype = chosen.param_dtype
        for value in list(vars(module).values()):
            if isinstance(value, nnx.Param) and jnp.issubdtype(value.dtype, jnp.floating):
                value.set_value(cast_floating(value.get_value(), chosen.param_dtype))
    return model
