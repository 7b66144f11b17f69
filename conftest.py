"""Doctests in jaxamp/ run under the same strict dtype promotion as tests/."""

import jax

jax.config.update("jax_numpy_dtype_promotion", "strict")
