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

import torch
import torch.distributed as dist

from fedagg.collectives.backends.torch_dist import run_processes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _hand_ring import HandRing
from _interleave import interleaved, paired_line


def job(comm: Any, nbytes: int, reps: int, nseg: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    pg = dist.distributed_c10d._get_default_group()
    ring = HandRing(dist.get_rank(), nbytes, nseg)
    fns = {
        "native": lambda: dist.all_reduce(ring.x),
        "eager": lambda: ring.eager(pg, pg),
        "lazy": lambda: ring.lazy(pg),
    }
    return interleaved(fns, reps, comm.barrier)


def main() -> None:
    mb = float(sys.argv[1]) if len(sys.argv) > 1 else 16.0
    nseg = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    nbytes = int(mb * (1 << 20))
    for _ in range(3):
        per = run_processes(2, job, nbytes, 25, nseg)
        print(paired_line(per, f"{mb:g} MB, {nseg} segments/chunk"), flush=True)


if __name__ == "__main__":
    main()
