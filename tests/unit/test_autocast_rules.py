"""The rule table against the installed JAX, and rules given per call.

No stale key, no higher-order primitive without a rule: a JAX upgrade that
renames a primitive (``pjit`` -> ``jit``, ``scatter_add`` -> ``scatter-add``) or
adds a higher-order one fails here, naming it, instead of in a user's run. The
primitives JAX defines are enumerated from its public modules and from tracing a
zoo of programs that use every higher-order primitive autocast knows (and a few
more).
"""

import importlib
import importlib.util
import pathlib
import re
import warnings

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import jaxamp
from jaxamp._engine import _compat as compat
from jaxamp._engine._visit import walk
from tests.helpers import assert_close, dot_dtypes

PUBLIC_MODULES = ("jax.lax", "jax.extend.core.primitives", "jax.random", "jax.nn")


def _public_primitives() -> set[str]:
    names = set()
    for module in PUBLIC_MODULES:
        mod = importlib.import_module(module)
        names |= {v.name for v in vars(mod).values() if isinstance(v, jex.Primitive)}
    return names


@jax.custom_vjp
def _custom_vjp_sin(x):
    return jnp.sin(x)


_custom_vjp_sin.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))


def _zoo(x):
    """One differentiable program with most higher-order primitives the table names."""
    mesh = jax.make_mesh((1,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec
    m = jnp.outer(x, x) + jnp.eye(x.shape[0])
    y = jax.lax.scan(lambda c, v: (c + v, c * v), 0.0, x)[1]
    y = y + jax.lax.fori_loop(0, 2, lambda i, c: c * 0.5, x)
    y = y + jax.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x)
    y = y + jax.lax.platform_dependent(x, cpu=jnp.tanh, default=jnp.sin)
    y = y + jax.checkpoint(jnp.sin)(x) + jax.jit(jnp.cos)(x) + jax.nn.relu(x)
    y = y + _custom_vjp_sin(x) + jnp.linalg.solve(m, x)
    y = y + jax.shard_map(jnp.sin, mesh=mesh, in_specs=spec(), out_specs=spec())(x)
    y = y.at[0].add(1.0).at[1].multiply(2.0).at[2].min(0.0).at[3].max(0.0).at[0].set(1.0)
    y = y + jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (2,), (1,), "SAME")
    y = y + jax.lax.ragged_dot(m, jnp.stack([m, m])[:, :, :2], jnp.array([1, 3]))[:, 0]
    return y + jax.lax.sort(x) + jax.lax.top_k(x, 2)[0].sum()


def _forward_only(x):
    """The rest: not reverse-differentiable."""
    y = jax.lax.while_loop(lambda c: c[0] > 10.0, lambda c: c * 0.5, x)
    y = y + jax.lax.reduce((x, x), (0.0, 0.0), lambda a, b: (a[0] + b[0], a[1]), (0,))[0]
    y = y + jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    y = y + jnp.ldexp(*jnp.frexp(x)) + jnp.searchsorted(x, x[::-1]).astype(x.dtype)
    return y + io_callback(np.cos, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


X = jnp.arange(1.0, 5.0)


def _traced_equations():
    programs = [
        jax.make_jaxpr(_zoo)(X),
        jax.make_jaxpr(jax.grad(lambda x: _zoo(x).sum()))(X),
        jax.make_jaxpr(_forward_only)(X),
    ]
    return [eqn for closed in programs for eqn, _ in walk(closed.jaxpr)]


def test_every_rule_key_names_a_primitive_of_this_jax():
    defined = _public_primitives() | {e.primitive.name for e in _traced_equations()}
    other_version = set(compat.VERSION_SPECIFIC_PRIMITIVES)
    stale = sorted(set(jaxamp.AUTOCAST_RULES) - defined - other_version)
    assert not stale, f"AUTOCAST_RULES names primitives jax {jax.__version__} lacks: {stale}"
    # A version-specific name is listed for the version that has it.
    present = sorted(other_version & defined)
    absent = sorted(other_version - defined)
    assert present and absent, (present, absent)


def test_every_higher_order_primitive_met_has_a_rule():
    holders = {e.primitive.name for e in _traced_equations() if compat.eqn_has_subjaxprs(e)}
    missing = sorted(holders - set(jaxamp.AUTOCAST_RULES))
    assert not missing, f"higher-order primitives of jax {jax.__version__} with no rule: {missing}"
    # The zoo really uses the higher-order primitives it is meant to.
    expected = {"scan", "while", "cond", "shard_map", "scatter-add", "custom_vjp_call", "jit"}
    assert expected <= holders, holders


def test_the_zoo_runs_under_autocast_without_unknown_primitives():
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxamp.UnknownPrimitiveWarning)
        for fun in (_zoo, _forward_only):
            exact = jax.jit(jaxamp.autocast(fun, "float32"))(X)
            np.testing.assert_array_equal(exact, jax.jit(fun)(X))
            assert np.isfinite(np.asarray(jax.jit(jaxamp.autocast(fun))(X))).all()
        grads = jax.jit(jax.grad(lambda x: jaxamp.autocast(_zoo)(x).sum()))(X)
    assert np.isfinite(np.asarray(grads)).all()


