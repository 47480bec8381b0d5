"""Host memory of this process as the memory plan counts it: anonymous resident bytes (what the process itself
allocated), not the page cache of memory-mapped files such as safetensors shards, and their peak over a block of
code, sampled from a thread (`benchmarks/memory_vs_plan.py`)."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from types import TracebackType

_PAGE = os.sysconf("SC_PAGE_SIZE")


def anon_bytes() -> int:
    """Resident bytes of this process less its file-backed and shared pages (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * _PAGE


def release_free_heap() -> None:
    """Give freed heap memory back to the kernel (glibc `malloc_trim`), so a baseline holds only live memory."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to trim
        pass


class PeakAnon:
    """`with PeakAnon() as m: ...` then `m.peak - m.base`: the highest `anon_bytes()` seen while the block ran,
    sampled every `period_s` (torch kernels release the GIL, so the sampler runs during them)."""

    def __init__(self, period_s: float = 0.0002) -> None:
        self.period_s = period_s
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, anon_bytes())
            time.sleep(self.period_s)

    def __enter__(self) -> PeakAnon:
        release_free_heap()
        self.base = self.peak = anon_bytes()
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anon_bytes())

    @property
    def grown(self) -> int:
        """Peak growth over the baseline, in bytes."""
        return self.peak - self.base
