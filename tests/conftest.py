"""Test-wide JAX configuration: strict dtype promotion makes accidental upcasts fail."""

import jax

jax.config.update("jax_numpy_dtype_promotion", "strict")


# Note: optax's adam, its schedules and MultiSteps mix Python floats with int32 step
# counts, which strict promotion rejects inside optax itself (not in jaxamp). Tests
# that use them wrap just those calls in `with jax.numpy_dtype_promotion("standard"):`.
