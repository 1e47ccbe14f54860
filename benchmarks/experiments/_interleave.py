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
