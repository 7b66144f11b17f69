"""The conformance sweep: autocast against float32 and a hand-cast reference, API-wide.

For every public function of the swept namespaces, ``signature_of`` finds by
trial the first generic argument list the function accepts in float32 under
tracing (``CANDIDATES``); the first argument is always the output of a matmul
(``x @ w``), so autocast has a 16-bit activation to propagate. ``check`` then
runs, for one policy:

- no crash where float32 runs (forward; ``grad`` of the summed floating outputs
  where float32's ``grad`` runs, finite where float32's and the hand-cast
  reference's gradients are);
- finite wherever float32 and the hand-cast reference (the same function on
  16-bit inputs under JAX's standard promotion) are finite;
- relative error no worse than ``FACTOR`` x the hand-cast reference's (plus the
  compute dtype's unit roundoff, for functions the reference gets exactly);
- integer and bool outputs (``argmax``, ``argsort``, ``isclose``, ``all``,
  ``searchsorted``, the exponent of ``frexp``): the float32 run's dtype, and no
  more elements differing from the float32 run than the hand-cast reference has
  (``DISCRETE_SLACK`` more at most; without a hand-cast reference, as for linear
  algebra on CPU, none). A 16-bit activation can tie or swap values float32 keeps
  apart, so the hand-cast mismatch count, not zero, is the bar: autocast may
  not lose more order information than converting the code by hand does;
- with the ``"float32"`` policy: bit-identical to the plain function (every
  output, integer and bool ones included): proven where it traces to the very
  jaxpr of the plain function (then its run is not compiled), else compared
  output by output.

A function is applicable when some argument list traces and lowers in float32
with a floating, integer or bool output computed from its inputs; one whose
output is fixed at trace time (``ndim``, ``shape``, ``result_type``) has no
traced value to check and is skipped with that reason.

The comparisons are in ``_oracles.py``, the functions not called in
``_excluded.py``. Compile time dominates a sweep of hundreds of tiny functions:
``check_many`` compiles many of them into one program.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

import jaxamp
from tests.conformance import _args
from tests.conformance._oracles import compare, is_floating

N = 4
F32 = np.dtype(np.float32)

STATIC_OUTPUT = "output fixed at trace time (a shape, dtype or flag): no traced value to check"
NO_OUTPUT = "no array output"
NO_SIGNATURE = "no generic argument list fits (no floating array input, or needs static arguments)"


@dataclasses.dataclass(frozen=True)
class Case:
    """One function with the argument list it accepts."""

    namespace: str
    name: str
    fun: Callable
    args: tuple  # first is the activation's float32 value; the rest as given
    kwargs: dict
    # How to call ``fun``: ``call(fun, activation, *rest, **kwargs)``; None: ``fun``
    # with the activation first (see ``_args``).
    call: Callable | None = None


def _values(seed: int, shape: Sequence[int], lo: float = 0.2, hi: float = 0.8) -> np.ndarray:
    return np.random.default_rng(seed).uniform(lo, hi, shape).astype(np.float32)


MAT = _values(0, (N, N))
MAT2 = _values(1, (N, N))
MAT3 = _values(2, (N, N))
VEC = _values(3, (N,))
VEC2 = _values(4, (N,))
INTS = np.array([[1, 0, 2, 3]] * N, np.int32)

# Generic argument lists, tried in order: the first the function accepts wins.
CANDIDATES: list[tuple[tuple, dict]] = [
    ((MAT,), {}),
    ((MAT, MAT2), {}),
    ((MAT, MAT2, MAT3), {}),
    ((VEC,), {}),
    ((VEC, VEC2), {}),
    ((MAT, 2), {}),
    ((MAT, 0), {}),
    ((MAT, INTS), {}),
    ((MAT, (N * N,)), {}),
    ((MAT, (N, N)), {}),
    ((MAT, MAT2, 1), {}),
    ((MAT, INTS[0]), {}),
    ((MAT,), {"axis": 0}),
    ((VEC, 2), {}),
    ((MAT, 0.5), {}),
    ((MAT, MAT2, 0.5), {}),
    ((MAT, np.float32(0.3), np.float32(0.7)), {}),
]


def _floating(tree: Any) -> list:
    """The floating and complex leaves."""
    return [x for x in jax.tree.leaves(tree) if is_floating(x)]


def _as_model(case: Case, widen: bool = False) -> Callable:
    """``f(w, x, *rest)``: ``case.fun`` with its first argument computed as ``x @ w``
    (``widen``: then cast to float32, as code converted by hand does before a
    function with no 16-bit kernel)."""

    def model(w, x, *rest):
        act = (x @ w).astype(F32) if widen else x @ w
        if case.call is None:
            return case.fun(act, *rest, **case.kwargs)
        return case.call(case.fun, act, *rest, **case.kwargs)

    return model


def _runs(fun: Callable, *args) -> str | None:
    """None: runs with an output to check; otherwise why this argument list does not fit."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            closed, out = jax.make_jaxpr(fun, return_shape=True)(*args)
            jax.jit(fun).lower(*args)  # shape errors some functions raise only here
    except Exception:  # any failure means "not this signature"
        return NO_SIGNATURE
    if _floating(out):
        return None
    if not jax.tree.leaves(out):
        return NO_OUTPUT
    if all(isinstance(v, jex.Literal) for v in closed.jaxpr.outvars):
        return STATIC_OUTPUT
    return None


