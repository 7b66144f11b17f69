"""Loss scales: exact trajectories, clamps, pytree round trips, jit, bad arguments."""

import dataclasses

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp import DynamicLossScale, NoOpLossScale, StaticLossScale

F32_MAX = float(np.finfo(np.float32).max)


def reference_trajectory(flags, scale, interval, growth, backoff, lo, hi):
    """torch.amp.GradScaler's rules with our clamps, in plain Python float32."""
    counter, out = 0, []
    for finite in flags:
        if finite:
            counter += 1
            if counter >= interval:
                scale, counter = min(float(np.float32(scale * growth)), hi), 0
        else:
            scale, counter = max(float(np.float32(scale * backoff)), lo), 0
        out.append((scale, counter))
    return out


TABLE = [
    # (flags, config, expected [(scale, counter), ...])
    ([1, 1, 1], dict(loss_scale=8.0, growth_interval=3), [(8, 1), (8, 2), (16, 0)]),
    ([0, 0, 1], dict(loss_scale=8.0, growth_interval=3), [(4, 0), (2, 0), (2, 1)]),
    (
        [1, 1, 0, 1, 1, 1],
        dict(loss_scale=8.0, growth_interval=3),
        [(8, 1), (8, 2), (4, 0), (4, 1), (4, 2), (8, 0)],
    ),
    ([0, 0, 0], dict(loss_scale=4.0, min_loss_scale=2.0), [(2, 0), (2, 0), (2, 0)]),
    (
        [1, 1, 1],
        dict(loss_scale=4.0, growth_interval=1, max_loss_scale=10.0),
        [(8, 0), (10, 0), (10, 0)],
    ),
    (
        [1, 0],
        dict(loss_scale=2.0**15, growth_interval=1, growth_factor=4.0, backoff_factor=0.25),
        [(2.0**17, 0), (2.0**15, 0)],
    ),
]


@pytest.mark.parametrize("flags, config, expected", TABLE)
def test_trajectory_table_under_jit(flags, config, expected):
    ls = DynamicLossScale(**config)
    adjust = jax.jit(lambda s, f: s.adjust(f))
    for flag, (scale, counter) in zip(flags, expected, strict=True):
        ls = adjust(ls, jnp.asarray(bool(flag)))
        assert ls.loss_scale.dtype == jnp.float32 and ls.counter.dtype == jnp.int32
        assert (float(ls.loss_scale), int(ls.counter)) == (scale, counter)


def test_growth_after_exactly_growth_interval_steps_unlike_flax():
    # flax.training.dynamic_scale grows after growth_interval + 1 finite steps.
    interval = 5
    ls = DynamicLossScale(loss_scale=1.0, growth_interval=interval)
    scales = []
    for _ in range(interval):
        ls = ls.adjust(True)
        scales.append(float(ls.loss_scale))
    assert scales == [1.0] * (interval - 1) + [2.0]


def test_min_loss_scale_survives_jit_unlike_jmp():
    # jmp.DynamicLossScale's min_loss_scale comes back as 1.0 once the state passes jit.
    ls = DynamicLossScale(loss_scale=4.0, min_loss_scale=2.0**-4)
    back = jax.jit(lambda s: s)(ls)
    assert back.min_loss_scale == 2.0**-4
    for _ in range(10):
        back = jax.jit(lambda s: s.adjust(jnp.asarray(False)))(back)
    assert float(back.loss_scale) == 2.0**-4
    # The peer, for the record: the same experiment with jmp.
    theirs = jmp.DynamicLossScale(jnp.float32(4.0), min_loss_scale=jnp.float32(2.0**-4))
    theirs_back = jax.jit(lambda s: s)(theirs)
    assert float(theirs_back.min_loss_scale) == 1.0  # jmp 0.0.4 (unmaintained) drops it


def test_scale_never_becomes_inf_or_zero():
    # torch once let the scale grow to inf; ours clamps at max_loss_scale (default f32 max).
    ls = DynamicLossScale(loss_scale=2.0**126, growth_interval=1)
    for _ in range(5):
        ls = ls.adjust(True)
        assert np.isfinite(float(ls.loss_scale))
    assert float(ls.loss_scale) == F32_MAX
    tiny = DynamicLossScale(loss_scale=2.0**-100, min_loss_scale=2.0**-120, backoff_factor=2.0**-20)
    for _ in range(5):
        tiny = tiny.adjust(False)
        assert float(tiny.loss_scale) > 0
    assert float(tiny.loss_scale) == 2.0**-120


