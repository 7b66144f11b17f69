"""Adapter: teaches ``flax.serialization`` to save every field of a loss scale.

Imported by ``jaxamp/__init__.py`` whenever flax is installed (core jaxamp's
only use of flax), so that ``flax.serialization`` and orbax checkpoints of
an optimizer state work without importing ``jaxamp.flax``. The state dict holds
the array state and the static configuration, and restoring takes both from the
saved state.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from flax import serialization

from jaxamp._loss_scaling._scales import LossScale


def _to_state_dict(scale: Any) -> dict[str, Any]:
    return {f.name: getattr(scale, f.name) for f in dataclasses.fields(scale)}


def _from_state_dict(target: Any, state: dict[str, Any]) -> Any:
    fields = {f.name for f in dataclasses.fields(target)}
    unknown = set(state) - fields
    if unknown:
        raise ValueError(
            f"cannot restore {type(target).__name__}: unknown fields {sorted(unknown)} "
            f"in the saved state (expected {sorted(fields)})."
        )
    values = {name: state.get(name, getattr(target, name)) for name in fields}
    if "growth_interval" in values:  # a checkpoint may hold a NumPy scalar
        values["growth_interval"] = int(values["growth_interval"])
    return type(target)(**values)


for _cls in typing.get_args(LossScale):
    serialization.register_serialization_state(_cls, _to_state_dict, _from_state_dict)
