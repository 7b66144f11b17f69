"""Argument lists for ``jax.numpy``, its ``linalg`` and ``fft``, ``jax.nn`` and
``jax.scipy.special`` (the form is in ``_args``).

Three ways of calling recur (the optional third element of an entry):

- ``at(k)``: the activation is the ``k``-th positional argument;
- ``plus``: a creation function (``zeros``, ``arange``, ``eye``, windows): the
  created array is added to the activation, so autocast must keep the
  created float32 values and the sum as accurate as converting by hand does;
- ``indexing``: index functions (``tril_indices``, ``diag_indices``): the
  activation is indexed with what they return;
- ``quantized(dtype)``: integer-only functions (``bitwise_*``, ``gcd``,
  ``packbits``) get the activation quantized, ``round(64 x)``, as quantization
  code feeds them; their integer outputs are checked by the discrete oracle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

N = 4


def _values(seed: int, shape, lo: float = 0.2, hi: float = 0.8) -> np.ndarray:
    return np.random.default_rng(seed).uniform(lo, hi, shape).astype(np.float32)


MAT = _values(10, (N, N))
MAT2 = _values(11, (N, N))
VEC = _values(12, (N,))
VEC2 = _values(13, (N,))
SORTED = np.float32([0.1, 0.35, 0.6, 0.9])  # breakpoints spanning the activation's range
CUBE = _values(14, (2, 2, N))
PICK = np.array([[0, 1, 1, 0]] * N, np.int32)  # which of two choices, per element
IDX = np.array([0, 2, 2, 3], np.int32)
SHIFTS = np.array([[1, 0, 2, 3]] * N, np.int32)
MASK = np.array([[True, False, True, False]] * N)
ROWS = np.array([True, False, True, True])


def at(position: int):
    """The activation as the ``position``-th positional argument."""

    def call(fun, x, *rest, **kwargs):
        rest = list(rest)
        rest.insert(position, x)
        return fun(*rest, **kwargs)

    return call


def plus(fun, x, *rest, **kwargs):
    """A created array added to the activation (reshaped to it when sizes match)."""
    made = fun(*rest, **kwargs)
    return x + (jnp.reshape(made, x.shape) if made.size == x.size else made)


def indexing(fun, x, *rest, **kwargs):
    """The activation indexed with the index arrays ``fun`` returns."""
    return x[fun(*rest, **kwargs)]


def quantized(dtype=jnp.int32):
    """The activation rounded to integers (``round(64 x)``) before ``fun``."""

    def call(fun, x, *rest, **kwargs):
        return fun(jnp.round(x * 64).astype(dtype), *rest, **kwargs)

    return call


def standard(call=None):
    """``call`` (or ``fun`` itself) under JAX's standard promotion: for functions whose
    own implementation mixes dtypes that the tests' strict promotion rejects."""

    def wrapped(fun, x, *rest, **kwargs):
        with jax.numpy_dtype_promotion("standard"):
            return call(fun, x, *rest, **kwargs) if call else fun(x, *rest, **kwargs)

    return wrapped


# A rational approximation's coefficients (expi's, 0 < x <= 2): fixed constants
# float16 cannot hold, as special-function code has them.
COEFFS = np.float32([-5.35, 218.5, -4176.6, 55411.8, -331338.1, 1592627.2])


def _fixed_coefficients(fun, x):
    return fun(COEFFS, x)


def _first_of_two(fun, x, pick, y, **kwargs):
    return fun(pick, [x, y], **kwargs)


def _conditions(fun, x, y):
    return fun([x < 0.5, x >= 0.5], [x, y])


def _pieces(fun, x):
    return fun(x, [x < 0.5, x >= 0.5], [jnp.sin, jnp.cos])


def _full(fun, x):
    return fun((N, N), x)


def _ufunc(fun, x, y):
    return fun(jnp.multiply, 2, 1)(x, y)


def _vectorized(fun, x):
    return fun(lambda v: v / jnp.sum(v), signature="(n)->(n)")(x)


def _list_of(fun, x, *rest, **kwargs):
    return fun([x, *rest], **kwargs)


def _weights(fun, x, idx):
    return fun(idx, weights=x, length=N)


def _multi_index(fun, x):
    q = jnp.round(x * 4).astype(jnp.int32)
    return fun((q, q.T), (N, N), mode="clip")


_QUANTIZED_UNARY = ("bitwise_count", "bitwise_invert", "bitwise_not", "invert")
_QUANTIZED_BINARY = (
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "bitwise_left_shift",
    "bitwise_right_shift",
    "left_shift",
    "right_shift",
    "gcd",
    "lcm",
)
_WINDOWS = ("bartlett", "blackman", "hamming", "hanning")
_SIZED = ("argwhere", "flatnonzero", "nonzero", "unique_values")

