"""What ``numerics_report`` sees of an FP4 quantization: one op and the facts it measures.

An FP4 quantization (``_fp4.quantize4``) runs in the name scope
``quantize_scope(fmt)`` (``"jaxamp_quantize_nvfp4"``), which holds
``QUANTIZE_SCOPE``: ``numerics_report`` measures it as one op, its cast to
``float4_e2m1fn``, and every other step (amaxes, the E4M3 or E8M0 block scale,
the clip) runs unmeasured.

The statistics of that op need values the cast does not read: the unscaled
input (its amax and which nonzero values were flushed to zero), the scaled
input before the clip (which values were clamped at the largest code) and the
scales. While the numerics report traces a program (``observing``), ``mark``
passes them, with the value the cast rounds, through one
``optimization_barrier`` in the name scope ``FACTS_SCOPE`` just before the
cast; the report reads them from there (``Facts``). Outside the report
nothing is added: a training step's quantization fuses as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax

from jaxamp._fp8._scalings import QUANTIZE_SCOPE

__all__ = ["FACTS_SCOPE", "Facts", "mark", "observing", "quantization_of", "quantize_scope"]

FACTS_SCOPE = "jaxamp_fp4_facts"
_OBSERVING = contextvars.ContextVar("jaxamp_fp4_observing", default=False)
_FP4_SCOPE = re.compile(rf"{QUANTIZE_SCOPE}_(nvfp4|mxfp4)\b")


class Facts(NamedTuple):
    """An FP4 quantization's float32 values, each in the codes' shape ``[B, R, KB, n]``.

    ``block`` and ``tensor`` are broadcast from one value per block and per
    tensor (or per expert group); a value's dequantized number is
    ``code * block / tensor``.
    """

    x: Any  # the input, unscaled
    y: Any  # the input times its encode scale, before the clip to +-6
    block: Any  # the block scale as its format stores it (E4M3 s_b, E8M0 X); NaN: non-finite
    tensor: Any  # NVFP4's S_enc (1 under MXFP4)


def quantize_scope(fmt: str) -> str:
    """The name scope of an FP4 quantization of format ``fmt``.

    >>> quantize_scope("nvfp4")
    'jaxamp_quantize_nvfp4'
    """
    return f"{QUANTIZE_SCOPE}_{fmt}"


def quantization_of(name_stack: str) -> str | None:
    """The FP4 format whose quantization scope ``name_stack`` holds, else None."""
    found = _FP4_SCOPE.search(name_stack)
    return found.group(1) if found else None


@contextlib.contextmanager
def observing() -> Iterator[None]:
    """While tracing inside it, FP4 quantizations pass their ``Facts`` to the report."""
    token = _OBSERVING.set(True)
    try:
        yield
    finally:
        _OBSERVING.reset(token)


def mark(rounded: jax.Array, facts: Callable[[], Facts]) -> jax.Array:
    """``rounded`` (what the float4 cast reads), with ``facts()`` beside it when observing.

    ``facts`` is called only then: a training step computes nothing more.
    """
    if not _OBSERVING.get():
        return rounded
    with jax.named_scope(FACTS_SCOPE):
        return jax.lax.optimization_barrier((rounded, *facts()))[0]
