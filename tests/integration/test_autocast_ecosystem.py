"""autocast on the JAX that people write: scatter, linalg, shard_map, masks, MoE, erf, sources.

Each test is a reproducer of something that failed on code jaxamp did not write.
Tolerances derive from bfloat16's unit roundoff u = 2**-8 (float16: 2**-11): one
rounding of an operand or a result is within u relative, a K-long float32-accumulated
dot of rounded operands within about 2u of the exact one relative to sum |x*y|.
"""

import inspect
import warnings

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.helpers import bits, rel_err

U_BF16 = 2.0**-8
BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
W = jax.random.normal(jax.random.key(0), (8, 8), jnp.float32) * 0.3
X = jax.random.normal(jax.random.key(1), (4, 8), jnp.float32)


def _same_bits(a, b):
    assert bits(a) == bits(b)


# -- 1. primitives whose rule names were not JAX's --------------------------------

SCATTER_CASES = {
    "at_add": lambda w, x: (x @ w).at[0].add(1.0),
    "at_max": lambda w, x: (x @ w).at[:, 1].max(0.5),
    "at_min": lambda w, x: (x @ w).at[1:3].min(x[:2] @ w),
    "at_mul": lambda w, x: (x @ w).at[2].multiply(2.0),
    "at_set": lambda w, x: (x @ w).at[1].set(w[0]),
    "segment_sum": lambda w, x: jax.ops.segment_sum(x @ w, jnp.array([0, 1, 0, 2]), 3),
}


@pytest.mark.parametrize("name", sorted(SCATTER_CASES))
def test_scatter_family_runs_in_the_compute_dtype(name):
    fun = SCATTER_CASES[name]
    report = jaxamp.precision_report(jaxamp.autocast(fun), W, X)
    scatters = {k: v for k, v in report.op_dtypes.items() if k.startswith("scatter")}
    # segment_sum adds 16-bit rows into a buffer traced as float32: the sum runs in
    # float32, like a float32 loop accumulator (the .at[] updates write into the
    # activation itself, in the compute dtype).
    want = {"float32"} if name == "segment_sum" else {"bfloat16"}
    assert scatters and all(set(d) == want for d in scatters.values()), scatters
    assert rel_err(jax.jit(jaxamp.autocast(fun))(W, X), fun(W, X)) < 4 * U_BF16
    grads = jax.jit(jax.grad(lambda w: jaxamp.autocast(fun)(w, X).sum()))(W)
    assert rel_err(grads, jax.grad(lambda w: fun(w, X).sum())(W)) < 8 * U_BF16
    _same_bits(jaxamp.autocast(fun, "float32")(W, X), fun(W, X))


def test_bincount_and_linalg_solve_run_also_under_float32():
    count = jaxamp.autocast(lambda i: jnp.bincount(i, length=4), "float32")
    np.testing.assert_array_equal(count(jnp.array([0, 1, 1, 3])), [1, 2, 0, 1])
    a = jnp.eye(3) * 2.0 + 0.1
    b = jnp.arange(3.0)
    _same_bits(jaxamp.autocast(jnp.linalg.solve, "float32")(a, b), jnp.linalg.solve(a, b))
    # Under mixed_bfloat16 the solve runs as traced, in float32.
    solve = jaxamp.autocast(lambda a, b: jnp.linalg.solve(a @ a, b))
    assert rel_err(jax.jit(solve)(a, b), jnp.linalg.solve(a @ a, b)) < 8 * U_BF16


# -- 2. shard_map ------------------------------------------------------------------


def _sharded_mlp(mesh):
    spec = jax.sharding.PartitionSpec

    def body(w, x):
        return jax.lax.psum(jnp.tanh(x @ w), "i")

    def f(w, x):
        return jax.shard_map(body, mesh=mesh, in_specs=(spec(), spec("i")), out_specs=spec())(
            w, x
        ).sum(0)

    return f


