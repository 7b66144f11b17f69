"""Argument lists for ``jax.lax`` and ``optax.losses`` (the form is in ``_args``)."""

from __future__ import annotations

SPECIFIC: dict[str, list[tuple[tuple, dict]]] = {}
