"""The layer sweep: every public layer class of flax.nnx, flax.linen, haiku and equinox.

``layer_classes`` enumerates each namespace's public subclasses of the library's
module base class by introspection. ``build`` makes each one with small
constructor arguments: the required parameters of its signature filled by name
from ``COMMON`` (features, kernel sizes, heads...), with a per-class ``Spec``
(``_args_layers.py``) for what a name cannot say (a wrapped layer, an input
shape, how it is called). The layer becomes a ``_sweep.Case``: a function of
its input, computed as ``x @ w`` so autocast has a 16-bit activation, and of
its parameter and state leaves, so that the hand-cast reference casts params
and input alike. It returns ``(outputs, new state)``: the updated state (batch
statistics, moving averages, codebooks) is compared like the outputs, never the
unchanged params.
``_sweep.check_many`` and ``_sweep.check`` then run the checks; ``check_grads``
adds the gradient with respect to the matmul weight and every float32 leaf.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp
from tests.conformance import _oracles, _sweep

KEY = 0  # every random initialisation and dropout mask derives from this seed


@dataclasses.dataclass(frozen=True)
class Spec:
    """How to build and call one class, beyond filling its signature from ``COMMON``.

    Attributes:
        kwargs: constructor arguments that override or add to ``COMMON``.
        x: the input's shape (its values come from ``_sweep._values``).
        call: ``call(layer, h)`` (equinox: ``call(layer, h, state)``); default ``layer(h)``.
        make: ``make()`` returns the layer itself, for wrappers of other layers.
        slow: run only in the slow test (too large to compile in CI).
    """

    kwargs: dict = dataclasses.field(default_factory=dict)
    x: tuple = (2, 4)
    call: Callable | None = None
    make: Callable | None = None
    slow: bool = False


# Required constructor parameters, filled by name.
COMMON: dict[str, Any] = {
    "features": 4,
    "in_features": 4,
    "out_features": 4,
    "num_features": 4,
    "hidden_features": 4,
    "hidden_size": 4,
    "output_size": 4,
    "output_channels": 4,
    "in_channels": 4,
    "out_channels": 4,
    "input_size": 4,
    "in_size": 4,
    "out_size": 4,
    "width_size": 4,
    "depth": 1,
    "shape": 4,
    "query_size": 4,
    "embedding_size": 4,
    "embedding_dim": 4,
    "num_embeddings": 8,
    "num_heads": 2,
    "key_size": 2,
    "kernel_size": 3,
    "kernel_shape": 3,
    "channel_multiplier": 2,
    "lora_rank": 2,
    "rate": 0.5,
    "groups": 2,
    "decay": 0.9,
    "decay_rate": 0.9,
    "commitment_cost": 0.25,
    "create_scale": True,
    "create_offset": True,
    "axis": -1,
    "window_shape": 2,
    "strides": 2,
    "padding": "VALID",
    "target_shape": 2,
    "num_classes": 4,
    "output_sizes": (4, 4),
    "num_spatial_dims": 1,
    "vocab_size": 8,
    "embed_dim": 4,
}


# Sizes some constructors default to None (an embedding given its table instead).
OPTIONAL_SIZES = {"num_embeddings", "embedding_size", "vocab_size", "embed_dim"}


def layer_classes(module: Any, base: type) -> list[tuple[str, type]]:
    """The module's public classes that subclass ``base`` (the library's layer base)."""
    out = []
    for name in sorted(dir(module)):
        value = getattr(module, name, None)
        if not name.startswith("_") and inspect.isclass(value) and issubclass(value, base):
            out.append((name, value))
    return out


def fill(cls: type, given: dict, **extra) -> dict:
    """Constructor arguments: ``given``, then each required parameter filled from
    ``extra`` (``rngs``, ``key``) or, when it has no default, ``COMMON``."""
    params = inspect.signature(cls).parameters.values()
    if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):  # nnx's metaclass
        params = inspect.signature(cls.__init__).parameters.values()
    kwargs = dict(given)
    for p in params:
        if p.name in kwargs or p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in extra:
            kwargs[p.name] = extra[p.name]
        elif p.name in COMMON and (p.default is p.empty or p.name in OPTIONAL_SIZES):
            kwargs[p.name] = COMMON[p.name]
    return kwargs


def _is_float32(leaf: Any) -> bool:
    return hasattr(leaf, "dtype") and leaf.dtype == _sweep.F32


def _is_key(leaf: Any) -> bool:
    return hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def input_of(spec: Spec) -> np.ndarray:
    return _sweep._values(7, spec.x, -1.0, 1.0)


def as_case(namespace: str, name: str, apply: Callable, tree: Any, x: np.ndarray) -> _sweep.Case:
    """``apply(tree, h)`` as a ``_sweep.Case`` of ``h`` and the float32 leaves of ``tree``.

    Other leaves (integer counters, PRNG keys, activation functions) stay closed over.
    """
    leaves, treedef = jax.tree.flatten(tree)
    args = [np.asarray(leaf) if _is_float32(leaf) else leaf for leaf in leaves]

    def fun(h, *leaves):
        # The libraries are written for JAX's standard promotion (haiku adds int32
        # counters to float32 averages); the tests' strict setting is for jaxamp.
        with jax.numpy_dtype_promotion("standard"):
            out = apply(jax.tree.unflatten(treedef, leaves), h)
        return jax.tree.map(lambda v: None if _is_key(v) else v, out)  # RNG state: no values

    return _sweep.Case(namespace, name, fun, (x, *args), {})


def _weighted_sum(fun: Callable) -> Callable:
    """The layer's floating outputs summed with fixed weights: a loss whose gradient
    is not zero by symmetry (a normalised output's plain sum is constant). The new
    state is left out: no training loss differentiates through running statistics."""

    def loss(*args):
        total = jnp.float32(0)
        outputs, _ = fun(*args)
        for i, out in enumerate(_sweep._floating(outputs)):
            out = jnp.real(out).astype(jnp.float32)
            weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32) + i).reshape(out.shape)
            total = total + jnp.sum(out * weights)
        return total

    return loss


def _argnums(args: list) -> tuple[int, ...]:
    """The matmul weight and every float32 leaf (not the input ``x``)."""
    return tuple(i for i, a in enumerate(args) if a.dtype == _sweep.F32 and i != 1)


def _grads(fun: Callable, argnums: tuple, policy: str) -> Callable:
    """float32, autocast and autocast("float32") gradients, in one program."""

    def run(*args):
        return [
            list(jax.grad(_weighted_sum(f), argnums)(*args))
            for f in (fun, jaxamp.autocast(fun, policy), jaxamp.autocast(fun, "float32"))
        ]

    return run


def _hand_grads(fun: Callable, argnums: tuple, dtype: Any) -> Callable:
    """The gradient of the hand-cast reference. Traced and lowered under standard
    promotion: its backward pass has mixed-dtype products that strict promotion
    refuses even at lowering."""

    def run(*args):
        low = [a.astype(dtype) if a.dtype == _sweep.F32 else a for a in args]
        return list(jax.grad(_weighted_sum(fun), argnums)(*low))

    return run


def _batched(make: Callable, jobs: list) -> list:
    """``make(job)(*args)`` for every job, in one compiled program."""

    def run(all_args):
        return [make(j)(*a) for j, a in zip(jobs, all_args, strict=True)]

    return jax.jit(run)([j[1] for j in jobs])


def _hand_or_none(jobs: list) -> list:
    """The hand-cast gradients per job; ``[]`` where the reference does not run
    (no 16-bit kernel on this backend): float32 is then the only reference."""
    with jax.numpy_dtype_promotion("standard"):
        make = lambda j: _hand_grads(j[0], j[2], jaxamp.get_policy(j[3]).compute_dtype)  # noqa: E731
        try:
            return _batched(make, jobs)
        except Exception:  # one layer at a time
            if len(jobs) == 1:
                return [[]]
            return [_hand_or_none([j])[0] for j in jobs]


def check_grads(case: _sweep.Case, policy: str) -> list[str]:
    """The gradient of a weighted sum of the outputs with respect to the matmul
    weight and every float32 leaf, checked like the forward (``_oracles.compare``)."""
    return check_grads_many([case], [policy])[0]


def check_grads_many(cases: Sequence[_sweep.Case], policies: Sequence[str]) -> list[list[str]]:
    """``check_grads`` for many at once (compiled together); a program that fails
    falls back to one layer at a time, so each failure names its layer."""
    jobs = []
    for case, policy in zip(cases, policies, strict=True):
        fun, args = _sweep._traced(case), _sweep._array_args(case)
        jobs.append((fun, args, _argnums(args), policy))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ours = _batched(lambda j: _grads(j[0], j[2], j[3]), jobs)
        except Exception as e:  # one layer at a time, to name the one that fails
            if len(cases) == 1:
                return [[f"grad raised {type(e).__name__}: {str(e)[:200]}"]]
            return [check_grads(c, p) for c, p in zip(cases, policies, strict=True)]
        hand = _hand_or_none(jobs)
    return [
        [f"grad: {f}" for f in _oracles.compare(*o, h, jaxamp.get_policy(p).compute_dtype)]
        for o, h, p in zip(ours, hand, policies, strict=True)
    ]


def runs_in_float32(case: _sweep.Case) -> str | None:
    """None when the layer runs forward in float32 under ``jit``; else why not."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = jax.eval_shape(_sweep._traced(case), *_sweep._array_args(case))
    except Exception as e:  # reported as the reason it is skipped
        return f"does not run in float32: {type(e).__name__}: {str(e)[:120]}"
    return None if _sweep._floating(out) else "no floating output"


def enumerate_layers(
    namespace: str,
    classes: Sequence[tuple[str, type]],
    build: Callable,
    specs: dict,
    skip: dict,
    slow: bool = True,
) -> tuple[list[_sweep.Case], dict[str, str], set[str]]:
    """Cases for every class, the reason each other class is skipped, and the names of
    the slow-only ones (not built unless ``slow``)."""
    cases, reasons, slow_only = [], {}, set()
    for name, cls in classes:
        spec = specs.get(name, Spec())
        if name in skip:
            reasons[name] = skip[name]
            continue
        if spec.slow:
            slow_only.add(name)
            if not slow:
                continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                apply, tree = build(cls, spec, input_of(spec))
        except Exception as e:  # reported as the reason it is skipped
            reasons[name] = f"does not build: {type(e).__name__}: {str(e)[:120]}"
            continue
        case = as_case(namespace, name, apply, tree, input_of(spec))
        why = runs_in_float32(case)
        if why:
            reasons[name] = why
            continue
        cases.append(case)
    return cases, reasons, slow_only


# -- one adapter per library: (cls, spec, x) -> (apply(tree, h), tree) -------------


def _default_call(layer, h, *state):
    return layer(h, *state)


def build_nnx(cls: type, spec: Spec, x: np.ndarray) -> tuple[Callable, Any]:
    from flax import nnx

    layer = spec.make() if spec.make else cls(**fill(cls, spec.kwargs, rngs=nnx.Rngs(KEY)))
    graphdef, state = nnx.split(layer)
    call = spec.call or _default_call

    def apply(state, h):
        layer = nnx.merge(graphdef, state)
        return call(layer, h), nnx.state(layer, nnx.Not(nnx.Param))

    return apply, state


def build_linen(cls: type, spec: Spec, x: np.ndarray) -> tuple[Callable, Any]:
    layer = spec.make() if spec.make else cls(**fill(cls, spec.kwargs))
    call = spec.call or _default_call
    keys = {"params": jax.random.key(KEY), "dropout": jax.random.key(KEY + 1)}
    # Under jit: one compiled program, not one per initialiser op (most of the time).
    variables = jax.jit(functools.partial(layer.init, method=call))(keys, jnp.asarray(x))
    mutable = [c for c in variables if c != "params"]

    def apply(variables, h):
        dropout = {"dropout": keys["dropout"]}
        out = layer.apply(variables, h, method=call, rngs=dropout, mutable=mutable)
        return out if mutable else (out, {})

    return apply, variables


def build_haiku(cls: type, spec: Spec, x: np.ndarray) -> tuple[Callable, Any]:
    import haiku as hk

    make = spec.make or (lambda: cls(**fill(cls, spec.kwargs)))
    call = spec.call or _default_call
    layer = hk.transform_with_state(lambda h: call(make(), h))
    with jax.numpy_dtype_promotion("standard"):
        params, state = jax.jit(layer.init)(jax.random.key(KEY), jnp.asarray(x))

    def apply(tree, h):
        return layer.apply(*tree, jax.random.key(KEY + 1), h)

    return apply, (params, state)


def build_equinox(cls: type, spec: Spec, x: np.ndarray) -> tuple[Callable, Any]:
    key = jax.random.key(KEY)
    made = spec.make() if spec.make else cls(**fill(cls, spec.kwargs, key=key))
    layer, state = made if isinstance(made, tuple) else (made, None)
    call = spec.call or (lambda layer, h, state: layer(h))

    def apply(tree, h):
        out = call(*tree[:1], h, tree[1])
        return out if tree[1] is not None else (out, None)

    return apply, (layer, state)