def test_shard_map_body_is_rewritten_and_its_specs_stay_valid():
    f = _sharded_mlp(jax.make_mesh((1,), ("i",), axis_types=(jax.sharding.AxisType.Auto,)))
    ac = jaxamp.autocast(f)
    report = jaxamp.precision_report(ac, W, X)
    assert {m.operand_dtypes for m in report.matmuls} == {("bfloat16", "bfloat16")}
    assert rel_err(jax.jit(ac)(W, X), f(W, X)) < 4 * U_BF16
    g = jax.jit(jax.grad(lambda w: ac(w, X).sum()))(W)
    assert rel_err(g, jax.grad(lambda w: f(w, X).sum())(W)) < 8 * U_BF16
    _same_bits(jax.jit(jaxamp.autocast(f, "float32"))(W, X), jax.jit(f)(W, X))


# -- 4. source locations ------------------------------------------------------------


def _user_function(w, x):
    h = x @ w  # the matmul's line
    return jnp.exp(h).sum()  # the exp's line


def test_rewritten_equations_keep_the_users_source_line():
    _, first = inspect.getsourcelines(_user_function)
    matmul_line, exp_line = first + 1, first + 2
    here = __file__.rsplit("/", 1)[-1]
    jaxpr = jax.make_jaxpr(jaxamp.autocast(_user_function))(W, X)
    sources = {
        e.primitive.name: jax.extend.source_info_util.summarize(e.source_info)
        for e in jaxpr.jaxpr.eqns
    }
    assert f"{here}:{exp_line}" in sources["exp"], sources
    hlo = jax.jit(jax.grad(jaxamp.autocast(_user_function))).lower(W, X).as_text(debug_info=True)
    assert f'{here}":{matmul_line}' in hlo and f'{here}":{exp_line}' in hlo
    assert "_caster.py" not in hlo and "_interpreter.py" not in hlo


# -- 5. constants never overflow into the compute dtype ---------------------------


def _masked_softmax(fill):
    return lambda w, x, m: jax.nn.softmax(jnp.where(m, x @ w, fill), -1)


MASK = jnp.array([[True] * 8, [False] * 8, [True] * 4 + [False] * 4, [False] * 8])


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize(
    "fill", [float(jnp.finfo(jnp.float32).min), -1e30, -0.7 * float(jnp.finfo(jnp.float32).max)]
)
def test_fully_masked_rows_stay_finite(policy, fill):
    f = _masked_softmax(np.float32(fill))
    got = jax.jit(jaxamp.autocast(f, policy))(W, X, MASK)
    assert rel_err(got, f(W, X, MASK)) < 4 * U_BF16
    np.testing.assert_allclose(got[1], np.full(8, 1 / 8))


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_dot_product_attention_with_padded_queries_trains(policy):
    optax = pytest.importorskip("optax")
    q = jax.random.normal(jax.random.key(2), (2, 4, 2, 8))
    mask = jnp.zeros((2, 1, 4, 4), bool).at[:, :, :2, :3].set(True)  # queries 2, 3 fully padded

    def loss(w, q):
        h = q @ w
        return jax.nn.dot_product_attention(h, h, h, mask=mask).astype(jnp.float32).mean()

    want = jax.grad(loss)(W, q)
    got = jax.jit(jax.grad(jaxamp.autocast(loss, policy)))(W, q)
    assert np.isfinite(np.asarray(got)).all() and rel_err(got, want) < 16 * U_BF16
    tx = jaxamp.loss_scaling(optax.sgd(1e-2), jaxamp.DynamicLossScale(2.0**8))
    state = tx.init(W)

    @jax.jit
    def step(w, state):
        scale = jaxamp.get_loss_scale(state)
        _, g = jaxamp.scaled_value_and_grad(jaxamp.autocast(loss, policy), scale)(w, q)
        updates, state = tx.update(g, state, w)
        return w + updates, state

    w = W
    for _ in range(3):
        w, state = step(w, state)
    assert int(jaxamp.loss_scaling_metrics(state)["skipped_steps"]) == 0
    assert not np.array_equal(np.asarray(w), np.asarray(W))


