"""communication_report: every collective of a function's partitioned program.

The function is lowered as ``jax.jit`` would lower it and compiled with XLA's
dump options, which write the module right after the SPMD partitioner: the
program whose collectives are what a GPU or TPU would send (a backend may widen
or fuse them later; XLA:CPU widens 16-bit collectives to float32 after
partitioning, so its final program would misstate the wire dtypes). Nothing runs.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._checks import check_callable
from jaxamp._hlo import (
    COLLECTIVE_KINDS,
    HloInstruction,
    HloModule,
    collective_kind,
    element_bits,
    hlo_dtype,
    parse_module,
)

__all__ = [
    "Collective",
    "CommunicationReport",
    "as_dtype",
    "communication_report",
    "floating_elements",
    "report_from_hlo",
]

# Opcodes a parameter passes through unchanged in what matters here (its elements),
# on its way to a collective: casts, layout changes (a broadcast that keeps the
# element count only adds unit dimensions) and barriers, the elementwise steps
# of a quantization (scale, clamp, round) and a shift (a norm's ``1 + scale``).
# An operand of another size (a broadcast constant) is not followed, and a
# collective whose data reaches two parameters names neither.
_CASTS = ("convert", "copy", "bitcast", "bitcast-convert")
_LAYOUTS = ("reshape", "transpose", "broadcast", "opt-barrier")
_SCALINGS = ("multiply", "divide", "add", "subtract", "round-nearest-even", "round-nearest-afz")
_FOLLOWED = frozenset((*_CASTS, *_LAYOUTS, *_SCALINGS, "clamp", "maximum", "minimum", "select"))
_JAXAMP_DIR = os.path.dirname(os.path.abspath(__file__))
# CommunicationReport.small_gathers: vectors at least this many times smaller
# than the largest all-gather.
_SMALL_GATHER_RATIO = 16


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the partitioned program (one entry per operand of a variadic one).

    Attributes:
      kind: ``"all-gather"``, ``"reduce-scatter"``, ``"all-reduce"``,
        ``"all-to-all"`` or ``"collective-permute"``.
      dtype: the element type on the wire.
      shape: the gathered shape for an all-gather, the full input's shape for a
        reduce-scatter, the operand's for the others.
      bytes: the bytes of that shape (one device's view of the logical tensor),
        half a byte per element of a 4-bit type (``float4_e2m1fn``, HLO's
        ``f4e2m1fn``), rounded up.
      parameter: the argument the collective's data comes from (e.g.
        ``"params['w1']"``) when it is one followed through casts, layout
        changes, optimization barriers and elementwise scaling or shifts;
        else ``None``.
      op_name: JAX's name of the operation that caused it (e.g.
        ``"jit(step)/transpose(jvp())/dot_general"``).
      location: ``file:line`` of the user code that caused it (the innermost
        frame outside jaxamp), when the program records it.
      parameter_dtype: that argument's dtype (``None`` without ``parameter``):
        an integer one (token ids) is data, not a parameter whose wire dtype
        a policy decides.
    """

    kind: str
    dtype: np.dtype
    shape: tuple[int, ...]
    bytes: int
    parameter: str | None
    op_name: str
    location: str | None
    parameter_dtype: np.dtype | None = None

    @property
    def backward(self) -> bool:
        """Whether the backward pass caused it (its ``op_name`` is under a ``transpose``)."""
        return "transpose(" in self.op_name

    @property
    def source(self) -> str:
        """Where it came from: the parameter, else the op (and ``file:line``)."""
        if self.parameter is not None:
            return self.parameter
        place = f" ({os.path.basename(self.location)})" if self.location else ""
        return f"{self.op_name.rsplit('/', 2)[-1] if self.op_name else '?'}{place}"


