"""Argument lists for ``jax.lax`` and ``optax.losses`` (the form is in ``_args``).

``jax.lax`` takes structured static arguments (dimension numbers, windows,
computations) and callables; a ``call`` puts the activation where the function
wants it: inside a loop body, a branch, a named axis (``jax.vmap(axis_name=)``
or a one-device ``shard_map``), or an integer view of the activation for bitwise
operations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

N = 4
RNG = np.random.default_rng(19)


def _values(*shape: int, lo: float = 0.2, hi: float = 0.8) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(np.float32)


MAT = _values(N, N)
MAT2 = _values(N, N)
ROW = _values(1, N)
IMAGE = _values(1, 2, N, N)  # NCHW
KERNEL = _values(3, 2, 2, 2)  # OIHW
SQUARE = _values(2, 2)
IDX = np.array([[2], [0], [3]], np.int32)
SCATTER_IDX = np.array([[2], [0]], np.int32)
UPDATES = _values(2, N)
GATHER = lax.GatherDimensionNumbers(
    offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,)
)
SCATTER = lax.ScatterDimensionNumbers(
    update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
)
NCHW = ("NCHW", "OIHW", "NCHW")
MATMUL = (((1,), (0,)), ((), ()))
AXIS = "i"


def _integers(x):
    """An integer view of the activation: 64 steps per unit."""
    return (x * 64).astype(jnp.int32)


def _on_ints(f, x, *rest, **kwargs):
    return f(_integers(x), *rest, **kwargs)


def _on_two_ints(f, x, y, **kwargs):
    return f(_integers(x), _integers(y), **kwargs)


def _on_bools(f, x, **kwargs):
    return f(x > 0.5, **kwargs)


def _over_rows(body):
    """``call`` running ``body(f, row)`` per row under ``vmap`` with a named axis."""

    def call(f, x, *rest, **kwargs):
        return jax.vmap(lambda r: body(f, r, *rest, **kwargs), axis_name=AXIS)(x)

    return call


def _sharded(body):
    """``call`` running ``body(f, x)`` in a ``shard_map`` over a one-device mesh."""

    def call(f, x, *rest, **kwargs):
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (AXIS,))
        spec = jax.sharding.PartitionSpec(AXIS)
        inner = lambda v: body(f, v, *rest, **kwargs)  # noqa: E731
        return jax.shard_map(inner, mesh=mesh, in_specs=spec, out_specs=spec)(x)

    return call


def _collective(f, r, **kwargs):
    return f(r, AXIS, **kwargs)


def _newton_sqrt(f, x):
    """``custom_root``: the square root of the activation by Newton's method."""

    def solve(g, y):
        return lax.fori_loop(0, 6, lambda _, z: z - g(z) / (2 * z), y)

    def tangent_solve(g, y):
        return y / g(jnp.ones_like(y))

    return f(lambda y: y * y - x, jnp.ones_like(x), solve, tangent_solve)


def _linear_solve(f, x):
    """``custom_linear_solve``: a well-conditioned system built from the activation."""
    a = x + 4 * jnp.eye(N, dtype=x.dtype)
    matvec = lambda v: a @ v  # noqa: E731
    solve = lambda _, b: jnp.linalg.solve(a, b)  # noqa: E731
    return f(matvec, x[0], solve, symmetric=False)


def _random_mask(f, x):
    """``rng_bit_generator``: dropout of the activation by random bits."""
    key = jnp.array([1, 2, 3, 4], jnp.uint32)
    _, bits = f(key, x.shape, dtype=jnp.uint32)
    return jnp.where(bits < jnp.uint32(2**31), x, 0)


def _truncate_bits(f, x):
    """``bitcast_convert_type``: the activation's low mantissa bits cleared."""
    bits = f(x.astype(jnp.float32), jnp.uint32) & jnp.uint32(0xFFFF0000)
    return f(bits, jnp.float32)


def _send_receive(send, receive, v):
    """``psend`` then ``precv`` of the activation within the one-device axis."""
    token = send(v, AXIS, [(0, 0)])
    return receive(token, jax.ShapeDtypeStruct(v.shape, v.dtype), AXIS, [(0, 0)])


def _ragged_dims():
    return lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (1,)), ((), ())),
        lhs_ragged_dimensions=(0,),
        rhs_group_dimensions=(0,),
    )


GROUPS = np.array([1, 3], np.int32)
GROUPED = _values(2, N, N)

