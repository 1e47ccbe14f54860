"""Pinning each rank to one vCPU vs leaving placement to the scheduler (issue 3, session 4).

For each size, six fresh launches alternate unpinned / pinned (``os.sched_setaffinity`` of rank
``r`` to CPU ``r % cpu_count``, so a rank's Python thread and gloo I/O thread share a core);
each launch interleaves native gloo and the public ring. Prints per launch the medians (max
over ranks per repeat) and the paired ratio. Run:
``python benchmarks/experiments/allreduce_pinning.py [N]``.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fedagg.collectives.backends.torch_dist import run_processes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _interleave import interleaved


def job(comm: Any, nbytes: int, reps: int, pin: bool) -> dict[str, list[float]]:
    import fedagg.collectives.api as api

    if pin:
        os.sched_setaffinity(0, {comm.rank % (os.cpu_count() or 1)})
    torch.set_num_threads(1)
    x = torch.ones(nbytes // 4)
    fns = {
        "native": lambda: dist.all_reduce(x),
        "ring": lambda: api.all_reduce(x, algorithm="ring", comm=comm),
    }
    return interleaved(fns, reps, comm.barrier)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    for nbytes in (65536, 1 << 20, 16 << 20):
        reps = 100 if nbytes < 1 << 24 else 20
        out = []
        for pin in (False, True) * 3:
            per = run_processes(n, job, nbytes, reps, pin, timeout=900)
            t = {k: [max(r[k][i] for r in per) for i in range(3, reps)] for k in per[0]}
            paired = statistics.median([a / b for a, b in zip(t["native"], t["ring"], strict=True)])
            out.append(
                f"pin={int(pin)} native {statistics.median(t['native']) * 1e3:.2f} "
                f"ring {statistics.median(t['ring']) * 1e3:.2f} x{paired:.2f}"
            )
        print(f"N={n} {nbytes}: " + " | ".join(out), flush=True)


if __name__ == "__main__":
    main()