@dataclasses.dataclass(frozen=True)
class CommunicationReport:
    """What :func:`communication_report` found. ``str()`` gives a table.

    Attributes:
      collectives: every collective of the partitioned program, in program
        order. One inside a loop body is listed once, not once per trip.
      param_count: the floating-point elements of the first positional
        argument (the parameters of a ``step(params, ...)`` by convention):
        the divisor of ``bytes_per_param``. ``dataclasses.replace(report,
        param_count=n)`` when the parameters are elsewhere.
      num_devices: the partitions of the program.
      hlo: the partitioned program's text.
    """

    collectives: tuple[Collective, ...]
    param_count: int
    num_devices: int
    hlo: str = dataclasses.field(repr=False)

    @property
    def small_gathers(self) -> tuple[Collective, ...]:
        """The all-gathers too small for a dtype decision, in program order.

        Those whose shape is a vector (at most one dimension above 1: a norm's
        scale, a bias) at least 16 times smaller than the program's largest
        all-gather (the rule and why: docs/many-devices.md, "Small gathers").
        ``str(report)`` marks them; :func:`jaxamp.testing.assert_gathers_in`
        does not judge them.

        >>> CommunicationReport((), 0, 1, "").small_gathers
        ()
        """
        gathers = [c for c in self.collectives if c.kind == "all-gather"]
        largest = max((c.bytes for c in gathers), default=0)
        return tuple(
            c
            for c in gathers
            if sum(d > 1 for d in c.shape) <= 1 and c.bytes * _SMALL_GATHER_RATIO <= largest
        )

    def bytes_by(self, kind: str | None = None, dtype: Any = None) -> int:
        """Total bytes of the collectives of one kind and/or dtype (None: all).

        >>> report = CommunicationReport((), 0, 1, "")
        >>> report.bytes_by("all-gather", "bfloat16")
        0
        """
        return sum(c.bytes for c in self._select(kind, dtype))

    def count_by(self, kind: str | None = None, dtype: Any = None) -> int:
        """How many collectives of one kind and/or dtype (None: all)."""
        return len(self._select(kind, dtype))

    def bytes_per_param(self, kind: str | None = None, dtype: Any = None) -> float:
        """``bytes_by(kind, dtype) / param_count`` (``nan`` without parameters)."""
        total = self.bytes_by(kind, dtype)
        return total / self.param_count if self.param_count else math.nan

    def totals(self) -> dict[tuple[str, np.dtype], tuple[int, int]]:
        """(kind, dtype) -> (count, bytes), in the order kinds are listed above."""
        out: dict[tuple[str, np.dtype], tuple[int, int]] = {}
        order = {k: i for i, k in enumerate(COLLECTIVE_KINDS)}
        for c in sorted(self.collectives, key=lambda c: (order[c.kind], c.dtype.name)):
            count, total = out.get((c.kind, c.dtype), (0, 0))
            out[(c.kind, c.dtype)] = (count + 1, total + c.bytes)
        return out

    def _select(self, kind: str | None, dtype: Any) -> list[Collective]:
        if kind is not None and kind not in COLLECTIVE_KINDS:
            raise ValueError(f"kind must be None or one of {COLLECTIVE_KINDS}; got {kind!r}.")
        wanted = None if dtype is None else as_dtype(dtype, "dtype")
        return [
            c
            for c in self.collectives
            if (kind is None or c.kind == kind) and (wanted is None or c.dtype == wanted)
        ]

    def __str__(self) -> str:
        rows = [("kind", "dtype", "count", "bytes", "B/param")]
        for (kind, dtype), (count, total) in self.totals().items():
            rows.append((kind, dtype.name, str(count), str(total), self._per_param(total)))
        everything = self.bytes_by()
        rows.append(
            ("total", "", str(len(self.collectives)), str(everything), self._per_param(everything))
        )
        small = {id(c) for c in self.small_gathers}
        listing = [("kind", "dtype", "shape", "bytes", "source", "")] + [
            (
                c.kind,
                c.dtype.name,
                "x".join(map(str, c.shape)) or "()",
                str(c.bytes),
                c.source,
                "small" if id(c) in small else "",
            )
            for c in self.collectives
        ]
        return "\n".join(
            [
                f"communication on {self.num_devices} devices, "
                f"{self.param_count} parameters (floating elements of the first argument)",
                *_table(rows),
                "",
                *_table(listing),
                *self._small_note(),
            ]
        )

    def _small_note(self) -> list[str]:
        small = self.small_gathers
        total = sum(c.bytes for c in small)
        note = (
            f"small: {len(small)} all-gathers of vectors, each at least {_SMALL_GATHER_RATIO}x "
            f"smaller than the largest ({total} bytes, {self._per_param(total)} B/param "
            "together): not worth a dtype decision"
        )
        return ["", note] if small else []

    def _per_param(self, total: int) -> str:
        return f"{total / self.param_count:.2f}" if self.param_count else "-"


