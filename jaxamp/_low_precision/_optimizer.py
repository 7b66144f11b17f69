"""Training with 16-bit params (and optimizer state) as an optax transformation.

Rounding each step's float32 result to a 16-bit param with round-to-nearest
drops every update smaller than half an ulp of its weight, so training stalls.
``low_precision_optimizer`` runs the wrapped optimizer in float32 and rounds its
result stochastically (unbiased), or to nearest with a Kahan compensation buffer
that carries what the rounding dropped into the next step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._casting import is_floating, widen
from jaxamp._checks import check_transformation, is_int
from jaxamp._low_precision._rounding import check_sixteen_bit, round_with_bits

__all__ = ["LowPrecisionState", "leaf_bits", "low_precision_optimizer"]

ROUNDINGS = ("stochastic", "kahan", "nearest")

# fold_in tags that keep the random streams of params and of state leaves apart.
_PARAMS_STREAM = 0
_STATE_STREAM = 1


class LowPrecisionState(NamedTuple):
    """State of :func:`low_precision_optimizer`.

    Attributes:
      count: optimizer steps taken (uint32, wraps at 2**32); with ``key`` it
        makes the random bits of each step.
      key: the raw PRNG key data made from ``seed`` (uint32).
      inner_state: the wrapped transformation's state (its floating leaves in
        ``state_dtype`` when that is given).
      compensation: for ``rounding="kahan"``, per 16-bit param what rounding
        dropped, in the param's dtype (``None`` for float32 params); else ``None``.
    """

    count: jax.Array
    key: jax.Array
    inner_state: Any
    compensation: Any = None


def leaf_bits(state: LowPrecisionState, stream: int, index: int, shape: Any) -> jax.Array:
    """The uniform uint32 bits that round leaf ``index`` of ``stream`` at this step.

    A function of the state and the leaf only (never of the device), so that
    replicated params stay identical on every device.
    """
    key = jax.random.wrap_key_data(state.key)
    key = jax.random.fold_in(jax.random.fold_in(key, state.count), stream)
    return jax.random.bits(jax.random.fold_in(key, index), shape, jnp.uint32)


def _round(x: jax.Array, dtype: np.dtype, rounding: str, bits: Any) -> jax.Array:
    if rounding == "stochastic":
        return round_with_bits(x, dtype, bits())
    return x.astype(dtype)


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


def _check_rounding(rounding: Any) -> str:
    if rounding not in ROUNDINGS:
        raise ValueError(
            f"rounding must be 'stochastic', 'kahan' or 'nearest'; got {rounding!r}. "
            "'stochastic' is the default and needs no extra memory."
        )
    return rounding


def _apply_leaf(p, u, c, rounding, bits):
    """(update in p's dtype, new compensation) for one param leaf."""
    if not _is_sixteen_bit(p):
        return u.astype(p.dtype), c
    p32 = p.astype(jnp.float32)
    if c is not None:
        u = u + c.astype(jnp.float32)
    target32 = p32 + u
    target = _round(target32, p.dtype, "nearest" if c is not None else rounding, bits)
    # apply_updates computes p + update in p's dtype. target - p is exact in float32
    # and in the 16-bit dtype whenever target is within [p/2, 2p] (Sterbenz), so
    # then p + update is target exactly; docs/api/low-precision.md has the rest.
    update = (target.astype(jnp.float32) - p32).astype(p.dtype)
    if c is None:
        return update, None
    # What apply_updates will give. reduce_precision, not a cast: XLA may drop a
    # float32 -> 16-bit -> float32 round trip (excess precision) but not this.
    finfo = jnp.finfo(p.dtype)
    applied = jax.lax.reduce_precision(p32 + update.astype(jnp.float32), finfo.nexp, finfo.nmant)
    return update, (target32 - applied).astype(p.dtype)


def _round_state(new_state, old_state, rounding, state):
    """Each new inner-state leaf back in its stored dtype, rounded as asked."""
    leaves, treedef = jax.tree.flatten(new_state)
    old_leaves = jax.tree.leaves(old_state)
    out = []
    for i, (new, old) in enumerate(zip(leaves, old_leaves, strict=True)):
        if _is_sixteen_bit(old) and is_floating(new) and new.dtype != old.dtype:
            mode = "nearest" if rounding == "nearest" else "stochastic"

            def bits(i=i, new=new):
                return leaf_bits(state, _STATE_STREAM, i, new.shape)

            new = _round(new.astype(jnp.float32), np.dtype(old.dtype), mode, bits)
        out.append(new)
    return jax.tree.unflatten(treedef, out)


def _check_arguments(inner: Any, rounding: Any, state_dtype: Any, seed: Any) -> tuple:
    check_transformation(inner, "inner")
    rounding = _check_rounding(rounding)
    if state_dtype is not None:
        state_dtype = check_sixteen_bit(state_dtype, "state_dtype")
    if not is_int(seed):
        raise TypeError(f"seed must be an int; got {type(seed).__name__}: {seed!r}.")
    return rounding, state_dtype


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

    The random bits are a function of ``seed``, the step count kept in the state
    and the leaf: no key to thread, the same seed gives the same run, every
    device draws the same bits for replicated params, and a step skipped by
    :func:`jaxamp.loss_scaling` (wrap this transformation in it) leaves the
    count, and so the random stream, where it was.

    Args:
      inner: the optimizer, e.g. ``optax.adam(1e-3)``.
      rounding: ``"stochastic"``, ``"kahan"`` or ``"nearest"``.
      state_dtype: ``None`` keeps ``inner``'s state dtypes (float32 moments for
        16-bit params); ``jnp.bfloat16`` or ``jnp.float16`` stores ``inner``'s
        floating state arrays in that dtype, rounded stochastically (to nearest
        for ``rounding="nearest"``; Kahan compensates the params only, as a
        buffer per moment would spend the memory saved). Scalar and integer
        leaves (step counts, hyperparameters) keep their dtypes.
      seed: an int that seeds the random stream.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`LowPrecisionState`; extra keyword arguments of ``update`` reach
      ``inner``.

    Raises:
      ValueError: unknown ``rounding``, a ``state_dtype`` that is not 16-bit, or
        ``init``/``update`` without params.
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
    rounding, state_dtype = _check_arguments(inner, rounding, state_dtype, seed)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        _check_params(params, "init")
        inner_state = inner.init(jax.tree.map(widen, params))
        if state_dtype is not None:
            inner_state = jax.tree.map(
                lambda x: x.astype(state_dtype) if _is_stored_narrow(x) else x, inner_state
            )
        compensation = None
        if rounding == "kahan":
            compensation = jax.tree.map(
                lambda p: jnp.zeros(p.shape, p.dtype) if _is_sixteen_bit(p) else None, params
            )
        key = jax.random.key_data(jax.random.key(int(seed)))
        return LowPrecisionState(jnp.zeros((), jnp.uint32), key, inner_state, compensation)

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, LowPrecisionState):
            raise TypeError(
                "state must be the LowPrecisionState returned by this transformation's "
                f"init; got {type(state).__name__}."
            )
        _check_params(params, "update")
        inner_state = state.inner_state
        if state_dtype is not None:
            inner_state = jax.tree.map(widen, inner_state)
        inner_updates, new_inner = inner.update(
            jax.tree.map(widen, updates), inner_state, jax.tree.map(widen, params), **extra_args
        )
        if state_dtype is not None:
            new_inner = _round_state(new_inner, state.inner_state, rounding, state)
        leaves, treedef = jax.tree.flatten(params)
        compensation = (
            treedef.flatten_up_to(state.compensation)
            if rounding == "kahan"
            else [None] * len(leaves)
        )
        out_updates, out_compensation = [], []
        for i, (p, u, c) in enumerate(
            zip(leaves, treedef.flatten_up_to(inner_updates), compensation, strict=True)
        ):

            def bits(i=i, p=p):
                return leaf_bits(state, _PARAMS_STREAM, i, jnp.shape(p))

            new_u, new_c = _apply_leaf(p, u, c, rounding, bits)
            out_updates.append(new_u)
            out_compensation.append(new_c)
        new_compensation = (
            jax.tree.unflatten(treedef, out_compensation) if rounding == "kahan" else None
        )
        new_state = LowPrecisionState(
            state.count + np.uint32(1), state.key, new_inner, new_compensation
        )
        return jax.tree.unflatten(treedef, out_updates), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
