"""Training with 16-bit params (and optimizer state) as an optax transformation.

Rounding each step's float32 result to a 16-bit param with round-to-nearest
drops every update smaller than half an ulp of its weight, so training stalls.
``low_precision_optimizer`` runs the wrapped optimizer in float32 and rounds its
result stochastically (unbiased), or to nearest with a Kahan compensation buffer
that carries what the rounding dropped into the next step.

Laid out as :func:`jaxamp.loss_scaling` is: the factory validates its arguments
into a small frozen ``_Config`` and closes over it; ``init`` and ``update`` are
the module-level pure steps below.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._casting import is_floating, widen
from jaxamp._checks import check_transformation, is_int
from jaxamp._low_precision._rounding import (
    check_sixteen_bit,
    counter_bits,
    mix32,
    round_with_bits,
)

__all__ = ["LowPrecisionState", "leaf_bits", "low_precision_optimizer"]

ROUNDINGS = ("stochastic", "kahan", "nearest")
SEED_LIMIT = 2**32

# Tags that keep the random streams of params and of state leaves apart.
_PARAMS_STREAM = 0
_STATE_STREAM = 1


class LowPrecisionState(NamedTuple):
    """State of :func:`low_precision_optimizer`.

    Attributes:
      count: optimizer steps taken (uint32, wraps at 2**32); with ``key`` it
        makes the random bits of each step.
      key: ``seed`` hashed to a uint32 scalar.
      inner_state: the wrapped transformation's state (its floating leaves in
        ``state_dtype`` when that is given).
      compensation: for ``rounding="kahan"``, per 16-bit param what rounding
        dropped, in the param's dtype (``None`` for float32 params); else ``None``.
    """

    count: jax.Array
    key: jax.Array
    inner_state: Any
    compensation: Any = None


class _LowPrecisionTransformation(optax.GradientTransformationExtraArgs):
    """An ``optax.GradientTransformationExtraArgs`` that takes float32 grads for 16-bit params.

    ``takes_float32_grads`` tells :func:`jaxamp.loss_scaling` to hand over the
    unscaled grads of 16-bit params in float32: unscaling back into float16
    would flush the small gradients the loss scale protected.
    """

    __slots__ = ()
    takes_float32_grads = True


@dataclasses.dataclass(frozen=True)
class _Config:
    """What :func:`low_precision_optimizer` closes over: the validated options."""

    inner: optax.GradientTransformationExtraArgs
    rounding: str
    state_dtype: np.dtype | None
    seed: int


def _check_inner(inner: Any) -> None:
    if isinstance(inner, optax.MultiSteps):
        raise TypeError(
            "inner must be an optax.GradientTransformation; got optax.MultiSteps, which "
            "is not one. Pass its .gradient_transformation() (or wrap this transformation "
            "in optax.MultiSteps instead)."
        )
    check_transformation(inner, "inner")


def _check_state_dtype(state_dtype: Any) -> np.dtype | None:
    if state_dtype is None:
        return None
    state_dtype = check_sixteen_bit(state_dtype, "state_dtype")
    if state_dtype == np.dtype(jnp.float16):
        raise ValueError(
            "state_dtype must be jnp.bfloat16 (or None for float32 state); got float16, "
            "which flushes second moments to zero: Adam's g**2 is 1e-10 for a gradient "
            "of 1e-5, below float16's smallest subnormal 6e-8. bfloat16 has float32's "
            "exponent range; float16 params can keep bfloat16 state."
        )
    return state_dtype


def _check_seed(seed: Any) -> int:
    if not is_int(seed):
        raise TypeError(f"seed must be an int; got {type(seed).__name__}: {seed!r}.")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(
            f"seed must be in [0, 2**32 - 1]; got {seed}. The random stream takes a "
            "32-bit seed, so a larger or negative seed would give another seed's run."
        )
    return int(seed)


def _make_config(inner: Any, rounding: Any, state_dtype: Any, seed: Any) -> _Config:
    _check_inner(inner)
    if rounding not in ROUNDINGS:
        raise ValueError(
            f"rounding must be 'stochastic', 'kahan' or 'nearest'; got {rounding!r}. "
            "'stochastic' is the default and needs no extra memory."
        )
    return _Config(
        inner=optax.with_extra_args_support(inner),
        rounding=rounding,
        state_dtype=_check_state_dtype(state_dtype),
        seed=_check_seed(seed),
    )


def low_precision_optimizer(
    inner: optax.GradientTransformation,
    *,
    rounding: str = "stochastic",
    state_dtype: Any = None,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` for params stored in bfloat16 or float16.

    ``update(grads, state, params)`` runs ``inner`` in float32 (grads, params and
    the ``state_dtype`` state leaves widened) and returns updates in each param's
    dtype such that ``optax.apply_updates(params, updates)`` is the float32 result
    ``params + inner_update`` rounded to the param's dtype by ``rounding``:

    * ``"stochastic"`` (default): up or down at random, unbiased, so updates
      below half an ulp of their weight survive on average. No extra memory.
    * ``"kahan"``: to nearest, with a 16-bit compensation buffer per param in the
      state that adds what the rounding dropped to the next step's update.
    * ``"nearest"``: round to nearest, today's behaviour (for comparison).

    The 16-bit addition in ``apply_updates`` reproduces the rounded target bit
    for bit whenever the target is within a factor 2 of the param with the same
    sign (Sterbenz's lemma), that is for any step smaller than the weight itself;
    a step that flips a weight's sign or more than halves or doubles it can land
    one 16-bit ulp of the step off (Kahan's buffer then carries the difference).
    Float32 params pass through with ``inner``'s update unchanged.

    The random bits are a hash of ``seed``, the step count kept in the state,
    the leaf and the element's index: no key to thread, the same seed gives the
    same run, every device draws the same bits for replicated params, and a step
    skipped by :func:`jaxamp.loss_scaling` (wrap this transformation in it)
    leaves the count, and so the random stream, where it was. Inside
    ``loss_scaling`` the grads arrive unscaled in float32, so that float16's
    small gradients are not flushed on the way.

    Args:
      inner: the optimizer, e.g. ``optax.adam(1e-3)``.
      rounding: ``"stochastic"``, ``"kahan"`` or ``"nearest"``.
      state_dtype: ``None`` keeps ``inner``'s state dtypes (float32 moments for
        16-bit params); ``jnp.bfloat16`` stores ``inner``'s floating state arrays
        in bfloat16, rounded stochastically (to nearest for ``rounding="nearest"``;
        Kahan compensates the params only, as a buffer per moment would spend the
        memory saved). Scalar and integer leaves (step counts, hyperparameters)
        keep their dtypes. float16 is refused: it flushes Adam's second moment.
      seed: an int in ``[0, 2**32)`` that seeds the random stream.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`LowPrecisionState`; extra keyword arguments of ``update`` reach
      ``inner``.

    Raises:
      ValueError: unknown ``rounding``, a ``state_dtype`` other than bfloat16,
        a ``seed`` out of range, or ``init``/``update`` without params.
      TypeError: ``inner`` is not an optax transformation, ``seed`` not an int, or
        a param is not floating.

    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.low_precision_optimizer(optax.sgd(1e-3), state_dtype=jnp.bfloat16)
    >>> params = {"w": jnp.ones(10_000, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> for _ in range(200):  # each step is a quarter of a bfloat16 ulp of 1.0
    ...     updates, state = tx.update({"w": -jnp.ones(10_000, jnp.bfloat16)}, state, params)
    ...     params = optax.apply_updates(params, updates)
    >>> round(float(params["w"].astype(jnp.float32).mean()), 2)  # 1 + 200 * 1e-3
    1.2
    """
    config = _make_config(inner, rounding, state_dtype, seed)

    def init_fn(params):
        return _init(config, params)

    def update_fn(updates, state, params=None, **extra_args):
        return _update(config, updates, state, params, extra_args)

    return _LowPrecisionTransformation(init_fn, update_fn)


