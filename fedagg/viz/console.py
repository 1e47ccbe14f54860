"""What ``fedagg simulate`` shows while it runs: per-round progress and quiet known warnings.

:class:`RoundProgress` has three modes: ``live`` (a rich progress bar with the round, sites
replied / sampled, the last accuracy and an ETA, plus one line per round above it; the default
when the stream is a terminal), ``lines`` (one plain line per round, nothing redrawn; the
default otherwise, e.g. in CI logs) and ``quiet`` (nothing per round).

:func:`filter_known_warnings` silences the deprecation notices Flower and Ray print on every
simulation that fedagg starts (listed in :data:`KNOWN_WARNINGS` and
:data:`KNOWN_LOG_MESSAGES`, matched by category and message); any other warning still shows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import time
import warnings
from collections.abc import Mapping
from types import TracebackType
from typing import Any, TextIO

__all__ = [
    "KNOWN_LOG_MESSAGES",
    "KNOWN_WARNINGS",
    "MODES",
    "ProcessWatch",
    "RoundProgress",
    "descendants",
    "eta_seconds",
    "filter_known_warnings",
    "round_line",
    "stop_processes",
]

MODES: tuple[str, ...] = ("auto", "live", "lines", "quiet")

KNOWN_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    # Ray, on every ray.init() with num_gpus=0: a note about a future default, no action needed
    (FutureWarning, r"Tip: In future versions of Ray, Ray will no longer override accelerator"),
)
"""``(category, message regex)`` of the Python warnings filtered in ``fedagg simulate``."""

KNOWN_LOG_MESSAGES: dict[str, tuple[str, ...]] = {
    # fedagg simulate drives Flower's simulation engine through run_simulation on purpose
    "flwr": (r"DEPRECATED FEATURE: The `run_simulation` function is deprecated",),
}
"""Logger name -> message regexes of the log records dropped in ``fedagg simulate``."""


class _DropKnown(logging.Filter):
    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except (TypeError, ValueError):
            return True
        return not any(p.search(text) for p in self.patterns)


def filter_known_warnings() -> None:
    """Silence the known Flower / Ray notices (idempotent); other warnings are untouched."""
    for category, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, patterns in KNOWN_LOG_MESSAGES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(patterns))


def eta_seconds(seconds: Mapping[int, float], total_rounds: int, *, resumed_after: int = 0
                ) -> float | None:
    """Estimated seconds left, from the per-round times seen so far.

    The first round the engine runs carries its cold start, so it is left out: there is no
    estimate until a later round has been timed. ``seconds`` maps round -> seconds (round 0,
    the initial evaluation, is not used); ``resumed_after``: the checkpoint's round of a
    resumed run (rounds up to it and the one after it are not used).
    """
    steady = [s for r, s in seconds.items() if r >= max(2, resumed_after + 2)]
    if not steady:
        return None  # round 1 alone (engine start-up included) says little about the rest
    left = total_rounds - max(seconds)
    return max(0, left) * sum(steady) / len(steady)


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _fmt(value: Any, spec: str) -> str:
    return "-" if not isinstance(value, int | float) or isinstance(value, bool) else format(value, spec)


def round_line(rec: Mapping[str, Any], total_rounds: int, eta: float | None = None) -> str:
    """One plain line for a round record (``fedagg simulate`` in a log, and the live view)."""
    sites = ""
    if "sites_sampled" in rec:
        sites = f"  sites {rec.get('sites_replied', '?')}/{rec['sites_sampled']}"
    line = (f"round {rec.get('round', '?'):>3}/{total_rounds}  accuracy {_fmt(rec.get('accuracy'), '.4f')}"
            f"  loss {_fmt(rec.get('loss'), '.4f')}{sites}"
            f"  up {(rec.get('bytes_up') or 0) / 1e6:.3f} MB  down {(rec.get('bytes_down') or 0) / 1e6:.3f} MB"
            f"  {_fmt(rec.get('seconds'), '.2f')} s")
    if eta is not None and rec.get("round", 0) < total_rounds:
        line += f"  ETA {_clock(eta)}"
    return line


class RoundProgress:
    """Per-round progress of a simulation; use as a context manager, call :meth:`update`.

    Parameters
    ----------
    total_rounds : int
        Rounds the run will reach.
    mode : {"auto", "live", "lines", "quiet"}
        ``auto``: ``live`` when ``stream`` is a terminal, else ``lines``.
    stream : file, optional
        Where to write (default ``sys.stdout``).
    resumed_after : int
        For a resumed run, the checkpoint's round: the records up to it, replayed by the
        server, update the display without a line each.
    """

    def __init__(self, total_rounds: int, *, mode: str = "auto", stream: TextIO | None = None,
                 resumed_after: int = 0) -> None:
        self.total = total_rounds
        self.resumed_after = resumed_after
        self.stream = sys.stdout if stream is None else stream
        if mode == "auto":
            isatty = getattr(self.stream, "isatty", None)
            mode = "live" if callable(isatty) and isatty() else "lines"
        self.mode = mode
        self.seconds: dict[int, float] = {}
        self.last_accuracy: float | None = None
        self.stopped = False
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> RoundProgress:
        if self.mode == "live":
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn

            self._progress = Progress(
                TextColumn("[bold]round {task.completed:.0f}/{task.total:.0f}"),
                BarColumn(),
                TextColumn("sites {task.fields[sites]}"),
                TextColumn("accuracy {task.fields[acc]}"),
                TextColumn("ETA {task.fields[eta]}"),
                console=Console(file=self.stream),
                transient=False,
            )
            self._task = self._progress.add_task("rounds", total=self.total, sites="-", acc="-",
                                                 eta="-")
            self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop the live display (idempotent); later updates are ignored."""
        self.stopped = True
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def message(self, text: str) -> None:
        """Print ``text`` (above the live bar, if any), unless quiet."""
        if self.mode == "quiet":
            return
        if self._progress is not None:
            self._progress.console.print(text, highlight=False, markup=False)
        else:
            print(text, file=self.stream, flush=True)

    def update(self, rec: Mapping[str, Any]) -> None:
        """Show one finished round (records of a resumed run are replayed through here too)."""
        if self.stopped:
            return
        rnd = rec.get("round")
        if not isinstance(rnd, int):
            return
        sec = rec.get("seconds")
        if isinstance(sec, int | float):
            self.seconds[rnd] = float(sec)
        if isinstance(rec.get("accuracy"), int | float):
            self.last_accuracy = float(rec["accuracy"])
        eta = eta_seconds(self.seconds, self.total, resumed_after=self.resumed_after)
        if rnd == 0 and isinstance(rec.get("seconds_startup"), int | float):
            self.message(f"simulation engine started in {rec['seconds_startup']:.1f} s "
                         "(not counted in round 1)")
        if rnd > self.resumed_after or (rnd == 0 and not self.resumed_after):
            self.message(round_line(rec, self.total, eta))
        if self._progress is not None:
            sites = (f"{rec.get('sites_replied', '?')}/{rec['sites_sampled']}"
                     if "sites_sampled" in rec else "-")
            acc = "-" if self.last_accuracy is None else f"{self.last_accuracy:.4f}"
            self._progress.update(self._task, completed=rnd, sites=sites, acc=acc,
                                  eta=_clock(eta) if rnd < self.total else "done")


