"""What the consistency header costs, N = 2 (issue 3, session 4).

One launch per size; interleaved: native gloo, ring checked with the step-0 data riding in the
header (``RIDE_BYTES`` = 1 MiB, the default), ring checked without riding (0), ring unchecked.
Prints medians (max over ranks per repeat), paired ratios to native and per-rank medians.
Run: ``python benchmarks/experiments/allreduce_header_cost.py [N]``.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fedagg.collectives.backends.torch_dist import run_processes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _interleave import interleaved


def job(comm: Any, nbytes: int, reps: int) -> dict[str, list[float]]:
    import fedagg.collectives.api as api
    import fedagg.collectives.executor as ex

    torch.set_num_threads(1)
    x = torch.ones(nbytes // 4)

    def run(ride: int, check: bool = True) -> None:
        ex.RIDE_BYTES = api.RIDE_BYTES = ride  # the plan cache is keyed by it
        api.all_reduce(x, algorithm="ring", comm=comm, check=check)

    fns = {
        "native": lambda: dist.all_reduce(x),
        "ride1M": lambda: run(1 << 20),
        "ride0": lambda: run(0),
        "nocheck": lambda: run(1 << 20, False),
    }
    return interleaved(fns, reps, comm.barrier)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    for nbytes in (4096, 1 << 20, 16 << 20):
        reps = 150 if nbytes < 1 << 24 else 30
        per = run_processes(n, job, nbytes, reps, timeout=900)
        t = {k: [max(r[k][i] for r in per) for i in range(3, reps)] for k in per[0]}
        rank_med = {
            k: statistics.median([statistics.median(r[k][3:]) for r in per]) for k in per[0]
        }
        print(
            f"N={n} {nbytes}: ms "
            + " ".join(f"{k}={statistics.median(v) * 1e3:.2f}" for k, v in t.items())
            + " | paired "
            + " ".join(
                f"{k}={statistics.median([a / b for a, b in zip(t['native'], t[k], strict=True)]):.2f}"
                for k in t
                if k != "native"
            )
            + " | per-rank ms "
            + " ".join(f"{k}={v * 1e3:.2f}" for k, v in rank_med.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