SPECIFIC: dict[str, list[tuple]] = {
    # Activation elsewhere than first.
    "jax.numpy.apply_along_axis": [((MAT, jnp.cumsum, 1), {}, at(2))],
    "jax.numpy.apply_over_axes": [((MAT, jnp.sum, [0]), {}, at(1))],
    "jax.numpy.compress": [((MAT, ROWS), {"axis": 0, "size": 3}, at(1))],
    "jax.numpy.extract": [((MAT, MASK), {"size": N * N // 2}, at(1))],
    "jax.numpy.choose": [((MAT, PICK, MAT2), {"mode": "clip"}, _first_of_two)],
    "jax.numpy.select": [((MAT, MAT2), {}, _conditions)],
    "jax.numpy.piecewise": [((MAT,), {}, _pieces)],
    "jax.numpy.bincount": [((VEC, IDX), {}, _weights)],
    "jax.numpy.full": [((VEC,), {}, _full)],
    "jax.numpy.frompyfunc": [((MAT, MAT2), {}, _ufunc)],
    "jax.numpy.vectorize": [((MAT,), {}, _vectorized)],
    "jax.numpy.ravel_multi_index": [((MAT,), {}, _multi_index)],
    "jax.numpy.polyval": [((MAT,), {}, _fixed_coefficients)],
    # Static arguments the generic lists lack.
    "jax.numpy.astype": [((MAT, jnp.float32), {})],
    "jax.numpy.moveaxis": [((MAT, 0, 1), {})],
    "jax.numpy.swapaxes": [((MAT, 0, 1), {})],
    "jax.numpy.permute_dims": [((MAT, (1, 0)), {})],
    "jax.numpy.dsplit": [((CUBE, 2), {})],
    "jax.numpy.cross": [((MAT[:, :3], MAT2[:, :3]), {})],
    "jax.numpy.fill_diagonal": [((MAT, 0.5), {"inplace": False})],
    "jax.numpy.insert": [((MAT, 1, VEC2), {"axis": 0})],
    "jax.numpy.interp": [((MAT, SORTED, VEC2), {})],
    "jax.numpy.place": [((MAT, MASK, VEC2), {"inplace": False})],
    "jax.numpy.put": [((MAT, IDX, VEC2), {"inplace": False})],
    "jax.numpy.put_along_axis": [((MAT, SHIFTS, MAT2), {"axis": 1, "inplace": False})],
    "jax.numpy.polyfit": [((VEC, VEC2, 2), {})],
    "jax.numpy.roots": [((VEC,), {"strip_zeros": False})],
    "jax.numpy.intersect1d": [((VEC, VEC2), {"size": N})],
    "jax.numpy.setdiff1d": [((VEC, VEC2), {"size": N})],
    "jax.numpy.setxor1d": [((VEC, VEC2), {"size": 2 * N})],
    "jax.numpy.union1d": [((VEC, VEC2), {"size": 2 * N})],
    "jax.numpy.unique": [((MAT,), {"size": N * N, "return_counts": True})],
    "jax.numpy.unique_all": [((MAT,), {"size": N * N})],
    "jax.numpy.unique_counts": [((MAT,), {"size": N * N})],
    "jax.numpy.unique_inverse": [((MAT,), {"size": N * N})],
    **{f"jax.numpy.{name}": [((MAT,), {"size": N * N})] for name in _SIZED},
    # Integer-only functions, on the quantized activation.
    **{f"jax.numpy.{name}": [((MAT,), {}, quantized())] for name in _QUANTIZED_UNARY},
    **{f"jax.numpy.{name}": [((MAT, SHIFTS), {}, quantized())] for name in _QUANTIZED_BINARY},
    "jax.numpy.packbits": [((MAT,), {"axis": -1}, quantized())],
    "jax.numpy.unpackbits": [((MAT,), {"axis": -1}, quantized(jnp.uint8))],
    # Creation functions, their result added to the activation.
    **{f"jax.numpy.{name}": [((MAT, N), {}, plus)] for name in _WINDOWS},
    "jax.numpy.kaiser": [((MAT, N, 5.0), {}, plus)],
    "jax.numpy.arange": [((MAT, float(N)), {}, plus)],
    "jax.numpy.empty": [((MAT, (N, N)), {}, plus)],
    "jax.numpy.zeros": [((MAT, (N, N)), {}, plus)],
    "jax.numpy.ones": [((MAT, (N, N)), {}, plus)],
    "jax.numpy.eye": [((MAT, N), {}, plus)],
    "jax.numpy.identity": [((MAT, N), {}, plus)],
    "jax.numpy.tri": [((MAT, N), {}, plus)],
    "jax.numpy.indices": [((MAT, (N, N)), {"dtype": jnp.float32}, plus)],
    "jax.numpy.fft.fftfreq": [((MAT, N), {}, plus)],
    "jax.numpy.fft.rfftfreq": [((MAT, 2 * N - 2), {}, plus)],
    "jax.scipy.special.bernoulli": [((MAT, N - 1), {}, plus)],
    # Index functions: the activation indexed with their result.
    "jax.numpy.diag_indices": [((MAT, N), {}, indexing)],
    "jax.numpy.tril_indices": [((MAT, N), {}, indexing)],
    "jax.numpy.triu_indices": [((MAT, N), {}, indexing)],
    "jax.numpy.mask_indices": [((MAT, N, jnp.triu), {"size": N * (N + 1) // 2}, indexing)],
    # linalg
    "jax.numpy.linalg.cross": [((MAT[:, :3], MAT2[:, :3]), {})],
    "jax.numpy.linalg.multi_dot": [((MAT, MAT2, MAT), {}, _list_of)],
    "jax.numpy.linalg.tensorinv": [((MAT + 2 * np.eye(N, dtype=np.float32), 1), {})],
    "jax.numpy.linalg.tensorsolve": [((MAT + 2 * np.eye(N, dtype=np.float32), VEC), {})],
    # scipy.special: orders and parameters first.
    "jax.scipy.special.bessel_jn": [((MAT,), {"v": 2})],
    "jax.scipy.special.polygamma": [((MAT, 1), {}, at(1))],
    "jax.scipy.special.hyp1f1": [((MAT, 0.5, 1.5), {}, standard(at(2)))],
    "jax.scipy.special.hyp2f1": [((MAT, 0.5, 1.0, 1.5), {}, at(3))],
    "jax.scipy.special.sph_harm_y": [
        ((VEC, np.full(N, 2, np.int32), IDX % 2, VEC2), {"n_max": 3}, standard(at(2)))
    ],
}