def test_a_constant_beyond_the_range_stays_float32_and_infinities_stay():
    # A constant fill float16 cannot hold selects in float32, as in the hand-cast
    # program's promotion: the fill is exact, not saturated to -65504.
    def f(w, x):
        return jnp.where(x > 0, x @ w, -1e30) + jnp.where(x < -5, -jnp.inf, 0.0)

    got = jaxamp.autocast(f, "mixed_float16")(W, X)
    want = f(W, X)
    assert got.dtype == F32
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    filled = np.asarray(want) == np.float32(-1e30)
    assert filled.any()
    np.testing.assert_array_equal(np.asarray(got)[filled], np.asarray(want)[filled])


# -- 6. ragged_dot (mixture of experts) --------------------------------------------


def test_ragged_dot_is_a_matmul():
    lhs = jax.random.normal(jax.random.key(3), (12, 8))
    experts = jax.random.normal(jax.random.key(4), (3, 8, 4))
    sizes = jnp.array([5, 3, 4], jnp.int32)

    def f(a, b):
        return jax.lax.ragged_dot(a, b, sizes)

    ac = jaxamp.autocast(f)
    fwd = jaxamp.precision_report(ac, lhs, experts)
    assert [(m.primitive, m.operand_dtypes, m.accumulation_dtype) for m in fwd.matmuls] == [
        ("ragged_dot_general", ("bfloat16", "bfloat16"), "float32")
    ]
    assert fwd.total_flops == 2 * 12 * 8 * 4
    assert rel_err(jax.jit(ac)(lhs, experts), f(lhs, experts)) < 4 * U_BF16
    grad = jax.grad(lambda a, b: ac(a, b).sum(), (0, 1))
    back = jaxamp.precision_report(grad, lhs, experts)
    assert {m.operand_dtypes for m in back.matmuls} == {("bfloat16", "bfloat16")}
    want = jax.grad(lambda a, b: f(a, b).sum(), (0, 1))(lhs, experts)
    for got_g, want_g in zip(jax.jit(grad)(lhs, experts), want, strict=True):
        assert rel_err(got_g, want_g) < 4 * U_BF16


# -- 7. special functions -----------------------------------------------------------


def test_probit_loss_keeps_the_tail_of_erf():
    def probit(w, x):
        z = (x @ w)[:, 0] - 4.0
        return -jnp.log((1 + jax.lax.erf(z / jnp.sqrt(2.0))) / 2).sum()

    x = jnp.ones((2, 8))
    w = jnp.zeros((8, 8))
    want = probit(w, x)  # -log(Phi(-4)) = 10.36 per row
    got = jaxamp.autocast(probit)(w, x)
    assert np.isfinite(got) and rel_err(got, want) < 4 * U_BF16


# The criterion for the special functions in the float32 list: on some input of
# their domain the 16-bit result loses what its callers need (the float32 result
# is finite and accurate there). Evaluated in float16 on float16 inputs.
# (primitive name, function, input, what callers compute from the result)
CRITERION = [
    ("erf", jax.lax.erf, -3.5, lambda v: 1.0 + v),  # 1 + erf(z) rounds to 0
    ("erfc", jax.lax.erfc, 4.5, lambda v: v),  # 2e-10 underflows
    ("lgamma", jax.lax.lgamma, 9000.0, lambda v: v),  # 72933 overflows
    ("digamma", jax.lax.digamma, 1e-5, lambda v: v),  # -99900 overflows
    ("expm1", jnp.expm1, 12.0, lambda v: v),  # 162754 overflows
]