SPECIFIC: dict[str, list[tuple]] = {
    # Shapes, slices and layout.
    "jax.lax.broadcast_in_dim": [((MAT, (2, N, N), (1, 2)), {})],
    "jax.lax.expand_dims": [((MAT, (0,)), {})],
    "jax.lax.rev": [((MAT, (0,)), {})],
    "jax.lax.transpose": [((MAT, (1, 0)), {})],
    "jax.lax.slice": [((MAT, (0, 1), (3, N)), {})],
    "jax.lax.slice_in_dim": [((MAT, 1, 3), {"axis": 1})],
    "jax.lax.split": [((MAT, (1, 3)), {"axis": 1})],
    "jax.lax.squeeze": [((ROW, (0,)), {})],
    "jax.lax.pad": [
        ((MAT,), {}, lambda f, x: f(x, jnp.zeros((), x.dtype), ((1, 0, 0), (0, 1, 1))))
    ],
    "jax.lax.index_take": [((MAT, (np.array([2, 0, 1], np.int32),), (0,)), {})],
    "jax.lax.dynamic_slice": [
        ((MAT, np.int32(1), np.int32(0), (2, 3)), {}, lambda f, x, *r: f(x, r[:2], r[2]))
    ],
    "jax.lax.dynamic_slice_in_dim": [((MAT, np.array(1, np.int32), 2), {"axis": 0})],
    "jax.lax.dynamic_update_slice": [((MAT, SQUARE, (1, 2)), {})],
    "jax.lax.dynamic_update_slice_in_dim": [((MAT, ROW, np.array(2, np.int32), 0), {})],
    "jax.lax.dynamic_update_index_in_dim": [((MAT, MAT2[0], np.array(1, np.int32), 0), {})],
    "jax.lax.gather": [((MAT, IDX, GATHER, (1, N)), {"mode": "clip"})],
    "jax.lax.scatter": [((MAT, SCATTER_IDX, UPDATES, SCATTER), {})],
    "jax.lax.scatter_add": [((MAT, SCATTER_IDX, UPDATES, SCATTER), {})],
    "jax.lax.scatter_sub": [((MAT, SCATTER_IDX, UPDATES, SCATTER), {})],
    "jax.lax.scatter_mul": [((MAT, SCATTER_IDX, UPDATES, SCATTER), {})],
    "jax.lax.scatter_min": [((MAT, SCATTER_IDX, UPDATES, SCATTER), {})],
    "jax.lax.scatter_max": [((MAT, SCATTER_IDX, UPDATES, SCATTER), {})],
    "jax.lax.scatter_apply": [((MAT, SCATTER_IDX, jnp.exp, SCATTER), {"update_shape": (2, N)})],
    "jax.lax.select": [((MAT, MAT2), {}, lambda f, x, y: f(x > 0.5, x, y))],
    "jax.lax.select_n": [((MAT, MAT2), {}, lambda f, x, y: f(x > 0.5, y, x))],
    "jax.lax.real": [((MAT,), {}, lambda f, x: f(lax.complex(x, 2 * x)))],
    "jax.lax.imag": [((MAT,), {}, lambda f, x: f(lax.complex(x, 2 * x)))],
    "jax.lax.fft": [((MAT, "RFFT", (N,)), {})],
    "jax.lax.convert_element_type": [((MAT, np.float16), {})],
    "jax.lax.bitcast_convert_type": [((MAT,), {}, _truncate_bits)],
    "jax.lax.reduce_precision": [((MAT,), {"exponent_bits": 5, "mantissa_bits": 10})],
    # Creation functions, given the activation's shape and dtype.
    "jax.lax.full": [((MAT,), {}, lambda f, x: x + f(x.shape, 0.5, x.dtype))],
    "jax.lax.empty": [((MAT,), {}, lambda f, x: f(x.shape, x.dtype).at[:].set(jnp.tanh(x)))],
    "jax.lax.iota": [((MAT,), {}, lambda f, x: x * f(x.dtype, N))],
    "jax.lax.broadcasted_iota": [((MAT,), {}, lambda f, x: x * f(x.dtype, x.shape, 0))],
    "jax.lax.rng_bit_generator": [((MAT,), {}, _random_mask)],
    # Reductions and windows.
    "jax.lax.reduce": [((MAT, 0.0, lax.add, (0,)), {})],
    "jax.lax.reduce_sum": [((MAT, (0,)), {})],
    "jax.lax.reduce_prod": [((MAT, (1,)), {})],
    "jax.lax.reduce_max": [((MAT, (0,)), {})],
    "jax.lax.reduce_min": [((MAT, (1,)), {})],
    "jax.lax.reduce_window": [((MAT, 0.0, lax.add, (2, 2), (1, 1), "VALID"), {})],
    # Contractions and convolutions.
    "jax.lax.dot_general": [((MAT, MAT2, MATMUL), {})],
    "jax.lax.ragged_dot": [((MAT, GROUPED, GROUPS), {})],
    "jax.lax.ragged_dot_general": [((MAT, GROUPED, GROUPS, _ragged_dims()), {})],
    "jax.lax.conv": [((IMAGE, KERNEL, (1, 1), "SAME"), {})],
    "jax.lax.conv_general_dilated": [
        ((IMAGE, KERNEL, (1, 1), "SAME"), {"rhs_dilation": (2, 1), "dimension_numbers": NCHW})
    ],
    "jax.lax.conv_with_general_padding": [
        ((IMAGE, KERNEL, (1, 1), ((0, 0), (1, 1)), None, None), {})
    ],
    "jax.lax.conv_transpose": [((IMAGE, KERNEL, (2, 2), "SAME"), {"dimension_numbers": NCHW})],
    "jax.lax.conv_general_dilated_patches": [((IMAGE, (2, 2), (1, 1), "VALID"), {})],
    "jax.lax.conv_general_dilated_local": [
        ((IMAGE, _values(3, 8, 3, 3), (1, 1), "VALID", (2, 2)), {"dimension_numbers": NCHW})
    ],
    # Control flow: callables that use the activation.
    "jax.lax.cond": [((MAT,), {}, lambda f, x: f(jnp.sum(x) > 0, jnp.sin, jnp.cos, x))],
    "jax.lax.switch": [((MAT,), {}, lambda f, x: f(1, [jnp.sin, jnp.tanh, jnp.cos], x))],
    "jax.lax.scan": [
        ((MAT,), {}, lambda f, x: f(lambda c, r: (c + jnp.tanh(r), c * r), jnp.zeros(N), x))
    ],
    "jax.lax.fori_loop": [
        ((MAT,), {}, lambda f, x: f(0, 3, lambda i, c: c * 0.5 + jnp.tanh(x), jnp.zeros((N, N))))
    ],
    "jax.lax.while_loop": [
        (
            (MAT,),
            {},
            lambda f, x: f(
                lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] + jnp.sin(x)), (0, jnp.zeros((N, N)))
            )[1],
        )
    ],
    "jax.lax.map": [((MAT,), {}, lambda f, x: f(lambda r: jnp.tanh(r) * jnp.sum(r), x))],
    "jax.lax.associative_scan": [((MAT,), {}, lambda f, x: f(jnp.add, x, axis=1))],
    "jax.lax.custom_root": [((MAT,), {}, _newton_sqrt)],
    "jax.lax.custom_linear_solve": [((MAT,), {}, _linear_solve)],
    "jax.lax.composite": [((MAT,), {}, lambda f, x: f(lambda y: jnp.sin(y) * 2, "jaxamp.sine")(x))],
    "jax.lax.platform_dependent": [((MAT,), {}, lambda f, x: f(x, default=jnp.sin, cpu=jnp.cos))],
    "jax.lax.with_sharding_constraint": [
        ((MAT, jax.sharding.SingleDeviceSharding(jax.devices()[0])), {})
    ],
    # Collectives over a named axis.
    "jax.lax.psum": [((MAT,), {}, _over_rows(_collective))],
    "jax.lax.pmean": [((MAT,), {}, _over_rows(_collective))],
    "jax.lax.pmax": [((MAT,), {}, _over_rows(_collective))],
    "jax.lax.pmin": [((MAT,), {}, _over_rows(_collective))],
    "jax.lax.all_gather": [((MAT,), {}, _over_rows(_collective))],
    "jax.lax.all_to_all": [((MAT,), {}, _over_rows(lambda f, r: f(r, AXIS, 0, 0)))],
    "jax.lax.psum_scatter": [((MAT,), {}, _over_rows(lambda f, r: f(r, AXIS, tiled=True)))],
    "jax.lax.ppermute": [
        ((MAT,), {}, _over_rows(lambda f, r: f(r, AXIS, [(0, 1), (1, 2), (2, 3), (3, 0)])))
    ],
    "jax.lax.pshuffle": [((MAT,), {}, _over_rows(lambda f, r: f(r, AXIS, [1, 2, 3, 0])))],
    "jax.lax.pswapaxes": [((MAT,), {}, _over_rows(lambda f, r: f(r, AXIS, 0)))],
    "jax.lax.pbroadcast": [((MAT,), {}, _sharded(lambda f, v: f(v, AXIS, 0)))],
    "jax.lax.axis_size": [((MAT,), {}, _over_rows(lambda f, r: lax.psum(r, AXIS) / f(AXIS)))],
    "jax.lax.axis_index": [((MAT,), {}, _over_rows(lambda f, r: r * f(AXIS).astype(r.dtype)))],
    "jax.lax.pcast": [
        ((MAT,), {}, _sharded(lambda f, v: f(lax.psum(v, AXIS), AXIS, to="varying")))
    ],
    "jax.lax.psend": [((MAT,), {}, _sharded(lambda f, v: _send_receive(f, lax.precv, v)))],
    "jax.lax.precv": [((MAT,), {}, _sharded(lambda f, v: _send_receive(lax.psend, f, v)))],
    # Integer and bool operations on an integer view of the activation.
    "jax.lax.population_count": [((MAT,), {}, _on_ints)],
    "jax.lax.clz": [((MAT,), {}, _on_ints)],
    "jax.lax.bitwise_not": [((MAT,), {}, _on_ints)],
    "jax.lax.bitwise_and": [((MAT, MAT2), {}, _on_two_ints)],
    "jax.lax.bitwise_or": [((MAT, MAT2), {}, _on_two_ints)],
    "jax.lax.bitwise_xor": [((MAT, MAT2), {}, _on_two_ints)],
    "jax.lax.mulhi": [((MAT, MAT2), {}, _on_two_ints)],
    "jax.lax.shift_left": [((MAT,), {}, lambda f, x: f(_integers(x), 2))],
    "jax.lax.shift_right_arithmetic": [((MAT,), {}, lambda f, x: f(_integers(x), 2))],
    "jax.lax.shift_right_logical": [((MAT,), {}, lambda f, x: f(_integers(x), 2))],
    "jax.lax.reduce_and": [((MAT,), {"axes": (0,)}, _on_bools)],
    "jax.lax.reduce_or": [((MAT,), {"axes": (0,)}, _on_bools)],
    "jax.lax.reduce_xor": [((MAT,), {"axes": (0,)}, _on_bools)],
    "jax.lax.argmax": [((MAT, 1, np.int32), {})],
    "jax.lax.argmin": [((MAT, 0, np.int32), {})],
    "jax.lax.dtype": [((MAT, MAT2), {}, lambda f, x, y: x + y.astype(f(x)))],
    # optax.losses
}