def communication_report(fun: Callable, *args: Any, **kwargs: Any) -> CommunicationReport:
    """Lists every collective of ``fun``'s program as the SPMD partitioner leaves it.

    ``fun`` is lowered as ``jax.jit`` would (a function already wrapped in
    ``jax.jit`` keeps its options: shardings, static and donated arguments),
    for ``args``/``kwargs`` as they are: arrays placed with a ``NamedSharding``
    or ``jax.ShapeDtypeStruct``\\ s with one; ``shard_map`` inside ``fun``
    works too. It is compiled for the default backend with XLA's dump options,
    and the module right after SPMD partitioning is read: the collectives the
    partitioner inserted and those ``shard_map`` code wrote (``psum``,
    ``all_gather``, ...), in the dtype they carry, before a backend rewrites
    them (XLA:CPU's final program widens 16-bit collectives to float32; a GPU
    or TPU sends what is listed here, possibly fused or split). Nothing runs.

    Args:
      fun: the function to inspect (a plain function or a ``jax.jit`` one).
      *args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
      **kwargs: its keyword arguments.

    Returns:
      A :class:`CommunicationReport`. Bytes per parameter divide by the
      floating-point elements of ``args[0]``.

    Raises:
      TypeError: if ``fun`` is not callable.

    >>> import jax, jax.numpy as jnp, jaxamp
    >>> report = jaxamp.communication_report(lambda w, x: x @ w, jnp.ones((4, 2)), jnp.ones((3, 4)))
    >>> report.collectives, report.param_count     # one device: nothing crosses a wire
    ((), 8)
    """
    check_callable(fun, "fun")
    jitted = fun if callable(getattr(fun, "lower", None)) else jax.jit(fun)
    lowered = jitted.lower(*args, **kwargs)
    return report_from_hlo(_partitioned_hlo(lowered), floating_elements(args[0] if args else None))


def report_from_hlo(text: str, param_count: int) -> CommunicationReport:
    """The report of an HLO module's text (any stage: a backend's final program too)."""
    module = parse_module(text)
    collectives = tuple(c for inst in module.collectives() for c in _describe(inst, module))
    return CommunicationReport(collectives, param_count, module.num_partitions, text)


def _partitioned_hlo(lowered: Any) -> str:
    """The module after SPMD partitioning, from XLA's dump of one compilation.

    A program for one partition (one device, or ``pmap``'s replicas) skips the
    partitioner: its module before optimizations is the same program then.
    """
    with tempfile.TemporaryDirectory(prefix="jaxamp_hlo_") as tmp:
        lowered.compile(
            compiler_options={
                "xla_dump_to": tmp,
                "xla_dump_hlo_pass_re": "spmd-partitioning",
                "xla_dump_hlo_as_text": True,
            }
        )
        after = sorted(glob.glob(os.path.join(tmp, "*.after_spmd-partitioning.*.txt")))
        before = sorted(glob.glob(os.path.join(tmp, "*.before_optimizations.txt")))
        chosen = after or before
        if not chosen:
            raise RuntimeError(
                "XLA wrote no HLO dump for this compilation; files: " + ", ".join(os.listdir(tmp))
            )
        with open(chosen[-1]) as f:
            return f.read()


