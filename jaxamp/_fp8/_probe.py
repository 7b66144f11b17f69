"""precision_plan's instrumentation of a recipe's low-bit products.

While ``jaxamp.precision_plan`` traces its program it makes a :class:`Probe`
current (:func:`probing`); ``_autocast/_api.autocast`` binds it to each
evaluation (:meth:`Probe.bind`: which parameter path each contraction's weight
is, as ``high_precision`` matches it) and ``_autocast/_caster.compute`` hands
every product the recipe runs at low bits to :meth:`Bound.product` with two
functions of the same operands: the recipe's product and autocast's
compute-dtype one.

:meth:`Bound.product` runs one of them, chosen by a traced bit of the program's
``mask`` (one bit per parameter path, the last for products no path names), so
one compiled program gives the low-bit step, the compute-dtype step and the
step with any set of paths kept, forward and backward. Where the traced flag
``measure`` is set, it also runs the other product on the same operands
(forward: ``x``, ``w``; backward: the same cotangent) and sends the squared
norms of the difference and of the compute-dtype result to the host
(``jax.debug.callback``), per product and kind (fprop, dgrad, wgrad).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from jaxamp._casting import F32
from jaxamp._engine._contractions import conv_axes, dot_dims
from jaxamp._fp8._hook import first_arg_name
from jaxamp._fp8._scales import ALL_CONTRACTIONS, weight_operands

__all__ = ["KINDS", "Probe", "Product", "current", "probing"]

KINDS = ("fprop", "dgrad", "wgrad")

_CURRENT: contextvars.ContextVar[Probe | None] = contextvars.ContextVar("probe", default=None)


class Product(NamedTuple):
    """One low-bit product as traced: its parameter path (None: none), weight operand, FLOPs."""

    path: str | None
    weight: int  # the operand index of the weight (its cotangent is the wgrad)
    eqn: jex.JaxprEqn
    flops: int  # of one execution of the forward product


class Probe:
    """What one traced precision_plan program instruments.

    ``mask``: traced bool ``[len(paths) + 1]``, True = that path's products run
    in the compute dtype (the last bit: products no path names);
    ``measure``: traced bool, whether to measure each product's error.
    ``sums[(product, kind)]`` accumulates ``[|low - ref|^2, |ref|^2, FLOPs]`` on
    the host while a measured run executes.
    """

    def __init__(self, paths: list[str], mask: Any, measure: Any):
        self.index = {path: i for i, path in enumerate(paths)}
        self.mask = mask
        self.measure = measure
        self.products: list[Product] = []
        self.sums: dict[tuple[int, str], list[float]] = {}

    def bind(self, closed: jex.ClosedJaxpr, paths: list) -> Bound:
        """The probe of one autocast evaluation of ``closed`` (``paths``: its inputs' key paths)."""
        names = {i: first_arg_name(path) for i, path in enumerate(paths)}
        operands = weight_operands(closed, ALL_CONTRACTIONS, scans=True)
        weights: dict[int, tuple[int, str]] = {}
        for (eqn, operand), source in sorted(operands.items(), key=lambda kv: -kv[0][1]):
            name = names.get(source)
            if name is not None and eqn not in weights:  # the rhs first: x @ w
                weights[eqn] = (operand, name)
        return Bound(self, weights)

    def record(self, key: int, kind: str, flops: int, num: Any, den: Any) -> None:
        """Host side of a measurement: adds one execution's norms and FLOPs."""
        sums = self.sums.setdefault((key, kind), [0.0, 0.0, 0.0])
        sums[0] += float(num)
        sums[1] += float(den)
        sums[2] += flops


class Bound(NamedTuple):
    """A :class:`Probe` and the weights of one evaluation: ``{id(eqn): (operand, path)}``."""

    probe: Probe
    weights: dict[int, tuple[int, str]]

    def product(
        self, eqn: jex.JaxprEqn, low: Callable, ref: Callable, x: Any, w: Any, extra: list
    ) -> Any:
        """``low(x, w, *extra)`` or ``ref(...)`` as the mask says, measured where asked."""
        probe = self.probe
        operand, path = self.weights.get(id(eqn), (1, None))
        bit = probe.index.get(path, len(probe.index)) if path is not None else len(probe.index)
        key = len(probe.products)
        flops = _flops(eqn)
        probe.products.append(Product(path, operand, eqn, flops))
        kinds = ("dgrad", "wgrad") if operand == 1 else ("wgrad", "dgrad")
        record = functools.partial(_send, probe, key, flops, kinds)
        fun = _probed(low, ref, record, len(extra))
        return fun(x, w, probe.mask[bit], probe.measure, *extra)


def _send(probe: Probe, key: int, flops: int, kinds: tuple, *sums: Any) -> None:
    """The callback: ``sums`` = (num, den) for fprop, or for each operand's cotangent."""
    if len(sums) == 2:
        probe.record(key, "fprop", flops, *sums)
        return
    for i, kind in enumerate(kinds):  # each backward product has the forward's FLOPs
        probe.record(key, kind, flops, sums[2 * i], sums[2 * i + 1])


def _squares(low: Any, ref: Any) -> tuple[Any, Any]:
    diff = low.astype(F32) - ref.astype(F32)
    return jnp.sum(diff * diff), jnp.sum(jnp.square(ref.astype(F32)))


def _measure(measure: Any, record: Callable, pairs: Callable) -> None:
    """``record(*norms)`` of ``pairs()`` on the host, where ``measure`` is set."""

    def measured():
        sums = [s for low, ref in pairs() for s in _squares(low, ref)]
        jax.debug.callback(record, *sums)

    jax.lax.cond(measure, measured, lambda: None)


def _probed(low: Callable, ref: Callable, record: Callable, n_extra: int) -> Callable:
    """``(x, w, keep, measure, *extra) -> product``: ``ref`` where ``keep``, else ``low``."""

    def either(x, w, keep, extra):
        dtype = jax.eval_shape(ref, x, w, *extra).dtype
        return jax.lax.cond(keep, ref, lambda *a: low(*a).astype(dtype), x, w, *extra)

    @jax.custom_vjp
    def fun(x, w, keep, measure, *extra):  # not differentiated (grad=False)
        return fwd(x, w, keep, measure, *extra)[0]

    def fwd(x, w, keep, measure, *extra):
        _measure(measure, record, lambda: [(low(x, w, *extra), ref(x, w, *extra))])
        return either(x, w, keep, extra), (x, w, keep, measure, extra)

    def bwd(residuals, g):
        x, w, keep, measure, extra = residuals

        def grads(product):
            return jax.vjp(lambda a, b: product(a, b, *extra).astype(g.dtype), x, w)[1](g)

        _measure(measure, record, lambda: list(zip(grads(low), grads(ref), strict=True)))
        dx, dw = jax.lax.cond(keep, lambda: grads(ref), lambda: grads(low))
        return (dx, dw, None, None, *([None] * n_extra))

    fun.defvjp(fwd, bwd)
    return fun


def _flops(eqn: jex.JaxprEqn) -> int:
    """``2 M N K`` (times the batch) of a dot or ragged dot, as precision_report counts it."""
    lhs: Any = eqn.invars[0].aval
    rhs: Any = eqn.invars[1].aval
    if eqn.primitive.name == "ragged_dot_general":
        numbers = eqn.params["ragged_dot_dimension_numbers"]
        dims = dot_dims(
            numbers.dot_dimension_numbers, lhs.ndim, rhs.ndim, numbers.rhs_group_dimensions
        )
    elif eqn.primitive.name == "dot_general":
        dims = dot_dims(eqn.params["dimension_numbers"], lhs.ndim, rhs.ndim)
    else:  # a convolution: each output element is a dot over in-features x taps
        out: Any = eqn.outvars[0].aval
        axes = conv_axes(eqn.params["dimension_numbers"])
        taps = math.prod(rhs.shape[d] for d in axes.rhs_spatial)
        return 2 * math.prod(out.shape) * rhs.shape[axes.rhs_in] * taps
    lb, lf, lc = dims.lhs_batch, dims.lhs_free, dims.lhs_contract
    batch, m, k = (math.prod(lhs.shape[d] for d in ds) for ds in (lb, lf, lc))
    return 2 * batch * m * k * math.prod(rhs.shape[d] for d in dims.rhs_free)


def current() -> Probe | None:
    """The probe precision_plan made current for the trace under way, else None."""
    return _CURRENT.get()


@contextlib.contextmanager
def probing(probe: Probe) -> Iterator[Probe]:
    """Makes ``probe`` current while precision_plan traces its program."""
    token = _CURRENT.set(probe)
    try:
        yield probe
    finally:
        _CURRENT.reset(token)