def _stat(pid: int) -> tuple[int, str] | None:
    """``(parent pid, start time)`` of a live, non-zombie process, or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), fields[19]


def descendants(pid: int) -> dict[int, str]:
    """Every live descendant of ``pid``: process id -> start time (Linux ``/proc``; else empty).

    The start time tells a process from a later one that reuses its id.
    """
    try:
        entries = [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return {}
    info = {p: st for p in entries if (st := _stat(p)) is not None}
    out: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, start) in info.items():
            if ppid == parent and child not in out:
                out[child] = start
                frontier.append(child)
    return out


def _alive(procs: dict[int, str]) -> dict[int, str]:
    return {p: s for p, s in procs.items() if (st := _stat(p)) is not None and st[1] == s}


def stop_processes(procs: dict[int, str], *, timeout: float = 3.0) -> list[int]:
    """SIGTERM the processes of a :func:`descendants` snapshot still alive, SIGKILL the rest.

    Take the snapshot *before* stopping the engine: once a parent (Ray's raylet) exits, its
    children are re-parented and no longer descend from this process. Returns the ids that
    were still alive and had to be signalled.
    """
    left = _alive(procs)
    signalled = sorted(left)
    for p in signalled:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        for p in list(left):
            with contextlib.suppress(OSError):
                os.waitpid(p, os.WNOHANG)  # reap our own children
        left = _alive(left)
    for p in left:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    for p in signalled:
        with contextlib.suppress(OSError):
            os.waitpid(p, os.WNOHANG)
    return signalled


class ProcessWatch:
    """The processes this one started (and theirs), remembered so they can be stopped later.

    Ray's workers are children of its raylet; when the raylet exits first they are
    re-parented and a late look at the process tree misses them. Call :meth:`snapshot`
    while the engine runs (``fedagg simulate`` does after every round and on Ctrl-C), then
    :meth:`stop` after the engine was asked to shut down.
    """

    def __init__(self, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.known: dict[int, str] = {}

    def snapshot(self) -> None:
        """Add the current descendants to the remembered ones."""
        self.known.update(descendants(self.pid))

    def stop(self, *, timeout: float = 3.0) -> list[int]:
        """:func:`stop_processes` over everything remembered plus the current descendants."""
        self.snapshot()
        return stop_processes(self.known, timeout=timeout)

    def stop_detached(self, *, timeout: float = 1.0) -> None:
        """SIGTERM everything remembered now; a detached process SIGKILLs what is left later.

        For a process that must exit at once (``fedagg simulate`` on Ctrl-C: Ray may end
        it with status 1 while it waits for its engine to go). The reaper runs in a session
        of its own (a second Ctrl-C does not reach it) and checks each process's start
        time, so an id reused meanwhile is never signalled.
        """
        import json
        import subprocess

        self.snapshot()
        left = _alive(self.known)
        for p in left:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGTERM)
        if not left:
            return
        code = ("import json, sys; from fedagg.viz.console import stop_processes; "
                "stop_processes({int(k): v for k, v in json.loads(sys.argv[1]).items()}, "
                f"timeout={float(timeout)!r})")
        with contextlib.suppress(OSError):
            subprocess.Popen([sys.executable, "-c", code, json.dumps(left)],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
