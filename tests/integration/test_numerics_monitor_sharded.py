"""numerics_monitor on 8 devices: an FSDP train step reports once per firing.

The checks run in a subprocess (this file run as a script) with 8 CPU devices
forced by XLA_FLAGS before jax is imported; it prints its measurements as JSON and
the test asserts on them. The parameters are sharded on their largest dim (FSDP),
the batch on its first. From the host loop the train step is the plain one (its
collectives are those of the step without a monitor) and a reporting step runs
the compiled report program once over the 8 shards; inside the step the
instrumented program sits under a ``lax.cond`` whose untaken branch moves nothing.
"""

import json

from tests.helpers import run_with_devices

N_DEVICES = 8
STEPS = 5


def _worker() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxamp

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    assert jax.device_count() == N_DEVICES, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    rng = np.random.default_rng(0)
    columns, rows = NamedSharding(mesh, P(None, "d")), NamedSharding(mesh, P("d", None))
    params = {
        "w1": jax.device_put(jnp.asarray(rng.normal(0, 0.3, (16, 64)), jnp.float32), columns),
        "w2": jax.device_put(jnp.asarray(rng.normal(0, 0.3, (64, 8)), jnp.float32), rows),
    }
    x = jax.device_put(jnp.asarray(rng.normal(size=(32, 16)), jnp.float32), rows)

    def loss(p, x):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)

    policy = "mixed_float16"
    scaled = jaxamp.autocast(loss, policy)

    def train_step(p, x):
        grads = jax.grad(scaled)(p, x)
        return jax.tree.map(lambda a, g: a - 0.01 * g, p, grads)

    plain = jax.jit(train_step)
    host_seen: list = []
    monitor = jaxamp.numerics_monitor(
        loss, every=2, policy=policy, grad=True, callback=lambda s, r: host_seen.append((s, r))
    )
    p = params
    for i in range(STEPS):
        monitor(i, p, x, loss_scale=2.0**4)
        p = plain(p, x)
    monitor.flush()
    sharded_params = all(len(a.sharding.device_set) == N_DEVICES for a in jax.tree.leaves(p))

    # The report numerics_report gives on the same (sharded) arguments.
    expected = jaxamp.numerics_report(loss, params, x, policy=policy, grad=True, loss_scale=2.0**4)
    first = host_seen[0][1]

    in_step_seen: list = []
    in_step = jaxamp.numerics_monitor(
        loss, every=2, policy=policy, grad=True, callback=lambda s, r: in_step_seen.append(s)
    )

    @jax.jit
    def monitored(i, p, x):
        in_step(i, p, x, loss_scale=2.0**4)
        return train_step(p, x)

    p = params
    for i in range(STEPS):
        p = monitored(i, p, x)
    jax.effects_barrier()

    def kinds(fun, *args):
        return sorted(c.kind for c in jaxamp.communication_report(fun, *args).collectives)

    return {
        "host_steps": [s for s, _ in host_seen],
        "sharded_params": sharded_params,
        "same_report": first == expected,
        "reports_nonempty": len(first.ops) > 10,
        "in_step_steps": in_step_seen,
        "plain_collectives": kinds(plain, params, x),
        "in_step_collectives": kinds(monitored, 1, params, x),
        "in_step_outside_branches": _collectives_outside_branches(
            monitored.lower(1, params, x).compile().as_text()
        ),
        "plain_outside_branches": _collectives_outside_branches(
            plain.lower(params, x).compile().as_text()
        ),
    }


_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")


def _collectives_outside_branches(hlo: str) -> list[str]:
    """The collectives of a compiled module that run whether or not a ``conditional``
    takes a branch: those of the computations reachable from the entry other than
    through a conditional's branches."""
    import re

    bodies: dict[str, list[str]] = {}
    entry, name = None, None
    for line in hlo.splitlines():
        header = re.match(r"^(ENTRY )?%?([\w.-]+) .*\{$", line)
        if header:
            name = header.group(2)
            bodies[name] = []
            entry = name if header.group(1) else entry
        elif name is not None and line.strip() != "}":
            bodies[name].append(line)
    seen, todo, found = set(), [entry], []
    while todo:
        comp = todo.pop()
        if comp in seen or comp not in bodies:
            continue
        seen.add(comp)
        for line in bodies[comp]:
            op = re.search(r"= \S+ ([\w-]+)\(", line)
            if op and op.group(1).removesuffix("-start") in _COLLECTIVES:
                found.append(op.group(1).removesuffix("-start"))
            branches = re.sub(r"branch_computations=\{[^}]*\}", "", line)
            branches = re.sub(r"(true|false)_computation=%?[\w.-]+", "", branches)
            todo += re.findall(r"(?:to_apply|calls|body|condition)=%?([\w.-]+)", branches)
    return sorted(found)


def test_sharded_monitor_reports_once_per_firing():
    got = run_with_devices(__file__, N_DEVICES)
    assert got["sharded_params"]
    # From the host loop: one report per reporting step, the one numerics_report gives
    # on the same sharded arguments; the train step is the plain one.
    assert got["host_steps"] == [0, 2, 4]
    assert got["same_report"] and got["reports_nonempty"]
    # Inside the step: the callback runs once per firing too, not once per device.
    assert got["in_step_steps"] == [0, 2, 4]
    # The step's own collectives (parameter gathers, the gradient's reduction) ...
    assert set(got["plain_collectives"]) >= {"all-gather", "all-reduce"}
    assert got["plain_outside_branches"] == sorted(got["plain_collectives"])
    # ... are all an idle in-step monitor adds: the report's are in the untaken branch.
    assert len(got["in_step_collectives"]) > len(got["plain_collectives"])
    assert got["in_step_outside_branches"] == got["plain_outside_branches"]


if __name__ == "__main__":
    print(json.dumps(_worker()))
