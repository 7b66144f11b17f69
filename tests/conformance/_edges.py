"""Argument generators along the axes where a dtype rule decides at an edge.

The namespace sweep (``_sweep``) calls each function once, on well-conditioned
4x4 matrices with entries in [0.2, 0.8] and constants of ordinary size: it
never meets a rule at the edge of its domain. Each generator here varies one
such axis and returns ``Case``s that ``_sweep.check`` and ``check_vjp`` run:

- ``linalg_cases``: non-square and ill-conditioned matrices (condition numbers
  1e1 to 1e4) for the linear algebra of ``jax.numpy.linalg``, and ``pinv``
  with a traced ``rtol`` (a custom_jvp that closes over a traced value);
- ``constant_cases``: constants at 0.5x, 1x, 1.5x and 10x the compute dtype's
  largest value and at a quarter of its smallest normal, multiplied, added and
  used as a mask fill (depends on the policy: ``policy`` is part of the case);
- ``buffer_cases``: float32 buffers receiving 16-bit updates with repeated
  indices (scatter add/max/min/mul, segment sums and maxima) and cumulative
  sums along a long axis (``cumsum``, a float32 scan carry);
- every case is differentiated: ``jax.grad`` of the summed outputs
  (``_sweep.check``) and a VJP with a random cotangent (``check_vjp``),
  both against float32 and the hand-cast program's derivative.

``CI`` picks one case per reproducer class (and policy) for the CI test; the
``slow`` test runs them all.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp
from tests.conformance import _sweep
from tests.conformance._oracles import compare
from tests.helpers import conditioned

F32 = np.dtype(np.float32)
POLICIES = ("mixed_bfloat16", "mixed_float16")
CONDITIONS = (1e1, 1e2, 1e3, 1e4)
SHAPES = ((4, 8), (8, 4), (8, 8))
CONSTANT_FACTORS = (0.5, 1.0, 1.5, 10.0)


def _rhs(rows: int) -> np.ndarray:
    return np.random.default_rng(1).uniform(0.2, 0.8, (rows, 2)).astype(F32)


# name -> (call(fun, a, *rest), square only, extra arguments of a rows x cols matrix)
_LINALG: dict[str, tuple[Callable, Callable, bool, Callable]] = {
    "pinv": (jnp.linalg.pinv, lambda f, a: f(a), False, lambda r: ()),
    "pinv_traced_rtol": (
        jnp.linalg.pinv,
        lambda f, a, r: f(a, rtol=jax.lax.stop_gradient(r)),
        False,
        lambda r: (np.asarray(1e-3, F32),),
    ),
    # Every floating output: the solution, the residuals and the singular values.
    "lstsq": (jnp.linalg.lstsq, lambda f, a, b: f(a, b), False, lambda r: (_rhs(r),)),
    "svd": (jnp.linalg.svd, lambda f, a: f(a, compute_uv=False), False, lambda r: ()),
    "solve": (jnp.linalg.solve, lambda f, a, b: f(a, b), True, lambda r: (_rhs(r),)),
    "inv": (jnp.linalg.inv, lambda f, a: f(a), True, lambda r: ()),
    "eigvalsh": (jnp.linalg.eigvalsh, lambda f, a: f(a + a.T), True, lambda r: ()),
    "slogdet": (jnp.linalg.slogdet, lambda f, a: f(a)[1], True, lambda r: ()),
}


def _case(name: str, fun: Callable, args: tuple, call: Callable | None = None) -> _sweep.Case:
    return _sweep.Case("edges", name, fun, args, {}, call)


def linalg_cases() -> list[_sweep.Case]:
    cases = []
    for name, (fun, call, square, extra) in _LINALG.items():
        for rows, cols in SHAPES:
            if square and rows != cols:
                continue
            for cond in CONDITIONS:
                args = (conditioned(rows, cols, cond), *extra(rows))
                cases.append(_case(f"{name}[{rows}x{cols},cond={cond:.0e}]", fun, args, call))
    return cases


def _activation(rows: int = 4, cols: int = 4, seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.2, 0.8, (rows, cols)).astype(F32)


_CONSTANT_USES: dict[str, Callable] = {
    "mul": lambda a, c: a * c,
    "add": lambda a, c: a + c,
    "where": lambda a, c: jnp.where(a > 0.5, a, -c),
}


def constant_values(policy: str) -> dict[str, float]:
    """The constants of ``constant_cases`` for ``policy``'s compute dtype, finite in float32."""
    info = jnp.finfo(jaxamp.get_policy(policy).compute_dtype)
    values = {f"{f}x max": f * float(info.max) for f in CONSTANT_FACTORS}
    values["tiny/4"] = float(info.tiny) / 4
    top = float(np.finfo(F32).max)
    return {k: v for k, v in values.items() if abs(v) <= top}


def constant_cases(policy: str) -> list[_sweep.Case]:
    cases = []
    for label, value in constant_values(policy).items():
        constant = np.float32(value)
        for use, op in _CONSTANT_USES.items():

            def fun(a, op=op, constant=constant):
                return op(a, constant)

            cases.append(_case(f"{use}[{label}]", fun, (_activation(),)))
    return cases


_UPDATES = 4096  # updates, on 4 slots: each slot receives ~1000


def _ids() -> np.ndarray:
    return (np.random.default_rng(3).integers(0, 4, _UPDATES)).astype(np.int32)