def signature_of(namespace: str, name: str, fun: Callable) -> Case | str:
    """The first argument list ``fun`` accepts (traced, float32), or why none.

    The function's own lists in ``_args.SPECIFIC`` (keyed ``"namespace.name"``)
    are tried before the generic ``CANDIDATES``.
    """
    reason = NO_SIGNATURE
    for args, kwargs, *call in [*_args.SPECIFIC.get(f"{namespace}.{name}", []), *CANDIDATES]:
        case = Case(namespace, name, fun, args, kwargs, *call)
        why = _runs(_traced(case), *_array_args(case))
        if why is None:
            return case
        if why != NO_SIGNATURE:
            reason = why
    return reason


def _traced(case: Case, widen: bool = False) -> Callable:
    """A function of the arrays only: static arguments (ints, shapes) are closed over
    at their positions."""
    model = _as_model(case, widen)
    rest = case.args[1:]
    is_array = [isinstance(a, np.ndarray) for a in rest]

    def traced(w, x, *arrays):
        given = iter(arrays)
        return model(w, x, *(next(given) if a else s for a, s in zip(is_array, rest, strict=True)))

    return traced


def _array_args(case: Case) -> list:
    """``[w, x, *array arguments after the first]``, ``w`` the identity."""
    x = np.asarray(case.args[0])
    w = np.eye(x.shape[-1], dtype=np.float32)
    return [w, x, *(a for a in case.args[1:] if isinstance(a, np.ndarray))]


def _hand_cast(fun: Callable, args: list, dtype: Any, kernel: bool = True) -> list:
    """``fun`` on 16-bit inputs under JAX's standard promotion; ``kernel=False`` (no
    16-bit kernel on this backend, as XLA:CPU's linear algebra): inputs rounded
    to 16 bits, computed in float32, as code converted by hand must do there."""
    low = [a.astype(dtype) if a.dtype == F32 else a for a in args]
    if not kernel:
        low = [a.astype(F32) if a.dtype == dtype else a for a in low]
    with jax.numpy_dtype_promotion("standard"):
        return jax.tree.leaves(fun(*low))


def _same_jaxpr(plain: Any, exact: Any) -> bool:
    """The ``"float32"`` policy traced to the plain function's very program.

    Then bit-identity holds by construction, and the sweep neither compiles nor
    compares that run: XLA:CPU may even round two copies of one computation
    differently within one program (``polygamma``: 16 of 16 elements), so the
    jaxpr is the stronger proof.
    """
    if str(plain.jaxpr) != str(exact.jaxpr) or len(plain.consts) != len(exact.consts):
        return False
    try:
        return all(
            np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
            for a, b in zip(plain.consts, exact.consts, strict=True)
        )
    except Exception:  # a traced constant: no proof, compare outputs instead
        return False


