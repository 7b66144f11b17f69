"""The compiled instrumented program, cached per function, argument types and options.

A report traces, catalogs and compiles an instrumented program that is several
times the size of the plain one; XLA's compile dominates its first call (see
BENCHMARKS.md, "numerics_report"). The program depends only on the function,
the structure, shapes and dtypes of the array arguments, the non-array arguments,
the policy, ``grad`` and ``has_aux`` (the loss scale is an argument of it), so it
is cached on those, like ``jax.jit`` caches its executables: a report on the next
batch of a training run costs one run of the compiled program.

When XLA rejects the program (a primitive whose float32 twin ``_retype`` could
not retype correctly), it is traced again with every twin lowered on its own
first (``_retype.checking_every_twin``): slower, and the twins that fail are
dropped instead of failing the report.

On the CPU the program is compiled so that LLVM never vectorizes float16 loops
wider than 64 bits. The float32 shadow puts 16-bit and float32 arithmetic in
the same fused loops, which the plain program never does, and LLVM's x86
backend aborts the process (``LLVM ERROR: Cannot select: ... v16f16 ...
X86ISD::SUBV_BROADCAST_LOAD``, no exception to catch) on some of them once they
are vectorized: on AVX-512 machines without AVX512-FP16 already
``jnp.where(c * d > 0, a, 0.0) / a`` with float16 ``c`` (4x8) and ``d`` (4x1)
does. A small program (under ``FAST_COMPILE_VALUES`` measured values) is
compiled without LLVM's optimizations at all, which halves its compile; a
larger one with them and 64-bit vectors (``xla_cpu_prefer_vector_width``),
since unoptimized code runs its measured values some 70 times slower
(BENCHMARKS.md, "numerics_report"). Where XLA still offers them (jax 0.10),
the fused loops are emitted by its classic emitters, which compile in about
half the time. Transcendental functions (``tanh``, ``rsqrt``, ``log1p``, and
``gelu`` already at XLA's lowest optimization level) may then differ from the
plain step's in the last bit, which changes an inf/NaN or an underflow only
for a value at the edge of its dtype's range.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxamp._numerics._flow import SiteGraph
from jaxamp._numerics._numerics_report import NumericsReport
from jaxamp._numerics._retype import checking_every_twin
from jaxamp._numerics._summary import summarise

__all__ = [
    "CACHE_SIZE",
    "FAST_COMPILE_VALUES",
    "Compiled",
    "cache_clear",
    "cache_key",
    "cached",
    "compile_with_fallback",
    "compiler_options",
    "materializes_values",
]

CACHE_SIZE = 32  # programs kept (least recently used dropped first)
# XLA's options for compiling a small program on the CPU (see the module docstring):
# LLVM never vectorizes (its x86 backend aborts on some vectorized mixed
# float16/float32 loops) and skips its optimization of the many small kernels, most
# of such a program's compile; the run is slower, BENCHMARKS.md, "numerics_report".
CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
# A larger program: LLVM's optimizations on, vectors of at most 64 bits (4 float16
# values), which LLVM's x86 backend selects without aborting.
CPU_LARGE_COMPILER_OPTIONS = {"xla_cpu_prefer_vector_width": 64}
# Both ways: every 16-bit value is rounded to its dtype at the op that makes it, as
# the jaxpr says, however XLA fuses the program (by default XLA may keep a fused
# chain's bfloat16/float16 intermediates in float32, and the report's program, whose
# values are all measured, fuses differently from the step's).
CPU_EXACT_ROUNDING = {"xla_allow_excess_precision": False}
# Where XLA still has them (jax 0.10, not 0.12), its classic fused-loop emitters,
# which compile the report's many small kernels in about half the time of the
# MLIR fusion emitters (BENCHMARKS.md, "numerics_report: the first call, compile
# included"); transcendental functions may differ in the last bit (module docstring).
CPU_CLASSIC_EMITTERS = {"xla_cpu_use_fusion_emitters": False}
# The measured values (elements of every site, once) up to which a program is
# compiled unoptimized: the 1-block transformer and the 1-layer GPT of BENCHMARKS.md
# measure 3.7 million; the 2-layer GPT (54 million) ran 26 s unoptimized, 0.4 s not.
FAST_COMPILE_VALUES = 2**22


class Compiled(NamedTuple):
    # The instrumented program: run(*inputs) -> (floats, ints, finite), compiled
    # (numerics_report) or to be traced into the caller's program (numerics_monitor).
    run: Callable
    sites: list  # its catalog (what each row of its statistics is)
    paths: list[str]  # the argument path of each array input, for naming non-finite ones
    graph: SiteGraph  # the data flow between sites: which inf/NaN reach the outputs
    # The screening pass (``_program._screening``; traced: ``_screened``): run(*inputs)
    # -> (floats, ints, finite, found), found: an inf/NaN (traced: the tables are the
    # full program's).
    screen: bool = False

    def report(
        self, floats, ints, finite, scale: float | None, full: bool = True
    ) -> NumericsReport:
        """The report from one run's statistics (host arrays); ``scale``: the loss scale;
        ``full``: False for the statistics of the screening pass alone."""
        flags = np.asarray(finite)
        bad = tuple(p for p, ok in zip(self.paths, flags, strict=False) if not ok)
        floats, ints = np.asarray(floats), np.asarray(ints)
        return summarise(self.sites, self.graph, floats, ints, scale, bad, screened=not full)


_CACHE: collections.OrderedDict[Hashable, Compiled] = collections.OrderedDict()
_LOCK = threading.Lock()


def _aval_key(x: Any) -> tuple:
    # str(dtype), not np.dtype(...).str: a typed PRNG key's dtype (key<fry>) is no
    # NumPy dtype, and the extended float types share one ('<V1' for every float8).
    # The sharding too: a compiled program takes its arguments as it was compiled for
    # them (a sharded train step's parameters, or the same shapes on one device).
    sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
    return (np.shape(x), str(x.dtype), bool(getattr(x, "weak_type", False)), sharding)


def cache_key(fun, policy, grad, has_aux, treedef, static, dynamic) -> Hashable | None:
    """The cache key, or None when a non-array argument is unhashable (not cached)."""
    key = (fun, policy, grad, has_aux, treedef, tuple(static), tuple(map(_aval_key, dynamic)))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def cached(key: Hashable | None, build: Callable[[], Compiled]) -> Compiled:
    """The program for ``key``, built (traced and compiled) on a miss."""
    if key is None:
        return build()
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    program = build()
    with _LOCK:
        _CACHE[key] = program
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return program


def cache_clear() -> None:
    """Drops every cached program."""
    with _LOCK:
        _CACHE.clear()


def compiler_options(platform: str, values: int = 0) -> dict | None:
    """The XLA options the report compiles its program with on ``platform``;
    ``values``: how many values it measures (the elements of its sites)."""
    if platform != "cpu":
        return None
    small = values <= FAST_COMPILE_VALUES
    options = dict(CPU_COMPILER_OPTIONS if small else CPU_LARGE_COMPILER_OPTIONS)
    options.update(CPU_EXACT_ROUNDING)
    if _has_classic_emitters():
        options.update(CPU_CLASSIC_EMITTERS)
    return options


def materializes_values(platform: str) -> bool:
    """Whether the instrumented program keeps each measured value in a buffer of its
    own: on the CPU where XLA has only its MLIR fusion emitters (jax 0.12), which
    compile a program with each value computed once in less time (BENCHMARKS.md,
    "numerics_report: the first call, compile included"); the classic emitters
    compile it faster without."""
    return platform == "cpu" and not _has_classic_emitters()


@functools.cache
def _has_classic_emitters() -> bool:
    """Whether this XLA knows ``CPU_CLASSIC_EMITTERS`` (asked once, on a tiny program)."""
    try:
        jax.jit(lambda x: x + 1).lower(np.float32(0)).compile(dict(CPU_CLASSIC_EMITTERS))
    except Exception:  # "No such compile option": XLA dropped it
        return False
    return True


def compile_with_fallback(make: Callable[[], Callable], inputs: list, values: int = 0) -> Callable:
    """``make()`` is a ``jax.jit``-ed program: lowered and compiled for ``inputs``;
    ``values``: how many values it measures (``compiler_options``).

    If XLA rejects it, ``make()`` is called again with every float32 twin lowered
    on its own first, and twins that fail restart from the real value.
    """
    options = compiler_options(jax.default_backend(), values)
    try:
        return make().lower(*inputs).compile(options)
    except Exception as first:  # a twin XLA rejects: trace again, checking each one
        try:
            with checking_every_twin():
                return make().lower(*inputs).compile(options)
        except Exception:
            raise first from None
