"""Clocks of the asynchronous loop: wall time, or a virtual clock for simulated site speeds.

The asynchronous server loop reads the time, and waits, only through a :class:`Clock`, so the
same loop runs

* on a real Grid (Flower's simulation or deployment engine) with :class:`WallClock`: time is
  ``time.monotonic()`` since the run started, waiting is a short sleep between polls; and
* on a Grid that knows when each reply will arrive (``server.delayed.DelayedGrid``, sites
  with a simulated speed) with :class:`VirtualClock`: waiting jumps straight to the next
  arrival. Runs on one machine then report time-to-accuracy in *simulated* seconds, with
  stragglers that cost no real time (Gillespie-style discrete-event simulation, as FedScale
  and FLSim simulate asynchronous training).

The tests check the virtual clock against real waits on a small case
(tests/asynchronous/test_clock.py).
"""

from __future__ import annotations

import math
import time
from typing import Protocol

from fedagg.errors import ConfigError, explain

__all__ = ["Clock", "VirtualClock", "WallClock"]


class Clock(Protocol):
    """What the loop needs from a clock."""

    virtual: bool

    def now(self) -> float:
        """Seconds since the run started."""

    def wait_until(self, t: float, *, poll: float) -> None:
        """Let time pass until ``t`` (or at most ``poll`` seconds for a wall clock)."""


class WallClock:
    """Real time: ``time.monotonic()`` relative to ``start`` (default: construction)."""

    virtual = False

    def __init__(self, start: float | None = None, offset: float = 0.0) -> None:
        self._t0 = time.monotonic() if start is None else float(start)
        self._offset = float(offset)

    def now(self) -> float:
        """Seconds since the run started (including ``offset``, the time before a resume)."""
        return self._offset + time.monotonic() - self._t0

    def wait_until(self, t: float, *, poll: float) -> None:
        """Sleep until ``t``, or for ``poll`` seconds, whichever is sooner."""
        left = t - self.now()
        if left > 0:
            time.sleep(min(left, max(poll, 0.0)) if math.isfinite(left) else max(poll, 0.0))

    def set(self, t: float) -> None:
        """Continue a resumed run's time line at ``t`` (now becomes ``t``)."""
        self._t0, self._offset = time.monotonic(), float(t)


class VirtualClock:
    """Simulated time: it moves only when told to, and never backwards except on :meth:`set`."""

    virtual = True

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        """The simulated time."""
        return self._now

    def advance_to(self, t: float) -> None:
        """Move to ``t`` (a time in the past is ignored).

        Raises
        ------
        ConfigError
            ``t`` is not finite (the loop would wait forever: no reply is due and no
            deadline is set).
        """
        if not math.isfinite(t):
            raise ConfigError(explain("virtual clock", t, "must advance to a finite time",
                                      "set run.round_timeout (every dispatch then has a "
                                      "deadline), or check that some site answers"))
        self._now = max(self._now, float(t))

    def wait_until(self, t: float, *, poll: float = 0.0) -> None:
        """Jump to ``t`` (the loop passes the next arrival or deadline)."""
        self.advance_to(t)

    def set(self, t: float) -> None:
        """Put the clock at ``t``, also backwards (only to replay dispatches on resume)."""
        self._now = float(t)