def _root_by_fixed_iterations(a, b):
    # 30 gradient steps on |a x - b|^2 inside lax.custom_root (jax 0.12: call_hi_primitive).
    def solve(_, x0):
        return jax.lax.fori_loop(0, 30, lambda i, x: x - 0.1 * (a @ x - b), x0)

    return jax.lax.custom_root(lambda x: a @ x - b, jnp.zeros_like(b), solve, lambda g, y: y)


def test_operations_held_in_hi_primitives_are_seen_and_typed():
    w, x = jnp.eye(4), jnp.array([[0.3, -1.5, 7.0, 2.5]])

    def ldexp(w, x):
        return jnp.ldexp(x @ w, 3)

    def frexp_ldexp(w, x):
        mantissa, exponent = jnp.frexp(x @ w)
        return jnp.ldexp(mantissa, exponent + 1)

    def lookups(w, x):
        h = (x @ w)[0]
        grid = jnp.linspace(-2.0, 8.0, 5)
        counts = jnp.histogram(h, bins=grid)[0].astype(h.dtype)
        first = jnp.nonzero(h > 0, size=4)[0].astype(h.dtype)
        return jnp.interp(h, grid, grid**2) + counts.sum() + first

    for fun in (ldexp, frexp_ldexp, lookups):
        out = jax.jit(jaxamp.autocast(fun))(w, x)
        assert out.dtype == jnp.float32, fun.__name__
        np.testing.assert_allclose(out, fun(w, x), rtol=2e-2, err_msg=fun.__name__)
        np.testing.assert_array_equal(jax.jit(jaxamp.autocast(fun, "float32"))(w, x), fun(w, x))
    a, b = 2.0 * jnp.eye(4), jnp.ones(4)
    report = jaxamp.precision_report(_root_by_fixed_iterations, a, b)
    assert sum(m.count for m in report.matmuls) == 30
    got = jax.jit(jaxamp.autocast(_root_by_fixed_iterations))(a, b)
    np.testing.assert_allclose(got, _root_by_fixed_iterations(a, b), rtol=2e-2)


def test_per_call_rules_override_and_callable():
    w0 = jax.random.normal(jax.random.key(0), (8, 8), jnp.float32) * 0.3
    x0 = jax.random.normal(jax.random.key(1), (4, 8), jnp.float32)

    def f(w, x):
        return jnp.tanh(x @ w)

    # tanh in float32 by rule; matmuls unchanged by "keep" -> float32.
    jaxpr = jax.make_jaxpr(jaxamp.autocast(f, rules={jax.lax.tanh_p: "float32"}))(w0, x0).jaxpr
    tanh_dtypes = [e.outvars[0].aval.dtype for e in jaxpr.eqns if e.primitive.name == "tanh"]
    assert tanh_dtypes == [jnp.float32]
    dtypes = set(dot_dtypes(jaxamp.autocast(f, rules={"dot_general": "keep"}), w0, x0))
    assert dtypes == {("float32", "float32")}

    calls = []

    def double_tanh(autocaster, eqn, x):
        calls.append(autocaster.compute_dtype)
        return [2.0 * autocaster.bind(eqn, x)[0]]

    out = jaxamp.autocast(f, rules={"tanh": double_tanh})(w0, x0)
    assert calls == [jnp.bfloat16]
    assert_close(out, 2.0 * f(w0, x0))


