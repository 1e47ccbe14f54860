"""Where a call spends its time: the executor vs a bare pre-posted ring, N = 2 (issue 3).

Times the same ``dist.isend`` / ``dist.irecv`` / ``wait`` calls in both paths (summed per call,
averaged over 200 interleaved calls of 1 MB, ``check=False``) plus the call's median.
Run: ``python benchmarks/experiments/allreduce_phases.py``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import fedagg.collectives.backends.torch_dist as td
from fedagg.collectives import all_reduce

WAIT = timedelta(seconds=60)
acc: dict[str, float] = {}


def timed(name: str, f: Callable[..., Any], *a: Any) -> Any:
    t0 = time.perf_counter()
    out = f(*a)
    acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0
    return out


def bare(x: torch.Tensor, sc: torch.Tensor) -> None:
    p = 1 - dist.get_rank()
    h = x.numel() // 2
    mine, other = (x[:h], x[h:]) if dist.get_rank() == 0 else (x[h:], x[:h])
    buf = sc[:h]
    q1 = timed("bare recv", dist.irecv, buf, p)
    q2 = timed("bare recv", dist.irecv, other, p)
    s1 = timed("bare send", dist.isend, other, p)
    timed("bare wait", q1.wait, WAIT)
    mine.add_(buf)
    s2 = timed("bare send", dist.isend, mine, p)
    for w in (q2, s1, s2):
        timed("bare wait", w.wait, WAIT)


def job(comm: Any, nbytes: int, reps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    cls, work = type(comm), td._Work
    isend, irecv, wait = cls.isend, cls.irecv, work.wait
    cls.isend = lambda self, t, d: timed("ours send", isend, self, t, d)
    cls.irecv = lambda self, t, s: timed("ours recv", irecv, self, t, s)
    work.wait = lambda self: timed("ours wait", wait, self)
    x = torch.ones(nbytes // 4)
    sc = torch.empty(nbytes // 4)
    calls: dict[str, list[float]] = {"bare": [], "ours": []}
    for i in range(reps):
        for k in ("bare", "ours") if i % 2 else ("ours", "bare"):
            dist.barrier()
            t0 = time.perf_counter()
            if k == "bare":
                bare(x, sc)
            else:
                all_reduce(x, algorithm="ring", comm=comm, check=False)
            calls[k].append(time.perf_counter() - t0)
    out = {f"{k} call": statistics.median(v) * 1e3 for k, v in calls.items()}
    out.update({k: v / reps * 1e3 for k, v in acc.items()})
    return out


def main() -> None:
    for rank, res in enumerate(td.run_processes(2, job, 1 << 20, 200, timeout=600)):
        print(f"rank {rank} (ms per call):", {k: round(v, 3) for k, v in res.items()})


if __name__ == "__main__":
    main()