def _describe(inst: HloInstruction, module: HloModule) -> list[Collective]:
    kind = collective_kind(inst.opcode)
    types = _wire_types(inst, kind, module)
    # A variadic collective (one operand per result) is attributed operand by operand.
    starts = (
        [[name] for name in inst.operands]
        if len(types) == len(inst.operands) > 1
        else [list(inst.operands)] * len(types)
    )
    location = _user_location(inst, module)
    sources = [_parameter_source(start, module) or (None, None) for start in starts]
    return [
        Collective(
            kind=str(kind),
            dtype=hlo_dtype(dtype),
            shape=shape,
            # float4_e2m1fn: half a byte per element (XLA packs sub-byte types).
            bytes=-(-math.prod(shape) * element_bits(hlo_dtype(dtype)) // 8),
            parameter=parameter,
            op_name=inst.op_name,
            location=location,
            parameter_dtype=parameter_dtype,
        )
        for (dtype, shape), (parameter, parameter_dtype) in zip(types, sources, strict=True)
    ]


def _wire_types(inst: HloInstruction, kind: str | None, module: HloModule) -> tuple:
    """(element type, shape) of what is counted: the gathered result, else the input."""
    operand_types: list = []
    for name in inst.operands:
        operand = module.instructions.get(name)
        operand_types.extend(operand.types if operand is not None else ())
    if kind == "all-gather":
        # all-gather-start's result is the tuple (input, output).
        started = inst.opcode.endswith("-start") and len(inst.types) > len(operand_types)
        return inst.types[len(operand_types) :] if started else inst.types
    if kind == "collective-permute":
        # Its in-place form also takes the output buffer and offsets.
        return tuple(operand_types[:1])
    return tuple(operand_types) or inst.types


def _parameter_source(operands: list[str], module: HloModule) -> tuple[str, Any] | None:
    """Name and dtype of the one entry parameter whose elements reach ``operands``.

    Through :data:`_FOLLOWED` ops; the dtype is None where HLO's has no NumPy twin.
    """
    found: dict[str, Any] = {}
    stack = [(name, 0) for name in operands]
    seen: set[str] = set()
    while stack:
        name, depth = stack.pop()
        node = module.instructions.get(name)
        if node is None or name in seen or depth > 16:
            continue
        seen.add(name)
        if node.opcode == "get-tuple-element":
            element = module.tuple_element(node)
            stack.extend([(element, depth + 1)] if element else [])
        elif node.opcode == "parameter" and node.computation == module.entry:
            name = node.op_name or f"argument {node.parameter_number}"
            found[name] = _known_dtype(node.types[0][0]) if len(node.types) == 1 else None
        elif node.opcode == "parameter":
            stack.extend((o, depth + 1) for o in module.call_arguments(node))
        elif node.opcode in _FOLLOWED:
            # Only operands with the node's own element count: a broadcast scale
            # or clamp bound is not the data.
            size = _elements(node)
            stack.extend(
                (o, depth + 1)
                for o in node.operands
                if o in module.instructions and _elements(module.instructions[o]) == size
            )
    return found.popitem() if len(found) == 1 else None


def _known_dtype(name: str) -> np.dtype | None:
    try:
        return hlo_dtype(name)
    except ValueError:  # a token, an opaque type
        return None


def _elements(inst: HloInstruction) -> int:
    return sum(math.prod(shape) for _, shape in inst.types)


def _user_location(inst: HloInstruction, module: HloModule) -> str | None:
    """The innermost ``file:line`` outside jaxamp (jaxamp's own lines say less)."""
    chain = list(module.frame_chain(inst.frame_id))
    for file, line in chain:
        if not _is_jaxamp_file(file):
            return f"{file}:{line}"
    return inst.location


def _is_jaxamp_file(file: str) -> bool:
    # This installation's files, or another's (a program dumped elsewhere).
    return os.path.abspath(file).startswith(_JAXAMP_DIR + os.sep) or bool(
        re.search(r"[/\\]jaxamp[/\\](_|flax[/\\])", file)
    )


def floating_elements(tree: Any) -> int:
    return sum(
        math.prod(np.shape(leaf))
        for leaf in jax.tree.leaves(tree)
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)
    )


def as_dtype(dtype: Any, name: str) -> np.dtype:
    try:
        return np.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"{name} must be a dtype (e.g. jnp.bfloat16 or 'float32'); got {dtype!r}."
        ) from None


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
