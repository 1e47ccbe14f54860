"""Slow calls of P2P rings on gloo (issue 3, session 5): how often, and where the time goes.

Part 1, interleaved per launch (five launches): native gloo, a hand-written Python ring on the
ProcessGroup (``pg.send`` / ``pg.recv``), the C++ plan runner called directly, and the public
``all_reduce`` unchecked / checked. Prints each variant's median (max over ranks) and the share
of calls over 2 ms. Part 2: per-op timeline of the hand-written ring (4 KB), fastest calls vs
slow calls, per rank: in the slow ones the step-1 ``send`` takes ~3 ms on both ranks (gloo
writes on the calling thread holding the pair lock while its I/O thread spins on try_lock).
Run: ``python benchmarks/experiments/allreduce_slow_mode.py``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fedagg.collectives.backends.torch_dist import TorchDistCommunicator, run_processes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _interleave import interleaved


def _ring(pg: Any, r: int, x: torch.Tensor, sc: torch.Tensor, marks: list[float] | None) -> None:
    p, h = 1 - r, sc.numel()
    mine, other = slice(r * h, (r + 1) * h), slice((1 - r) * h, (2 - r) * h)

    def mark() -> None:
        if marks is not None:
            marks.append(time.perf_counter())

    mark()
    r1 = pg.recv([sc], p, 0)
    r2 = pg.recv([x[other]], p, 0)
    mark()
    s1 = pg.send([x[other]], p, 0)
    mark()
    r1.wait()
    mark()
    x[mine].add_(sc)
    mark()
    s2 = pg.send([x[mine]], p, 0)
    mark()
    r2.wait()
    mark()
    s1.wait()
    s2.wait()
    mark()


def _setup(nbytes: int) -> tuple[TorchDistCommunicator, int, Any, torch.Tensor, torch.Tensor]:
    """One torch thread; communicator, rank, process group, buffer and half-size scratch."""
    torch.set_num_threads(1)
    pg = dist.distributed_c10d._get_default_group()
    return (
        TorchDistCommunicator(),
        dist.get_rank(),
        pg,
        torch.ones(nbytes // 4),
        torch.empty(nbytes // 8),
    )


def variants(comm: Any, nbytes: int, reps: int) -> dict[str, list[float]]:
    import fedagg.collectives.api as api
    from fedagg.collectives.executor import compile_plan
    from fedagg.collectives.plan_runner import runner_for
    from fedagg.collectives.schedule import get_schedule

    comm, r, pg, x, sc = _setup(nbytes)
    plan = compile_plan(
        get_schedule("ring", 2, x.numel()),
        r,
        work_dtype=torch.float32,
        wire_dtype=torch.float32,
        segment_elems=1 << 20,
        header=False,
    )
    runner = runner_for(plan, comm, None)
    scratch = torch.empty(plan.scratch)
    fns = {
        "native": lambda: dist.all_reduce(x),
        "hand": lambda: _ring(pg, r, x, sc, None),
        "runner": lambda: runner.run(pg, r, 2, x, scratch, None, None, None, 0, 60000),
        "api_nocheck": lambda: api.all_reduce(x, algorithm="ring", comm=comm, check=False),
        "api_check": lambda: api.all_reduce(x, algorithm="ring", comm=comm),
    }
    return interleaved(fns, reps, comm.barrier)


def timeline(comm: Any, nbytes: int, reps: int) -> list[list[float]]:
    comm, r, pg, x, sc = _setup(nbytes)
    rows = []
    for _ in range(reps):
        comm.barrier()
        marks: list[float] = []
        _ring(pg, r, x, sc, marks)
        rows.append(marks)
    return rows


def main() -> None:
    for nbytes in (4096, 1 << 20):
        for launch in range(5):
            per = run_processes(2, variants, nbytes, 150)
            cells = []
            for k in per[0]:
                v = np.array(
                    [max(a, b) for a, b in zip(per[0][k][10:], per[1][k][10:], strict=True)]
                )
                cells.append(f"{k} {np.median(v) * 1e3:.2f} ms ({np.mean(v > 2e-3):.0%} > 2 ms)")
            print(f"{nbytes} B, launch {launch}: " + "; ".join(cells), flush=True)
    per = run_processes(2, timeline, 4096, 400)
    a, b = np.array(per[0][20:]), np.array(per[1][20:])
    dur = np.maximum(a[:, -1], b[:, -1]) - np.minimum(a[:, 0], b[:, 0])
    order = np.argsort(dur)
    names = ["post", "send1", "wait_r1", "add", "send2", "wait_r2", "wait_s"]
    for label, sel in (("fastest 20", order[:20]), ("slow (p87-p97)", order[-40:-10])):
        print(f"{label}: call {np.median(dur[sel]) * 1e3:.2f} ms")
        for rank, m in ((0, a), (1, b)):
            d = np.diff(m[sel], axis=1)
            print(
                f"  rank {rank}: "
                + " ".join(f"{n}={np.median(d[:, i]) * 1e3:.2f}" for i, n in enumerate(names))
            )


if __name__ == "__main__":
    main()
