"""The functions the conformance sweep does not call, each with its one-line reason."""

from __future__ import annotations

# name -> one-line reason: functions the sweep does not call, and why.
EXCLUDED = {
    # Input/output, printing and configuration: no numerics to check.
    "save": "writes a file",
    "savez": "writes a file",
    "load": "reads a file",
    "fromfile": "reads a file",
    "frombuffer": "takes bytes",
    "fromstring": "takes a string",
    "fromiter": "takes a Python iterable",
    "fromfunction": "takes a Python callable and a shape",
    "array_repr": "returns a string",
    "array_str": "returns a string",
    "einsum_path": "returns a contraction plan (Python lists and a string)",
    "trim_zeros": "output shape depends on the values: not traceable",
    "promote_types": "dtype utility: dtypes in, a dtype out",
    "result_type": "dtype utility: arrays or dtypes in, a dtype out",
    "broadcast_shapes": "shape utility: shapes in, a shape out",
    "get_scaled_dot_general_config": "returns a configuration object",
    "printoptions": "printing configuration",
    "set_printoptions": "printing configuration",
    "get_printoptions": "printing configuration",
    "show_config": "prints configuration",
    "from_dlpack": "takes a DLPack capsule",
    # Host-side effects and devices.
    "infeed": "host infeed",
    "outfeed": "host outfeed",
    "create_token": "effect token, no value",
    "after_all": "effect token, no value",
    "optimization_barrier": "returns its operands unchanged by definition",
    # jax.lax shape utilities and backend-specific collectives.
    "conv_dimension_numbers": "shape utility: shapes in, a shape out",
    "conv_general_permutations": "shape utility: shapes in, a shape out",
    "conv_general_shape_tuple": "shape utility: shapes in, a shape out",
    "conv_shape_tuple": "shape utility: shapes in, a shape out",
    "conv_transpose_shape_tuple": "shape utility: shapes in, a shape out",
    "padtype_to_pads": "shape utility: shapes in, a shape out",
    "reduce_window_shape_tuple": "shape utility: shapes in, a shape out",
    "shape_as_value": "shape utility: shapes in, a shape out",
    "pbroadcast": "no XLA:CPU lowering, and its vmap rule fails in JAX itself",
    "psend": "implemented on GPU only",
    "precv": "implemented on GPU only",
    "ragged_all_to_all": "XLA:CPU has no ragged all-to-all",
    "psum_scatter_start": "async collective start (jax 0.12): no vmap rule, no XLA:CPU kernel",
    "rng_uniform": "stateful random numbers: every call differs, no reference to compare",
}

# Why the rest are skipped: none of CANDIDATES fits (creation functions, dtype and
# index utilities, functions needing specific static arguments or integer inputs).
