"""Loss scales as plain pytrees: static configuration, array state.

Each class is a frozen dataclass registered as a pytree (``_register``):
its configuration lives in the tree structure (so it survives jit, scan and
flatten/unflatten, unlike jmp's ``min_loss_scale``), its state is arrays.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._casting import is_floating, widen
from jaxamp._checks import check_int_in_range, check_static
from jaxamp._loss_scaling._finite import all_finite, check_finite_flag, select

__all__ = ["DynamicLossScale", "LossScale", "NoOpLossScale", "StaticLossScale"]

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _state_array(value: Any, dtype: Any, name: str, positive: bool) -> Any:
    """Converts a user-given Python/NumPy scalar to a scalar JAX array.

    JAX arrays (tracers included) pass through untouched. Runs at construction
    only: unflattening does not call ``__init__`` (see ``_register``).
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a number, got the bool {value!r}.")
    if isinstance(value, (int, float, np.number, np.ndarray)):
        array = np.asarray(value)
        if array.shape != ():
            raise ValueError(f"{name} must be a scalar; got shape {array.shape}.")
        if positive and not (np.isfinite(array) and array > 0):
            raise ValueError(f"{name} must be finite and > 0; got {value!r}.")
        return jnp.asarray(array, dtype)
    return value


def _static_float(value: Any, name: str) -> float:
    check_static(value, name, "a Python number", show_value=True)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name} must be a Python float; got {type(value).__name__}: {value!r}.")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value}.")
    return value


class _Scaling:
    """``scale``/``unscale`` shared by the array-backed loss scales."""

    loss_scale: jax.Array

    def scale(self, tree: Any) -> Any:
        """Multiplies every floating leaf of ``tree`` by the loss scale.

        16-bit leaves are multiplied in float32 and rounded back once, so a scale
        above float16's maximum does not overflow by itself.
        """
        return jax.tree.map(lambda x: _multiply(x, self.loss_scale), tree)

    def unscale(self, tree: Any) -> Any:
        """Divides every floating leaf of ``tree`` by the loss scale.

        It multiplies by the scale's reciprocal, in (at least) float32, and each
        leaf keeps its dtype. For the power-of-two scales of DynamicLossScale this
        is exact; unlike a division, XLA can fuse the multiply into every consumer
        of a gradient instead of keeping an extra buffer per leaf (BENCHMARKS.md,
        "Why the numbers are what they are").
        """
        reciprocal = 1 / self.loss_scale  # once, not once per leaf
        return jax.tree.map(lambda x: _multiply(x, reciprocal), tree)

    def unscale_keeps_finiteness(self) -> bool:
        """Whether ``unscale(g)`` is finite exactly where ``g`` is, whatever the state.

        True when the scale can never be below 1 (see ``raw_grads_finite``); a
        scale whose value is free array state may be below 1.
        """
        return False

    def raw_grads_finite(self, raw: Any) -> jax.Array:
        """The step's finite flag read off the raw (scaled) grads.

        Unscaling multiplies by ``r = 1 / scale``. With ``scale >= 1``,
        ``0 <= r <= 1``: a finite ``g`` stays finite (``|g * r| <= |g|``, also after
        rounding back to a 16-bit dtype) and inf or NaN stays non-finite
        (``inf * r`` is inf, or NaN if ``r`` flushed to 0). A scale below 1 (built
        from an out-of-range array) gives False: the step is skipped, and a
        dynamic scale's ``adjust`` clamps it back up to ``min_loss_scale``. Checking
        the raw grads lets the unscaling multiply fuse into the optimizer's
        kernels instead of being kept as one buffer per leaf for the check
        (BENCHMARKS.md, "Why the numbers are what they are").
        """
        return all_finite(raw) & (self.loss_scale >= 1.0)


