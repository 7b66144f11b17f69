"""Many devices: sharded jit, shard_map and pmap skip together and match one device.

The checks run in a subprocess (this file run as a script) with 8 CPU devices
forced by XLA_FLAGS, which must be set before jax is imported; the subprocess
prints its measurements as JSON and the test asserts on them.
"""

import json

from tests.helpers import run_with_devices

N_DEVICES = 8
STEPS = 5
BAD_STEP = 2  # on this step only the rows of device 5 (of 8) overflow


def _pmap_trace(loss_fn, make_tx, params0, xs, y, record) -> list:
    """Scenario 4 of :func:`_worker`: pmap with per-device grads, reduced by loss_scaling."""
    import functools

    import jax
    import numpy as np
    import optax

    import jaxamp

    per_device = y.shape[0] // N_DEVICES
    tx_axis = make_tx(axis_name="data", grad_reduction="mean")

    @functools.partial(jax.pmap, axis_name="data", in_axes=(None, None, 0, 0))
    def pmap_step(params, state, x, y):
        scale = jaxamp.get_loss_scale(state)
        _, grads = jaxamp.scaled_value_and_grad(loss_fn, scale)(params, x, y)
        updates, state = tx_axis.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, state, pmap_trace = params0, tx_axis.init(params0), []
    for t in range(STEPS):
        xb = xs[t].reshape(N_DEVICES, per_device, -1)
        yb = y.reshape(N_DEVICES, per_device)
        params, state = pmap_step(params, state, xb, yb)
        devices_agree = all(
            np.array_equal(p[i], p[0]) for p in jax.tree.leaves(params) for i in range(N_DEVICES)
        )
        assert devices_agree
        params, state = jax.tree.map(lambda a: a[0], (params, state))
        record(pmap_trace, params, state)

    return pmap_trace


