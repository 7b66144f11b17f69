"""Reports of the host-loop monitor, read back and summarised off the training loop.

``Delivery.put(step, compiled, outputs, seed)`` takes the device arrays of one
dispatched instrumented run and returns at once; a worker thread waits for them
(``jax.device_get``), summarises them and calls the callback, in the order the runs
were put. The thread runs while reports are pending and ends when none are (not a
daemon: a report put before the interpreter exits is delivered). ``flush()`` waits
for every pending report and raises the first error a callback raised since the
last flush.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import jax

from jaxamp._numerics._compiled import Compiled
from jaxamp._numerics._numerics_report import NumericsReport

__all__ = ["Delivery"]


class Delivery:
    """A queue of dispatched runs and the thread that turns them into reports."""

    def __init__(self, report_to: Callable[[int, NumericsReport], Any]):
        self._report_to = report_to
        self._pending: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._draining = False
        self._error: BaseException | None = None

    def put(self, step: int, compiled: Compiled, outputs: Any, seed: Any) -> None:
        """Hands one run's device arrays over (``seed``: the loss scale, or None)."""
        with self._cond:
            self._pending.append((step, compiled, outputs, seed))
            if not self._draining:
                self._draining = True
                threading.Thread(target=self._drain, name="jaxamp-numerics-monitor").start()

    def flush(self) -> None:
        """Waits until every report put so far reached the callback; raises the first
        exception a callback raised since the last ``flush``."""
        with self._cond:
            self._cond.wait_for(lambda: not self._draining)
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._pending:
                    self._draining = False
                    self._cond.notify_all()
                    return
                item = self._pending.popleft()
            try:
                self._deliver(*item)
            except Exception as error:  # kept for flush(): this thread has no caller
                with self._cond:
                    if self._error is None:
                        self._error = error

    def _deliver(self, step: int, compiled: Compiled, outputs: Any, seed: Any) -> None:
        # A screened program also says whether its full pass ran (``_program._screened``).
        floats, ints, finite, *full = jax.device_get(outputs)
        scale = None if seed is None else float(jax.device_get(seed))
        report = compiled.report(floats, ints, finite, scale, *(bool(f) for f in full))
        self._report_to(step, report)
