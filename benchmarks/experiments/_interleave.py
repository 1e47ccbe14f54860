"""Shared by the experiment scripts: time several callables interleaved, order rotated."""

from __future__ import annotations

import time
from collections.abc import Callable


def interleaved(
    fns: dict[str, Callable[[], object]], reps: int, barrier: Callable[[], None]
) -> dict[str, list[float]]:
    """Seconds per call of every function, ``reps`` rounds, each after ``barrier()``."""
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(reps):
        r = i % len(names)
        for k in names[r:] + names[:r]:
            barrier()
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return times


def paired_line(per_rank: list[dict[str, list[float]]], label: str, skip: int = 3) -> str:
    """Medians (max over ranks per repeat) and paired ratios to ``native``, one line."""
    import statistics

    t = {
        k: [max(r[k][i] for r in per_rank) for i in range(skip, len(per_rank[0][k]))]
        for k in per_rank[0]
    }
    medians = " ".join(f"{k}={statistics.median(v) * 1e3:.2f}" for k, v in t.items())
    paired = " ".join(
        f"{k}={statistics.median(a / b for a, b in zip(t['native'], v, strict=True)):.2f}"
        for k, v in t.items()
        if k != "native"
    )
    return f"{label}: ms {medians} | paired {paired}"