@pytest.mark.parametrize(("name", "fun", "x", "use"), CRITERION, ids=[c[0] for c in CRITERION])
def test_float32_special_functions_fail_in_16_bits(name, fun, x, use):
    assert jaxamp.AUTOCAST_RULES[name] == "float32"
    x16 = jnp.float16(x)
    exact = float(use(fun(x16.astype(jnp.float32))))
    in_f16 = float(use(fun(x16)).astype(jnp.float32))
    tol = 4 * 2.0**-11 * abs(exact)
    assert not abs(in_f16 - exact) <= tol, (in_f16, exact)

    def f(w, v):
        return use(fun((v @ w)[0, 0]))

    got = float(jaxamp.autocast(f, "mixed_float16")(jnp.ones((1, 1)), jnp.full((1, 1), x)))
    assert abs(got - exact) <= tol, (got, exact)


# -- 8. equinox's filtered transforms ----------------------------------------------


def test_scaled_value_and_grad_with_equinox_filter_value_and_grad():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.Linear(8, 2, key=jax.random.key(5))
    fn = jaxamp.scaled_value_and_grad(
        lambda m, x: jaxamp.autocast(m)(x).sum(),
        jaxamp.StaticLossScale(8.0),
        value_and_grad=eqx.filter_value_and_grad,
    )
    loss, grads = eqx.filter_jit(fn)(model, X[0])
    want_loss, want_grads = eqx.filter_value_and_grad(lambda m, x: m(x).sum())(model, X[0])
    assert rel_err(loss, want_loss) < 4 * U_BF16
    assert rel_err(grads.weight, 8.0 * want_grads.weight) < 4 * U_BF16


# -- higher-order primitives autocast does not know -------------------------------


def _opaque_call_p():
    prim = jex.Primitive("opaque_call")
    prim.multiple_results = True

    def impl(*args, jaxpr):
        return jax.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *args)

    prim.def_impl(impl)
    prim.def_abstract_eval(lambda *args, jaxpr: [v.aval for v in jaxpr.jaxpr.outvars])
    return prim


def test_unknown_higher_order_primitive_runs_as_traced_with_a_warning():
    prim = _opaque_call_p()

    def f(w, x):
        inner = jax.make_jaxpr(lambda w, x: [x @ w])(w, x)
        (out,) = prim.bind(w, x @ w, jaxpr=inner)
        return out

    with pytest.warns(jaxamp.UnknownPrimitiveWarning, match=r"'opaque_call'.*rules=\{"):
        report = jaxamp.precision_report(jaxamp.autocast(f), W, X)
    # The outer matmul is autocast; the one inside runs as traced, in float32.
    assert sorted(m.compute_dtype for m in report.matmuls) == ["bfloat16", "float32"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = jaxamp.autocast(f, rules={"opaque_call": "keep"})(W, X)
    assert rel_err(out, f(W, X)) < 4 * U_BF16


def test_platform_dependent_keeps_one_branch_per_platform():
    def f(w, x):
        return jax.lax.platform_dependent(x @ w, cpu=jnp.tanh, default=jnp.sin)

    ac = jaxamp.autocast(f)
    assert rel_err(jax.jit(ac)(W, X), jnp.tanh(X @ W)) < 4 * U_BF16
    text = jax.jit(ac).lower(W, X).as_text()
    assert "tanh" in text and "sine" not in text


@pytest.mark.parametrize(
    ("rules", "error", "match"),
    [
        ({"add": "compute"}, ValueError, r"rules\['add'\] = 'compute' is for contractions"),
        ({"exp": "compute"}, ValueError, r"rules\['exp'\] = 'compute'"),
        ({"add": "recurse"}, ValueError, r"'recurse' needs a built-in handler"),
        ({"add": "fast"}, ValueError, r"must be one of 'compute'"),
    ],
)
def test_rules_are_checked_against_what_each_kind_supports(rules, error, match):
    with pytest.raises(error, match=match):
        jaxamp.autocast(jnp.add, rules=rules)