def _summed(fun: Callable) -> Callable:
    def total(*args):
        return sum(jnp.sum(jnp.real(o).astype(jnp.float32)) for o in _floating(fun(*args)))

    return total


@dataclasses.dataclass
class Result:
    case: Case
    policy: str
    failures: list[str]
    reference: bool = True  # False: the hand-cast reference does not run on this backend


def _as_dtypes(outputs: list, like: list) -> list:
    """``outputs`` in the dtypes of ``like``: the ``"float32"`` policy gives a 16-bit
    output in float32, and under ``jit`` XLA may then skip that output's 16-bit
    rounding (``xla_allow_excess_precision``, as for plain JAX's
    ``f(x).astype(jnp.float32)``); rounded back, it must be the plain output."""
    return [o.astype(w.dtype) for o, w in zip(outputs, like, strict=True)]


def _outputs(fun: Callable, policy: str, with_hand: bool) -> Callable:
    """float32, autocast, autocast("float32") and hand-cast outputs (all leaves), in one
    program; no autocast("float32") outputs where its jaxpr is the plain one."""
    dtype = jaxamp.get_policy(policy).compute_dtype

    def run(*args):
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
        plain = jax.make_jaxpr(fun)(*specs)
        exact = jax.make_jaxpr(jaxamp.autocast(fun, "float32"))(*specs)
        want = jex.jaxpr_as_fun(plain)(*args)
        return [
            want,
            jax.tree.leaves(jaxamp.autocast(fun, policy)(*args)),
            [] if _same_jaxpr(plain, exact) else _as_dtypes(jex.jaxpr_as_fun(exact)(*args), want),
            _hand_cast(fun, args, dtype, kernel=with_hand),
        ]

    return run


# Compile time dominates a sweep of hundreds of tiny programs; LLVM's optimization
# level barely matters to them (XLA's own passes, fusion included, still run) and
# every output the checks compare comes from the same program. A third less CPU.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _compiled(fun: Callable, *args) -> Any:
    """``jax.jit(fun)(*args)``, compiled with ``FAST_COMPILE``."""
    return jax.jit(fun).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def check(case: Case, policy: str, grad: bool = True) -> Result:
    """Runs the checks of the module docstring for one function and one policy."""
    fun, args = _traced(case), _array_args(case)
    dtype = jaxamp.get_policy(policy).compute_dtype
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            want, got, exact, hand = _compiled(_outputs(fun, policy, True), *args)
            with_hand = True
        except Exception:  # e.g. no float16 linear algebra on CPU
            with_hand = False
            try:
                want, got, exact, hand = _compiled(_outputs(fun, policy, False), *args)
            except Exception as e:  # reported as a failure
                message = f"forward raised {type(e).__name__}: {str(e)[:200]}"
                return Result(case, policy, [message])
        failures = compare(want, got, exact, hand, dtype)
        if grad:
            promotion = getattr(case.call, "promotion", None)
            failures += _check_grad(fun, args, policy, promotion, _traced(case, widen=True))
    return Result(case, policy, failures, with_hand)


