"""Kill-and-resume with orbax at random steps, and restoring onto 8 (simulated) devices."""

import os
import pathlib
import pickle
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import jaxamp
from jaxamp.testing import inject_fault_in_leaf
from tests.helpers import bits

STEPS = 24
FAULTS = jnp.asarray([2, 3, 9, 17], jnp.int32)  # including two faults in a row


def _setup():
    tx = jaxamp.loss_scaling(
        optax.sgd(0.05, momentum=0.9),
        jaxamp.DynamicLossScale(loss_scale=2.0**10, growth_interval=4, min_loss_scale=2.0**-2),
    )
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": jnp.zeros(3)}
    x = jnp.linspace(-2.0, 2.0, 32).reshape(8, 4)
    policy = jaxamp.get_policy("mixed_float16")

    @jax.jit
    def step(params, opt_state, index):
        scale = jaxamp.get_loss_scale(opt_state)

        def loss_fn(p):
            p, xc = policy.cast_to_compute((p, x))
            return jnp.mean(policy.cast_to_output(jnp.tanh(xc @ p["w"] + p["b"])) ** 2)

        grads = jax.grad(lambda p: scale.scale(loss_fn(p)))(params)
        grads = inject_fault_in_leaf(grads, 0, index, FAULTS, float("inf"))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return tx, params, step


def _run(step, state, start, stop):
    params, opt_state = state
    for i in range(start, stop):
        params, opt_state = step(params, opt_state, jnp.int32(i))
    return params, opt_state


def test_kill_and_resume_at_random_steps_is_bit_identical(tmp_path):
    tx, params, step = _setup()
    reference = _run(step, (params, tx.init(params)), 0, STEPS)
    assert int(reference[1].skipped_steps) == 4
    kill_points = sorted(np.random.default_rng(7).choice(np.arange(1, STEPS), 3, replace=False))
    for kill in [*kill_points, 3, 4]:  # also right after, and between, skipped steps
        state = _run(step, (params, tx.init(params)), 0, int(kill))
        path = tmp_path / f"kill{kill}"
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(path, state)
        del state  # the process "dies": only the checkpoint survives
        template = jax.eval_shape(lambda: (params, tx.init(params)))
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(path, template)
        resumed = _run(step, restored, int(kill), STEPS)
        assert bits(resumed) == bits(reference), f"resume after step {kill}"
        assert jaxamp.get_loss_scale(resumed[1]).min_loss_scale == 2.0**-2


_EIGHT_DEVICES = textwrap.dedent(
    """
    import pickle, sys
    import jax, jax.numpy as jnp, numpy as np, orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    sys.path.insert(0, sys.argv[2])
    import tests.integration.test_reliability_resume as t
    assert jax.device_count() == 8, jax.devices()
    tx, params, step = t._setup()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, P())
    template = jax.eval_shape(lambda: (params, tx.init(params)))
    template = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), template)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(sys.argv[1] + "/ckpt", template)
    assert len(jax.tree.leaves(restored)[0].sharding.device_set) == 8
    resumed = t._run(step, restored, int(sys.argv[3]), t.STEPS)
    with open(sys.argv[1] + "/resumed.pkl", "wb") as f:
        pickle.dump(t.bits(resumed), f)
    """
)


def test_resume_on_eight_devices_matches_single_device_run(tmp_path):
    tx, params, step = _setup()
    reference = _run(step, (params, tx.init(params)), 0, STEPS)
    kill = 10
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", _run(step, (params, tx.init(params)), 0, kill))
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
    )
    root = str(pathlib.Path(__file__).resolve().parents[2])  # imports tests.integration...
    done = subprocess.run(
        [sys.executable, "-c", _EIGHT_DEVICES, str(tmp_path), root, str(kill)],
        env=env,
        timeout=240,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = pickle.loads((tmp_path / "resumed.pkl").read_bytes())
    assert resumed == bits(reference)
