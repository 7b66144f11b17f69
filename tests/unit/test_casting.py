"""cast_floating and policy casting: only floating array leaves change."""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp

FLOATS = ["float16", "bfloat16", "float32"]
OTHERS = ["int8", "int32", "uint8", "bool", "complex64"]


def _mixed_tree():
    return {
        "w": jnp.ones((2, 3), jnp.float32),
        "b": np.ones(3, np.float32),
        "h": jnp.ones(2, jnp.float16),
        "step": jnp.int32(3),
        "mask": np.array([True, False]),
        "ids": np.arange(4),
        "key": jax.random.key(0),
        "raw_key": jax.random.PRNGKey(0),
        "lr": 0.1,
        "name": "layer",
        "nothing": None,
        "nested": [jnp.zeros(1, jnp.bfloat16), (np.float32(2.0), 7)],
    }


def test_cast_floating_changes_only_floating_arrays():
    tree = _mixed_tree()
    out = jaxamp.cast_floating(tree, jnp.bfloat16)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    assert out["w"].dtype == jnp.bfloat16 and isinstance(out["w"], jax.Array)
    assert out["b"].dtype == jnp.bfloat16 and isinstance(out["b"], np.ndarray)
    assert out["h"].dtype == jnp.bfloat16
    assert out["nested"][1][0].dtype == jnp.bfloat16
    for key in ("step", "mask", "ids", "key", "raw_key", "lr", "name", "nothing"):
        assert out[key] is tree[key]
    assert out["nested"][1][1] == 7
    assert isinstance(out["ids"], np.ndarray)


@pytest.mark.parametrize(
    "spec", ["p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32", "bf16", "f16", "c=bf16"]
)
def test_casting_dtypes_match_jmp(spec):
    tree = {
        "w": jnp.ones(3, jnp.float32),
        "h": jnp.ones(3, jnp.float16),
        "i": jnp.arange(3),
        "b": jnp.array([True]),
    }
    ours, theirs = jaxamp.get_policy(spec), jmp.get_policy(spec)
    for method in ("cast_to_param", "cast_to_compute", "cast_to_output"):
        a = jax.tree.map(lambda x: x.dtype, getattr(ours, method)(tree))
        b = jax.tree.map(lambda x: x.dtype, getattr(theirs, method)(tree))
        assert a == b, method


def test_cast_inside_jit_and_of_shape_dtype_structs():
    f = jax.jit(lambda t: jaxamp.cast_floating(t, jnp.float16))
    assert f({"a": jnp.ones(2)})["a"].dtype == jnp.float16
    sds = jaxamp.cast_floating(jax.ShapeDtypeStruct((2,), jnp.float32), "bf16")
    assert sds.dtype == jnp.bfloat16 and sds.shape == (2,)


def test_cast_values_round_like_astype():
    x = jnp.array([1.0 + 2.0**-9, 3.14159, 65504.0, 1e6], jnp.float32)
    assert np.array_equal(jaxamp.cast_floating(x, jnp.float16), x.astype(jnp.float16))


@pytest.mark.parametrize("bad", [jnp.int32, "int8", "complex64", "bool", "float42", object()])
def test_bad_target_dtype(bad):
    with pytest.raises(TypeError, match="dtype must be a floating-point dtype"):
        jaxamp.cast_floating({"a": jnp.ones(1)}, bad)


def test_float64_without_x64_is_loud():
    assert not jax.config.jax_enable_x64
    with pytest.raises(ValueError, match="jax_enable_x64"):
        jaxamp.cast_floating(jnp.ones(2), jnp.float64)
    # NumPy arrays can always be float64.
    assert jaxamp.cast_floating(np.ones(2, np.float32), "f64").dtype == np.float64


@st.composite
def trees(draw):
    def leaf():
        kind = st.sampled_from(FLOATS + OTHERS + ["py", "str", "none", "np"])
        shape = st.lists(st.integers(0, 3), max_size=2).map(tuple)
        return st.tuples(kind, shape)

    specs = draw(st.lists(leaf(), max_size=6))
    out = []
    for kind, shape in specs:
        if kind == "py":
            out.append(1.5)
        elif kind == "str":
            out.append("s")
        elif kind == "none":
            out.append(None)
        elif kind == "np":
            out.append(np.zeros(shape, np.float32))
        else:
            out.append(jnp.zeros(shape, kind))
    nest = draw(st.booleans())
    return {"a": out[: len(out) // 2], "b": tuple(out[len(out) // 2 :])} if nest else out


@settings(max_examples=60, deadline=None)
@given(tree=trees(), target=st.sampled_from(FLOATS))
def test_property_structure_kept_only_floating_change(tree, target):
    out = jaxamp.cast_floating(tree, target)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for before, after in zip(jax.tree.leaves(tree), jax.tree.leaves(out), strict=True):
        if hasattr(before, "dtype") and jnp.issubdtype(before.dtype, jnp.floating):
            assert after.dtype == jnp.dtype(target)
            assert after.shape == before.shape
            assert type(after) is type(before) or isinstance(after, jax.Array)
        else:
            assert after is before
