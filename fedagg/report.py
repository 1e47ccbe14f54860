"""Run outputs: per-round metrics as JSON and CSV, and an accuracy / loss plot.

Files are written atomically (temporary file, fsync, rename), so a reader never sees half a
file and a crash leaves the previous version in place. They get the permissions any new file
of the user's gets (``0666`` less the process's umask, as ``open()`` would give), unless the
caller asks for others (private keys: ``0600``).
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_bytes", "current_umask", "write_metrics", "write_plot"]


def current_umask() -> int:
    """The process's umask, read without changing it (``/proc/self/status`` on Linux).

    Elsewhere it is read by setting and restoring it (``os.umask``), which is not atomic
    with respect to other threads creating files at the same moment.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes, *, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same directory, fsync, rename).

    The file gets ``mode`` when given (set on the temporary file before any byte lands, for
    private keys, and again on the final path), else the permissions a new file of the user's
    gets: ``0666`` less the umask (``-rw-r--r--`` under the usual ``022``), not the ``0600``
    of the temporary file.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        os.fchmod(fd, mode if mode is not None else 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if mode is not None:
        os.chmod(p, mode)
    dir_fd = os.open(p.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_metrics(run_dir: str | Path, records: Sequence[Mapping[str, Any]]) -> None:
    """Write ``metrics.json`` (list of per-round records) and ``metrics.csv``."""
    d = Path(run_dir)
    atomic_write_bytes(d / "metrics.json", json.dumps(list(records), indent=2).encode())
    columns: list[str] = []
    for rec in records:
        columns += [k for k in rec if k not in columns and not isinstance(rec[k], (dict, list))]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    for rec in records:
        writer.writerow({k: rec.get(k, "") for k in columns})
    atomic_write_bytes(d / "metrics.csv", buf.getvalue().encode())


def write_plot(run_dir: str | Path, records: Sequence[Mapping[str, Any]], *, title: str = "") -> Path:
    """Plot accuracy and loss per round to ``run_dir/metrics.png``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [r["round"] for r in records if r.get("accuracy") is not None]
    acc = [r["accuracy"] for r in records if r.get("accuracy") is not None]
    loss = [r["loss"] for r in records if r.get("accuracy") is not None]
    fig, ax1 = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax1.plot(rounds, acc, "o-", color="tab:blue", label="accuracy")
    ax1.set_xlabel("round")
    ax1.set_ylabel("accuracy", color="tab:blue")
    ax1.set_ylim(0, 1)
    ax2 = ax1.twinx()
    ax2.plot(rounds, loss, "s--", color="tab:red", label="loss")
    ax2.set_ylabel("loss", color="tab:red")
    ax1.set_title(title or "centralized evaluation")
    fig.tight_layout()
    out = Path(run_dir) / "metrics.png"
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(out, buf.getvalue())
    return out