def test_thousands_of_steps_in_scan_match_reference():
    rng = np.random.default_rng(0)
    flags = rng.random(5000) < 0.97
    flags[1000:1400] = True  # long finite runs push into the max clamp
    flags[3000:3300] = False  # long faulty runs push into the min clamp
    config = dict(
        loss_scale=2.0**10, growth_interval=7, min_loss_scale=2.0**-3, max_loss_scale=2.0**20
    )
    ls = DynamicLossScale(**config)

    def body(s, f):
        s = s.adjust(f)
        return s, (s.loss_scale, s.counter)

    final, (scales, counters) = jax.jit(lambda s, f: jax.lax.scan(body, s, f))(ls, flags)
    expected = reference_trajectory(flags, 2.0**10, 7, 2.0, 0.5, 2.0**-3, 2.0**20)
    assert np.array_equal(np.asarray(scales), np.array([e[0] for e in expected], np.float32))
    assert np.array_equal(np.asarray(counters), np.array([e[1] for e in expected]))
    assert float(scales.max()) == 2.0**20 and float(scales.min()) == 2.0**-3
    assert final.min_loss_scale == 2.0**-3


def test_flatten_unflatten_keeps_every_field():
    ls = DynamicLossScale(
        loss_scale=64.0,
        counter=3,
        growth_interval=17,
        growth_factor=3.0,
        backoff_factor=0.25,
        min_loss_scale=0.5,
        max_loss_scale=2.0**30,
    )
    leaves, treedef = jax.tree.flatten(ls)
    assert len(leaves) == 2
    back = jax.tree.unflatten(treedef, leaves)
    for field in dataclasses.fields(ls):
        assert np.array_equal(getattr(back, field.name), getattr(ls, field.name))
    through_jit = jax.jit(lambda s: s)(ls)
    assert dataclasses.astuple(jax.device_get(through_jit))[2:] == (17, 3.0, 0.25, 0.5, 2.0**30)
    static = jax.tree.unflatten(*reversed(jax.tree.flatten(StaticLossScale(8.0))))
    assert float(static.loss_scale) == 8.0
    assert jax.tree.leaves(NoOpLossScale()) == []


def test_scale_changes_every_step_but_compiles_once():
    traces = []

    @jax.jit
    def step(ls, g):
        traces.append(1)
        grads = ls.unscale(ls.scale(g))
        return ls.adjust(jaxamp.all_finite(grads)), grads

    ls = DynamicLossScale(loss_scale=2.0**15, growth_interval=1)
    for i in range(20):
        g = jnp.array([1.0, jnp.inf if i % 3 == 0 else 2.0])
        ls, _ = step(ls, g)
    assert len(traces) == 1


def test_scale_and_unscale_keep_dtypes_and_skip_non_floating():
    ls = StaticLossScale(2.0**16)  # above float16's max
    tree = {
        "h": jnp.array([1.0, 2.0], jnp.float16),
        "b": jnp.ones(2, jnp.bfloat16),
        "f": jnp.ones(2),
        "i": jnp.arange(2),
    }
    scaled = ls.scale(tree)
    assert jax.tree.map(lambda x: x.dtype, scaled) == jax.tree.map(lambda x: x.dtype, tree)
    assert scaled["i"] is tree["i"]
    assert float(scaled["b"][0]) == 2.0**16
    # fp16: 2 * 2**16 overflows float16 itself (that is what loss scaling detects)...
    assert np.isinf(np.asarray(scaled["h"][1], np.float32))
    # ...but unscaling a representable value computes in float32, without overflow.
    small = {"h": jnp.array([1.0], jnp.float16)}
    assert float(ls.unscale(ls.scale(jnp.float32(3.0)))) == 3.0
    assert ls.unscale(small)["h"].dtype == jnp.float16
    assert float(ls.unscale(small)["h"][0]) == np.float16(2.0**-16)


