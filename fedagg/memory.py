"""Peak resident memory of this process over a span of time (one round, one benchmark case).

Linux keeps the process's peak resident set size ("high-water mark", ``VmHWM`` in
``/proc/self/status``); writing ``5`` to ``/proc/self/clear_refs`` resets it to the current
RSS (proc(5), "clear_refs", Linux >= 4.0). :class:`PeakMemory` uses that pair: reset at the
start, read at the end — exact (the kernel updates the mark on every page fault), no thread,
no tracing overhead, and it sees every allocation (NumPy, Flower's protobufs, Ray's shared
memory pages this process touches), which tracemalloc does not.

Where the reset is not allowed (another OS, a restricted ``/proc``) it falls back to a
sampling thread that reads the RSS every ``interval`` seconds and keeps the largest value
(``method == "sampled"``: a spike shorter than the interval can be missed).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MemorySpan", "PeakMemory", "current_rss", "peak_rss", "reset_peak"]

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


def _status_kib(key: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def current_rss() -> int | None:
    """Resident set size of this process in bytes (None where /proc is unavailable)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss() -> int | None:
    """Peak resident set size since the start or the last :func:`reset_peak`, in bytes."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def reset_peak() -> bool:
    """Reset the kernel's peak RSS to the current RSS; False where that is not allowed."""
    try:
        _CLEAR.write_text("5")
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class MemorySpan:
    """What :meth:`PeakMemory.stop` measured (bytes)."""

    start: int
    """RSS when the span started."""
    peak: int
    """Largest RSS during the span."""
    end: int
    """RSS when it stopped."""
    method: str
    """``"vmhwm"`` (kernel high-water mark, reset at the start) or ``"sampled"``."""

    @property
    def above_start(self) -> int:
        """``peak - start``: what the span added at its worst."""
        return max(self.peak - self.start, 0)


class PeakMemory:
    """Measure this process's peak RSS between :meth:`start` and :meth:`stop`.

    Parameters
    ----------
    interval : float
        Seconds between samples of the fallback thread.
    """

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self._start = 0
        self._method = ""
        self._peak = 0
        self._stop_evt: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start a span (resets the kernel's mark, or starts the sampling thread)."""
        self._start = current_rss() or 0
        if reset_peak() and peak_rss() is not None:
            self._method = "vmhwm"
            return
        self._method = "sampled"
        self._peak = self._start
        self._stop_evt = threading.Event()

        def sample() -> None:
            assert self._stop_evt is not None
            while not self._stop_evt.wait(self.interval):
                self._peak = max(self._peak, current_rss() or 0)

        self._thread = threading.Thread(target=sample, name="fedagg-peak-rss", daemon=True)
        self._thread.start()

    def stop(self) -> MemorySpan:
        """End the span and return what it measured."""
        end = current_rss() or 0
        if self._method == "vmhwm":
            peak = peak_rss() or end
        else:
            if self._stop_evt is not None:
                self._stop_evt.set()
            if self._thread is not None:
                self._thread.join()
            peak = max(self._peak, end)
        return MemorySpan(start=self._start, peak=max(peak, end, self._start), end=end,
                          method=self._method or "sampled")
