"""Costs around the C++ plan runner (issue 3, session 5).

1. Python time per ``all_reduce`` call outside the runner (median over 300 calls, N = 2, each
   rank): total call time minus the time inside ``TorchDistCommunicator.run_plan``.
2. CPU used by each thread of a rank during 5 s of back-to-back 4 KB all-reduces (native gloo,
   then ``all_reduce`` on the runner), from /proc/<pid>/task/*/stat: how busy gloo's I/O
   thread (``gloo_tcp_loop``) is.
3. Loading the built runner in a fresh process (``plan_runner.load()``), five processes.
Run: ``python benchmarks/experiments/allreduce_runner_overhead.py``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fedagg.collectives.backends.torch_dist import TorchDistCommunicator, run_processes


def outside_runner(comm: Any, nbytes: int, reps: int, check: bool) -> tuple[float, float]:
    import fedagg.collectives.api as api
    import fedagg.collectives.backends.torch_dist as td

    torch.set_num_threads(1)
    comm = TorchDistCommunicator()
    x = torch.ones(nbytes // 4)
    inner: list[float] = []
    run_plan = td.TorchDistCommunicator.run_plan

    def timed(self: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return run_plan(self, *args)
        finally:
            inner.append(time.perf_counter() - t0)

    td.TorchDistCommunicator.run_plan = timed  # type: ignore[method-assign]
    outer = []
    for _ in range(reps):
        comm.barrier()
        t0 = time.perf_counter()
        api.all_reduce(x, algorithm="ring", comm=comm, check=check)
        outer.append(time.perf_counter() - t0)
    rest = [o - i for o, i in zip(outer[10:], inner[10:], strict=True)]
    return statistics.median(outer[10:]) * 1e6, statistics.median(rest) * 1e6


def _thread_ticks() -> dict[str, int]:
    out: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            task = Path(f"/proc/{os.getpid()}/task/{tid}")
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        out[f"{name}:{tid}"] = int(stat[11]) + int(stat[12])
    return out


def thread_cpu(comm: Any, mode: str, seconds: float) -> tuple[int, dict[str, float]]:
    import fedagg.collectives.api as api

    torch.set_num_threads(1)
    comm = TorchDistCommunicator()
    x = torch.ones(1024)
    if mode == "native":
        call: Any = lambda: dist.all_reduce(x)  # noqa: E731
    else:
        call = lambda: api.all_reduce(x, algorithm="ring", comm=comm, check=False)  # noqa: E731
    for _ in range(50):
        comm.barrier()
        call()
    before, calls, end = _thread_ticks(), 0, time.time() + seconds
    while time.time() < end:
        comm.barrier()
        call()
        calls += 1
    after = _thread_ticks()
    hz = os.sysconf("SC_CLK_TCK")
    share = {k: (v - before.get(k, 0)) / hz / seconds for k, v in after.items()}
    return calls, {k: round(v, 2) for k, v in share.items() if v > 0.01}


def main() -> None:
    for nbytes in (4096, 1 << 20):
        for check in (False, True):
            per = run_processes(2, outside_runner, nbytes, 300, check)
            print(
                f"{nbytes} B check={check}: per rank (call us, Python outside the runner us) "
                + ", ".join(f"({a:.0f}, {b:.0f})" for a, b in per),
                flush=True,
            )
    for mode in ("native", "runner"):
        for rank, (calls, share) in enumerate(run_processes(2, thread_cpu, mode, 5.0)):
            print(f"{mode}, rank {rank}: {calls} calls in 5 s; share of a core {share}", flush=True)
    probe = "import torch, time; from fedagg.collectives import plan_runner; t = time.perf_counter(); plan_runner.load(); print(time.perf_counter() - t)"
    loads = [
        float(subprocess.check_output([sys.executable, "-c", probe], text=True)) for _ in range(5)
    ]
    print("plan_runner.load() in a fresh process, s: " + " ".join(f"{v:.3f}" for v in loads))


if __name__ == "__main__":
    main()
