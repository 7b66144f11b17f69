"""all_finite and select_tree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_all_finite_detects_any_non_finite_leaf(bad, dtype):
    tree = {"a": jnp.ones((3, 3), dtype), "b": [jnp.zeros(4, dtype), jnp.int32(5)]}
    assert bool(jaxamp.all_finite(tree))
    broken = {"a": tree["a"], "b": [tree["b"][0].at[2].set(bad), tree["b"][1]]}
    assert not bool(jaxamp.all_finite(broken))
    assert not bool(jax.jit(jaxamp.all_finite)(broken))


def test_all_finite_ignores_non_floating_and_handles_empty():
    assert bool(jaxamp.all_finite({}))
    assert bool(jaxamp.all_finite({"i": jnp.arange(3), "b": jnp.array([True]), "s": "x"}))
    assert jaxamp.all_finite([]).dtype == jnp.bool_
    assert bool(jaxamp.all_finite(np.array([1.0, 2.0])))
    assert not bool(jaxamp.all_finite(jnp.array([1 + 1j, jnp.inf + 0j])))


@pytest.mark.parametrize(
    "bad", [float("nan"), float("inf"), -float("inf"), complex(1, float("nan"))]
)
def test_all_finite_checks_python_float_leaves(bad):
    assert not bool(jaxamp.all_finite({"a": bad}))
    assert not bool(jaxamp.all_finite({"a": jnp.ones(3), "b": [2, bad]}))
    assert bool(jaxamp.all_finite({"a": 1.5, "b": 3, "c": True, "d": 1 + 2j}))


def test_all_finite_is_one_flat_reduction_in_the_jaxpr():
    tree = [jnp.ones(3) for _ in range(50)]
    jaxpr = jax.make_jaxpr(jaxamp.all_finite)(tree)
    names = [e.primitive.name for e in jaxpr.eqns]
    # No chain of scalar `and`s (jmp's pattern), and no reduction per leaf: one
    # concatenation checked by one reduction, whatever the leaf count.
    assert names.count("and") == 0
    assert names.count("reduce_and") == 1
    assert names.count("concatenate") == 1


def test_all_finite_groups_by_dtype_and_size(monkeypatch):
    from jaxamp._loss_scaling import _finite

    monkeypatch.setattr(_finite, "_GROUP_ELEMENTS", 8)
    tree = [jnp.ones(5), jnp.ones(5), jnp.ones(20), jnp.ones(3, jnp.bfloat16), jnp.ones(2)]
    names = [e.primitive.name for e in jax.make_jaxpr(jaxamp.all_finite)(tree).eqns]
    # float32 groups (in order, at most 8 elements unless one leaf is bigger): [5], [5],
    # [20], [2]; bfloat16: [3]; one reduction each, and one over the five flags.
    assert names.count("reduce_and") == 5 + 1
    assert bool(jaxamp.all_finite(tree))
    for i in range(len(tree)):
        broken = list(tree)
        broken[i] = tree[i].at[-1].set(jnp.nan)
        assert not bool(jax.jit(jaxamp.all_finite)(broken)), i


def test_all_finite_checks_large_leaves_on_their_own():
    from jaxamp._loss_scaling import _finite

    big = _finite._OWN_REDUCTION_ELEMENTS
    tree = [jnp.ones((big // 64, 64)), jnp.ones(7), jnp.ones(big + 1), jnp.ones(9)]
    names = [e.primitive.name for e in jax.make_jaxpr(jaxamp.all_finite)(tree).eqns]
    # The two large leaves are reduced where they are (no copy into a concatenation),
    # the two small ones concatenated into one group; then one reduction of the flags.
    assert names.count("concatenate") == 1
    assert names.count("reduce_and") == 2 + 1 + 1
    for i in range(len(tree)):
        broken = list(tree)
        broken[i] = tree[i].at[(0,) * tree[i].ndim].set(-jnp.inf)
        assert not bool(jax.jit(jaxamp.all_finite)(broken)), i


def test_select_tree_chooses_bitwise():
    a = {"x": jnp.array([1.0, jnp.nan]), "n": jnp.int32(1)}
    b = {"x": jnp.array([3.0, 4.0]), "n": jnp.int32(2)}
    out = jax.jit(jaxamp.select_tree)(jnp.asarray(True), a, b)
    assert np.array_equal(out["x"], a["x"], equal_nan=True) and int(out["n"]) == 1
    out = jaxamp.select_tree(False, a, b)
    assert np.array_equal(out["x"], b["x"]) and int(out["n"]) == 2


@pytest.mark.parametrize(
    "pred, on_true, on_false, error, fragment",
    [
        (jnp.ones(2, bool), 1.0, 1.0, TypeError, "pred must be a bool scalar"),
        (
            jnp.asarray(True),
            {"a": jnp.ones(1)},
            {"b": jnp.ones(1)},
            ValueError,
            "same tree structure",
        ),
        (jnp.asarray(True), jnp.ones(2), jnp.ones(3), ValueError, "match in shape and dtype"),
        (jnp.asarray(True), jnp.ones(2), jnp.ones(2, jnp.bfloat16), ValueError, "match in shape"),
    ],
)
def test_select_tree_bad_input(pred, on_true, on_false, error, fragment):
    with pytest.raises(error, match=fragment):
        jaxamp.select_tree(pred, on_true, on_false)
