"""Many processes: two JAX processes on loopback skip the same steps with the same scale.

The test runs this file as a script twice (process ids 0 and 1) with
``jax.distributed.initialize`` on 127.0.0.1 and gloo CPU collectives. The
global batch is sharded over both processes' devices; only process 1's local
data overflows on step ``BAD_STEP``. Each process prints its trace as JSON.
"""

import json
import os
import socket
import subprocess
import sys

STEPS = 4
BAD_STEP = 1
TIMEOUT_S = 120


def _worker(process_id: int, port: int) -> dict:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import jaxamp

    policy = jaxamp.get_policy("mixed_float16")
    tx = jaxamp.loss_scaling(
        optax.sgd(0.1, momentum=0.9), jaxamp.DynamicLossScale(loss_scale=2.0**10, growth_interval=2)
    )
    mesh = Mesh(np.array(jax.devices()), ("data",))
    batch_sharding = NamedSharding(mesh, PartitionSpec("data"))
    replicated = NamedSharding(mesh, PartitionSpec())

    def loss_fn(params, x, y):
        p, x = policy.cast_to_compute((params, x))
        logits = policy.cast_to_output(x @ p["w"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, state, x, y):
        scale = jaxamp.get_loss_scale(state)
        loss, grads = jaxamp.scaled_value_and_grad(loss_fn, scale)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    params = jax.device_put({"w": jnp.full((5, 3), 0.1)}, replicated)
    state = jax.device_put(tx.init({"w": jnp.full((5, 3), 0.1)}), replicated)
    local_rows = 4
    trace = []
    for t in range(STEPS):
        rng = np.random.default_rng(100 * t + process_id)
        x_local = rng.standard_normal((local_rows, 5)).astype(np.float32)
        if t == BAD_STEP and process_id == 1:
            x_local[2, 3] = np.inf  # only this process's data overflows
        y_local = (np.arange(local_rows) % 3).astype(np.int32)
        x = jax.make_array_from_process_local_data(batch_sharding, x_local)
        y = jax.make_array_from_process_local_data(batch_sharding, y_local)
        params, state, loss = step(params, state, x, y)
        metrics = jaxamp.loss_scaling_metrics(state)
        w = np.asarray(params["w"].addressable_shards[0].data)
        trace.append(
            {
                "scale": float(metrics["loss_scale"]),
                "skipped": int(metrics["skipped_steps"]),
                "loss_finite": bool(np.isfinite(np.asarray(loss.addressable_shards[0].data))),
                "w": w.tolist(),
            }
        )
    jax.distributed.shutdown()
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "trace": trace,
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_share_scale_and_skip_together():
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(i), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
            assert proc.returncode == 0, stderr[-4000:]
            outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    assert [o["process_index"] for o in outputs] == [0, 1]
    assert all(o["process_count"] == 2 and o["device_count"] == 2 for o in outputs)
    first, second = (o["trace"] for o in outputs)
    # Same scale, same skips, same params on both processes, every step.
    assert first == second
    assert [s["scale"] for s in first] == [1024.0, 512.0, 512.0, 1024.0]
    assert [s["skipped"] for s in first] == [0, 1, 1, 1]
    assert [s["loss_finite"] for s in first] == [True, False, True, True]
    assert first[BAD_STEP]["w"] == first[BAD_STEP - 1]["w"]  # skipped: unchanged
    assert first[BAD_STEP + 1]["w"] != first[BAD_STEP]["w"]  # and training goes on


if __name__ == "__main__":
    print(json.dumps(_worker(int(sys.argv[1]), int(sys.argv[2]))))
