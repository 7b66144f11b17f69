"""communication_report: every collective of a function's partitioned program.

The function is lowered as ``jax.jit`` would lower it and compiled with XLA's
dump options, which write the module right after the SPMD partitioner: the
program whose collectives are what a GPU or TPU would send (a backend may widen
or fuse them later; XLA:CPU widens 16-bit collectives to float32 after
partitioning, so its final program would misstate the wire dtypes). Nothing runs.
"""

from __future__ import annotations

import glob
import math
import os
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._checks import check_callable
from jaxamp._reporting import is_jaxamp_file
from jaxamp._wire._communication_report import Collective, CommunicationReport
from jaxamp._wire._hlo import (
    HloInstruction,
    HloModule,
    collective_kind,
    element_bits,
    hlo_dtype,
    parse_module,
)

__all__ = ["communication_report", "floating_elements", "report_from_hlo"]

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
    # A gather of an already gathered value (the partitioner gathers a dim split
    # over two mesh-aligned dims in stages) adds only what it did not have: the
    # stages together count as one gather of the whole tensor.
    had = _gathered_input(inst, module) if kind == "all-gather" else 0
    return [
        Collective(
            kind=str(kind),
            dtype=hlo_dtype(dtype),
            shape=shape,
            # float4_e2m1fn: half a byte per element (XLA packs sub-byte types).
            bytes=-(-(math.prod(shape) - had) * element_bits(hlo_dtype(dtype)) // 8),
            parameter=parameter,
            op_name=inst.op_name,
            location=location,
            parameter_dtype=parameter_dtype,
            staged=had > 0,
        )
        for (dtype, shape), (parameter, parameter_dtype) in zip(types, sources, strict=True)
    ]


def _gathered_input(inst: HloInstruction, module: HloModule) -> int:
    """The elements of an all-gather's input if an earlier all-gather produced it, else 0.

    Followed through casts and layout changes that keep the element count.
    """
    if len(inst.operands) != 1 or inst.operands[0] not in module.instructions:
        return 0
    node = module.instructions[inst.operands[0]]
    size = _elements(node)
    for _ in range(8):
        if collective_kind(node.opcode) == "all-gather":
            return size
        if node.opcode not in (*_CASTS, *_LAYOUTS) or len(node.operands) != 1:
            return 0
        node = module.instructions.get(node.operands[0])
        if node is None or _elements(node) != size:
            return 0
    return 0


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
        elif node.opcode in ("pad", "slice"):  # a parameter padded (to whole blocks) or cut
            stack.extend([(node.operands[0], depth + 1)] if node.operands else [])
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
        if not is_jaxamp_file(file):
            return f"{file}:{line}"
    return inst.location


def floating_elements(tree: Any) -> int:
    return sum(
        math.prod(np.shape(leaf))
        for leaf in jax.tree.leaves(tree)
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)
    )