def check_many(cases: Sequence[Case], policies: Sequence[str]) -> list[Result]:
    """``check(case, policy, grad=False)`` for many at once: one compiled program.

    Compiling one program per tiny function dominates a sweep. A function whose
    hand-cast reference does not lower (no 16-bit kernel on the backend, as
    XLA:CPU's float16 linear algebra and FFTs, complex numbers) gets its float32-
    compute reference in the same program; a program that still fails to build or
    run (a crash under autocast) is split in halves until the failing function
    runs alone, through ``check``.
    """
    if len(cases) == 1:
        return [check(cases[0], policies[0], grad=False)]
    jobs = [
        (c, p, _traced(c), _array_args(c), _hand_lowers(c, p))
        for c, p in zip(cases, policies, strict=True)
    ]

    def run(all_args):
        return [_outputs(f, p, h)(*a) for (_, p, f, _, h), a in zip(jobs, all_args, strict=True)]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            outs = _compiled(run, [a for _, _, _, a, _ in jobs])
        except Exception:  # split: the rest still share programs
            half = len(cases) // 2
            return [
                *check_many(cases[:half], policies[:half]),
                *check_many(cases[half:], policies[half:]),
            ]
    return [
        Result(c, p, compare(*o, jaxamp.get_policy(p).compute_dtype), h)
        for (c, p, _, _, h), o in zip(jobs, outs, strict=True)
    ]


def _hand_lowers(case: Case, policy: str) -> bool:
    """Whether the hand-cast reference of ``case`` traces and lowers (no compile)."""
    fun, args = _traced(case), _array_args(case)
    dtype = jaxamp.get_policy(policy).compute_dtype
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            jax.jit(lambda *a: _hand_cast(fun, list(a), dtype)).lower(*args)
    except Exception:  # no 16-bit kernel: inputs rounded, computed in float32
        return False
    return True


def hand_cast_fun(fun: Callable, dtype: Any) -> Callable:
    """``fun`` on 16-bit inputs (its float32 arguments cast) under standard promotion."""

    def hand(*a):
        with jax.numpy_dtype_promotion("standard"):
            return fun(*[x.astype(dtype) if x.dtype == F32 else x for x in a])

    return hand


def _hand_cast_grad(
    fun: Callable, args: list, dtype: Any, widened: Callable | None = None
) -> np.ndarray | None:
    """The gradient of the hand-cast reference, or None where it does not run.

    Where ``fun`` has no 16-bit kernel (XLA:CPU's linear algebra), ``widened``
    (the activation computed in 16 bits, cast to float32 before the function) is
    the hand-cast program: its gradient is 16-bit where the activation is.
    """
    for candidate in (fun, widened):
        try:
            total = _summed(hand_cast_fun(candidate, dtype))
            return np.asarray(jax.jit(jax.grad(total))(*args))
        except Exception:  # no 16-bit kernel: try the widened one, then float32 alone
            continue
    return None


def _check_grad(
    fun: Callable, args: list, policy: str, promotion: str | None, widened: Callable | None = None
) -> list[str]:
    with jax.numpy_dtype_promotion(promotion or jax.config.jax_numpy_dtype_promotion):
        return _grad_failures(fun, args, policy, widened)


def _grad_failures(fun: Callable, args: list, policy: str, widened: Callable | None) -> list[str]:
    total = _summed(fun)
    try:
        want = np.asarray(jax.jit(jax.grad(total))(*args))
    except Exception:  # not differentiable in float32: nothing to check
        return []
    try:
        got = jax.jit(jax.grad(_summed(jaxamp.autocast(fun, policy))))(*args)
    except Exception as e:  # reported as a failure
        return [f"grad raised {type(e).__name__}: {str(e)[:200]}"]
    should = np.isfinite(want)
    hand = _hand_cast_grad(fun, args, jaxamp.get_policy(policy).compute_dtype, widened)
    if hand is not None:  # a gradient beyond the 16-bit range is inf by hand too
        should &= np.isfinite(hand)
    if np.any(should & ~np.isfinite(np.asarray(got))):
        return ["grad non-finite where float32's and the hand-cast reference's are finite"]
    return []


def public_functions(module: Any) -> list[tuple[str, Callable]]:
    """The module's public callables that are functions (not classes or modules)."""
    out = []
    for name in sorted(dir(module)):
        value = getattr(module, name, None)
        if name.startswith("_") or not callable(value):
            continue
        if inspect.isclass(value) or inspect.ismodule(value) or typing.get_origin(value):
            continue  # classes, modules, type aliases (``PrecisionLike``)
        out.append((name, value))
    return out
