"""autocast: torch.autocast for JAX, by re-running a function's jaxpr with dtype rules.

The function is traced once to a jaxpr, then each equation is re-bound under the
caller's trace (so jit, grad, vmap compose) after its operands were cast as its
rule says (see ``_autocast_rules``). Every value carries a role:

- ``PLAIN``: as traced (inputs, parameters, constants, and what only they feed);
- ``ACTIVATION``: moved to the compute dtype by a matmul rule, or computed from one;
- ``PINNED``: float32 on purpose (a float32-rule result, an explicit cast).

"follow" operations take the highest role among their operands: PINNED beats
ACTIVATION beats PLAIN. That is how a float32 bias added to a bfloat16 activation
stays bfloat16 (the memory saving), while a softmax or a loss that went to float32
stays float32 until the next matmul.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jaxamp import _jaxpr_compat as compat
from jaxamp._alignment import tensor_core_multiple
from jaxamp._autocast_control_flow import HANDLERS
from jaxamp._autocast_matmul import padded, run_matmul
from jaxamp._autocast_remat import save_narrow_values
from jaxamp._autocast_rules import AUTOCAST_RULES, RULE_KINDS
from jaxamp._autocast_values import ACTIVATION, PINNED, PLAIN, cast, is_float, promote
from jaxamp._policy import Policy, get_policy

__all__ = ["Autocaster", "autocast"]

_F32 = np.dtype(np.float32)
_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


class Autocaster:
    """Evaluates jaxprs under a policy and a rule table (one per autocast call).

    Custom rules receive it as their first argument: ``policy``, ``compute_dtype``
    and ``bind(eqn, *args)`` (run an equation as written) are public.
    """

    def __init__(self, policy: Policy, rules: Mapping[str, Any], pad_to: int | None):
        self.policy = policy
        self.compute_dtype = np.dtype(policy.compute_dtype)
        self.rules = rules
        self.pad_to = pad_to

    @staticmethod
    def bind(eqn: jex.JaxprEqn, *args: Any) -> list[Any]:
        """Runs ``eqn`` as written on ``args``."""
        return compat.bind_eqn(eqn, args)

    # -- evaluation ---------------------------------------------------------------

    def eval_jaxpr(self, closed: jex.ClosedJaxpr, args: Sequence[tuple]) -> list[tuple]:
        """Evaluates ``closed`` on ``(value, role)`` pairs; returns such pairs."""
        env: dict[jex.Var, tuple] = {}

        def read(atom):
            if isinstance(atom, jex.Literal):
                return np.asarray(compat.literal_value(atom), atom.aval.dtype), PLAIN
            return env[atom]

        jaxpr = closed.jaxpr
        for var, const in zip(jaxpr.constvars, closed.consts, strict=True):
            env[var] = (const, PLAIN)
        for var, arg in zip(jaxpr.invars, args, strict=True):
            env[var] = arg
        for eqn in jaxpr.eqns:
            outs = self._apply(eqn, [read(atom) for atom in eqn.invars])
            for var, out in zip(eqn.outvars, outs, strict=True):
                if not isinstance(var, jex.DropVar):
                    env[var] = out
        return [read(atom) for atom in jaxpr.outvars]

    def _apply(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
        name = eqn.primitive.name
        rule = self.rules.get(name)
        if rule is None:
            if compat.eqn_has_subjaxprs(eqn):
                raise NotImplementedError(_unknown_higher_order_message(name))
            rule = "follow"
        if callable(rule):
            return self._custom(rule, eqn, ins)
        if rule == "follow" and name == "convert_element_type":
            return self._convert(eqn, ins)
        if rule == "recurse":
            return HANDLERS[name](self, eqn, ins)
        return getattr(self, "_" + rule)(eqn, ins)

    # -- first-order rules ----------------------------------------------------------

    def _groups(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> dict[np.dtype, list[int]]:
        # Operands traced with the same dtype must again share one dtype.
        groups: dict[np.dtype, list[int]] = {}
        for i, (atom, (value, _)) in enumerate(zip(eqn.invars, ins, strict=True)):
            if is_float(value):
                groups.setdefault(np.dtype(atom.aval.dtype), []).append(i)
        return groups

    def _follow(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
        values = [v for v, _ in ins]
        for idxs in self._groups(eqn, ins).values():
            pinned = [ins[i][0].dtype for i in idxs if ins[i][1] == PINNED]
            active = [ins[i][0].dtype for i in idxs if ins[i][1] == ACTIVATION]
            if pinned or active:
                target = promote(pinned + active)
                for i in idxs:
                    values[i] = cast(values[i], target)
        role = max((r for v, r in ins if is_float(v)), default=PLAIN)
        return [(o, role if is_float(o) else PLAIN) for o in compat.bind_eqn(eqn, values)]

    def _float32(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
        values = [v for v, _ in ins]
        for idxs in self._groups(eqn, ins).values():
            target = promote([_F32] + [ins[i][0].dtype for i in idxs])
            for i in idxs:
                values[i] = cast(values[i], target)
        touched = any(r != PLAIN for v, r in ins if is_float(v))
        outs = compat.bind_eqn(eqn, values)
        return [
            (o, PINNED if is_float(o) and (touched or o.dtype != var.aval.dtype) else PLAIN)
            for o, var in zip(outs, eqn.outvars, strict=True)
        ]

    def _keep(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
        values = [
            cast(v, np.dtype(atom.aval.dtype)) if is_float(v) else v
            for atom, (v, _) in zip(eqn.invars, ins, strict=True)
        ]
        return [(o, PLAIN) for o in compat.bind_eqn(eqn, values)]

    def _convert(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
        ((value, role),) = ins
        (out,) = compat.bind_eqn(eqn, [value])
        if not is_float(out) or not is_float(value) or role == PLAIN:
            return [(out, PLAIN)]
        # An explicit cast of an autocast value: respected, and it decides the role.
        return [(out, ACTIVATION if out.dtype == self.compute_dtype else PINNED)]

    def _compute(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
        (lhs, _), (rhs, _) = ins[0], ins[1]
        if len(ins) != 2 or not (is_float(lhs) and is_float(rhs)):
            return self._follow(eqn, ins)
        lhs, rhs = cast(lhs, self.compute_dtype), cast(rhs, self.compute_dtype)
        multiple = self.pad_to
        if multiple is not None:
            lhs, rhs, unpad = padded(eqn.primitive.name, eqn.params, lhs, rhs, multiple)
        else:
            unpad = None
        out = run_matmul(eqn, lhs, rhs, self.compute_dtype)
        if unpad is not None:
            out = unpad(out)
        return [(out, ACTIVATION)]

    def _custom(self, rule: Callable, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
        outs = list(rule(self, eqn, *[v for v, _ in ins]))
        in_role = max((r for v, r in ins if is_float(v)), default=PLAIN)
        roles = []
        for out, var in zip(outs, eqn.outvars, strict=True):
            if not is_float(out):
                roles.append(PLAIN)
            elif out.dtype == var.aval.dtype:
                roles.append(in_role)
            else:
                roles.append(ACTIVATION if out.dtype == self.compute_dtype else PINNED)
        return list(zip(outs, roles, strict=True))

    # -- helpers for the higher-order handlers -------------------------------------

    def function_of(self, closed: jex.ClosedJaxpr, prefix: Sequence[tuple], roles, box: list):
        """A plain function of the non-prefix inputs that evaluates ``closed``.

        ``prefix`` are (value, role) pairs bound first (closure constants);
        the output roles are written to ``box`` each time it is traced.
        """

        def fun(*args):
            outs = self.eval_jaxpr(closed, [*prefix, *zip(args, roles, strict=True)])
            box[:] = [r for _, r in outs]
            return [v for v, _ in outs]

        return fun

    def probe(self, closed, prefix, types) -> list[tuple[np.dtype, int]]:
        """Output (dtype, role) of ``closed`` for inputs of the given (aval, role)."""
        box: list = []
        fun = self.function_of(closed, prefix, [r for _, r in types], box)
        shapes = jax.eval_shape(fun, *[a for a, _ in types])
        return [(np.dtype(s.dtype), r) for s, r in zip(shapes, box, strict=True)]


def _unknown_higher_order_message(name: str) -> str:
    return (
        f"jaxamp.autocast has no rule for the higher-order primitive {name!r}: it holds "
        "jaxprs or functions that autocast cannot rewrite without knowing their meaning. "
        f"Register a rule: jaxamp.autocast(fun, policy, rules={{{name!r}: 'keep'}}) runs it "
        "exactly as traced (its inputs are cast back to their traced dtypes), or pass a "
        "callable rule(autocaster, eqn, *args) -> list of outputs."
    )


# -- the public transform -----------------------------------------------------------


def _merge_rules(rules: Mapping | None) -> dict[str, Any]:
    table: dict[str, Any] = dict(AUTOCAST_RULES)
    if rules is None:
        return table
    if not isinstance(rules, Mapping):
        raise TypeError(
            "rules must be a mapping {primitive or primitive name: rule}; "
            f"got {type(rules).__name__}: {rules!r}."
        )
    for key, rule in rules.items():
        if isinstance(key, jex.Primitive):
            name = key.name
        elif isinstance(key, str):
            name = key
        else:
            raise TypeError(
                "rules keys must be jax primitives (e.g. jax.lax.exp_p) or their names "
                f"(e.g. 'exp'); got {type(key).__name__}: {key!r}."
            )
        if isinstance(rule, str):
            if rule not in RULE_KINDS:
                raise ValueError(
                    f"rules[{name!r}] must be one of {', '.join(map(repr, RULE_KINDS))} "
                    f"or a callable; got {rule!r}."
                )
            if rule == "recurse" and name not in HANDLERS:
                raise ValueError(
                    f"rules[{name!r}] = 'recurse' needs a built-in handler, which exists "
                    f"only for {', '.join(sorted(HANDLERS))}; use 'keep' or a callable."
                )
        elif not callable(rule):
            raise TypeError(
                f"rules[{name!r}] must be a rule name or a callable "
                f"rule(autocaster, eqn, *args); got {type(rule).__name__}: {rule!r}."
            )
        table[name] = rule
    return table


def _pad_multiple(pad_to: Any, policy: Policy) -> int | None:
    if pad_to is None:
        return None
    if pad_to == "auto":
        return tensor_core_multiple(policy.compute_dtype)
    if isinstance(pad_to, bool) or not isinstance(pad_to, (int, np.integer)) or pad_to < 1:
        raise ValueError(
            f"pad_to must be None, 'auto' (jaxamp.tensor_core_multiple of the compute "
            f"dtype) or an int >= 1; got {pad_to!r}."
        )
    return int(pad_to)


def autocast(
    fun: Callable,
    policy: Policy | str | Any = "mixed_bfloat16",
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
      policy: a ``jaxamp.Policy`` or anything ``jaxamp.get_policy`` accepts.
      rules: overrides ``{primitive or name: "compute" | "float32" | "follow" |
        "keep" | callable}``; a callable is called as ``rule(autocaster, eqn,
        *args)`` and returns the list of outputs.
      pad_to: ``None`` (default), an int, or ``"auto"`` (the Tensor Core multiple
        of the compute dtype): the M, N and K dims of matmuls and the channel dims
        of convolutions are zero-padded to that multiple and the result sliced
        back, so results are unchanged and the compiled shapes aligned.
      remat_float32: ``False`` (default) or ``True``: keep only 16-bit (and
        integer) values for the backward pass and recompute the float32 ones
        (softmax, normalisation statistics, the loss) from them, with
        ``jax.checkpoint``. Saves memory for a little elementwise recomputation;
        has no effect when the compute dtype is 32-bit. On the GPT of
        ``benchmarks/activation_memory``: residuals 0.53x of float32 instead of
        0.64x.

    Returns:
      A function with ``fun``'s signature.

    Raises:
      NotImplementedError: ``fun`` uses a higher-order primitive with no rule;
        the message names it and shows how to register one.

    >>> import jax, jax.numpy as jnp, jaxamp
    >>> def layer(w, x):
    ...     return jnp.tanh(x @ w + 1.0)
    >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    >>> jaxamp.autocast(layer)(w, x).dtype  # output dtype of mixed_bfloat16
    dtype('float32')
    >>> jaxamp.precision_report(jaxamp.autocast(layer), w, x).flops_by_dtype
    {'bfloat16': 48}
    """
    if not callable(fun):
        raise TypeError(f"fun must be callable; got {type(fun).__name__}: {fun!r}.")
    policy = get_policy(policy)
    table = _merge_rules(rules)
    multiple = _pad_multiple(pad_to, policy)
    if not isinstance(remat_float32, (bool, np.bool_)):
        raise TypeError(
            f"remat_float32 must be True or False; got {type(remat_float32).__name__}: "
            f"{remat_float32!r}."
        )
    remat = bool(remat_float32) and np.dtype(policy.compute_dtype).itemsize < 4

    @functools.wraps(fun)
    def autocast_fun(*args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        is_dynamic = [isinstance(leaf, _ARRAY_TYPES) for leaf in leaves]
        dynamic = [leaf for leaf, d in zip(leaves, is_dynamic, strict=True) if d]
        out_trees: list = []

        def flat_fun(*dyn):
            it = iter(dyn)
            full = [next(it) if d else leaf for leaf, d in zip(leaves, is_dynamic, strict=True)]
            a, k = jax.tree.unflatten(treedef, full)
            flat_out, out_tree = jax.tree.flatten(fun(*a, **k))
            out_trees.append(out_tree)
            return flat_out

        closed = jax.make_jaxpr(flat_fun)(*dynamic)
        autocaster = Autocaster(policy, table, multiple)

        def run(*dyn):
            return [v for v, _ in autocaster.eval_jaxpr(closed, [(v, PLAIN) for v in dyn])]

        if remat:
            run = jax.checkpoint(run, policy=save_narrow_values)
        output_dtype = np.dtype(policy.output_dtype)
        flat = [
            cast(v, output_dtype)
            if is_float(v) and jnp.issubdtype(var.aval.dtype, jnp.floating)
            else v
            for v, var in zip(run(*dynamic), closed.jaxpr.outvars, strict=True)
        ]
        return jax.tree.unflatten(out_trees[-1], flat)

    return autocast_fun
