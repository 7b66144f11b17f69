"""Policies: parsing (with jmp parity), hashing, casting and device choice."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import jaxamp
from jaxamp import Policy, get_policy

F32, BF16, F16 = np.dtype("float32"), jnp.dtype("bfloat16"), np.dtype("float16")

PRESETS = {
    "float32": (F32, F32, F32),
    "mixed_bfloat16": (F32, BF16, F32),
    "mixed_float16": (F32, F16, F32),
    "bfloat16": (BF16, BF16, BF16),
    "float16": (F16, F16, F16),
}


@pytest.mark.parametrize("name, dtypes", PRESETS.items())
def test_presets(name, dtypes):
    p = get_policy(name)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == dtypes
    assert all(type(d) is type(np.dtype("float32")) or isinstance(d, np.dtype) for d in dtypes)


JMP_SPECS = [
    "params=float32,compute=bfloat16,output=float32",
    "p=f32,c=bf16,o=f32",
    "c=bf16",
    "c=f16",
    "p=bf16",
    "params=float16",
    "compute=float16,output=float32",
    "p=f32,c=f16",
    "o=bf16",
    "float32",
    "bfloat16",
    "params=full,compute=f32",
    "p=f32,c=bfloat16,o=full",
]


@pytest.mark.parametrize("spec", JMP_SPECS)
def test_parity_with_jmp_strings(spec):
    ours = get_policy(spec)
    theirs = jmp.get_policy(spec)
    assert ours.param_dtype == theirs.param_dtype
    assert ours.compute_dtype == theirs.compute_dtype
    assert ours.output_dtype == theirs.output_dtype


def test_param_key_alias():
    assert get_policy("param=full,compute=single") == get_policy("float32")


def test_half_is_always_float16():
    assert get_policy("c=half").compute_dtype == F16
    assert get_policy("half") == Policy(F16, F16, F16)


def test_defaults_follow_jmp():
    assert get_policy("c=bf16") == Policy(F32, BF16, BF16)
    assert get_policy("p=bf16") == Policy(BF16, BF16, BF16)
    assert get_policy("o=f16") == Policy(F32, F32, F16)


def test_spaces_and_case_are_ignored():
    assert get_policy(" Params = float32 , Compute = BF16 ") == get_policy("c=bf16")


def test_policy_and_jmp_policy_are_accepted():
    p = get_policy("mixed_float16")
    assert get_policy(p) is p
    assert get_policy(jmp.get_policy("p=f32,c=f16,o=f32")) == p


@pytest.mark.parametrize("name", list(PRESETS) + JMP_SPECS)
def test_str_round_trips(name):
    p = get_policy(name)
    assert get_policy(str(p)) == p
    assert (
        eval(repr(p).replace("=", "='").replace(", ", "', ").replace(")", "')"), {"Policy": Policy})
        == p
    )


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("mixed_bf16", "neither a preset"),
        ("params=float32,compute=int8", "unknown dtype 'int8'"),
        ("weights=float32", "unknown key 'weights'"),
        ("c=bf16,compute=f16", "compute is given twice"),
        ("", "neither a preset"),
    ],
)
def test_bad_specs_name_what_is_valid(spec, fragment):
    with pytest.raises(ValueError) as info:
        get_policy(spec)
    message = str(info.value)
    assert fragment in message
    for valid in ("mixed_bfloat16", "mixed_float16", "bf16", "f16", "params", "compute", "o"):
        assert valid in message


@pytest.mark.parametrize("spec", [None, 3, jnp.float32, ["c=bf16"]])
def test_non_string_spec_is_type_error(spec):
    with pytest.raises(TypeError, match="policy must be a jaxamp.Policy"):
        get_policy(spec)


@pytest.mark.parametrize("dtype", [jnp.int32, "bool", jnp.complex64, "not-a-dtype"])
def test_policy_rejects_non_floating_dtypes(dtype):
    with pytest.raises(TypeError, match="param_dtype must be a floating-point dtype"):
        Policy(dtype, jnp.float32, jnp.float32)


def test_policy_is_hashable_frozen_and_static_for_jit():
    a, b = get_policy("mixed_bfloat16"), Policy("float32", "bfloat16", "float32")
    assert a == b and hash(a) == hash(b) and a is not b
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.__setattr__("compute_dtype", F16)

    traces = []

    @jax.jit
    def run(x, policy):
        traces.append(policy)
        return policy.cast_to_compute(x)

    run = jax.jit(run.__wrapped__ if hasattr(run, "__wrapped__") else run, static_argnums=1)
    x = jnp.ones(3)
    assert run(x, a).dtype == BF16
    assert run(x, b).dtype == BF16
    assert len(traces) == 1
    assert run(x, get_policy("mixed_float16")).dtype == F16
    assert len(traces) == 2


def test_casting_methods_and_module_kwargs():
    p = get_policy("mixed_float16")
    tree = {"w": jnp.ones(2, F32), "i": jnp.arange(2)}
    assert p.cast_to_compute(tree)["w"].dtype == F16
    assert p.cast_to_param(p.cast_to_compute(tree))["w"].dtype == F32
    assert p.cast_to_output(jnp.ones(2, F16)).dtype == F32
    assert p.cast_to_compute(tree)["i"].dtype == jnp.int32
    assert p.module_kwargs() == {"dtype": F16, "param_dtype": F32}
    assert p.with_compute_dtype("bf16").compute_dtype == BF16


def test_matmul_operands_is_checked_and_changes_nothing_off_an_explicit_mesh():
    # Off a mesh of several explicit devices the cast is the plain cast, bit for bit.
    p = get_policy("mixed_bfloat16")
    tree = {"w": jnp.linspace(-3.0, 3.0, 6, dtype=F32).reshape(2, 3), "b": jnp.ones(3, F32)}
    for operands in (True, lambda path, x: x.ndim >= 2):
        got = jax.jit(lambda t, o=operands: p.cast_to_compute(t, matmul_operands=o))(tree)
        want = p.cast_to_compute(tree)
        assert all(
            g.dtype == w.dtype == BF16 and bool(jnp.array_equal(g, w))
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
        )
    with pytest.raises(TypeError, match="matmul_operands must be None, a bool or a callable"):
        p.cast_to_compute(tree, matmul_operands="kernel")


ROLES = ("param", "compute", "output")


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize(
    "dtype, expected",
    [("bf16", BF16), ("half", F16), ("full", F32), (jnp.bfloat16, BF16), (np.float16, F16)],
)
def test_with_dtype_replaces_one_role(role, dtype, expected):
    base = get_policy("mixed_float16")
    changed = getattr(base, f"with_{role}_dtype")(dtype)
    # Oracle: the policy built from scratch with that one dtype changed.
    dtypes = {r: getattr(base, f"{r}_dtype") for r in ROLES}
    dtypes[role] = expected
    want = Policy(dtypes["param"], dtypes["compute"], dtypes["output"])
    assert changed == want and hash(changed) == hash(want)
    assert all(isinstance(getattr(changed, f"{r}_dtype"), np.dtype) for r in ROLES)
    assert getattr(changed, f"{role}_dtype") == expected
    assert base == get_policy("mixed_float16")  # the original is unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        changed.__setattr__(f"{role}_dtype", F32)


def test_with_dtype_matches_jmp_and_the_string_spec():
    policy = get_policy("mixed_float16").with_output_dtype("bf16").with_param_dtype("half")
    assert policy == get_policy("p=f16,c=f16,o=bf16")
    theirs = jmp.get_policy("p=f16,c=f16,o=f32").with_output_dtype(jnp.bfloat16)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
        theirs.param_dtype,
        theirs.compute_dtype,
        theirs.output_dtype,
    )
    # Replacing a dtype by the one it has gives an equal policy, not a different one.
    assert get_policy("mixed_bfloat16").with_compute_dtype(jnp.bfloat16) == get_policy(
        "mixed_bfloat16"
    )


def test_with_dtype_policies_are_jit_static_arguments():
    traces = []

    @functools.partial(jax.jit, static_argnums=1)
    def run(x, policy):
        traces.append(policy)
        return policy.cast_to_output(policy.cast_to_compute(x))

    base = get_policy("mixed_float16")
    x = jnp.ones(3)
    assert run(x, base).dtype == F32
    assert run(x, base.with_output_dtype("f32")).dtype == F32  # equal policy: no retrace
    assert len(traces) == 1
    assert run(x, base.with_output_dtype("f16")).dtype == F16
    assert run(x, base.with_param_dtype("bf16")).dtype == F32  # a new static value
    assert len(traces) == 3


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize(
    "bad, got", [(jnp.int32, "got int32"), ("bool", "got bool"), (None, "got None"), ("x", "'x'")]
)
def test_with_dtype_rejects_non_floating_dtypes(role, bad, got):
    method = getattr(get_policy("mixed_float16"), f"with_{role}_dtype")
    with pytest.raises(TypeError, match=rf"{role}_dtype must be a floating-point dtype.*{got}"):
        method(bad)


def test_policy_rejects_none():
    with pytest.raises(TypeError, match="output_dtype must be a floating-point dtype.*got None"):
        Policy(F32, F32, None)


def test_policy_for_device_on_cpu_is_float32_with_reason():
    policy, reason = jaxamp.policy_for_device(jax.devices("cpu")[0], with_reason=True)
    assert policy == get_policy("float32")
    assert "cpu" in reason.lower()
    assert jaxamp.policy_for_device() == get_policy("float32")


class _FakeDevice:
    def __init__(self, platform, capability=None, kind="fake"):
        self.platform = platform
        self.device_kind = kind
        if capability is not None:
            self.compute_capability = capability


@pytest.mark.parametrize(
    "device, expected",
    [
        (_FakeDevice("tpu"), "mixed_bfloat16"),
        (_FakeDevice("gpu", "9.0", "NVIDIA H100"), "mixed_bfloat16"),
        (_FakeDevice("gpu", "8.0", "NVIDIA A100"), "mixed_bfloat16"),
        (_FakeDevice("gpu", "7.5", "Tesla T4"), "mixed_float16"),
        (_FakeDevice("gpu", "7.0", "Tesla V100"), "mixed_float16"),
        (_FakeDevice("gpu", "6.1", "GTX 1080"), "float32"),
        (_FakeDevice("rocm"), "mixed_bfloat16"),
        (_FakeDevice("cpu"), "float32"),
    ],
)
def test_policy_for_device_table(device, expected):
    policy, reason = jaxamp.policy_for_device(device, with_reason=True)
    assert policy == get_policy(expected)
    assert reason


def test_policy_for_device_rejects_non_devices():
    with pytest.raises(TypeError, match="device must be a jax.Device"):
        jaxamp.policy_for_device("gpu")


# --- The wire dtypes: gather_dtype and reduce_dtype ---------------------------


@pytest.mark.parametrize(
    "name, gather, reduce",
    [
        ("float32", F32, F32),
        ("mixed_bfloat16", BF16, F32),
        ("mixed_float16", F16, F32),
        ("bfloat16", BF16, F32),
        ("float16", F16, F32),
        ("float64", np.dtype("float64"), np.dtype("float64")),
    ],
)
def test_wire_dtype_defaults(name, gather, reduce):
    # Gather in the compute dtype (each shard cast before the all-gather) and reduce
    # gradients in float32, as FSDP2's MixedPrecisionPolicy(reduce_dtype=float32) and
    # Megatron's grad_reduce_in_fp32; never narrower than float64 params.
    policy = get_policy(name)
    assert (policy.gather_dtype, policy.reduce_dtype) == (gather, reduce)
    assert isinstance(policy.gather_dtype, np.dtype) and isinstance(policy.reduce_dtype, np.dtype)
    assert "gather" not in str(policy) and "reduce" not in str(policy)  # defaults stay implicit


@pytest.mark.parametrize(
    "spec, gather, reduce",
    [
        ("params=float32,compute=bfloat16,output=float32,reduce=bfloat16", BF16, BF16),
        ("p=f32,c=bf16,o=f32,r=bf16", BF16, BF16),
        ("p=f32,c=f16,o=f32,gather=bf16", BF16, F32),
        ("c=bf16,g=f32,r=f32", F32, F32),
    ],
)
def test_wire_dtypes_parse_and_round_trip(spec, gather, reduce):
    policy = get_policy(spec)
    assert (policy.gather_dtype, policy.reduce_dtype) == (gather, reduce)
    assert get_policy(str(policy)) == policy
    assert hash(get_policy(str(policy))) == hash(policy)
    fields = dict(part.split("=") for part in repr(policy)[len("Policy(") : -1].split(", "))
    assert Policy(**fields) == policy  # repr names every non-default field


def test_with_wire_dtypes():
    base = get_policy("mixed_bfloat16")
    low = base.with_reduce_dtype(jnp.bfloat16)
    assert low.reduce_dtype == BF16 and low != base and hash(low) != hash(base)
    assert str(low) == "params=float32,compute=bfloat16,output=float32,reduce=bfloat16"
    assert low == get_policy(str(low)) and base.reduce_dtype == F32  # the original unchanged
    wide = base.with_gather_dtype("f32")
    assert wide.gather_dtype == F32 and str(wide).endswith(",gather=float32")
    # A gather dtype left at its default follows the compute dtype; a chosen one stays.
    assert base.with_compute_dtype("f16").gather_dtype == F16
    assert wide.with_compute_dtype("f16").gather_dtype == F32
    # A reduce dtype left at its default follows wider params; a chosen one stays.
    assert base.with_param_dtype("f64").reduce_dtype == np.dtype("float64")
    assert low.with_param_dtype("f64").reduce_dtype == BF16
    # Changing nothing gives an equal policy.
    assert base.with_gather_dtype("bf16") == base == base.with_reduce_dtype("f32")


@pytest.mark.parametrize("role", ["gather", "reduce"])
@pytest.mark.parametrize(
    "bad, got", [(jnp.int32, "got int32"), ("bool", "got bool"), (None, "got None"), ("x", "'x'")]
)
def test_with_wire_dtype_rejects_non_floating_dtypes(role, bad, got):
    method = getattr(get_policy("mixed_float16"), f"with_{role}_dtype")
    with pytest.raises(TypeError, match=rf"{role}_dtype must be a floating-point dtype.*{got}"):
        method(bad)


def test_wire_keys_are_listed_in_the_spec_error():
    with pytest.raises(ValueError, match=r"keys .*gather.*reduce") as info:
        get_policy("params=float32,wire=bfloat16")
    assert "unknown key 'wire'" in str(info.value)
