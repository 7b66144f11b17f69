"""Bad input everywhere: each public entry point names the argument, what it got, what is valid.

The table below is also the source of the error table in docs/errors.md; a test
keeps the two in step.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp
from jaxamp.testing import inject_fault

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "errors.md"


def _traced(fn):
    """Calls ``fn`` with a traced scalar, as user code inside jit would."""
    return lambda: jax.jit(fn)(jnp.int32(8))


def _autocast_as_context_manager():
    with jaxamp.autocast(jnp.sin):
        pass


def _integer_grads_update():
    tx = jaxamp.loss_scaling(optax.sgd(0.1))
    params = {"w": jnp.ones(3), "count": jnp.int32(0)}
    tx.update({"w": jnp.ones(3), "count": jnp.int32(1)}, tx.init(params), params)


def _shard_mapped_update(grad_reduction):
    """loss_scaling's update of a replicated param's grads in shard_map (check_vma=True)."""
    mesh = jax.make_mesh((1,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = jaxamp.loss_scaling(optax.sgd(0.1), axis_name="i", grad_reduction=grad_reduction)
    params = {"w": jnp.ones(2)}

    def step(params, x):
        grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(params)  # summed over "i" by JAX
        return tx.update(grads, tx.init(params), params)[0]

    spec = jax.sharding.PartitionSpec
    return jax.shard_map(step, mesh=mesh, in_specs=(spec(), spec("i")), out_specs=spec())(
        params, jnp.ones(2)
    )


# (what the user wrote, the call, error type, fragments the message must contain)
CASES = [
    (
        'get_policy("mixed_fp16")',
        lambda: jaxamp.get_policy("mixed_fp16"),
        ValueError,
        ["'mixed_fp16'", "Did you mean 'mixed_float16'?"],
    ),
    (
        'get_policy("mixed_float8")',
        lambda: jaxamp.get_policy("mixed_float8"),
        ValueError,
        ["FP8 is not a policy", "jaxamp.autocast(fn, 'mixed_float8')", "Float8Recipe"],
    ),
    (
        'get_policy("c=fp16")',
        lambda: jaxamp.get_policy("c=fp16"),
        ValueError,
        ["unknown dtype 'fp16'", "Did you mean c=float16?"],
    ),
    (
        "with jaxamp.autocast(f):",
        _autocast_as_context_manager,
        TypeError,
        ["not a context manager", "jaxamp.autocast(loss_fn, 'mixed_bfloat16')"],
    ),
    (
        'with jaxamp.autocast("mixed_bfloat16"):',
        lambda: jaxamp.autocast("mixed_bfloat16"),
        TypeError,
        ["fun must be the function to run", "jaxamp.autocast(loss_fn, 'mixed_bfloat16')"],
    ),
    (
        "tx.update(grads_with_an_int32_leaf, state, params)",
        _integer_grads_update,
        TypeError,
        ["the leaf at ['count'] has dtype int32", "floating"],
    ),
    (
        "check_skips(state_without_a_limit)",
        lambda: jaxamp.check_skips(jaxamp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(1)})),
        ValueError,
        ["max_consecutive_skips=N"],
    ),
    (
        'get_policy("mixed_bf16")',
        lambda: jaxamp.get_policy("mixed_bf16"),
        ValueError,
        ["mixed_bf16", "Did you mean 'mixed_bfloat16'?", "bf16", "params"],
    ),
    (
        'get_policy("c=int8")',
        lambda: jaxamp.get_policy("c=int8"),
        ValueError,
        ["unknown dtype 'int8'", "float16"],
    ),
    (
        'get_policy("weights=f32")',
        lambda: jaxamp.get_policy("weights=f32"),
        ValueError,
        ["unknown key 'weights'", "compute"],
    ),
    ("get_policy(3)", lambda: jaxamp.get_policy(3), TypeError, ["jaxamp.Policy", "int"]),
    (
        'Policy("int32", "bf16", "f32")',
        lambda: jaxamp.Policy("int32", "bf16", "f32"),
        TypeError,
        ["param_dtype", "int32", "floating-point"],
    ),
    (
        'Policy("f32", "complex64", "f32")',
        lambda: jaxamp.Policy("f32", "complex64", "f32"),
        TypeError,
        ["compute_dtype", "complex64"],
    ),
    (
        "policy.with_output_dtype(None)",
        lambda: jaxamp.get_policy("mixed_bfloat16").with_output_dtype(None),
        TypeError,
        ["output_dtype", "got None", "floating-point"],
    ),
    (
        'cast_floating(x, "int8")',
        lambda: jaxamp.cast_floating(jnp.ones(2), "int8"),
        TypeError,
        ["dtype", "int8", "floating-point"],
    ),
    (
        'cast_floating(x, "f64") without x64',
        lambda: jaxamp.cast_floating(jnp.ones(2), "f64"),
        ValueError,
        ["float64", "jax_enable_x64"],
    ),
    (
        'policy_for_device("gpu")',
        lambda: jaxamp.policy_for_device("gpu"),
        TypeError,
        ["device", "jax.Device", "'gpu'"],
    ),
    (
        "DynamicLossScale(growth_factor=1.0)",
        lambda: jaxamp.DynamicLossScale(growth_factor=1.0),
        ValueError,
        ["growth_factor", "> 1", "1.0"],
    ),
    (
        "DynamicLossScale(backoff_factor=2.0)",
        lambda: jaxamp.DynamicLossScale(backoff_factor=2.0),
        ValueError,
        ["backoff_factor", "(0, 1)", "2.0"],
    ),
    (
        "DynamicLossScale(growth_interval=0)",
        lambda: jaxamp.DynamicLossScale(growth_interval=0),
        ValueError,
        ["growth_interval", "[1, 2**31 - 1]", "0"],
    ),
    (
        "DynamicLossScale(growth_interval=1.5)",
        lambda: jaxamp.DynamicLossScale(growth_interval=1.5),
        TypeError,
        ["growth_interval", "int", "1.5"],
    ),
    (
        "DynamicLossScale(min_loss_scale=8, max_loss_scale=2)",
        lambda: jaxamp.DynamicLossScale(min_loss_scale=8.0, max_loss_scale=2.0),
        ValueError,
        ["min_loss_scale", "max_loss_scale", "8.0", "2.0"],
    ),
    (
        'DynamicLossScale(loss_scale=float("inf"))',
        lambda: jaxamp.DynamicLossScale(loss_scale=float("inf")),
        ValueError,
        ["loss_scale", "finite and > 0", "inf"],
    ),
    (
        "DynamicLossScale(growth_factor=<traced>)",
        _traced(lambda g: jaxamp.DynamicLossScale(growth_factor=g)),
        TypeError,
        ["growth_factor", "static configuration", "traced"],
    ),
    (
        "DynamicLossScale(growth_interval=<traced>)",
        _traced(lambda g: jaxamp.DynamicLossScale(growth_interval=g)),
        TypeError,
        ["growth_interval", "static configuration", "traced"],
    ),
    (
        "StaticLossScale(-1.0)",
        lambda: jaxamp.StaticLossScale(-1.0),
        ValueError,
        ["loss_scale", "finite and > 0", "-1.0"],
    ),
    (
        "scale.adjust(jnp.ones(3, bool))",
        lambda: jaxamp.DynamicLossScale().adjust(jnp.ones(3, bool)),
        TypeError,
        ["grads_finite", "bool scalar", "(3,)"],
    ),
    (
        "scale.adjust(jnp.float32(1))",
        lambda: jaxamp.DynamicLossScale().adjust(jnp.float32(1)),
        TypeError,
        ["grads_finite", "bool scalar", "float32"],
    ),
    (
        "select_tree(pred, {'a': x}, {'b': x})",
        lambda: jaxamp.select_tree(jnp.asarray(True), {"a": 1.0}, {"b": 1.0}),
        ValueError,
        ["on_true and on_false", "same tree structure"],
    ),
    (
        "loss_scaling(optax.sgd(0.1), 2.0**15)",
        lambda: jaxamp.loss_scaling(optax.sgd(0.1), 2.0**15),
        TypeError,
        ["loss_scale", "DynamicLossScale", "float"],
    ),
    (
        "loss_scaling(lambda g: g)",
        lambda: jaxamp.loss_scaling(lambda g: g),
        TypeError,
        ["inner", "optax.GradientTransformation", "function"],
    ),
    (
        "loss_scaling(tx, axis_name=3)",
        lambda: jaxamp.loss_scaling(optax.sgd(0.1), axis_name=3),
        TypeError,
        ["axis_name", "str", "3"],
    ),
    (
        'loss_scaling(tx, grad_reduction="max", axis_name="i")',
        lambda: jaxamp.loss_scaling(optax.sgd(0.1), grad_reduction="max", axis_name="i"),
        ValueError,
        ["grad_reduction", "'mean'", "'max'"],
    ),
    (
        'shard_map(step) with loss_scaling(tx, axis_name="i", grad_reduction="mean")',
        lambda: _shard_mapped_update("mean"),
        ValueError,
        ["grad_reduction='mean'", "axis_name='i'", "grads['w']", "check_vma", "device count"],
    ),
    (
        "loss_scaling(tx, accumulation_steps=0)",
        lambda: jaxamp.loss_scaling(optax.sgd(0.1), accumulation_steps=0),
        ValueError,
        ["accumulation_steps", ">= 1", "0"],
    ),
    (
        "loss_scaling(tx, max_consecutive_skips=0)",
        lambda: jaxamp.loss_scaling(optax.sgd(0.1), max_consecutive_skips=0),
        ValueError,
        ["max_consecutive_skips", "[1, 2**31 - 1]", "0"],
    ),
    (
        "tx.update(grads, optax.EmptyState())",
        lambda: jaxamp.loss_scaling(optax.sgd(0.1)).update({"w": jnp.ones(1)}, optax.EmptyState()),
        TypeError,
        ["state", "LossScalingState", "EmptyState"],
    ),
    (
        "get_loss_scale(optax.sgd(0.1).init(params))",
        lambda: jaxamp.get_loss_scale(optax.sgd(0.1).init({"w": jnp.ones(1)})),
        ValueError,
        ["no jaxamp loss-scaling state", "jaxamp.loss_scaling(inner)"],
    ),
    (
        "loss_scaling_metrics({})",
        lambda: jaxamp.loss_scaling_metrics({}),
        ValueError,
        ["no jaxamp loss-scaling state"],
    ),
    ("align_dim(-1)", lambda: jaxamp.align_dim(-1), ValueError, ["n", ">= 0", "-1"]),
    ("align_dim(10, 0)", lambda: jaxamp.align_dim(10, 0), ValueError, ["multiple", ">= 1", "0"]),
    ("align_dim(<traced>)", _traced(jaxamp.align_dim), TypeError, ["n", "Python int"]),
    (
        "pad_to_multiple(x, 8, axis=3)",
        lambda: jaxamp.pad_to_multiple(jnp.ones((2, 2)), 8, axis=3),
        ValueError,
        ["axis 3", "out of range", "(2, 2)"],
    ),
    (
        "pad_to_multiple(x, <traced>)",
        _traced(lambda m: jaxamp.pad_to_multiple(jnp.ones(3), m)),
        TypeError,
        ["multiple", "Python int"],
    ),
    (
        "tensor_core_multiple(jnp.bool_)",
        lambda: jaxamp.tensor_core_multiple(jnp.bool_),
        TypeError,
        ["dtype", "bool"],
    ),
    (
        "numerics_report(lambda w: w * 2, w, grad=True)",
        lambda: jaxamp.numerics_report(lambda w: w * 2, jnp.ones(3), grad=True),
        TypeError,
        ["grad=True", "floating scalar", "float32[3]", "jnp.mean"],
    ),
    (
        "numerics_report(loss, jnp.arange(3), grad=True)",
        lambda: jaxamp.numerics_report(jnp.sum, jnp.arange(3), grad=True),
        TypeError,
        ["first argument", "floating", "int32[3]"],
    ),
    (
        'numerics_report(loss, w, policy="mixed_f16")',
        lambda: jaxamp.numerics_report(jnp.sum, jnp.ones(3), policy="mixed_f16"),
        ValueError,
        ["mixed_f16", "mixed_float16"],
    ),
    (
        "numerics_report(loss, w, loss_scale=1024.0)",
        lambda: jaxamp.numerics_report(jnp.sum, jnp.ones(3), loss_scale=1024.0),
        ValueError,
        ["loss_scale", "grad=True"],
    ),
    (
        "numerics_report(loss, w, grad=True, loss_scale=0.0)",
        lambda: jaxamp.numerics_report(jnp.sum, jnp.ones(3), grad=True, loss_scale=0.0),
        ValueError,
        ["loss_scale", "> 0", "0.0"],
    ),
    (
        "inject_fault(jnp.arange(3), 0, 0)",
        lambda: inject_fault(jnp.arange(3), 0, 0),
        TypeError,
        ["x", "floating", "int32"],
    ),
    (
        'autocast(f, rules={"add": "compute"})',
        lambda: jaxamp.autocast(jnp.add, rules={"add": "compute"}),
        ValueError,
        ["rules['add']", "contractions", "dot_general", "'follow'"],
    ),
    (
        'autocast(f, rules={"add": "recurse"})',
        lambda: jaxamp.autocast(jnp.add, rules={"add": "recurse"}),
        ValueError,
        ["rules['add']", "built-in handler", "scan", "'keep'"],
    ),
    (
        'autocast(f, rules={"add": "fast"})',
        lambda: jaxamp.autocast(jnp.add, rules={"add": "fast"}),
        ValueError,
        ["rules['add']", "'compute'", "'keep'", "'fast'"],
    ),
    (
        'autocast(f, rules={3: "keep"})',
        lambda: jaxamp.autocast(jnp.add, rules={3: "keep"}),
        TypeError,
        ["rules keys", "jax.lax.exp_p", "int"],
    ),
    (
        "autocast(f, pad_to=0)",
        lambda: jaxamp.autocast(jnp.add, pad_to=0),
        ValueError,
        ["pad_to", "'auto'", "0"],
    ),
    (
        'low_precision_optimizer(tx, rounding="up")',
        lambda: jaxamp.low_precision_optimizer(optax.sgd(0.1), rounding="up"),
        ValueError,
        ["rounding", "'up'", "'stochastic'", "'kahan'", "'nearest'"],
    ),
    (
        "low_precision_optimizer(tx, state_dtype=jnp.float32)",
        lambda: jaxamp.low_precision_optimizer(optax.sgd(0.1), state_dtype=jnp.float32),
        ValueError,
        ["state_dtype", "16-bit", "float32", "jnp.bfloat16"],
    ),
    (
        "low_precision_optimizer(tx, state_dtype=jnp.float16)",
        lambda: jaxamp.low_precision_optimizer(optax.adam(0.1), state_dtype=jnp.float16),
        ValueError,
        ["state_dtype", "jnp.bfloat16", "float16", "second moments", "6e-8"],
    ),
    (
        "low_precision_optimizer(tx, seed=2**32)",
        lambda: jaxamp.low_precision_optimizer(optax.sgd(0.1), seed=2**32),
        ValueError,
        ["seed", "[0, 2**32 - 1]", "4294967296"],
    ),
    (
        "low_precision_optimizer(tx, seed=-1)",
        lambda: jaxamp.low_precision_optimizer(optax.sgd(0.1), seed=-1),
        ValueError,
        ["seed", "[0, 2**32 - 1]", "-1"],
    ),
    (
        "loss_scaling(optax.MultiSteps(tx, 4))",
        lambda: jaxamp.loss_scaling(optax.MultiSteps(optax.sgd(0.1), 4)),
        TypeError,
        ["inner", "optax.MultiSteps", "accumulation_steps", ".gradient_transformation()"],
    ),
    (
        "low_precision_optimizer(tx).init({'n': jnp.arange(3)})",
        lambda: jaxamp.low_precision_optimizer(optax.sgd(0.1)).init({"n": jnp.arange(3)}),
        TypeError,
        ["floating params", "params['n']", "int32"],
    ),
    (
        "stochastic_round(x, jnp.float32, key)",
        lambda: jaxamp.stochastic_round(jnp.ones(2), jnp.float32, jax.random.key(0)),
        ValueError,
        ["dtype", "16-bit", "float32"],
    ),
    (
        'Float8Recipe(scaling="colwise")',
        lambda: jaxamp.Float8Recipe(scaling="colwise"),
        ValueError,
        ["scaling", "'colwise'", "'tensorwise'", "'rowwise'", "'blockwise'", "'mxfp8'"],
    ),
    (
        "Float8Recipe(forward_dtype=jnp.bfloat16)",
        lambda: jaxamp.Float8Recipe(forward_dtype=jnp.bfloat16),
        TypeError,
        ["forward_dtype", "float8_e4m3fn", "got bfloat16", "'mixed_bfloat16'"],
    ),
    (
        "Float8Recipe(gradient_dtype=jnp.int8)",
        lambda: jaxamp.Float8Recipe(gradient_dtype=jnp.int8),
        TypeError,
        ["gradient_dtype", "float8_e5m2", "got int8"],
    ),
    (
        "Float8Recipe(compute_dtype=jnp.float32)",
        lambda: jaxamp.Float8Recipe(compute_dtype=jnp.float32),
        TypeError,
        ["compute_dtype", "16-bit", "jnp.bfloat16", "got float32"],
    ),
    (
        "Float8Recipe(power_of_two_scale=1)",
        lambda: jaxamp.Float8Recipe(power_of_two_scale=1),
        TypeError,
        ["power_of_two_scale", "True or False", "int"],
    ),
    (
        'Float8Recipe("mxfp8", gemm="cudnn")',
        lambda: jaxamp.Float8Recipe("mxfp8", gemm="cudnn"),
        ValueError,
        ["gemm", "'auto'", "'native'", "'emulated'", "'cudnn'"],
    ),
    (
        'Float8Recipe("rowwise", gemm="native")',
        lambda: jaxamp.Float8Recipe("rowwise", gemm="native"),
        ValueError,
        ["gemm='native'", "scaling='mxfp8'", "'rowwise'", "gemm='auto'"],
    ),
    (
        'Float4Recipe(format="fp4")',
        lambda: jaxamp.Float4Recipe(format="fp4"),
        ValueError,
        ["format", "'nvfp4'", "'mxfp4'", "'fp4'"],
    ),
    (
        'Float4Recipe("nvfp4", scale_rounding="ceil")',
        lambda: jaxamp.Float4Recipe("nvfp4", scale_rounding="ceil"),
        ValueError,
        ["scale_rounding='ceil'", "MXFP4's alone", "format='mxfp4'"],
    ),
    (
        'Float4Recipe("mxfp4", scale_rounding="nearest")',
        lambda: jaxamp.Float4Recipe("mxfp4", scale_rounding="nearest"),
        ValueError,
        ["scale_rounding", "'floor'", "'ceil'", "'nearest'"],
    ),
    (
        "Float4Recipe(hadamard=1)",
        lambda: jaxamp.Float4Recipe(hadamard=1),
        TypeError,
        ["hadamard", "True or False", "int"],
    ),
    (
        "Float4Recipe(seed=1.5)",
        lambda: jaxamp.Float4Recipe(seed=1.5),
        TypeError,
        ["seed", "int", "[0, 2**32)", "1.5"],
    ),
    (
        "Float4Recipe(seed=-1)",
        lambda: jaxamp.Float4Recipe(seed=-1),
        ValueError,
        ["seed", "[0, 2**32)", "-1"],
    ),
    (
        'Float4Recipe(high_precision=["head"])',
        lambda: jaxamp.Float4Recipe(high_precision=["head"]),
        TypeError,
        ["high_precision", "tuple", "keystr", "['head']"],
    ),
    (
        'Float4Recipe(high_precision="head[")',
        lambda: jaxamp.Float4Recipe(high_precision="head["),
        ValueError,
        ["high_precision", "'head['", "not a regular expression"],
    ),
    (
        "Float4Recipe(compute_dtype=jnp.float32)",
        lambda: jaxamp.Float4Recipe(compute_dtype=jnp.float32),
        TypeError,
        ["compute_dtype", "16-bit", "jnp.bfloat16", "got float32"],
    ),
    (
        'Float8Recipe("nvfp4")',
        lambda: jaxamp.Float8Recipe("nvfp4"),
        ValueError,
        ["scaling", "'mxfp8'", "'nvfp4'", "Float4Recipe(format=...)"],
    ),
    (
        'autocast(f, "mixed_fp4")',
        lambda: jaxamp.autocast(lambda x: x, "mixed_fp4"),
        ValueError,
        ["'mixed_fp4'", "Float4Recipe", "'mixed_nvfp4'", "'mixed_mxfp4'"],
    ),
    (
        "Float8Recipe(high_precision=3)",
        lambda: jaxamp.Float8Recipe(high_precision=3),
        TypeError,
        ["Float8Recipe(high_precision=...)", "regular expression", "keystr", "int: 3"],
    ),
]


@pytest.mark.parametrize("written, call, error, fragments", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_a_clear_error(written, call, error, fragments):
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{written}: {fragment!r} not in {message!r}"


def test_docs_error_table_lists_every_case():
    text = DOCS.read_text()
    missing = [written for written, *_ in CASES if f"`{written}`" not in text]
    assert not missing, f"docs/errors.md lacks rows for: {missing}"


def test_no_error_is_an_assert():
    # Running Python with -O must not change validation: nothing relies on `assert`.
    for module in pathlib.Path(jaxamp.__file__).parent.rglob("*.py"):
        source = module.read_text()
        assert not re.search(r"^\s*assert\s", source, re.MULTILINE), module