# -- the steps ----------------------------------------------------------------------


def leaf_bits(state: LowPrecisionState, stream: int, index: int, shape: Any) -> jax.Array:
    """The uniform uint32 bits that round leaf ``index`` of ``stream`` at this step.

    A function of the state and the leaf only (never of the device), so that
    replicated params stay identical on every device.
    """
    step_key = mix32(state.key ^ mix32(state.count))
    leaf = np.uint32((index << 1) | stream)
    return counter_bits(mix32(step_key ^ leaf), tuple(shape))


def _is_sixteen_bit(x: Any) -> bool:
    return is_floating(x) and jnp.dtype(x.dtype).itemsize == 2


def _is_stored_narrow(x: Any) -> bool:
    # State leaves that state_dtype stores: floating arrays of at least one
    # dimension wider than 16 bits. Scalars (hyperparameters, loss scales) stay.
    return is_floating(x) and jnp.ndim(x) > 0 and jnp.dtype(x.dtype).itemsize > 2


def _check_params(params: Any, where: str) -> None:
    if params is None:
        raise ValueError(
            f"low_precision_optimizer's {where} needs the params (not None): the "
            "rounded update is computed from them. Pass tx.update(grads, state, params)."
        )
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not is_floating(leaf):
            raise TypeError(
                "low_precision_optimizer needs floating params; the leaf at "
                f"params{jax.tree_util.keystr(path)} has dtype "
                f"{getattr(leaf, 'dtype', type(leaf).__name__)}. Keep integer and other "
                "non-trainable values out of the params (or mask them with optax.masked)."
            )


