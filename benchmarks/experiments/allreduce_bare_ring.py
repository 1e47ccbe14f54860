"""N = 2 hand-written rings vs native gloo, interleaved per iteration (issue 3, session 3).

``stepwise`` posts each step's receive just before its send; ``prepost`` posts every receive
of the call first (``prepost_tag``: with a tag per step); ``seg2M``: prepost in 2 MB segments
with the all-gather send of a segment right after its reduction; ``ours``: the public
``all_reduce`` (ring), with and without the consistency header. Times are medians per rank,
the max over the two ranks. Run: ``python benchmarks/experiments/allreduce_bare_ring.py``.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fedagg.collectives import all_reduce
from fedagg.collectives.backends.torch_dist import run_processes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _interleave import interleaved


def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.numel() // 2
    return (x[:h], x[h:]) if dist.get_rank() == 0 else (x[h:], x[:h])


def stepwise(x: torch.Tensor, sc: torch.Tensor) -> None:
    p = 1 - dist.get_rank()
    mine, other = halves(x)
    buf = sc[: mine.numel()]
    s = dist.isend(other, p)
    q = dist.irecv(buf, p)
    q.wait()
    mine.add_(buf)
    s.wait()
    s = dist.isend(mine, p)
    q = dist.irecv(other, p)
    q.wait()
    s.wait()


def prepost(x: torch.Tensor, sc: torch.Tensor, seg: int = 0, tags: bool = False) -> None:
    p = 1 - dist.get_rank()
    mine, other = halves(x)
    m = mine.numel()
    seg = seg or m
    buf = sc[:m]
    t1, t2 = (1, 2) if tags else (0, 0)
    starts = range(0, m, seg)
    q1 = [dist.irecv(buf[a : a + seg], p, tag=t1) for a in starts]
    q2 = [dist.irecv(other[a : a + seg], p, tag=t2) for a in starts]
    s1 = [dist.isend(other[a : a + seg], p, tag=t1) for a in starts]
    s2 = []
    for a, q in zip(starts, q1, strict=True):
        q.wait()
        mine[a : a + seg].add_(buf[a : a + seg])
        s2.append(dist.isend(mine[a : a + seg], p, tag=t2))
    for w in q2 + s1 + s2:
        w.wait()


def job(comm: Any, nbytes: int, reps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    x = torch.ones(nbytes // 4)
    sc = torch.empty(nbytes // 4)
    fns = {
        "native": lambda: dist.all_reduce(x),
        "stepwise": lambda: stepwise(x, sc),
        "prepost": lambda: prepost(x, sc),
        "prepost_tag": lambda: prepost(x, sc, tags=True),
        "seg2M": lambda: prepost(x, sc, seg=1 << 19, tags=True),
        "ours": lambda: all_reduce(x, algorithm="ring", comm=comm),
        "ours_nocheck": lambda: all_reduce(x, algorithm="ring", comm=comm, check=False),
    }
    times = interleaved(fns, reps, dist.barrier)
    return {k: statistics.median(v[3:]) * 1e3 for k, v in times.items()}


def main() -> None:
    for nbytes in (4096, 1 << 20, 16 << 20):
        per_rank = run_processes(2, job, nbytes, 200 if nbytes < 1 << 24 else 40, timeout=600)
        m = {k: round(max(r[k] for r in per_rank), 3) for k in per_rank[0]}
        print(nbytes, "bytes, ms:", m, flush=True)


if __name__ == "__main__":
    main()
