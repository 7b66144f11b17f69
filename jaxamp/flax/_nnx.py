"""Flax NNX: set a precision policy on a built model, with per-module overrides."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxamp._casting import cast_floating
from jaxamp._policy import Policy
from jaxamp._resolve import resolve
from jaxamp.flax._overrides import check_all_matched, normalize_overrides, policy_for

__all__ = ["set_policy"]


def set_policy(
    model: nnx.Module, policy: Any, overrides: Mapping[Any, Any] | None = None
) -> nnx.Module:
    """Sets every NNX layer's ``dtype`` and ``param_dtype`` from a policy, in place.

    NNX layers (``Linear``, ``Conv``, ``Embed``, ``LayerNorm``, ``BatchNorm``,
    attention...) read ``self.dtype`` (the compute dtype) when called, so a
    built model can be switched to mixed precision. Each module gets
    ``overrides``' policy when one matches, else ``policy``. Its own
    ``nnx.Param`` variables are cast to that policy's ``param_dtype`` (integer
    and other non-float variables are untouched). Building layers with
    ``**policy.module_kwargs()`` does the same at construction time.

    Override keys: a path string names a module at any depth and everything
    inside it (``"head"`` matches ``head`` and ``decoder/head``; write
    ``"decoder/head"`` or ``"decoder.head"`` to pick one; ``"blocks/0"`` for a
    list entry); a class such as ``nnx.LayerNorm`` matches its instances. The
    deepest matching path wins, and paths win over classes. A key that matches
    no module raises ValueError naming the closest paths.

    The model's output follows ``policy.output_dtype``: ``model(x)`` casts its
    floating results to it (``"mixed_float16"``: float32 logits), so the model's
    class is swapped for a same-named subclass (``isinstance`` still holds).
    Only ``__call__`` is cast; other methods return the compute dtype.

    Args:
      model: an ``nnx.Module``; modified in place and returned.
      policy: anything :func:`jaxamp.autocast` accepts, e.g. ``"mixed_bfloat16"``;
        a ``jaxamp.Float8Recipe`` (or ``"mixed_float8"``) sets its 16-bit policy
        (``Float8Recipe.policy``): FP8 matmuls come from ``jaxamp.autocast``.
      overrides: ``{module class or path: policy}``, e.g.
        ``{nnx.LayerNorm: "float32", "head": "float32"}``.

    Returns:
      ``model``.

    Raises:
      ValueError: a policy is invalid, or an override key matches no module.
      TypeError: ``model`` is not an ``nnx.Module``, or a key is neither a class nor a path.

    >>> import jax.numpy as jnp, jaxamp
    >>> from flax import nnx
    >>> rngs = nnx.Rngs(0)
    >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=rngs), nnx.LayerNorm(8, rngs=rngs))
    >>> model = jaxamp.flax.set_policy(model, "mixed_bfloat16", {nnx.LayerNorm: "float32"})
    >>> model.layers[0].dtype, model.layers[1].dtype, model.layers[0].kernel.dtype
    (dtype(bfloat16), dtype('float32'), dtype('float32'))
    >>> model(jnp.ones((2, 4))).dtype
    dtype('float32')
    >>> model = jaxamp.flax.set_policy(model, "float16", {"layers.1": "float32"})
    >>> model.layers[1].dtype, model(jnp.ones((2, 4))).dtype
    (dtype('float32'), dtype('float16'))
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module; got {type(model).__name__}: {model!r}.")
    default, _ = resolve(policy)  # a Float8Recipe: its 16-bit policy
    pairs = normalize_overrides(overrides)
    seen = [(module, tuple(str(p) for p in path)) for path, module in nnx.iter_modules(model)]
    # Checked before anything changes: a typo leaves the model as it was.
    check_all_matched(pairs, seen)
    for module, path in seen:
        if hasattr(module, "dtype"):
            _set_module_policy(module, policy_for(module, path, default, pairs))
    _cast_output(model, default.output_dtype)
    return model


def _set_module_policy(module: nnx.Module, chosen: Policy) -> None:
    """Sets one layer's compute and param dtypes, and casts its own float params."""
    module.dtype = chosen.compute_dtype
    if hasattr(module, "param_dtype"):
        module.param_dtype = chosen.param_dtype
    for value in list(vars(module).values()):
        if isinstance(value, nnx.Param) and jnp.issubdtype(value.dtype, jnp.floating):
            value.set_value(cast_floating(value.get_value(), chosen.param_dtype))


def _cast_output(model: nnx.Module, output_dtype: Any) -> None:
    """Makes ``model(...)`` return its floating outputs in ``output_dtype``.

    ``__call__`` is looked up on the class, so the model's class is swapped for
    a subclass (same name; ``isinstance`` unchanged; cached per class and dtype)
    whose ``__call__`` casts. Setting a policy again replaces the subclass.
    """
    base = getattr(type(model), "_jaxamp_base_class", type(model))
    if not any("__call__" in vars(cls) for cls in base.__mro__[:-1]):
        return  # a model used through its methods only: nothing to cast
    key = (base, np.dtype(output_dtype))
    if key not in _OUTPUT_CLASSES:

        def __call__(self, *args, **kwargs):
            return cast_floating(base.__call__(self, *args, **kwargs), key[1])

        _OUTPUT_CLASSES[key] = type(base)(
            base.__name__,
            (base,),
            {
                "__call__": __call__,
                "__module__": base.__module__,
                "__qualname__": base.__qualname__,
                "__doc__": base.__doc__,
                "_jaxamp_base_class": base,
            },
        )
    model.__class__ = _OUTPUT_CLASSES[key]


# (model class, output dtype) -> its subclass whose __call__ casts the output.
_OUTPUT_CLASSES: dict[tuple[type, np.dtype], type] = {}