def _multiply(x: Any, factor: jax.Array) -> Any:
    """``x * factor`` in at least float32, rounded back to ``x``'s dtype once."""
    if not is_floating(x):
        return x  # integer, bool and float0 leaves are not scaled
    wide = jnp.asarray(widen(x))
    return (wide * factor.astype(wide.dtype)).astype(x.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale:
    """A loss scale of exactly 1 that never changes (for float32 and bfloat16).

    >>> import jaxamp
    >>> ls = jaxamp.NoOpLossScale()
    >>> float(ls.loss_scale), ls.adjust(False) is ls
    (1.0, True)
    """

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.ones((), jnp.float32)

    def scale(self, tree: Any) -> Any:
        """Returns ``tree`` unchanged."""
        return tree

    def unscale(self, tree: Any) -> Any:
        """Returns ``tree`` unchanged."""
        return tree

    def adjust(self, grads_finite: Any) -> NoOpLossScale:
        """Returns ``self``: a no-op scale never changes."""
        check_finite_flag(grads_finite)
        return self

    def unscale_keeps_finiteness(self) -> bool:
        """True: unscaling changes nothing."""
        return True

    def raw_grads_finite(self, raw: Any) -> jax.Array:
        """The step's finite flag: the raw grads are the unscaled ones."""
        return all_finite(raw)


@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale(_Scaling):
    """A constant loss scale.

    >>> import jax.numpy as jnp, jaxamp
    >>> ls = jaxamp.StaticLossScale(128.0)
    >>> ls.scale(jnp.float32(0.5)), ls.unscale(jnp.float32(64.0))
    (Array(64., dtype=float32), Array(0.5, dtype=float32))
    """

    loss_scale: jax.Array

    def __post_init__(self):
        value = _state_array(self.loss_scale, jnp.float32, "loss_scale", positive=True)
        object.__setattr__(self, "loss_scale", value)

    def adjust(self, grads_finite: Any) -> StaticLossScale:
        """Returns ``self``: a static scale never changes."""
        check_finite_flag(grads_finite)
        return self


@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(_Scaling):
    """A loss scale that shrinks on overflow and grows after a run of finite steps.

    The rules are torch.amp.GradScaler's: when the gradients are not all finite
    the scale is multiplied by ``backoff_factor`` (never below
    ``min_loss_scale``) and the counter of finite steps resets; after exactly
    ``growth_interval`` consecutive finite steps it is multiplied by
    ``growth_factor`` (never above ``max_loss_scale``, never inf) and the counter
    resets.

    ``loss_scale`` (float32) and ``counter`` (int32) are the array state; the
    rest is static configuration kept in the pytree structure.

    >>> import jaxamp
    >>> ls = jaxamp.DynamicLossScale(loss_scale=8.0, growth_interval=2)
    >>> ls = ls.adjust(True); float(ls.loss_scale), int(ls.counter)
    (8.0, 1)
    >>> ls = ls.adjust(True); float(ls.loss_scale), int(ls.counter)
    (16.0, 0)
    >>> ls = ls.adjust(False); float(ls.loss_scale), int(ls.counter)
    (8.0, 0)
    """

    loss_scale: jax.Array = 2.0**15
    counter: jax.Array = 0
    growth_interval: int = dataclasses.field(default=2000, metadata={"static": True})
    growth_factor: float = dataclasses.field(default=2.0, metadata={"static": True})
    backoff_factor: float = dataclasses.field(default=0.5, metadata={"static": True})
    min_loss_scale: float = dataclasses.field(default=1.0, metadata={"static": True})
    max_loss_scale: float = dataclasses.field(default=_FLOAT32_MAX, metadata={"static": True})

    def __post_init__(self):
        check_static(self.growth_interval, "growth_interval", "a Python int")
        growth_interval = check_int_in_range(self.growth_interval, "growth_interval", "an int")
        growth = _static_float(self.growth_factor, "growth_factor")
        backoff = _static_float(self.backoff_factor, "backoff_factor")
        lo = _static_float(self.min_loss_scale, "min_loss_scale")
        hi = _static_float(self.max_loss_scale, "max_loss_scale")
        if growth <= 1.0:
            raise ValueError(f"growth_factor must be > 1; got {growth}.")
        if not 0.0 < backoff < 1.0:
            raise ValueError(f"backoff_factor must be in the open interval (0, 1); got {backoff}.")
        if not 0.0 < lo <= hi:
            raise ValueError(
                f"need 0 < min_loss_scale <= max_loss_scale; got min_loss_scale={lo}, "
                f"max_loss_scale={hi}."
            )
        if hi > _FLOAT32_MAX:
            raise ValueError(
                f"max_loss_scale must be a finite float32 (<= {_FLOAT32_MAX:.6g}); got {hi}."
            )
        scale = _state_array(self.loss_scale, jnp.float32, "loss_scale", positive=True)
        if isinstance(self.loss_scale, (int, float, np.number, np.ndarray)) and not (
            lo <= float(self.loss_scale) <= hi
        ):
            raise ValueError(
                f"loss_scale must be in [min_loss_scale, max_loss_scale] = [{lo}, {hi}]; "
                f"got {float(self.loss_scale)}."
            )
        counter = _state_array(self.counter, jnp.int32, "counter", positive=False)
        for name, value in (
            ("loss_scale", scale),
            ("counter", counter),
            ("growth_interval", growth_interval),
            ("growth_factor", growth),
            ("backoff_factor", backoff),
            ("min_loss_scale", lo),
            ("max_loss_scale", hi),
        ):
            object.__setattr__(self, name, value)

    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """Returns the scale for the next step, given whether this step's grads were finite.

        Args:
          grads_finite: a bool scalar (a traced value inside jit), usually
            ``jaxamp.all_finite(grads)``.
        """
        grads_finite = check_finite_flag(grads_finite)
        # counter < growth_interval <= int32 max always holds, so +1 cannot overflow.
        finite_steps = self.counter + 1
        grow = finite_steps >= self.growth_interval
        grown = jnp.minimum(self.loss_scale * self.growth_factor, self.max_loss_scale)
        shrunk = jnp.maximum(self.loss_scale * self.backoff_factor, self.min_loss_scale)
        loss_scale = select(grads_finite, select(grow, grown, self.loss_scale), shrunk)
        counter = select(grads_finite & ~grow, finite_steps, jnp.zeros_like(finite_steps))
        return dataclasses.replace(self, loss_scale=loss_scale, counter=counter)

    def unscale_keeps_finiteness(self) -> bool:
        """True when ``min_loss_scale >= 1``: the scale stays in ``[min, max]``."""
        return self.min_loss_scale >= 1.0


def _register(cls: type) -> None:
    """Registers ``cls`` as a pytree whose unflatten does not re-run ``__post_init__``.

    Validation is for the values a user passes to the constructor. JAX and
    Equinox rebuild the tree with whatever leaves a transform needs (bool masks
    in ``eqx.partition``/``eqx.filter_jit``, ``jax.tree.map(lambda _: True, state)``,
    None, tracers), which are not loss scales and must pass through untouched.
    """
    fields = dataclasses.fields(cls)
    data = tuple(f.name for f in fields if not f.metadata.get("static"))
    static = tuple(f.name for f in fields if f.metadata.get("static"))

    def flatten_with_keys(obj):
        children = [(jax.tree_util.GetAttrKey(n), getattr(obj, n)) for n in data]
        return children, tuple(getattr(obj, n) for n in static)

    def flatten(obj):
        return [getattr(obj, n) for n in data], tuple(getattr(obj, n) for n in static)

    def unflatten(aux, children):
        obj = object.__new__(cls)
        for name, value in (*zip(static, aux, strict=True), *zip(data, children, strict=True)):
            object.__setattr__(obj, name, value)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale

for _cls in typing.get_args(LossScale):
    _register(_cls)