def test_recurse_names_exactly_the_primitives_with_a_built_in_rule():
    from jaxamp._autocast._control_flow import HIGHER_ORDER_RULES

    recurse = {name for name, kind in jaxamp.AUTOCAST_RULES.items() if kind == "recurse"}
    assert recurse == set(HIGHER_ORDER_RULES)
    assert set(compat.CALL_NAMES) <= recurse  # "call"/"closed_call", jax 0.12's "eval_jaxpr"


def test_the_call_primitive_of_this_jax_is_evaluated_inline():
    # closed_call_p is "closed_call" up to jax 0.11 and "eval_jaxpr" from 0.12.
    from jax.extend.core.primitives import closed_call_p

    w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    body = jax.make_jaxpr(lambda w, x: jnp.tanh(x @ w))(w, x)

    params = closed_call_p.get_bind_params({"call_jaxpr": body})  # jax 0.10: its subfuns

    def f(w, x):
        return closed_call_p.bind(w, x, **params)[0]

    assert closed_call_p.name in {e.primitive.name for e, _ in walk(jax.make_jaxpr(f)(w, x).jaxpr)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxamp.UnknownPrimitiveWarning)
        assert dot_dtypes(jaxamp.autocast(f), w, x) == [("bfloat16", "bfloat16")]
        np.testing.assert_array_equal(jaxamp.autocast(f, "float32")(w, x), f(w, x))


def _docs_hooks():
    root = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("docs_hooks", root / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, root


def test_version_notes_in_the_docs_come_from_the_compat_table():
    # The generated rules table (docs/api/autocast.md, README.md) marks each rule
    # of one supported JAX only with its versions, and lists them all; the page's
    # hand-written table of higher-order primitives says the same versions.
    hooks, root = _docs_hooks()
    table = hooks.autocast_rules_table()
    versions = compat.VERSION_SPECIFIC_PRIMITIVES
    for primitive, version in versions.items():
        if primitive in jaxamp.AUTOCAST_RULES:
            assert f"`{primitive}` ({version})" in table, primitive
        assert f"`{primitive}`" in table.split("Primitives of one supported JAX only:")[1]
    page = (root / "docs" / "api" / "autocast.md").read_text()
    section = page[page.index("## Higher-order primitives") :]
    section = section[: section.index("\n## ")]
    for primitive in re.findall(r"`([\w-]+)` \(", section):
        if primitive in versions:
            assert f"`{primitive}` ({versions[primitive]}" in section, primitive
    assert all(f"`{p}`" in section for p in ("call", "closed_call", "eval_jaxpr"))


def test_every_mention_of_a_version_specific_primitive_carries_its_versions():
    # docs/api/autocast.md as built (its rules table generated by docs/hooks.py) and
    # README.md: wherever a primitive of one supported JAX only is named, its versions
    # from compat.VERSION_SPECIFIC_PRIMITIVES follow it, so no key can drift from the
    # table; every such rule key is named on the page.
    hooks, root = _docs_hooks()
    versions = compat.VERSION_SPECIFIC_PRIMITIVES
    source = (root / "docs" / "api" / "autocast.md").read_text()
    assert hooks.RULES_MARKER in source, "the page's rules table must be the generated one"
    page = source.replace(hooks.RULES_MARKER, hooks.autocast_rules_table())
    readme = (root / "README.md").read_text()
    summary = "Primitives of one supported JAX only:"  # the table's own list, grouped
    for name, text in (("docs/api/autocast.md", page), ("README.md", readme)):
        lines = [line for line in text.splitlines() if not line.startswith(summary)]
        for match in re.finditer(r"`([\w-]+)`", "\n".join(lines)):
            primitive = match[1]
            if primitive in versions:
                after = match.string[match.end() : match.end() + 40]
                assert after.startswith(f" ({versions[primitive]}"), (name, primitive, after)
    named = set(re.findall(r"`([\w-]+)` \(jax", page))
    assert set(versions) & set(jaxamp.AUTOCAST_RULES) <= named
