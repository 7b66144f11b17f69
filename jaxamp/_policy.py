"""Precision policies: which dtype params, computation and outputs use."""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any

import jax
import numpy as np

from jaxamp._casting import DTYPE_ALIASES, canonical_float_dtype, cast_floating
from jaxamp._wire import _explicit
from jaxamp._wire._warnings import warn_unhonoured_wire_dtypes

__all__ = ["Policy", "get_policy", "policy_for_device"]


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes for the roles a value plays in mixed-precision training.

    ``param_dtype`` is the dtype of the stored (master) parameters,
    ``compute_dtype`` the dtype the forward and backward pass run in and
    ``output_dtype`` the dtype of what the model returns (the loss is computed
    from it). Policies are frozen, hashable and equal by value, so they can be
    static arguments of ``jax.jit``.

    Two more dtypes say what crosses the wire when parameters are sharded over
    devices (FSDP, ZeRO): ``gather_dtype``, the dtype parameters are
    all-gathered in (default: ``compute_dtype``, so each shard is cast before
    the gather), and ``reduce_dtype``, the dtype weight gradients are
    reduce-scattered or all-reduced in (default: float32, or float64 for
    float64 params), as PyTorch FSDP2's ``MixedPrecisionPolicy`` and
    Megatron's ``grad_reduce_in_fp32`` do. On one device they change nothing.

    >>> import jaxamp
    >>> policy = jaxamp.get_policy("mixed_bfloat16")
    >>> policy
    Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=float32)
    >>> str(policy)
    'params=float32,compute=bfloat16,output=float32'
    >>> policy.gather_dtype, policy.reduce_dtype
    (dtype(bfloat16), dtype('float32'))
    >>> str(policy.with_reduce_dtype("bfloat16"))
    'params=float32,compute=bfloat16,output=float32,reduce=bfloat16'
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype
    gather_dtype: np.dtype | None = None  # None: the compute dtype
    reduce_dtype: np.dtype | None = None  # None: float32 (float64 for float64 params)

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            value = canonical_float_dtype(getattr(self, field), field)
            object.__setattr__(self, field, value)
        defaults = {
            "gather_dtype": self.compute_dtype,
            "reduce_dtype": _default_reduce_dtype(self.param_dtype),
        }
        for field, default in defaults.items():
            value = getattr(self, field)
            value = default if value is None else canonical_float_dtype(value, field)
            object.__setattr__(self, field, value)

    def _wire_fields(self) -> list[tuple[str, np.dtype]]:
        # Only the wire dtypes that differ from their defaults are spelled out, so
        # that the usual policies print as they always have.
        wire = []
        if self.gather_dtype != self.compute_dtype:
            wire.append(("gather", self.gather_dtype))
        if self.reduce_dtype != _default_reduce_dtype(self.param_dtype):
            wire.append(("reduce", self.reduce_dtype))
        return wire

    def __repr__(self) -> str:
        extra = "".join(f", {key}_dtype={dtype.name}" for key, dtype in self._wire_fields())
        return (
            f"Policy(param_dtype={self.param_dtype.name}, "
            f"compute_dtype={self.compute_dtype.name}, "
            f"output_dtype={self.output_dtype.name}{extra})"
        )

    def __str__(self) -> str:
        extra = "".join(f",{key}={dtype.name}" for key, dtype in self._wire_fields())
        return (
            f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
            f"output={self.output_dtype.name}{extra}"
        )

    def cast_to_param(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``param_dtype``."""
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any, *, matmul_operands: Any = None) -> Any:
        """Casts the floating leaves of ``tree`` to ``compute_dtype``.

        In a traced program over several devices the cast may not choose what
        crosses the wire. Under ``jax.jit`` of a mesh of ``AxisType.Auto`` axes
        (and inside ``shard_map``) the partitioner gathers the cast shard, and a
        weight gradient is reduced in the result dtype of the product that
        computes it; where that differs from ``gather_dtype`` or
        ``reduce_dtype`` it warns (:class:`jaxamp.WireDtypeWarning`). Under a
        mesh of ``AxisType.Explicit`` axes it honours both: a leaf sharded over
        the mesh is gathered here in ``gather_dtype`` (its gradient
        reduce-scattered in ``reduce_dtype``), and a leaf ``matmul_operands``
        selects is typed ``reduced``, so its gradient is summed at this cast's
        transpose, in ``reduce_dtype``. See the policies page, "Across devices".

        Args:
          tree: a pytree; non-floating leaves come back unchanged.
          matmul_operands: under an explicit mesh, the leaves that products
            alone read (``jnp.dot``, ``einsum``, ``lax.dot_general``): ``True``
            for all, or a callable ``(path, leaf) -> bool`` over
            ``jax.tree_util`` key paths. A ``reduced`` value cannot meet a
            batch-sharded one elementwise (JAX raises a sharding type error at
            a bias add), so biases and norm scales are left out; their gradients
            are reduced in the compute dtype. Ignored elsewhere.

        Returns:
          ``tree`` with its floating leaves in ``compute_dtype``.

        Raises:
          TypeError: ``matmul_operands`` is not None, a bool or a callable.
        """
        _explicit.check_matmul_operands(matmul_operands)
        leaves = jax.tree.leaves(tree)
        if _explicit.explicit_mesh(leaves) is not None:
            if matmul_operands is None:
                warn_unhonoured_wire_dtypes(self, leaves, explicit=True)
            return _explicit.cast_explicit(tree, self, matmul_operands)
        warn_unhonoured_wire_dtypes(self, leaves)
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``output_dtype``."""
        return cast_floating(tree, self.output_dtype)

    def with_param_dtype(self, dtype: Any) -> Policy:
        """Returns a copy with another ``param_dtype``.

        A ``reduce_dtype`` left at its default follows (float64 params reduce in
        float64).
        """
        reduce = self.reduce_dtype
        if reduce == _default_reduce_dtype(self.param_dtype):
            reduce = None
        return dataclasses.replace(self, param_dtype=dtype, reduce_dtype=reduce)

    def with_compute_dtype(self, dtype: Any) -> Policy:
        """Returns a copy with another ``compute_dtype``.

        A ``gather_dtype`` equal to the old compute dtype (the default) follows
        the new one.
        """
        gather = None if self.gather_dtype == self.compute_dtype else self.gather_dtype
        return dataclasses.replace(self, compute_dtype=dtype, gather_dtype=gather)

    def with_output_dtype(self, dtype: Any) -> Policy:
        """Returns a copy with another ``output_dtype``."""
        return dataclasses.replace(self, output_dtype=dtype)

    def with_gather_dtype(self, dtype: Any) -> Policy:
        """Returns a copy whose parameters are all-gathered in ``dtype``."""
        if dtype is None:
            canonical_float_dtype(dtype, "gather_dtype")  # raises the usual TypeError
        return dataclasses.replace(self, gather_dtype=dtype)

    def with_reduce_dtype(self, dtype: Any) -> Policy:
        """Returns a copy whose weight gradients are reduced across devices in ``dtype``."""
        if dtype is None:
            canonical_float_dtype(dtype, "reduce_dtype")
        return dataclasses.replace(self, reduce_dtype=dtype)

    def module_kwargs(self) -> dict[str, np.dtype]:
        """The ``dtype``/``param_dtype`` keyword arguments of Flax layers.

        >>> import jaxamp
        >>> jaxamp.get_policy("mixed_bfloat16").module_kwargs()
        {'dtype': dtype(bfloat16), 'param_dtype': dtype('float32')}
        """
        return {"dtype": self.compute_dtype, "param_dtype": self.param_dtype}


def _default_reduce_dtype(param_dtype: np.dtype) -> np.dtype:
    # float32 unless the params are wider: a gradient is never reduced in fewer
    # bits than a float32 master weight keeps, unless the policy asks for it.
    return np.promote_types(param_dtype, np.float32)


_KEYS = {
    "p": "param",
    "param": "param",
    "params": "param",
    "c": "compute",
    "compute": "compute",
    "o": "output",
    "output": "output",
    "g": "gather",
    "gather": "gather",
    "r": "reduce",
    "reduce": "reduce",
}
_PRESETS = {
    "float32": ("float32", "float32", "float32"),
    "mixed_bfloat16": ("float32", "bfloat16", "float32"),
    "mixed_float16": ("float32", "float16", "float32"),
    "bfloat16": ("bfloat16", "bfloat16", "bfloat16"),
    "float16": ("float16", "float16", "float16"),
}


def _suggestion(spec: str) -> str:
    """A sentence pointing at what ``spec`` probably meant ("" when nothing is close)."""
    text = spec.strip().lower().replace(" ", "").replace("-", "_")
    if re.search(r"(fp|float|f)8|e4m3|e5m2", text):
        return (
            " FP8 is not a policy of params and layers but an autocast recipe: "
            "jaxamp.autocast(fn, 'mixed_float8') (or jaxamp.autocast(fn, jaxamp.Float8Recipe())) "
            "runs fn's matmuls and convolutions in FP8."
        )
    if "=" in text:
        return _pair_suggestion(text)
    close = difflib.get_close_matches(_spelled(text), [*_PRESETS, *DTYPE_ALIASES], n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def _spelled(text: str) -> str:
    """``"mixed_fp16"`` -> ``"mixed_float16"``, ``"bf16"`` -> ``"bfloat16"``."""
    return re.sub(
        r"b?fp?(16|32|64)", lambda m: ("bfloat" if m[0][0] == "b" else "float") + m[1], text
    )


def _pair_suggestion(text: str) -> str:
    """For ``key=dtype`` pairs: the closest key or dtype to the first one that is unknown."""
    for part in text.split(","):
        key, _, name = part.partition("=")
        if key not in _KEYS:
            close = difflib.get_close_matches(key, list(_KEYS), n=1, cutoff=0.6)
            return f" Did you mean {close[0]!r} (not {key!r})?" if close else ""
        if name not in DTYPE_ALIASES:
            close = difflib.get_close_matches(_spelled(name), list(DTYPE_ALIASES), n=1, cutoff=0.6)
            return f" Did you mean {key}={close[0]}?" if close else ""
    return ""


def _bad_spec(spec: str, why: str) -> ValueError:
    return ValueError(
        f"invalid policy spec {spec!r}: {why}.{_suggestion(spec)} Valid forms: a preset "
        f"({', '.join(_PRESETS)}), a bare dtype name, or comma-separated "
        f"key=dtype pairs such as 'params=float32,compute=bfloat16,output=float32' "
        f"with keys {'|'.join(_KEYS)} and dtypes {'|'.join(DTYPE_ALIASES)}."
    )


def _parse(spec: str) -> Policy:
    text = spec.strip().lower().replace(" ", "")
    if text in _PRESETS:
        return Policy(*_PRESETS[text])
    if text in DTYPE_ALIASES:
        return Policy(*[DTYPE_ALIASES[text]] * 3)
    chosen: dict[str, str] = {}
    for part in text.split(","):
        key, sep, name = part.partition("=")
        if not sep:
            raise _bad_spec(spec, f"{part!r} is neither a preset, a dtype nor key=dtype")
        if key not in _KEYS:
            raise _bad_spec(spec, f"unknown key {key!r}")
        if name not in DTYPE_ALIASES:
            raise _bad_spec(spec, f"unknown dtype {name!r}")
        if _KEYS[key] in chosen:
            raise _bad_spec(spec, f"{_KEYS[key]} is given twice")
        chosen[_KEYS[key]] = DTYPE_ALIASES[name]
    # jmp's defaults: params float32, compute = params, output = compute.
    param = chosen.get("param", "float32")
    compute = chosen.get("compute", param)
    output = chosen.get("output", compute)
    # gather defaults to compute, reduce to float32 (Policy's defaults).
    return Policy(param, compute, output, chosen.get("gather"), chosen.get("reduce"))


def _is_jmp_policy(spec: Any) -> bool:
    # Duck-typed so that core jaxamp never imports jmp.
    return type(spec).__module__.split(".")[0] == "jmp" and all(
        hasattr(spec, f) for f in ("param_dtype", "compute_dtype", "output_dtype")
    )


def get_policy(spec: Policy | str | Any) -> Policy:
    """Returns the :class:`Policy` that ``spec`` names.

    Args:
      spec: a ``Policy`` (returned as is), a ``jmp.Policy`` (converted), a preset
        name (``"float32"``, ``"mixed_bfloat16"``, ``"mixed_float16"``,
        ``"bfloat16"``, ``"float16"``), a bare dtype name, or jmp's string format
        ``"params=float32,compute=bfloat16,output=float32"`` with jmp's defaults
        (params float32, compute = params, output = compute), plus the keys
        ``gather``/``g`` and ``reduce``/``r`` for the wire dtypes (defaults:
        gather = compute, reduce = float32).

    Raises:
      ValueError: a string that is none of these; the message lists the valid
        keys, dtypes and presets.
      TypeError: ``spec`` is neither a string nor a policy.

    >>> import jaxamp
    >>> jaxamp.get_policy("c=bf16")
    Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=bfloat16)
    >>> jaxamp.get_policy("p=f32,c=f16,o=f32") == jaxamp.get_policy("mixed_float16")
    True
    >>> jaxamp.get_policy("params=float32,compute=bfloat16,output=float32,reduce=bfloat16")
    Policy(param_dtype=float32, compute_dtype=bfloat16, output_dtype=float32, reduce_dtype=bfloat16)
    """
    if isinstance(spec, Policy):
        return spec
    if _is_jmp_policy(spec):
        return Policy(spec.param_dtype, spec.compute_dtype, spec.output_dtype)
    if isinstance(spec, str):
        return _parse(spec)
    raise TypeError(
        f"policy must be a jaxamp.Policy, a jmp.Policy or a string such as "
        f"'mixed_bfloat16'; got {type(spec).__name__}: {spec!r}."
    )


_FP8_NOTE = (
    " It also has FP8 Tensor Cores (twice the bfloat16 rate on Hopper): "
    "jaxamp.autocast(fun, 'mixed_float8') or a jaxamp.Float8Recipe runs its matmuls "
    "in FP8 (docs/fp8.md)."
)

_MX_NOTE = (
    " Its block-scaled Tensor Cores run Float8Recipe('mxfp8') products as one "
    "jax.nn.scaled_matmul (cuDNN's MXFP8 GEMM), picked by gemm='auto'."
)


_PLATFORM_CHOICES = {
    "tpu": ("mixed_bfloat16", "TPUs compute natively in bfloat16."),
    "rocm": ("mixed_bfloat16", "AMD matrix cores support bfloat16."),
}


def _nvidia_choice(kind: str, capability: Any) -> tuple[str, str]:
    """``(preset, reason)`` for an NVIDIA GPU of this compute capability."""
    major = float(capability) if capability else 0.0
    where = f"{kind} (compute capability {capability})"
    if major >= 8.0:
        reason = (
            f"{where} has bfloat16 Tensor Cores; "
            "bfloat16 keeps float32's range, so no loss scaling is needed."
        )
        reason += (_FP8_NOTE if major >= 8.9 else "") + (_MX_NOTE if major >= 10.0 else "")
        return "mixed_bfloat16", reason
    if major >= 7.0:
        return "mixed_float16", (
            f"{where} has float16 but no "
            "bfloat16 Tensor Cores; use dynamic loss scaling with float16."
        )
    return "float32", f"{where} has no Tensor Cores."


def policy_for_device(
    device: jax.Device | None = None, *, with_reason: bool = False
) -> Policy | tuple[Policy, str]:
    """The policy to train with on ``device`` (default: ``jax.devices()[0]``).

    ``mixed_bfloat16`` on TPUs, on NVIDIA GPUs of compute capability 8.0 or
    newer (Ampere, Hopper, Blackwell) and on AMD GPUs (the reason mentions
    ``"mixed_float8"`` from compute capability 8.9, Ada and Hopper, up: FP8 Tensor
    Cores; on a CPU FP8 runs emulated, slower); ``mixed_float16`` (which
    needs loss scaling) on NVIDIA GPUs of compute capability 7.x (Volta,
    Turing); ``float32`` elsewhere, including CPUs.

    Args:
      device: a ``jax.Device``; ``None`` means the first default device.
      with_reason: also return a sentence saying why.

    Returns:
      The policy, or ``(policy, reason)`` when ``with_reason`` is true.

    >>> import jaxamp, jax
    >>> policy, reason = jaxamp.policy_for_device(jax.devices("cpu")[0], with_reason=True)
    >>> str(policy)
    'params=float32,compute=float32,output=float32'
    """
    if device is None:
        device = jax.devices()[0]
    if not hasattr(device, "platform"):
        raise TypeError(f"device must be a jax.Device or None; got {device!r}.")
    platform = device.platform.lower()
    kind = getattr(device, "device_kind", platform)
    if platform in ("gpu", "cuda"):
        name, reason = _nvidia_choice(kind, getattr(device, "compute_capability", None))
    elif platform in _PLATFORM_CHOICES:
        name, why = _PLATFORM_CHOICES[platform]
        reason = f"{kind}: {why}"
    else:
        name = "float32"
        reason = (
            f"{platform} device: no Tensor Cores. 16-bit compute only pays on a CPU "
            "with float32 accumulation (see jaxamp.autocast); float32 is the safe default. "
            "FP8 (autocast(fun, 'mixed_float8')) runs emulated on a CPU: the same numbers, "
            "slower than float32."
        )
    policy = get_policy(name)
    return (policy, reason) if with_reason else policy
