"""Receives posted up front vs only when needed, hand-written N = 2 ring (issue 3, session 5).

``eager``: every receive of the call is posted before the first send (what the executor and
the C++ plan runner do): the peer's sends find them and are written on its calling thread.
``lazy``: each receive is posted right before it is waited on: the sender's message waits in
its queue until the receive notification arrives, then the sender's gloo I/O thread writes it.
Interleaved with native gloo, three launches; paired ratio = native time / variant time.
Run: ``python benchmarks/experiments/allreduce_lazy_recv.py [MB] [segments per chunk]``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fedagg.collectives.backends.torch_dist import run_processes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _interleave import interleaved


def job(comm: Any, nbytes: int, reps: int, nseg: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    r = dist.get_rank()
    p = 1 - r
    pg = dist.distributed_c10d._get_default_group()
    h = nbytes // 8
    x = torch.ones(2 * h)
    sc = torch.empty(h)
    seg = h // nseg
    mine = [slice(r * h + k * seg, r * h + (k + 1) * seg) for k in range(nseg)]
    other = [slice((1 - r) * h + k * seg, (1 - r) * h + (k + 1) * seg) for k in range(nseg)]
    scs = [sc[k * seg : (k + 1) * seg] for k in range(nseg)]

    def eager() -> None:
        r1 = [pg.recv([scs[k]], p, 0) for k in range(nseg)]
        r2 = [pg.recv([x[other[k]]], p, 0) for k in range(nseg)]
        s = [pg.send([x[other[k]]], p, 0) for k in range(nseg)]
        for k in range(nseg):
            r1[k].wait()
            x[mine[k]].add_(scs[k])
            s.append(pg.send([x[mine[k]]], p, 0))
        for w in r2 + s:
            w.wait()

    def lazy() -> None:
        s = [pg.send([x[other[k]]], p, 0) for k in range(nseg)]
        for k in range(nseg):
            pg.recv([scs[k]], p, 0).wait()
            x[mine[k]].add_(scs[k])
            s.append(pg.send([x[mine[k]]], p, 0))
        for k in range(nseg):
            pg.recv([x[other[k]]], p, 0).wait()
        for w in s:
            w.wait()

    fns = {"native": lambda: dist.all_reduce(x), "eager": eager, "lazy": lazy}
    return interleaved(fns, reps, comm.barrier)


def main() -> None:
    mb = float(sys.argv[1]) if len(sys.argv) > 1 else 16.0
    nseg = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    nbytes = int(mb * (1 << 20))
    for _ in range(3):
        per = run_processes(2, job, nbytes, 25, nseg)
        t = {
            k: np.array([max(a, b) for a, b in zip(per[0][k][3:], per[1][k][3:], strict=True)])
            for k in per[0]
        }
        print(
            f"{mb:g} MB, {nseg} segments/chunk: ms "
            + " ".join(f"{k}={np.median(v) * 1e3:.1f}" for k, v in t.items())
            + " | paired "
            + " ".join(f"{k}={np.median(t['native'] / t[k]):.2f}" for k in t if k != "native"),
            flush=True,
        )


if __name__ == "__main__":
    main()
