"""When an engine is busy: the same definition for every engine.

Busy = wall time during which the engine holds at least one unfinished sequence and is not paused for a weight
update, i.e. time it spends computing steps. The clock follows the engine's own view of a sequence's life (vLLM:
from submission until vLLM returns its final output), not when the inference loop collects it: a loop blocked on a
full send queue does not make its engine look busy. Sequence-seconds (sequences in flight x time) give the mean
occupancy over busy time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BusyClock:
    """Thread-safe: sequences may enter from one thread and leave from another (vLLM's client loop)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._n = 0  # sequences the engine holds
        self._paused = False
        self._mark = clock()
        self._busy_s = 0.0
        self._seq_s = 0.0

    def _advance(self) -> None:
        now = self._clock()
        if self._n > 0 and not self._paused:
            self._busy_s += now - self._mark
            self._seq_s += self._n * (now - self._mark)
        self._mark = now

    def enter(self, n: int = 1) -> None:
        """`n` sequences were handed to the engine."""
        with self._lock:
            self._advance()
            self._n += n

    def leave(self, n: int = 1) -> None:
        """`n` sequences are finished in the engine (whether or not anyone has collected them yet)."""
        with self._lock:
            self._advance()
            self._n -= n

    def pause(self) -> None:
        """The engine stops computing (a weight update) until `resume`."""
        with self._lock:
            self._advance()
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._advance()
            self._paused = False

    def read(self) -> tuple[float, float]:
        """(busy seconds, sequence-seconds) so far."""
        with self._lock:
            self._advance()
            return self._busy_s, self._seq_s
