"""Benchmarks of jaxamp against jmp, Flax's DynamicScale and optax (see BENCHMARKS.md).

Run each as a module from the repository root, e.g. ``python -m benchmarks.compile_scaling``;
``--smoke`` runs a tiny configuration in seconds (used by tests/smoke/test_benchmarks.py).
"""
