"""A/B: the executor before / after posting every receive up front (session 3), vs native gloo.

``old`` is the previous ``_Run.run_pipelined`` (receives posted one step ahead), ``new`` the
current one (every receive of the call posted before the first data send). Both go through the
public ``all_reduce`` (ring, consistency header included); the three are interleaved per
iteration with the order rotated, and a call's time is the max over ranks of the medians.

Run: ``python benchmarks/experiments/allreduce_prepost_ab.py`` (spawns 2 and 4 gloo processes
on 127.0.0.1; ~1 minute). It patches session 3's interpreter loop (``_Run``), which session 4
replaced by compiled plans: run it in a checkout of commit b2a5fbc
(``git worktree add /tmp/s3 b2a5fbc && cd /tmp/s3 && PYTHONPATH=. python ...``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from fedagg.collectives import all_reduce
from fedagg.collectives import executor as ex
from fedagg.collectives.backends.torch_dist import run_processes

if not hasattr(ex, "_Run"):
    raise SystemExit(
        "this A/B needs session 3's executor (_Run); run it at commit b2a5fbc, see the docstring"
    )
NEW = ex._Run.run_pipelined


def old_run_pipelined(self: Any) -> None:
    """The executor loop before the change: step ``s + 1`` is prepared while step ``s`` runs."""
    n = len(self.prog)
    if n == 0:
        return
    self.prepare(0)
    for k in range(max(self.nseg(self.prog[0][0]), self.nseg(self.prog[0][1]))):
        self.advance(0, k)
    for s in range(n):
        if s + 1 < n:
            self.prepare(s + 1)
        items = self.posted.pop(s)
        nk = self.nseg(self.prog[s][1])
        i = 0
        for k in range(nk):
            while i < len(items) and items[i][1] == k:
                t, _, tmp, req = items[i]
                req.wait()
                self.apply(t, k, tmp)
                i += 1
            if s + 1 < n:
                self.advance(s + 1, k)
        if s + 1 < n:
            nxt = self.prog[s + 1]
            for k in range(nk, max(self.nseg(nxt[0]), self.nseg(nxt[1]))):
                self.advance(s + 1, k)
    for req, _ in self.sends:
        req.wait()


def job(comm: Any, nbytes: int, reps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    x = torch.ones(nbytes // 4)

    def run(loop: Any) -> None:
        ex._Run.run_pipelined = loop  # type: ignore[method-assign]
        all_reduce(x, algorithm="ring", comm=comm)

    fns = {
        "native": lambda: dist.all_reduce(x),
        "old": lambda: run(old_run_pipelined),
        "new": lambda: run(NEW),
    }
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(reps):
        for k in names[i % 3 :] + names[: i % 3]:
            dist.barrier()
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v[3:]) * 1e3 for k, v in times.items()}


def main() -> None:
    for world in (2, 4):
        for nbytes in (1 << 20, 16 << 20):
            reps = 100 if nbytes < (1 << 24) else 30
            per_rank = run_processes(world, job, nbytes, reps, timeout=600)
            m = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
            print(
                f"N={world} {nbytes >> 20} MB ms {({k: round(v, 2) for k, v in m.items()})} "
                f"ring x native: old {m['native'] / m['old']:.2f}, new {m['native'] / m['new']:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
