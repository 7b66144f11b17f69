"""Reading the collectives out of an HLO module's text (as XLA dumps it).

Only what :func:`jaxamp.communication_report` needs: each instruction's name,
result type, opcode, operands and metadata, the computation it lives in, and
the module's stack-frame tables (which map ``stack_frame_id`` to file:line).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np

__all__ = [
    "COLLECTIVE_KINDS",
    "HloInstruction",
    "HloModule",
    "element_bits",
    "hlo_dtype",
    "parse_module",
]

# The opcodes (and their async "-start" forms) that move data between devices.
COLLECTIVE_KINDS = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "collective-permute",
)

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY_TYPE = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_OPCODE = re.compile(r"\s([a-z][\w\-]*)\(")
# ``%name`` or ``%name#2``: the short form of ``get-tuple-element(%name), index=2``.
_OPERAND = re.compile(r"%([\w.\-]+(?:#\d+)?)")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_SOURCE = re.compile(r'source_file="((?:[^"\\]|\\.)*)"\s+source_line=(\d+)')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")
_FIELD = re.compile(r"(\w+)=(\d+)")

# HLO's dtype spellings that differ from NumPy/ml_dtypes names (f8e4m3fn etc.
# follow a rule, see hlo_dtype).
_DTYPES = {
    "pred": np.dtype(bool),
    "bf16": np.dtype(jnp.bfloat16),
    "f16": np.dtype(np.float16),
    "f32": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
    "c64": np.dtype(np.complex64),
    "c128": np.dtype(np.complex128),
}


def hlo_dtype(name: str) -> np.dtype:
    """The NumPy dtype of an HLO element type (``"bf16"``, ``"f8e4m3fn"``, ``"s32"``)."""
    if name in _DTYPES:
        return _DTYPES[name]
    if name[0] in "su" and name[1:].isdigit():
        # int4 and uint4 (s4, u4) are ml_dtypes', which NumPy does not name.
        return np.dtype(getattr(jnp, f"{'int' if name[0] == 's' else 'uint'}{name[1:]}"))
    match = re.fullmatch(r"f(\d+)(e\d+m\d+\w*)", name)
    if match and hasattr(jnp, f"float{match[1]}_{match[2]}"):
        return np.dtype(getattr(jnp, f"float{match[1]}_{match[2]}"))
    raise ValueError(f"unknown HLO element type {name!r}")


def element_bits(dtype: np.dtype) -> int:
    """Bits per element of ``dtype``: 4 for ``float4_e2m1fn`` and ``int4``, whose
    NumPy ``itemsize`` (1) is that of one unpacked element.

    >>> element_bits(hlo_dtype("f4e2m1fn")), element_bits(hlo_dtype("bf16"))
    (4, 16)
    """
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return int(jnp.finfo(dtype).bits)
    if jnp.issubdtype(dtype, jnp.integer):
        return int(jnp.iinfo(dtype).bits)
    return 8 * dtype.itemsize


@dataclasses.dataclass(frozen=True)
class HloInstruction:
    """One instruction: ``types`` holds (element type, shape) per result (one, or a tuple's)."""

    name: str
    opcode: str
    types: tuple[tuple[str, tuple[int, ...]], ...]
    operands: tuple[str, ...]
    computation: str
    op_name: str
    frame_id: int | None
    location: str | None
    parameter_number: int | None
    tuple_index: int | None = None
    callee: str | None = None  # the computation a ``call`` runs


@dataclasses.dataclass
class HloModule:
    """The instructions of a module by name, its entry computation and frame tables.

    ``num_partitions`` counts the devices: partitions times replicas.
    """

    instructions: dict[str, HloInstruction]
    entry: str
    num_partitions: int
    frames: dict[int, tuple[str, int, int]]  # frame id -> (file, line, parent id)

    def collectives(self) -> Iterator[HloInstruction]:
        """The collective instructions, in program order (an async ``-done`` is skipped)."""
        for inst in self.instructions.values():
            if collective_kind(inst.opcode) is not None:
                yield inst

    def tuple_element(self, inst: HloInstruction) -> str | None:
        """For a get-tuple-element of a ``tuple`` (or a barrier over one): the element's name."""
        source = self.instructions.get(inst.operands[0]) if inst.operands else None
        if source is not None and source.opcode == "opt-barrier" and source.operands:
            source = self.instructions.get(source.operands[0])
        if source is None or source.opcode != "tuple" or inst.tuple_index is None:
            return None
        return (
            source.operands[inst.tuple_index] if inst.tuple_index < len(source.operands) else None
        )

    def call_arguments(self, parameter: HloInstruction) -> list[str]:
        """For a parameter of a ``call``-ed computation: the callers' matching operands.

        (``shard_map`` bodies are such calls.)
        """
        number = parameter.parameter_number
        return [
            inst.operands[number]
            for inst in self.instructions.values()
            if inst.opcode == "call"
            and inst.callee == parameter.computation
            and number is not None
            and number < len(inst.operands)
        ]

    def frame_chain(self, frame_id: int | None) -> Iterator[tuple[str, int]]:
        """(file, line) from the innermost frame outwards."""
        seen = set()
        while frame_id in self.frames and frame_id not in seen:
            seen.add(frame_id)
            file, line, parent = self.frames[frame_id]
            yield file, line
            frame_id = parent


def collective_kind(opcode: str) -> str | None:
    """``"all-gather"`` for ``all-gather`` and ``all-gather-start``; None if not a collective."""
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVE_KINDS else None


def parse_module(text: str) -> HloModule:
    """Parses an HLO module's text (short or long operand form)."""
    lines = text.splitlines()
    header = lines[0] if lines else ""
    partitions = re.search(r"num_partitions=(\d+)", header)
    instructions: dict[str, HloInstruction] = {}
    entry, computation = "", ""
    frames = _frame_tables(lines)
    for line in lines:
        head = _COMPUTATION.match(line)
        if head:
            computation = head[2]
            entry = computation if head[1] else entry
            continue
        inst = _parse_instruction(line, computation, frames)
        if inst is not None:
            instructions[inst.name] = inst
    _add_tuple_elements(instructions)
    replicas = re.search(r"replica_count=(\d+)", header)  # pmap's programs
    devices = (int(partitions[1]) if partitions else 1) * (int(replicas[1]) if replicas else 1)
    return HloModule(instructions, entry, devices, frames)


def _parse_instruction(
    line: str, computation: str, frames: dict[int, tuple[str, int, int]]
) -> HloInstruction | None:
    match = _INSTRUCTION.match(line)
    if not match or not computation:
        return None
    name, body = match[1], match[2]
    opcode = _OPCODE.search(body)
    if opcode is None:
        return None
    type_text = body[: opcode.start()]
    operand_text = _balanced(body, opcode.end())
    attributes = body[opcode.end() + len(operand_text) :]
    types = tuple(
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY_TYPE.findall(type_text)
    )
    # op_name is quoted and may hold braces: search from "metadata={" on.
    start = attributes.find("metadata={")
    meta = attributes[start:] if start >= 0 else ""
    op_name = _OP_NAME.search(meta)
    frame = _FRAME_ID.search(meta)
    source = _SOURCE.search(meta)
    location = f"{source[1]}:{source[2]}" if source else None
    if location is None and frame and int(frame[1]) in frames:
        file, line_no, _ = frames[int(frame[1])]
        location = f"{file}:{line_no}"
    index = re.search(r"\bindex=(\d+)", attributes) if opcode[1] == "get-tuple-element" else None
    callee = re.search(r"\bto_apply=%?([\w.\-]+)", attributes) if opcode[1] == "call" else None
    parameter = re.fullmatch(r"\s*(\d+)\s*", operand_text) if opcode[1] == "parameter" else None
    return HloInstruction(
        name=name,
        opcode=opcode[1],
        types=types,
        operands=tuple(_OPERAND.findall(operand_text)),
        computation=computation,
        op_name=op_name[1].replace("\\'", "'").replace('\\"', '"') if op_name else "",
        frame_id=int(frame[1]) if frame else None,
        location=location,
        parameter_number=int(parameter[1]) if parameter else None,
        tuple_index=int(index[1]) if index else None,
        callee=callee[1] if callee else None,
    )


def _add_tuple_elements(instructions: dict[str, HloInstruction]) -> None:
    """Adds a ``get-tuple-element`` for each ``%name#i`` operand, named as it is written.

    Newer XLA prints a read of one element of a tuple (an ``opt-barrier``'s, a
    ``call``'s) as ``%name#i`` in the reader's operand list instead of a
    ``get-tuple-element`` instruction of its own; both forms then read alike.
    """
    written = {name for inst in instructions.values() for name in inst.operands if "#" in name}
    for ref in sorted(written):
        name, index = ref.rsplit("#", 1)
        source = instructions.get(name)
        if source is None or ref in instructions:
            continue
        i = int(index)
        instructions[ref] = dataclasses.replace(
            source,
            name=ref,
            opcode="get-tuple-element",
            types=source.types[i : i + 1],
            operands=(name,),
            parameter_number=None,
            tuple_index=i,
            callee=None,
        )


def _balanced(text: str, start: int) -> str:
    """The text from ``start`` up to the parenthesis that closes the one before it."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return text[start:]


def _frame_tables(lines: list[str]) -> dict[int, tuple[str, int, int]]:
    """frame id -> (file, line, parent frame id) from the module's stack-frame tables.

    XLA prints ``parent_frame_id`` one above the parent's id (0: no parent).
    """
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in lines:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        row = _TABLE_ROW.match(line) if current is not None else None
        if row is None:
            current = None
            continue
        current[int(row[1])] = row[2]
    files = {k: v.strip().strip('"') for k, v in tables.get("FileNames", {}).items()}
    locations = {k: dict(_FIELD.findall(v)) for k, v in tables.get("FileLocations", {}).items()}
    frames = {}
    for frame_id, text in tables.get("StackFrames", {}).items():
        fields = dict(_FIELD.findall(text))
        loc = locations.get(int(fields.get("file_location_id", 0)), {})
        file = files.get(int(loc.get("file_name_id", 0)), "?")
        frames[frame_id] = (
            file,
            int(loc.get("line", 0)),
            int(fields.get("parent_frame_id", 0)) - 1,
        )
    return frames