def _init(config: _Config, params: Any) -> LowPrecisionState:
    _check_params(params, "init")
    inner_state = config.inner.init(jax.tree.map(widen, params))
    if config.state_dtype is not None:
        inner_state = jax.tree.map(
            lambda x: x.astype(config.state_dtype) if _is_stored_narrow(x) else x, inner_state
        )
    compensation = None
    if config.rounding == "kahan":
        compensation = jax.tree.map(
            lambda p: jnp.zeros(p.shape, p.dtype) if _is_sixteen_bit(p) else None, params
        )
    key = mix32(jnp.asarray(config.seed, jnp.uint32))
    return LowPrecisionState(jnp.zeros((), jnp.uint32), key, inner_state, compensation)


def _update(
    config: _Config, updates: Any, state: Any, params: Any, extra_args: dict
) -> tuple[Any, LowPrecisionState]:
    """One step: ``inner`` in float32, then each state leaf and param rounded back."""
    if not isinstance(state, LowPrecisionState):
        raise TypeError(
            "state must be the LowPrecisionState returned by this transformation's "
            f"init; got {type(state).__name__}."
        )
    _check_params(params, "update")
    inner_state = state.inner_state
    if config.state_dtype is not None:
        inner_state = jax.tree.map(widen, inner_state)
    inner_updates, new_inner = config.inner.update(
        jax.tree.map(widen, updates), inner_state, jax.tree.map(widen, params), **extra_args
    )
    if config.state_dtype is not None:
        new_inner = _narrow_state(new_inner, state, config.rounding)
    new_updates, compensation = _param_updates(inner_updates, state, params, config.rounding)
    new_state = LowPrecisionState(state.count + np.uint32(1), state.key, new_inner, compensation)
    return new_updates, new_state


def _narrow_state(new_inner: Any, state: LowPrecisionState, rounding: str) -> Any:
    """Each new inner-state leaf back in its stored dtype, rounded as asked."""
    leaves, treedef = jax.tree.flatten(new_inner)
    out = []
    for i, (new, old) in enumerate(zip(leaves, jax.tree.leaves(state.inner_state), strict=True)):
        if _is_sixteen_bit(old) and is_floating(new) and new.dtype != old.dtype:
            dtype = np.dtype(old.dtype)
            if rounding == "nearest":
                new = new.astype(dtype)
            else:
                bits = leaf_bits(state, _STATE_STREAM, i, jnp.shape(new))
                new = round_with_bits(new.astype(jnp.float32), dtype, bits)
        out.append(new)
    return jax.tree.unflatten(treedef, out)


def _param_updates(
    inner_updates: Any, state: LowPrecisionState, params: Any, rounding: str
) -> tuple[Any, Any]:
    """(updates in each param's dtype, the new Kahan compensation or ``None``)."""
    leaves, treedef = jax.tree.flatten(params)
    kahan = rounding == "kahan"
    compensation = treedef.flatten_up_to(state.compensation) if kahan else [None] * len(leaves)
    out_updates, out_compensation = [], []
    for i, (p, u, c) in enumerate(
        zip(leaves, treedef.flatten_up_to(inner_updates), compensation, strict=True)
    ):
        if not _is_sixteen_bit(p):
            new_u, new_c = u.astype(p.dtype), c
        elif kahan:
            new_u, new_c = _kahan_update(p, u, c)
        else:
            bits = None
            if rounding == "stochastic":
                bits = leaf_bits(state, _PARAMS_STREAM, i, jnp.shape(p))
            new_u, new_c = _rounded_update(p, u, rounding, bits), None
        out_updates.append(new_u)
        out_compensation.append(new_c)
    new_compensation = jax.tree.unflatten(treedef, out_compensation) if kahan else None
    return jax.tree.unflatten(treedef, out_updates), new_compensation


def _rounded_update(p: jax.Array, u: jax.Array, rounding: str, bits: Any) -> jax.Array:
    """The 16-bit update that takes ``p`` to ``p + u`` rounded by ``rounding``."""
    p32 = p.astype(jnp.float32)
    target32 = p32 + u
    if rounding == "stochastic":
        target = round_with_bits(target32, np.dtype(p.dtype), bits)
    else:
        target = target32.astype(p.dtype)
    # apply_updates computes p + update in p's dtype. target - p is exact in float32
    # and in the 16-bit dtype whenever target is within [p/2, 2p] (Sterbenz), so
    # then p + update is target exactly; docs/api/low-precision.md has the rest.
    return (target.astype(jnp.float32) - p32).astype(p.dtype)


def _kahan_update(p: jax.Array, u: jax.Array, c: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(16-bit update to the nearest of ``p + u + c``, what that update leaves out)."""
    p32 = p.astype(jnp.float32)
    target32 = p32 + (u + c.astype(jnp.float32))
    update = (target32.astype(p.dtype).astype(jnp.float32) - p32).astype(p.dtype)
    # What apply_updates will give. reduce_precision, not a cast: XLA may drop a
    # float32 -> 16-bit -> float32 round trip (excess precision) but not this.
    finfo = jnp.finfo(p.dtype)
    applied = jax.lax.reduce_precision(p32 + update.astype(jnp.float32), finfo.nexp, finfo.nmant)
    return update, (target32 - applied).astype(p.dtype)
