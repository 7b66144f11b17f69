"""Argument lists for ``jax.numpy``, its ``linalg`` and ``fft``, ``jax.nn`` and
``jax.scipy.special`` (the form is in ``_args``)."""

from __future__ import annotations

SPECIFIC: dict[str, list[tuple[tuple, dict]]] = {}
