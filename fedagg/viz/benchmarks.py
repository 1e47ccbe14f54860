"""Measured all-reduce figures read from ``docs/benchmarks.md``, for the schedule page.

The benchmark page is written by people and changes; this reader is deliberately cautious.
It looks for Markdown tables whose header has the columns ``N``, ``size``, ``algorithm`` and
``median ms`` (the tables ``benchmarks/allreduce.py --markdown`` prints), remembers the
``###`` / ``##`` heading each table sits under, and keeps the first row it meets for every
``(N, size, algorithm)`` -- the page lists the newest session first. Anything it cannot parse
is skipped; a page without such tables gives no measurements, never an error.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Measurement", "measured_for", "parse_benchmarks", "parse_size"]

_log = logging.getLogger(__name__)

_UNITS = {"b": 1, "kb": 1 << 10, "kib": 1 << 10, "mb": 1 << 20, "mib": 1 << 20,
          "gb": 1 << 30, "gib": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?i?b)\s*$", re.IGNORECASE)
_NEEDED = ("n", "size", "algorithm", "median ms")
_DIARY = re.compile(r"\bsessions?\s+\d|\bissues?[\s#-]*\d|\b\d{4}-\d{2}-\d{2}\b", re.IGNORECASE)
"""A heading that names a work session, an issue or a date: not cited on a user's page."""


@dataclass(frozen=True)
class Measurement:
    """One measured all-reduce: median milliseconds of ``algorithm`` at ``world_size`` ranks.

    Parameters
    ----------
    world_size : int
        Number of ranks ``N``.
    nbytes : int
        Tensor size in bytes.
    algorithm : str
        ``ring``, ``tree``, ``hierarchical`` or ``native`` (variants such as ``ring:py`` are
        kept under their own name).
    median_ms : float
        Median time of one all-reduce, in milliseconds.
    section : str
        The heading the table sits under (what was measured, on which machine); ``""`` when
        the heading names a work session, an issue or a date (a page for users cites the
        figure, not the diary it came from).
    """

    world_size: int
    nbytes: int
    algorithm: str
    median_ms: float
    section: str


def parse_size(text: str) -> int | None:
    """``"4 KB"`` -> 4096, ``"1MB"`` -> 1048576 (binary units); None if not a size."""
    m = _SIZE.match(text)
    if m is None:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_benchmarks(text: str) -> list[Measurement]:
    """All all-reduce measurements in a benchmarks page, first occurrence of each kept.

    Parameters
    ----------
    text : str
        Markdown text of ``docs/benchmarks.md``.

    Returns
    -------
    list of Measurement
        In page order; empty when no table of the expected shape is found.
    """
    out: list[Measurement] = []
    seen: set[tuple[int, int, str]] = set()
    section = ""
    header: list[str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            section = stripped.lstrip("#").strip()
            section = "" if _DIARY.search(section) else section  # cite what holds, not when
            header = None
            continue
        if not stripped.startswith("|"):
            header = None
            continue
        cells = _cells(stripped)
        if header is None:
            lowered = [c.lower() for c in cells]
            header = lowered if all(k in lowered for k in _NEEDED) else []
            continue
        if not header or set(stripped) <= set("|-: "):
            continue
        row = dict(zip(header, cells, strict=False))
        try:
            n = int(row["n"])
            nbytes = parse_size(row["size"])
            median = float(row["median ms"])
        except (KeyError, ValueError):
            continue
        algorithm = row.get("algorithm", "")
        if nbytes is None or not algorithm:
            continue
        key = (n, nbytes, algorithm)
        if key in seen:
            continue
        seen.add(key)
        out.append(Measurement(n, nbytes, algorithm, median, section))
    return out


def measured_for(
    path: str | Path | None, world_size: int, nbytes: int
) -> tuple[int, list[Measurement]]:
    """The measurements at ``world_size`` ranks for the measured size nearest ``nbytes``.

    Parameters
    ----------
    path : str or Path, optional
        The benchmarks page; a missing or unreadable file gives no measurements.
    world_size, nbytes : int
        What the schedule page shows.

    Returns
    -------
    (int, list of Measurement)
        The measured size that was picked (``0`` when none) and its rows.
    """
    if path is None:
        return 0, []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        _log.info("no measured figures: %s unreadable (%s)", path, exc)
        return 0, []
    rows = [m for m in parse_benchmarks(text) if m.world_size == world_size]
    if not rows:
        return 0, []
    target = max(nbytes, 1)
    size = min({m.nbytes for m in rows}, key=lambda s: (abs(_log2(s) - _log2(target)), s))
    return size, [m for m in rows if m.nbytes == size]


def _log2(x: int) -> float:
    return math.log2(max(x, 1))
