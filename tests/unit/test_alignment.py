"""Tensor Core alignment utilities."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp


@given(n=st.integers(0, 10**6), multiple=st.integers(1, 512))
def test_align_dim_is_smallest_multiple_at_least_n(n, multiple):
    m = jaxamp.align_dim(n, multiple)
    assert type(m) is int
    assert m % multiple == 0 and m >= n and m - n < multiple


def test_align_dim_examples():
    assert jaxamp.align_dim(50257, 64) == 50304
    assert jaxamp.align_dim(7) == 8 and jaxamp.align_dim(8) == 8 and jaxamp.align_dim(0) == 0
    assert jaxamp.align_dim(np.int64(9), np.int32(4)) == 12


@pytest.mark.parametrize(
    "n, multiple, error, fragment",
    [
        (-1, 8, ValueError, "n must be >= 0"),
        (5, 0, ValueError, "multiple must be >= 1"),
        (5, -8, ValueError, "multiple must be >= 1"),
        (5.0, 8, TypeError, "n must be a Python int"),
        (True, 8, TypeError, "n must be a Python int"),
        (5, "8", TypeError, "multiple must be a Python int"),
    ],
)
def test_align_dim_bad_input(n, multiple, error, fragment):
    with pytest.raises(error, match=fragment):
        jaxamp.align_dim(n, multiple)


@settings(deadline=None, max_examples=40)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    multiple=st.integers(1, 8),
    data=st.data(),
)
def test_pad_to_multiple_property(shape, multiple, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    y = jaxamp.pad_to_multiple(x, multiple, axis=axis, value=-1)
    assert y.shape[axis] == jaxamp.align_dim(shape[axis], multiple)
    assert y.dtype == x.dtype
    index = [slice(None)] * len(shape)
    index[axis] = slice(0, shape[axis])
    assert np.array_equal(y[tuple(index)], x)
    index[axis] = slice(shape[axis], None)
    assert np.all(y[tuple(index)] == -1)


def test_pad_to_multiple_keeps_dtype_and_aligned_input():
    x = jnp.ones((3, 16), jnp.bfloat16)
    assert jaxamp.pad_to_multiple(x, 8) is x
    assert jaxamp.pad_to_multiple(x, 8, axis=0).shape == (8, 16)
    assert jaxamp.pad_to_multiple(jnp.arange(3), 4).dtype == jnp.int32


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        (dict(multiple=0), ValueError, "multiple must be >= 1"),
        (dict(multiple=8, axis=2), ValueError, "axis 2 is out of range"),
        (dict(multiple=8, axis=-3), ValueError, "axis -3 is out of range"),
        (dict(multiple=2.5), TypeError, "multiple must be a Python int"),
    ],
)
def test_pad_to_multiple_bad_input(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        jaxamp.pad_to_multiple(jnp.ones((2, 3)), **kwargs)


@pytest.mark.parametrize(
    "dtype, expected",
    [
        (jnp.float16, 8),
        (jnp.bfloat16, 8),
        ("float32", 4),
        (jnp.float64, 2),
        (jnp.int8, 16),
        (jnp.uint8, 16),
        (jnp.float8_e4m3fn, 16),
        (jnp.float8_e5m2, 16),
        (jnp.int4, 32),
    ],
)
def test_tensor_core_multiple_follows_16_byte_rule(dtype, expected):
    assert jaxamp.tensor_core_multiple(dtype) == expected


@pytest.mark.parametrize("dtype", [jnp.bool_, jnp.complex64, "nonsense"])
def test_tensor_core_multiple_bad_dtype(dtype):
    with pytest.raises(TypeError, match="dtype must be a"):
        jaxamp.tensor_core_multiple(dtype)
