"""What every benchmark script shares: ``--smoke`` / ``--json``, the machine, the load.

``--smoke`` runs a script at a tiny size (the CI smoke test runs every script that way: it must
exit 0 and print its table, so a refactor that breaks a benchmark fails CI); ``--json PATH``
writes the script's results with :func:`record`'s metadata (command, date, machine, commit,
load) so that ``benchmarks/summary.py`` and docs/results read the same numbers the table shows.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def add_common(parser: argparse.ArgumentParser) -> None:
    """``--smoke`` and ``--json`` on ``parser``."""
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, a few seconds: checks that the script runs (CI)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the results, with the command and machine, here")


@contextlib.contextmanager
def own_garbage() -> Iterator[None]:
    """A measured step that pays for its own garbage only: everything alive before it is
    collected and frozen (``gc.freeze``), so a full collection inside the step traverses the
    step's objects, not the harness's or another protocol's (the reason ``timeit`` turns the
    collector off; here it stays on)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def loadavg() -> str:
    """The 1 / 5 / 15 minute load averages (``n/a`` where /proc is missing)."""
    try:
        with open("/proc/loadavg") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "n/a"


def machine() -> str:
    """One line naming the machine: CPU model, cores, memory, OS."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kib / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return f"{model}, {os.cpu_count()} cores{mem}, {platform.system()} {platform.machine()}"


def commit() -> str:
    """The checkout's commit (with ``+`` when it has uncommitted changes), or ''."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+" if dirty else "")


def command(argv: list[str] | None = None) -> str:
    """The command line that ran this script, relative to the repository root."""
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(ROOT)
    args = list(sys.argv[1:] if argv is None else argv)
    if "--json" in args:  # where this run wrote its results is nobody else's business
        i = args.index("--json")
        del args[i:i + 2]
    return shlex.join(["python", str(script), *[a for a in args if a]])


def record(results: Any, argv: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """``results`` with the metadata a recorded figure needs."""
    return {"command": command(argv),
            "date": datetime.date.today().isoformat(), "machine": machine(),
            "commit": commit(), "load_average": loadavg(), **extra, "results": results}


def write_json(path: Path | None, results: Any, argv: list[str] | None = None,
               **extra: Any) -> None:
    """Write :func:`record` of ``results`` to ``path`` (nothing when ``path`` is None)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record(results, argv, **extra), indent=1, default=_plain) + "\n")


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON: {type(value).__name__}")