# optax.losses: CTC over a batch of 2 sequences of 5 frames, 4 classes (0: blank).
LOGITS = _values(2, 5, N, lo=-2.0, hi=2.0)
LOGIT_PADDINGS = np.array([[0, 0, 0, 0, 0], [0, 0, 0, 1, 1]], np.float32)
LABELS = np.array([[1, 2, 1], [3, 3, 0]], np.int32)
LABEL_PADDINGS = np.array([[0, 0, 0], [0, 0, 1]], np.float32)
CLASSES = np.array([2, 0, 3, 1], np.int32)
PAIRS = np.array([0, 1, 0, 1], np.int32)


def _standard_promotion(f, *args, **kwargs):
    """Calls ``f`` under JAX's standard promotion (optax's own code mixes int and
    float; the tests otherwise run under strict promotion)."""
    with jax.numpy_dtype_promotion("standard"):
        return f(*args, **kwargs)


SPECIFIC.update(
    {
        "optax.losses.ctc_loss": [((LOGITS, LOGIT_PADDINGS, LABELS, LABEL_PADDINGS), {})],
        "optax.losses.ctc_loss_with_forward_probs": [
            ((LOGITS, LOGIT_PADDINGS, LABELS, LABEL_PADDINGS), {})
        ],
        "optax.losses.make_fenchel_young_loss": [
            ((MAT[0], MAT2[0]), {}, lambda f, x, y: f(jax.nn.logsumexp)(x, y))
        ],
        "optax.losses.multiclass_sparsemax_loss": [((MAT, CLASSES), {}, _standard_promotion)],
        "optax.losses.ntxent": [((MAT, PAIRS), {}, _standard_promotion)],
    }
)
