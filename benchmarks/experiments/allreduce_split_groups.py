"""One gloo group per direction vs one group, hand-written N = 2 ring (issue 3, session 5).

gloo's tcp pair writes a send on the calling thread under the pair's mutex while its I/O thread,
woken by the peer's data, spins on ``try_lock`` of the same mutex. With two process groups,
messages from the lower to the higher rank on one and the other way on the other, a rank's
writes and its incoming data use different pairs, mutexes and I/O threads. Interleaved with
native gloo (one group), three launches; the ring posts every receive up front and runs as a
wavefront over ``SEG`` segments per chunk. Paired ratio = native time / variant time.
Run: ``python benchmarks/experiments/allreduce_split_groups.py [MB,...] [segments per chunk]``.
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
    r = dist.get_rank()
    one = dist.distributed_c10d._get_default_group()
    up, down = dist.new_group([0, 1]), dist.new_group([0, 1])  # up: 0 -> 1, down: 1 -> 0
    out_pg, in_pg = (up, down) if r == 0 else (down, up)
    ring = HandRing(r, nbytes, nseg)
    fns = {
        "native": lambda: dist.all_reduce(ring.x),
        "one_group": lambda: ring.eager(one, one),
        "split": lambda: ring.eager(out_pg, in_pg),
    }
    return interleaved(fns, reps, comm.barrier)


def main() -> None:
    sizes = [float(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "1,16").split(",")]
    nseg = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    for mb in sizes:
        nbytes = int(mb * (1 << 20))
        reps = 100 if nbytes <= 1 << 20 else 25
        for _ in range(3):
            per = run_processes(2, job, nbytes, reps, nseg)
            print(paired_line(per, f"{mb:g} MB, {nseg} segments/chunk"), flush=True)


if __name__ == "__main__":
    main()
