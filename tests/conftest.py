"""Test-wide JAX configuration: strict dtype promotion makes accidental upcasts fail."""

import jax

jax.config.update("jax_numpy_dtype_promotion", "strict")


# Note: optax's adam, its schedules and MultiSteps mix Python floats with int32 step
# counts, which strict promotion rejects inside optax itself (not in jaxamp). Tests
# that use them wrap just those calls in `with jax.numpy_dtype_promotion("standard"):`.


# The conformance sweep's tests record their coverage with
# ``record_property("coverage", text)``: a property travels back from
# pytest-xdist's workers, where a print would be lost. This hook lives here, not in
# tests/conformance/, because only conftests on the command line's paths load in
# xdist's controller process.
def pytest_terminal_summary(terminalreporter):
    texts = [
        value
        for key in ("passed", "failed")
        for report in terminalreporter.stats.get(key, [])
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", [])
        if name == "coverage"
    ]
    if texts:
        terminalreporter.section("conformance sweep coverage")
        for text in sorted(texts):
            terminalreporter.write_line(text)
