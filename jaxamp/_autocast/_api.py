"""``jaxamp.autocast``: the public transform (argument checks, tracing, output casts)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._alignment import tensor_core_multiple
from jaxamp._autocast._caster import Autocaster
from jaxamp._autocast._dispatch import rule_table
from jaxamp._autocast._remat import save_narrow_values
from jaxamp._autocast._values import PLAIN, cast
from jaxamp._casting import is_floating
from jaxamp._checks import check_bool, check_callable, is_int
from jaxamp._engine._trace import flatten_call, trace
from jaxamp._fp8 import RECIPES, Float4Recipe, Float8Recipe, recipe_weights
from jaxamp._fp8._probe import current as current_probe
from jaxamp._policy import Policy
from jaxamp._resolve import resolve
from jaxamp._wire._warnings import warn_unhonoured_wire_dtypes

__all__ = ["autocast"]


def _pad_multiple(pad_to: Any, policy: Policy) -> int | None:
    if pad_to is None:
        return None
    if pad_to == "auto":
        return tensor_core_multiple(policy.compute_dtype)
    if not is_int(pad_to) or pad_to < 1:
        raise ValueError(
            f"pad_to must be None, 'auto' (jaxamp.tensor_core_multiple of the compute "
            f"dtype) or an int >= 1; got {pad_to!r}."
        )
    return int(pad_to)


def autocast(
    fun: Callable,
    policy: Policy | Float8Recipe | Float4Recipe | str | Any = "mixed_bfloat16",
    *,
    rules: Mapping | None = None,
    pad_to: int | str | None = None,
    remat_float32: bool = False,
) -> Callable:
    """Runs ``fun`` with mixed precision by rewriting its jaxpr (torch.autocast for JAX).

    Matmuls and convolutions run with compute-dtype operands, float32 accumulation
    and a compute-dtype result; precision-sensitive operations (exp/log family,
    pow, rsqrt, sums and other reductions, cumsum, special functions, linear
    algebra) run in float32; everything else follows its operands, where a
    parameter or constant meeting an activation follows the activation and a
    float32 result keeps its operation in float32. Floating outputs are cast to
    ``policy.output_dtype``. Integer and bool values are never cast; with the
    ``"float32"`` policy the result is bit-identical to ``fun``. The table is
    :data:`jaxamp.AUTOCAST_RULES`.

    Compose it with ``jax.jit``, ``jax.grad``, ``jax.value_and_grad`` and
    ``jax.vmap`` as usual; ``fun`` may use jit, custom_jvp (``jax.nn.relu``,
    ``gelu``), scan, while_loop, cond/switch and ``jax.checkpoint`` inside.

    Args:
      fun: the function; its array arguments (JAX or NumPy arrays, anywhere in
        pytrees) are traced, other leaves (Python scalars, strings) are static.
      policy: a ``jaxamp.Policy`` or anything ``jaxamp.get_policy`` accepts; or
        FP8 matmuls: a ``jaxamp.Float8Recipe``, or ``"mixed_float8"`` (its
        defaults); FP4 matmuls: a ``jaxamp.Float4Recipe``, ``"mixed_nvfp4"`` or
        ``"mixed_mxfp4"``. Everything else then runs as under the recipe's
        16-bit compute dtype (docs/fp8.md, docs/fp4.md).
      rules: overrides ``{primitive or name: "compute" | "float32" | "follow" |
        "keep" | "recurse" | callable}``; a callable is a custom rule, called as
        ``rule(context, eqn, *args)`` with a :class:`jaxamp.AutocastContext`,
        and returns the list of outputs.
      pad_to: ``None`` (default), an int, or ``"auto"`` (the Tensor Core multiple
        of the compute dtype): the M, N and K dims of matmuls and the channel dims
        of convolutions are zero-padded to that multiple and the result sliced
        back, so results are unchanged and the compiled shapes aligned.
      remat_float32: ``False`` (default) or ``True``: keep only 16-bit (and
        integer) values for the backward pass and recompute the float32 ones
        (softmax, normalisation statistics, the loss) from them, with
        ``jax.checkpoint``. Saves memory for a little elementwise recomputation;
        has no effect when the compute dtype is 32-bit. On the GPT of
        ``benchmarks/activation_memory.py``: residuals 0.53x of float32 instead of
        0.64x.

    Returns:
      A function with ``fun``'s signature.

    Warns:
      UnknownPrimitiveWarning: ``fun`` uses a higher-order primitive with no
        rule; it runs as traced, and the message names it and shows how to
        register a rule.

    >>> import jax, jax.numpy as jnp, jaxamp
    >>> def layer(w, x):
    ...     return jnp.tanh(x @ w + 1.0)
    >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    >>> jaxamp.autocast(layer)(w, x).dtype  # output dtype of mixed_bfloat16
    dtype('float32')
    >>> jaxamp.precision_report(jaxamp.autocast(layer), w, x).flops_by_dtype
    {'bfloat16': 48}
    """
    if isinstance(fun, (str, Policy, *RECIPES)):
        raise TypeError(f"fun must be the function to run; got {fun!r}. {_ONE_LINE}")
    check_callable(fun)
    policy, recipe = resolve(policy)  # recipe: a Float8Recipe/Float4Recipe, or None
    table = rule_table(rules)
    multiple = _pad_multiple(pad_to, policy)
    remat = check_bool(remat_float32, "remat_float32")
    remat = remat and np.dtype(policy.compute_dtype).itemsize < 4

    @functools.wraps(fun)
    def autocast_fun(*args, **kwargs):
        closed, arrays, out_tree = trace(fun, args, kwargs)
        # Each input's key path: FP4's high_precision matches parameters by name.
        paths = flatten_call(fun, args, kwargs).paths if recipe is not None else None
        warn_unhonoured_wire_dtypes(policy, list(arrays), getattr(fun, "__name__", "fun"))
        autocaster = Autocaster(policy, table, multiple, recipe=recipe)

        def run(*dyn):
            if recipe is not None:  # FP8: every weight's scale from one reduction
                autocaster.recipe_weights = recipe_weights(recipe, closed, dyn, paths)
                probe = current_probe()  # precision_plan's trace: instrument the products
                autocaster.plan_probe = None if probe is None else probe.bind(closed, paths or [])
            return [v for v, _ in autocaster.eval_jaxpr(closed, [(v, PLAIN) for v in dyn])]

        if remat:
            run = jax.checkpoint(run, policy=save_narrow_values)
        output_dtype = np.dtype(policy.output_dtype)
        flat = [
            cast(v, output_dtype)
            if is_floating(v) and jnp.issubdtype(var.aval.dtype, jnp.floating)
            else v
            for v, var in zip(run(*arrays), closed.jaxpr.outvars, strict=True)
        ]
        return jax.tree.unflatten(out_tree, flat)

    return _AutocastFunction(fun, autocast_fun)


_ONE_LINE = (
    "jaxamp.autocast wraps a function (torch's `with autocast(...):` block is one line "
    "here): fast = jaxamp.autocast(loss_fn, 'mixed_bfloat16'), then call fast(params, batch) "
    "or jax.value_and_grad(fast)(params, batch)."
)


class _AutocastFunction:
    """What ``autocast`` returns: ``fun``'s rewritten version, a plain callable.

    A class rather than a closure only so that ``with jaxamp.autocast(fun):``
    (the torch habit) gets a message that shows the one-line form instead of
    Python's generic context-manager error.
    """

    def __init__(self, fun: Callable, call: Callable):
        functools.update_wrapper(self, fun)
        self._call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        # Bound like a function when stored as a class attribute.
        return self if obj is None else functools.partial(self, obj)

    def __enter__(self) -> None:
        raise TypeError(f"jaxamp.autocast(...) is not a context manager. {_ONE_LINE}")

    def __exit__(self, *exc: Any) -> None:
        return None
