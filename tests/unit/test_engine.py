"""The jaxpr engine's contracts: one trace helper, one path scheme, tables that hold rules.

The numerics report's catalog and its instrumented evaluation must agree on
every site: a disagreement raises instead of leaving a site unmeasured.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._autocast import _caster, _dispatch
from jaxamp._autocast._control_flow import HIGHER_ORDER_RULES
from jaxamp._engine import _compat as compat
from jaxamp._engine import _control as control
from jaxamp._engine._trace import flatten_call, trace
from jaxamp._engine._visit import sub_path, walk
from jaxamp._numerics._instrument import instrumented
from jaxamp._numerics._sites import catalog, site_key


def _program(w, x):
    def body(c, v):
        return jnp.tanh(c * v), jnp.sin(c)

    c, ys = jax.lax.scan(body, x[0], x)
    c = jax.lax.cond(c.sum() > 0, jnp.exp, jnp.cos, c)
    return jax.jit(lambda z: jax.checkpoint(jnp.sin)(z @ w))(c).sum() + ys.sum()


W, X = jnp.full((3, 3), 0.5), jnp.linspace(0.1, 1.0, 12).reshape(4, 3)


def test_flatten_call_traces_array_leaves_and_keeps_the_rest_static():
    def f(tree, scale, *, name):
        assert name == "n" and scale == 2
        return tree["a"] * scale + tree["b"]

    args = ({"a": jnp.ones(2), "b": np.ones(2, np.float32)}, 2)
    call, arrays, _, static, paths = flatten_call(f, args, {"name": "n"})
    assert len(arrays) == 2 and static == [2, "n"]
    assert [jax.tree_util.keystr(p) for p in paths] == ["[0][0]['a']", "[0][0]['b']"]
    np.testing.assert_array_equal(call(*arrays), f(*args, name="n"))
    traced = trace(f, args, {"name": "n"})
    assert len(traced.closed.jaxpr.invars) == 2
    (out,) = jax.core.eval_jaxpr(traced.closed.jaxpr, traced.closed.consts, *traced.arrays)
    np.testing.assert_array_equal(jax.tree.unflatten(traced.out_tree, [out]), 3 * np.ones(2))


def test_sub_path_is_the_one_path_scheme():
    assert sub_path((), 3) == ((3, 0),)
    assert sub_path(((3, 0),), 1, 2) == ((3, 0), (1, 2))
    assert site_key(sub_path((), 3), 5, 1) == (((3, 0),), 5, 1)


def test_structured_rules_cover_the_call_like_and_loop_primitives():
    table = control.structured_rules(call="c", loop="l", branch="b", extra={"x": "x", "jit": None})
    assert set(table) == {*control.STRUCTURED_NAMES, "x"} - {"jit"}
    assert {table[name] for name in compat.INLINE_NAMES if name != "jit"} == {"c"}
    assert (table["scan"], table["while"], table["cond"]) == ("l", "l", "b")


def test_parts_split_the_operands_of_loops_and_branches():
    jaxpr = jax.make_jaxpr(_program)(W, X).jaxpr
    scan, cond = (e for e in jaxpr.eqns if e.primitive.name in ("scan", "cond"))
    ins = list(range(len(scan.invars)))
    loop = control.loop_of(scan, ins)
    assert [*loop.consts, *loop.carry, *loop.xs] == ins and loop.n_carry == 1
    assert loop.xs == [ins[-1]] and loop.cond is None and loop.returns_body_outputs
    branch = control.branch_of(cond, ["i", "o"])
    assert (branch.index, branch.operands, len(branch.branches)) == ("i", ["o"], 2)
    whl = jax.make_jaxpr(
        lambda a: jax.lax.while_loop(lambda c: c[0] < a, lambda c: (c[0] * a, c[1] + c[0]), (a, a))
    )
    loop = control.loop_of(whl(1.0).jaxpr.eqns[0], ["a", "b", "c0", "c1"])
    assert (loop.cond_consts, loop.consts, loop.carry, loop.xs) == (["a"], ["b"], ["c0", "c1"], [])
    assert not loop.returns_body_outputs


def test_carry_fixpoint_stops_when_nothing_moves_and_at_the_bound():
    rounds = []

    def body(carry):  # flag i is set by flag i - 1: a chain of carries
        rounds.append(list(carry))
        return [False, *carry[:-1]]

    def join(carry, outs):
        return [a or b for a, b in zip(carry, outs, strict=True)]

    assert control.carry_fixpoint(body, [True, False, False], join) == [True] * 3
    assert len(rounds) == 3  # two rounds move a flag, the third changes nothing
    rounds.clear()
    chain = [True] + [False] * (2 * control.CARRY_ROUNDS)
    assert sum(control.carry_fixpoint(body, chain, join)) == control.CARRY_ROUNDS + 1
    assert len(rounds) == control.CARRY_ROUNDS


def test_walk_counts_scan_bodies_per_iteration():
    closed = jax.make_jaxpr(_program)(W, X)
    counts = {eqn.primitive.name: n for eqn, n in walk(closed.jaxpr)}
    assert counts["tanh"] == 4 and counts["dot_general"] == 1


def test_autocast_table_holds_the_rule_itself():
    table = _dispatch.rule_table(None)
    assert set(table) == set(jaxamp.AUTOCAST_RULES)
    for name, kind in jaxamp.AUTOCAST_RULES.items():
        want = HIGHER_ORDER_RULES[name] if kind == "recurse" else _caster.KIND_RULES[kind]
        assert table[name] is want, name
    # convert_element_type's rule is what AUTOCAST_RULES says: follow.
    assert jaxamp.AUTOCAST_RULES["convert_element_type"] == "follow"
    assert table["convert_element_type"] is _caster.follow


def test_an_explicit_cast_under_follow_is_kept():
    def f(w, x):
        y = x @ w
        return y.astype(jnp.bfloat16).astype(jnp.float32) + y

    jaxpr = jax.make_jaxpr(jaxamp.autocast(f))(W, X[:2]).jaxpr
    # The upcast is respected, so the sum with the bfloat16 activation runs in float32.
    (add,) = [e for e in jaxpr.eqns if e.primitive.name == "add"]
    assert [v.aval.dtype for v in add.invars] == [jnp.float32, jnp.float32]


def _catalogued():
    closed = jax.make_jaxpr(_program)(W, X)
    return closed, catalog(closed, [False, False], ["forward"])


def test_catalog_and_evaluation_agree_on_every_site():
    closed, sites = _catalogued()
    floats, _ = jax.device_get(instrumented(closed, sites)(W, X))
    assert len(sites) == len(floats) > 10
    assert {len(site.key[0]) for site in sites} >= {0, 1, 2}  # top level, bodies, nested


def test_a_site_missing_from_the_catalog_raises():
    closed, sites = _catalogued()
    with pytest.raises(RuntimeError, match="has no site in the catalog"):
        instrumented(closed, sites[:-1])(W, X)


def test_a_site_the_evaluation_never_reaches_raises():
    closed, sites = _catalogued()
    stray = sites[0]._replace(key=site_key(sub_path((), 99), 0, 0))
    with pytest.raises(RuntimeError, match="never reached the sites"):
        instrumented(closed, [*sites, stray])(W, X)