def test_noop_and_static_adjust_return_themselves():
    for ls in (NoOpLossScale(), StaticLossScale(4.0)):
        assert ls.adjust(jnp.asarray(False)) is ls
        assert ls.loss_scale.dtype == jnp.float32
    x = {"a": jnp.ones(2)}
    assert NoOpLossScale().scale(x) is x and NoOpLossScale().unscale(x) is x


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        (dict(growth_factor=1.0), ValueError, "growth_factor must be > 1"),
        (dict(growth_factor=0.5), ValueError, "growth_factor must be > 1"),
        (
            dict(backoff_factor=1.0),
            ValueError,
            r"backoff_factor must be in the open interval \(0, 1\)",
        ),
        (dict(backoff_factor=0.0), ValueError, "backoff_factor must be in the open interval"),
        (dict(growth_interval=0), ValueError, "growth_interval must be in"),
        (dict(growth_interval=2**31), ValueError, "growth_interval must be in"),
        (dict(growth_interval=2.5), TypeError, "growth_interval must be an int"),
        (dict(growth_interval=True), TypeError, "growth_interval must be an int"),
        (
            dict(min_loss_scale=4.0, max_loss_scale=2.0),
            ValueError,
            "min_loss_scale <= max_loss_scale",
        ),
        (dict(min_loss_scale=0.0), ValueError, "0 < min_loss_scale"),
        (dict(min_loss_scale=float("nan")), ValueError, "min_loss_scale must be finite"),
        (dict(max_loss_scale=float("inf")), ValueError, "max_loss_scale must be finite"),
        (dict(max_loss_scale=1e39), ValueError, "max_loss_scale must be a finite float32"),
        (dict(loss_scale=float("inf")), ValueError, "loss_scale must be finite and > 0"),
        (dict(loss_scale=0.0), ValueError, "loss_scale must be finite and > 0"),
        (dict(loss_scale=-2.0), ValueError, "loss_scale must be finite and > 0"),
        (
            dict(loss_scale=0.5),
            ValueError,
            r"loss_scale must be in \[min_loss_scale, max_loss_scale\]",
        ),
        (dict(loss_scale=np.ones(2)), ValueError, "loss_scale must be a scalar"),
        (dict(growth_factor="2"), TypeError, "growth_factor must be a Python float"),
    ],
)
def test_dynamic_bad_arguments(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        DynamicLossScale(**kwargs)


def test_static_bad_arguments_and_traced_config():
    with pytest.raises(ValueError, match="loss_scale must be finite and > 0"):
        StaticLossScale(float("nan"))
    with pytest.raises(TypeError, match="static configuration"):
        jax.jit(lambda g: DynamicLossScale(growth_factor=g))(2.0)


@pytest.mark.parametrize(
    "flag, fragment",
    [
        (jnp.ones(3, bool), "shape"),
        (jnp.float32(1.0), "dtype float32"),
        ("yes", "got str"),
    ],
)
def test_adjust_rejects_non_bool_scalars(flag, fragment):
    for ls in (DynamicLossScale(), StaticLossScale(2.0), NoOpLossScale()):
        with pytest.raises(TypeError, match=f"grads_finite must be a bool scalar.*{fragment}"):
            ls.adjust(flag)


def test_unflatten_does_not_validate_so_filters_and_masks_work():
    # eqx.partition / eqx.filter_jit and tree-wide masks rebuild the state with
    # bool (or None) leaves: the constructor validates, unflatten must not.
    tx = jaxamp.loss_scaling(optax.sgd(0.1))
    opt_state = tx.init({"w": jnp.ones(3)})
    mask = jax.tree.map(lambda _: True, opt_state)
    ls = jaxamp.get_loss_scale(mask)
    assert ls.loss_scale is True and ls.counter is True and ls.growth_interval == 2000
    for scale in (DynamicLossScale(8.0, growth_interval=3), StaticLossScale(4.0)):
        leaves, treedef = jax.tree.flatten(scale)
        back = jax.tree.unflatten(treedef, [None] * len(leaves))
        assert back.loss_scale is None
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(scale)]
        assert paths[0] == ".loss_scale"
    # The constructor still rejects the same values.
    with pytest.raises(TypeError, match="loss_scale must be a number, got the bool True"):
        DynamicLossScale(loss_scale=True)
    with pytest.raises(TypeError, match="loss_scale must be a number, got the bool True"):
        StaticLossScale(True)


def test_equinox_filter_jit_train_step():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.Linear(4, 2, key=jax.random.key(0))
    tx = jaxamp.loss_scaling(optax.sgd(0.1), DynamicLossScale(2.0**10))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    x = jnp.ones((3, 4))

    @eqx.filter_jit
    def step(model, opt_state, x):
        def loss(m):
            return jnp.mean(jax.vmap(m)(x) ** 2)

        grad_fn = jaxamp.scaled_value_and_grad(
            loss, jaxamp.get_loss_scale(opt_state), value_and_grad=eqx.filter_value_and_grad
        )
        value, grads = grad_fn(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    model2, opt_state2, value = step(model, opt_state, x)
    want = jnp.mean(jax.vmap(model)(x) ** 2)
    assert float(value) == pytest.approx(float(want), rel=1e-6)
    assert int(jaxamp.get_loss_scale(opt_state2).counter) == 1
    assert not np.array_equal(np.asarray(model2.weight), np.asarray(model.weight))
    params, static = eqx.partition(opt_state2, eqx.is_array)
    assert jax.tree.leaves(eqx.combine(params, static)) == jax.tree.leaves(opt_state2)
