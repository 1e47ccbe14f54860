"""A/B: the public ring all-reduce at an older commit vs the working tree, interleaved (issue 3).

Extracts ``fedagg/collectives/api.py`` and ``executor.py`` of ``REV`` (default ``b2a5fbc``, the last commit before session 4) into
a temporary directory as ``old_api`` / ``old_executor`` and runs, in one launch per point,
native gloo, the old and the new ``all_reduce`` back to back (order rotated), printing medians
(max over ranks per repeat) and the paired ratio to native. Run from the repository root:
``python benchmarks/experiments/allreduce_session4_ab.py [REV] [--tree] [--nocheck]``.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fedagg.collectives.backends.torch_dist import run_processes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _interleave import interleaved


def job(
    comm: Any, nbytes: int, reps: int, check: bool, alg: str, old_dir: str
) -> dict[str, list[float]]:
    sys.path.insert(0, old_dir)
    import old_api  # type: ignore[import-not-found]

    import fedagg.collectives.api as api

    torch.set_num_threads(1)
    x = torch.ones(nbytes // 4)
    fns = {
        "native": lambda: dist.all_reduce(x),
        "old": lambda: old_api.all_reduce(x, algorithm=alg, comm=comm, check=check),
        "new": lambda: api.all_reduce(x, algorithm=alg, comm=comm, check=check),
    }
    return interleaved(fns, reps, comm.barrier)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    rev = args[0] if args else "b2a5fbc"
    check, alg = "--nocheck" not in sys.argv, "tree" if "--tree" in sys.argv else "ring"
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("api", "executor"):
            src = subprocess.run(
                ["git", "show", f"{rev}:fedagg/collectives/{name}.py"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            src = src.replace("from fedagg.collectives.executor import", "from old_executor import")
            src = src.replace('key = ("plan", rank', 'key = ("plan-old", rank')  # own plan cache
            Path(tmp, f"old_{name}.py").write_text(src)
        for n in (2, 4):
            for nbytes in (4096, 1 << 20, 16 << 20):
                reps = 150 if nbytes < 1 << 24 else 30
                per = run_processes(n, job, nbytes, reps, check, alg, tmp, timeout=900)
                t = {k: [max(r[k][i] for r in per) for i in range(3, reps)] for k in per[0]}
                med = " ".join(f"{k}={statistics.median(v) * 1e3:.3f}" for k, v in t.items())
                paired = {
                    k: statistics.median([a / b for a, b in zip(t["native"], t[k], strict=True)])
                    for k in ("old", "new")
                }
                print(
                    f"{alg} N={n} {nbytes:>9} B ms {med}  x native (paired): "
                    f"old {paired['old']:.2f} new {paired['new']:.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
