"""Loss scales save and restore every field with flax.serialization and orbax."""

import dataclasses
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import serialization

import jaxamp

CUSTOM = jaxamp.DynamicLossScale(
    loss_scale=2.0**7,
    counter=5,
    growth_interval=11,
    growth_factor=4.0,
    backoff_factor=0.125,
    min_loss_scale=0.25,
    max_loss_scale=2.0**40,
)


def _fields(ls):
    return [np.asarray(getattr(ls, f.name)).item() for f in dataclasses.fields(ls)]


def test_flax_serialization_saves_state_and_config():
    data = serialization.to_bytes(CUSTOM)
    restored = serialization.from_bytes(jaxamp.DynamicLossScale(), data)
    assert _fields(restored) == _fields(CUSTOM)
    assert restored.loss_scale.dtype == jnp.float32 and restored.counter.dtype == jnp.int32
    static = serialization.from_bytes(
        jaxamp.StaticLossScale(1.0), serialization.to_bytes(jaxamp.StaticLossScale(64.0))
    )
    assert float(static.loss_scale) == 64.0


def test_flax_serialization_of_a_whole_optimizer_state():
    tx = jaxamp.loss_scaling(optax.sgd(1e-3, momentum=0.9), CUSTOM)
    params = {"w": jnp.ones((2, 2))}
    state = tx.init(params)
    _, state = tx.update({"w": jnp.full((2, 2), jnp.inf)}, state, params)
    restored = serialization.from_bytes(tx.init(params), serialization.to_bytes(state))
    assert _fields(jaxamp.get_loss_scale(restored)) == _fields(jaxamp.get_loss_scale(state))
    assert int(restored.skipped_steps) == 1


def test_orbax_round_trip(tmp_path):
    tree = {"scale": CUSTOM, "params": {"w": jnp.arange(4.0)}}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", tree)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(
            tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
        )
    assert _fields(restored["scale"]) == _fields(CUSTOM)
    assert np.array_equal(restored["params"]["w"], tree["params"]["w"])


def test_import_jaxamp_registers_loss_scales_without_jaxamp_flax():
    # A fresh interpreter: the suite's other tests import jaxamp.flax.
    code = textwrap.dedent(
        """
        import sys
        import flax.serialization
        import optax
        import jax.numpy as jnp
        import jaxamp
        tx = jaxamp.loss_scaling(optax.sgd(0.1), jaxamp.DynamicLossScale(8.0, growth_interval=7))
        state = tx.init({"w": jnp.ones(2)})
        blob = flax.serialization.to_bytes(state)
        target = jaxamp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})
        restored = jaxamp.get_loss_scale(flax.serialization.from_bytes(target, blob))
        assert restored.growth_interval == 7 and float(restored.loss_scale) == 8.0
        assert "jaxamp.flax" not in sys.modules
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
