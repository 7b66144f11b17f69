"""``grad_reduction``: all-reducing per-device gradients, never already-reduced ones.

Inside ``jax.shard_map`` with ``check_vma=True`` (the default) JAX tracks which
values vary over the mesh axes, and the backward pass of a replicated
(invariant) parameter already sums its gradient over the devices: the gradient
comes out invariant. A ``pmean`` of that sum is the sum again and a ``psum``
multiplies it by the device count, so reducing it would scale the update by
the device count, silently. Whether the loss was averaged before
differentiation cannot be told from the gradient, so such a gradient is an
error, not something to divide.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxamp._casting import is_floating, widen
from jaxamp._engine._compat import tracks_variance, varying_axes

__all__ = ["reduce_grads"]


def reduce_grads(
    updates: Any, loss_scale: Any, axis_name: Any, grad_reduction: str, *, keep_dtype: bool
) -> Any:
    """The grads all-reduced over ``axis_name`` (float32 for 16-bit leaves), then unscaled."""
    check_grads_vary(updates, axis_name, grad_reduction)
    reduce = jax.lax.pmean if grad_reduction == "mean" else jax.lax.psum

    def one(g):
        if not is_floating(g):
            return g
        unscaled = loss_scale.unscale(reduce(widen(g), axis_name))
        return unscaled.astype(g.dtype) if keep_dtype else unscaled

    return jax.tree.map(one, updates)


def check_grads_vary(updates: Any, axis_name: Any, grad_reduction: str) -> None:
    """Raises if a gradient is already reduced over ``axis_name`` (see the module docstring)."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    tracked = [n for n in names if tracks_variance(n)]
    if not tracked:
        return  # pmap or check_vma=False: every device holds its own grads
    for path, g in jax.tree_util.tree_flatten_with_path(updates)[0]:
        summed = [n for n in tracked if is_floating(g) and n not in varying_axes(g)]
        if summed:
            raise ValueError(
                f"grad_reduction={grad_reduction!r} over axis_name={axis_name!r}, but the "
                f"gradient grads{jax.tree_util.keystr(path)} does not vary over {summed[0]!r}: "
                "inside jax.shard_map with check_vma=True (the default) JAX already sums "
                "the gradients of replicated parameters over the devices, and reducing them "
                "again would multiply the update by the device count. Keep "
                "grad_reduction=None there (average the loss with "
                f"jax.lax.pmean(loss, {summed[0]!r})), or use jax.shard_map(..., "
                "check_vma=False) for per-device gradients."
            )