def _unique_ids() -> np.ndarray:
    return np.random.default_rng(4).permutation(_UPDATES)[:4].astype(np.int32) % 4


def _scan_total(a):
    # A float32 carry accumulating 16-bit rows (the hand-cast program keeps it float32).
    return jax.lax.scan(lambda c, r: (c + r, None), jnp.zeros(a.shape[1], F32), a)[0]


_BUFFERS: dict[str, tuple[Callable, Callable]] = {
    "scatter_add": (lambda a, i: jnp.zeros(4, F32).at[i].add(a[:, 0]), _ids),
    "scatter_max": (lambda a, i: jnp.full(4, -1.0, F32).at[i].max(a[:, 0] - 0.5), _ids),
    "scatter_min": (lambda a, i: jnp.full(4, 1.0, F32).at[i].min(a[:, 0] - 0.5), _ids),
    "scatter_mul": (
        lambda a, i: jnp.ones(4, F32).at[i].mul(1 + 0.01 * a[:4, 0], unique_indices=True),
        _unique_ids,
    ),
    "segment_sum": (lambda a, i: jax.ops.segment_sum(a[:, 0], i, num_segments=4), _ids),
    "segment_max": (lambda a, i: jax.ops.segment_max(a[:, 0], i, num_segments=4), _ids),
    "cumsum": (lambda a, i: jnp.cumsum(a[:, 0])[i], _ids),
    "scan_carry": (lambda a, i: _scan_total(a), _ids),
}


def buffer_cases() -> list[_sweep.Case]:
    act = _activation(_UPDATES, 4, seed=5)
    return [_case(name, fun, (act, ids())) for name, (fun, ids) in _BUFFERS.items()]


def _floating_f32(fun: Callable) -> Callable:
    def outputs(*args):
        return [o.astype(F32) for o in _sweep._floating(fun(*args))]

    return outputs


def _vjp_of(fun: Callable, cotangents: list) -> Callable:
    def vjp(w, *rest):
        _, pull = jax.vjp(lambda w: _floating_f32(fun)(w, *rest), w)
        return list(pull(cotangents))

    return vjp


def check_vjp(case: _sweep.Case, policy: str) -> list[str]:
    """A random-cotangent VJP (with respect to the matmul's weight) against float32's
    and the hand-cast program's: finite where both are, error within ``FACTOR``."""
    fun, args = _sweep._traced(case), _sweep._array_args(case)
    dtype = jaxamp.get_policy(policy).compute_dtype
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            outs = jax.eval_shape(_floating_f32(fun), *args)
            rng = np.random.default_rng(6)
            cts = [rng.standard_normal(o.shape).astype(F32) for o in outs]
            want = jax.jit(_vjp_of(fun, cts))(*args)
        except Exception:  # not differentiable in float32: nothing to check
            return []
        try:
            got = jax.jit(_vjp_of(jaxamp.autocast(fun, policy), cts))(*args)
        except Exception as e:  # reported as a failure
            return [f"vjp raised {type(e).__name__}: {str(e)[:200]}"]
        hand = []
        for candidate in (fun, _sweep._traced(case, widen=True)):
            try:
                hand = jax.jit(_vjp_of(_sweep.hand_cast_fun(candidate, dtype), cts))(*args)
                break
            except Exception:  # no 16-bit kernel: the widened program, else float32 alone
                continue
    return [f"vjp: {f}" for f in compare(want, got, [], hand, dtype)]


# Known failures left open, "case name [policy]": "open: <what fails>". Empty means none.
OPEN: dict[str, str] = {}

# One case per reproducer class for the CI test: (generator's case name, policy).
CI = (
    ("pinv[8x8,cond=1e+03]", "mixed_bfloat16"),
    ("pinv_traced_rtol[4x8,cond=1e+01]", "mixed_bfloat16"),
    ("lstsq[4x8,cond=1e+01]", "mixed_float16"),
    ("mul[1.5x max]", "mixed_float16"),
    ("add[10.0x max]", "mixed_float16"),
    ("where[1.5x max]", "mixed_float16"),
    ("mul[tiny/4]", "mixed_float16"),
    ("scatter_add", "mixed_bfloat16"),
    ("segment_sum", "mixed_float16"),
)


def _linalg_pairs() -> list[tuple[_sweep.Case, str]]:
    # One policy per case, alternating (about 7 compiled programs each), and both
    # at the lowest condition number, where rounding, not conditioning, decides:
    # lstsq's float16 residual on a wide matrix is exactly 0, its gradient NaN.
    lowest = f"cond={CONDITIONS[0]:.0e}]"
    return [
        (c, p)
        for i, c in enumerate(linalg_cases())
        for p in (POLICIES if c.name.endswith(lowest) else (POLICIES[i % 2],))
    ]


def all_cases() -> dict[str, list[tuple[_sweep.Case, str]]]:
    """Axis -> (case, policy) pairs: every generator's cases under each policy (linear
    algebra: under one, alternating, except at the lowest condition number; the CI
    cases are among them)."""
    return {
        "linalg: non-square, ill-conditioned": _linalg_pairs(),
        "constants at the range's edges": [(c, p) for p in POLICIES for c in constant_cases(p)],
        "float32 buffers, 16-bit updates": [(c, p) for c in buffer_cases() for p in POLICIES],
    }
