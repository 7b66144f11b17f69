"""Sharding layouts of the GPT of benchmarks/_models.py over a one-axis mesh ("d").

- ``fsdp``: every parameter sharded on its largest dim that the device count
  divides (ZeRO-3 / FSDP), the batch sharded too;
- ``tp``: Megatron tensor parallelism: query/key/value and the first MLP layer
  column-parallel, the attention output and the second MLP layer row-parallel,
  everything else replicated, the batch replicated.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

LAYOUTS = ("fsdp", "tp")
# Column-parallel kernels shard their output features, row-parallel ones their inputs.
TP_SPECS = {
    ("query", "kernel"): P(None, "d", None),
    ("key", "kernel"): P(None, "d", None),
    ("value", "kernel"): P(None, "d", None),
    ("query", "bias"): P("d", None),
    ("key", "bias"): P("d", None),
    ("value", "bias"): P("d", None),
    ("out", "kernel"): P("d", None, None),
    ("Dense_0", "kernel"): P(None, "d"),
    ("Dense_0", "bias"): P("d"),
    ("Dense_1", "kernel"): P("d", None),
}


def _fsdp_spec(shape: tuple[int, ...], n_devices: int) -> P:
    dims = [i for i in np.argsort(shape)[::-1] if shape[i] % n_devices == 0]
    if not dims:
        return P()
    spec: list[Any] = [None] * len(shape)
    spec[int(dims[0])] = "d"
    return P(*spec)


def _tp_spec(path: tuple) -> P:
    keys = tuple(getattr(k, "key", str(k)) for k in path)
    return TP_SPECS.get(keys[-2:], P())


def param_specs(params: Any, layout: str, n_devices: int) -> Any:
    """The PartitionSpec of every parameter in ``layout`` ("fsdp" or "tp")."""
    if layout == "fsdp":
        return jax.tree.map(lambda p: _fsdp_spec(p.shape, n_devices), params)
    return jax.tree_util.tree_map_with_path(lambda k, _: _tp_spec(k), params)


def batch_spec(layout: str) -> P:
    return P("d") if layout == "fsdp" else P()