def _worker() -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import jaxamp

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    assert jax.device_count() == N_DEVICES, jax.devices()
    policy = jaxamp.get_policy("mixed_float16")
    ls = jaxamp.DynamicLossScale(loss_scale=2.0**10, growth_interval=2)

    def loss_fn(params, x, y):
        p, x = policy.cast_to_compute((params, x))
        logits = policy.cast_to_output(jnp.tanh(x @ p["w1"]) @ p["w2"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def make_tx(**kwargs):
        return jaxamp.loss_scaling(optax.sgd(0.1, momentum=0.9), ls, **kwargs)

    keys = jax.random.split(jax.random.key(0), 3)
    params0 = {
        "w1": jax.random.normal(keys[0], (6, 16)) * 0.3,
        "w2": jax.random.normal(keys[1], (16, 4)) * 0.3,
    }
    per_device = 4
    xs = jax.random.normal(keys[2], (STEPS, N_DEVICES * per_device, 6))
    bad_row = 5 * per_device + 1  # belongs to device 5's shard
    xs = xs.at[BAD_STEP, bad_row, 0].set(jnp.inf)
    y = jnp.arange(N_DEVICES * per_device, dtype=jnp.int32) % 4

    def record(trace, params, state):
        metrics = jaxamp.loss_scaling_metrics(state)
        trace.append(
            {
                "scale": float(metrics["loss_scale"]),
                "skipped": int(metrics["skipped_steps"]),
                "params": [np.asarray(p).tolist() for p in jax.tree.leaves(params)],
            }
        )

    # 1. One device, plain jit: the reference.
    tx = make_tx()

    @jax.jit
    def step(params, state, x, y):
        scale = jaxamp.get_loss_scale(state)
        _, grads = jaxamp.scaled_value_and_grad(loss_fn, scale)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def run_jit(put_batch, params):
        params, state, trace = params, tx.init(params), []
        for t in range(STEPS):
            params, state = step(params, state, put_batch(xs[t]), put_batch(y))
            record(trace, params, state)
        return trace, params

    single, _ = run_jit(lambda a: jax.device_put(a, jax.devices()[0]), params0)

    # 2. NamedSharding data parallel under jit: the same code, batch split 8 ways.
    mesh = Mesh(np.array(jax.devices()), ("data",))
    batch_sharding = NamedSharding(mesh, PartitionSpec("data"))
    replicated = jax.device_put(params0, NamedSharding(mesh, PartitionSpec()))
    sharded, sharded_params = run_jit(lambda a: jax.device_put(a, batch_sharding), replicated)
    param_shards_agree = all(
        all(np.array_equal(s.data, p.addressable_shards[0].data) for s in p.addressable_shards)
        for p in jax.tree.leaves(sharded_params)
    )
    batch_devices = len(jax.device_put(xs[0], batch_sharding).addressable_shards)

    # 3. shard_map. With check_vma=True (the default) JAX psums the grads of the
    # replicated params itself: pmean the loss, and loss_scaling reduces the flag.
    # With check_vma=False each device keeps its own grads: grad_reduction="mean".
    spec, rep = PartitionSpec("data"), PartitionSpec()
    shard_map_traces = {}
    for check_vma in (True, False):
        tx_axis = make_tx(axis_name="data", grad_reduction=None if check_vma else "mean")

        def global_loss(params, x, y, check_vma=check_vma):
            loss = loss_fn(params, x, y)
            return jax.lax.pmean(loss, "data") if check_vma else loss

        @jax.jit
        @functools.partial(
            jax.shard_map,
            mesh=mesh,
            in_specs=(rep, rep, spec, spec),
            out_specs=(rep, rep),
            check_vma=check_vma,
        )
        def shard_step(params, state, x, y, tx_axis=tx_axis, global_loss=global_loss):
            scale = jaxamp.get_loss_scale(state)
            _, grads = jaxamp.scaled_value_and_grad(global_loss, scale)(params, x, y)
            updates, state = tx_axis.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        params, state, trace = params0, tx_axis.init(params0), []
        for t in range(STEPS):
            params, state = shard_step(params, state, xs[t], y)
            record(trace, params, state)
        shard_map_traces[check_vma] = trace

    # 3b. Without axis_name each device would decide alone: the flags disagree.
    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(rep, spec, spec), out_specs=spec, check_vma=False
    )
    def local_flags(params, x, y):
        _, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return jnp.reshape(jaxamp.all_finite(grads), (1,))

    local = [bool(f) for f in local_flags(params0, xs[BAD_STEP], y)]

    # 4. pmap: per-device grads, reduced by loss_scaling.
    pmap_trace = _pmap_trace(loss_fn, make_tx, params0, xs, y, record)

    return {
        "single": single,
        "sharded": sharded,
        "shard_map": shard_map_traces[True],
        "shard_map_unchecked": shard_map_traces[False],
        "pmap": pmap_trace,
        "param_shards_agree": param_shards_agree,
        "batch_devices": batch_devices,
        "local_flags": local,
    }


def test_many_devices_skip_together_and_match_one_device():
    out = run_with_devices(__file__, N_DEVICES, timeout=240)

    assert out["batch_devices"] == N_DEVICES
    # Only device 5 saw the inf; alone it would skip and the others would not.
    assert out["local_flags"] == [i != 5 for i in range(N_DEVICES)]
    single = out["single"]
    # 1024 -> finite, grow to 2048 -> overflow on one shard: halve -> 1024 ...
    assert [s["scale"] for s in single] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0]
    assert [s["skipped"] for s in single] == [0, 0, 1, 1, 1]
    assert single[BAD_STEP]["params"] == single[BAD_STEP - 1]["params"]
    assert out["param_shards_agree"]
    for mode in ("sharded", "shard_map", "shard_map_unchecked", "pmap"):
        trace = out[mode]
        assert [s["scale"] for s in trace] == [s["scale"] for s in single], mode
        assert [s["skipped"] for s in trace] == [s["skipped"] for s in single], mode
        # The skipped step left every device's params exactly as they were.
        assert trace[BAD_STEP]["params"] == trace[BAD_STEP - 1]["params"], mode
        for got, want in zip(trace, single, strict=True):
            for a, b in zip(got["params"], want["params"], strict=True):
                # Same math; only the order of the float16 batch reduction differs.
                assert _close(a, b, tol=5e-4), mode


def _close(a, b, tol):
    if isinstance(a, list):
        return all(_close(x, y, tol) for x, y in zip(a, b, strict=True))
    return abs(a - b) <= tol * (1 + abs(b))


if __name__ == "__main__":
    print(json.dumps(_worker()))
