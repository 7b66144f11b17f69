"""precision_plan: which low-bit products lose most, and which paths to keep in 16 bits.

One program (``jax.jit``, compiled once) runs the step under ``autocast(fun,
recipe)`` with every low-bit product instrumented (``jaxamp._fp8._probe``): a
traced mask picks, per parameter path, the recipe's product or autocast's
compute-dtype one, forward and backward. The plan executes it ``P + 2`` times
(``P``: the paths with low-bit products): once all at low bits, measuring each
product's error against the compute-dtype product on the same operands; once
all in the compute dtype (the reference step); once per path with that path
alone in the compute dtype, whose deviation from the reference, against the
low-bit step's, is the path's sensitivity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._autocast import autocast
from jaxamp._checks import check_callable
from jaxamp._fp8 import RECIPES
from jaxamp._fp8._probe import KINDS, Probe, probing
from jaxamp._numerics._sites import user_source
from jaxamp._plan._types import PlanRow, PrecisionPlan
from jaxamp._resolve import resolve

__all__ = ["precision_plan"]


def precision_plan(
    fun: Callable, params: Any, *args: Any, recipe: Any, grad: bool = True, **kwargs: Any
) -> PrecisionPlan:
    """Measures which low-bit products of a step lose most, and which paths to keep.

    For every product ``recipe`` runs at low bits (forward, and with ``grad=True``
    the two backward products of each), the norm-wise relative error against
    the same product in the compute dtype on the same operands; for every
    parameter path with such products, its sensitivity: the share of the
    step's deviation from the compute-dtype step (of the gradient with respect
    to ``params``, or with ``grad=False`` of ``fun``'s floating outputs) that
    goes away when that path alone runs in the compute dtype. Cost: one compile
    of the instrumented step and ``P + 2`` executions of it (``P``: the paths
    with low-bit products).

    Args:
      fun: the loss, ``fun(params, *args, **kwargs)``; with ``grad=True`` it
        returns a scalar.
      params: its first argument, whose leaves ``high_precision`` names.
      *args: its other arguments (arrays, one representative batch).
      recipe: a ``jaxamp.Float8Recipe``, ``jaxamp.Float4Recipe`` or a preset
        naming one (``"mixed_float8"``, ``"mixed_nvfp4"``, ``"mixed_mxfp4"``).
        Its ``high_precision`` is ignored: every product is measured.
      grad: measure the step's gradient (the backward products too), not only
        the forward.
      **kwargs: more arguments of ``fun``.

    Returns:
      A :class:`jaxamp.PrecisionPlan`: ``rows`` (most sensitive first),
      ``keep(count=)`` / ``keep(fraction=)`` (the recipe to train with) and
      ``str()``, a table.

    Raises:
      TypeError: ``fun`` not callable; ``recipe`` no FP8/FP4 recipe; ``grad``
        no bool.
      ValueError: ``recipe`` a string that names no recipe; ``fun`` runs no
        product at low bits.

    >>> import jax, jax.numpy as jnp, jaxamp
    >>> def loss(p, x):
    ...     return jnp.mean((x @ p["a"] @ p["b"]) ** 2)
    >>> k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    >>> p = {"a": jax.random.normal(k1, (64, 64)), "b": jax.random.normal(k2, (64, 32))}
    >>> x = jax.random.normal(k3, (32, 64)).at[:, 3].mul(50.0)  # an outlier channel into a
    >>> plan = jaxamp.precision_plan(loss, p, x, recipe="mixed_nvfp4")
    >>> plan.paths[0], [r.kind for r in plan.rows if r.path == "['a']"]
    ("['a']", ['fprop', 'dgrad', 'wgrad'])
    >>> plan.keep(count=1).high_precision
    ("^\\\\['a'\\\\]$",)
    """
    check_callable(fun)
    base = _recipe(recipe)
    if not isinstance(grad, (bool, np.bool_)):
        raise TypeError(f"precision_plan(grad=...) must be a bool; got {grad!r}.")
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    names = [jax.tree_util.keystr(path) for path, _ in leaves]
    step = autocast(fun, base)
    probes: list[Probe] = []

    def program(mask, measure, params, args, kwargs):
        probe = Probe(names, mask, measure)
        probes.append(probe)
        with probing(probe):
            if grad:
                return jax.grad(step)(params, *args, **kwargs)
            return step(params, *args, **kwargs)

    jitted = jax.jit(program)

    def run(kept: list[int], measure: bool = False) -> list[np.ndarray]:
        mask = np.zeros(len(names) + 1, bool)
        mask[kept] = True
        out = jitted(jnp.asarray(mask), jnp.asarray(measure), params, args, kwargs)
        jax.effects_barrier()
        return [np.asarray(v, np.float64) for v in jax.tree.leaves(out) if _floating(v)]

    low = run([], measure=True)
    probe = probes[-1]
    if not probe.products:
        raise ValueError(
            f"precision_plan: fun runs no product at low bits under {base}: nothing to plan."
        )
    reference = run(list(range(len(names) + 1)))
    deviation = _deviation(low, reference)
    paths = list(dict.fromkeys(p.path for p in probe.products if p.path is not None))
    sensitivity = {}
    for path in paths:
        kept = _deviation(run([names.index(path)]), reference)
        sensitivity[path] = (deviation - kept) / deviation if deviation > 0 else 0.0
    rows = _rows(probe, sensitivity)
    ranked = tuple(dict.fromkeys(r.path for r in rows if r.path is not None))
    target = "gradient" if grad else "output"
    return PrecisionPlan(base, rows, ranked, deviation, target)


def _recipe(recipe: Any) -> Any:
    if not isinstance(recipe, (str, *RECIPES)):
        raise TypeError(
            "precision_plan(recipe=...) must be a jaxamp.Float8Recipe, a jaxamp.Float4Recipe "
            "or a preset naming one ('mixed_float8', 'mixed_nvfp4', 'mixed_mxfp4'); "
            f"got {recipe!r}."
        )
    resolved = resolve(recipe)[1]
    if resolved is None:
        raise ValueError(
            f"precision_plan(recipe=...): {recipe!r} names no FP8 or FP4 recipe "
            "('mixed_float8', 'mixed_nvfp4', 'mixed_mxfp4')."
        )
    return dataclasses.replace(resolved, high_precision=None)


def _floating(value: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(value), jnp.floating)


def _deviation(values: list[np.ndarray], reference: list[np.ndarray]) -> float:
    """``||values - reference|| / ||reference||`` over all leaves together."""
    num = sum(float(np.sum((v - r) ** 2)) for v, r in zip(values, reference, strict=True))
    den = sum(float(np.sum(r**2)) for r in reference)
    return float(np.sqrt(num / den)) if den > 0 else float(np.sqrt(num))


def _rows(probe: Probe, sensitivity: dict[str, float]) -> tuple[PlanRow, ...]:
    total = sum(sums[2] for sums in probe.sums.values()) or 1
    path_flops: dict[str | None, float] = {}
    for (key, _), sums in probe.sums.items():
        path = probe.products[key].path
        path_flops[path] = path_flops.get(path, 0) + sums[2]
    rows = []
    for (key, kind), (num, den, flops) in probe.sums.items():
        product = probe.products[key]
        error = float(np.sqrt(num / den)) if den > 0 else (0.0 if num == 0 else float("inf"))
        path = product.path
        rows.append(
            (
                (
                    path is None,
                    -sensitivity.get(path, 0.0) if path is not None else 0.0,
                    -path_flops[path],
                    path or "",
                    key,
                    KINDS.index(kind),
                ),
                PlanRow(
                    path=path,
                    source=user_source(product.eqn),
                    kind=kind,
                    flops=int(flops),
                    share=flops / total,
                    error=error,
                    sensitivity=sensitivity.get(path) if path is not None else None,
                ),
            )
        )
    return tuple(row for _, row in sorted(rows, key=lambda r: r[0]))
