"""A fedagg site vs plain torch DDP, in one run and interleaved: time per epoch, S(K), round
overhead of persistent workers.

For every K in ``--workers`` and every variant in ``--variants`` (interleaved over
``--repeats``; the order rotates every repeat, so slow phases of a shared machine hit every
variant), one *round* trains ``--epochs`` epochs of the same model on the same data with the
same global batch and the same torch threads per worker (``--threads``, default 1):

``overlap``     the site as ``run_site`` runs it in every round (:mod:`clients.site`): a
                persistent pool (``site.persistent``) of K worker processes (``--mode
                process``, gloo on 127.0.0.1; K = 1 trains in this process), the bucketed
                all-reduce started from the backward hooks (``site.algorithm``, ``auto``
                by default), each round sending only the global weights and settings
``no-overlap``  the same with one all-reduce of all gradients after backward
``accum``       gradient accumulation: global batch ``M x --batch-size`` in M micro-batches,
                one all-reduce per M (DDP ``no_sync``)
``ddp``         plain ``torch.nn.parallel.DistributedDataParallel`` in K fresh gloo
                processes (``gradient_as_bucket_view=True``, ``bucket_cap_mb=--bucket-mb``),
                each worker taking its ``1/K`` slice of the same seeded global batches
                (:func:`fedagg.task.global_batches`), mean loss (DDP averages)

Time per epoch is measured inside the workers (slowest worker), epoch 0 of every round is
dropped (warm-up; round 1 of a pool also holds the bucket rebuild and ``auto``'s probe);
figures are medians. ``/ DDP`` is the median over repeats of (variant / DDP at the same K in
the same repeat). ``S(K) = T1 / (K TK)`` against the same family at K = 1 (fedagg: the
one-worker site; DDP: one DDP process), 1.0 = perfect scaling at a fixed global batch.
``round overhead`` is a round's time outside local training (start-up, weight hand-off,
reply: ``overhead_seconds``) from round 2 on; ``--fresh`` adds one round per K on fresh
workers (``site.persistent = false``) for the start-up it costs; ``--service`` sends the
fedagg rounds with K > 1 through a ``fedagg site-workers`` service started for the run (the
deployment path: one more hand-off, ClientApp process -> service -> workers). References: Li et al. 2020
(PyTorch DDP, sections 3.2-4); He et al. 2016 (ResNet); Goyal et al. 2017.

Usage::

    python benchmarks/site.py --workers 1,2 --repeats 3 --fresh --markdown        # 2 cores
    python benchmarks/site.py --workers 1,2,4,8 --repeats 5 --fresh --markdown    # >= 8 cores
    python benchmarks/site.py --smoke    # every variant, K = 1, 2, digits MLP, --fresh (CI)

``--json PATH`` writes the table's rows with the command, date, machine and commit
(``benchmarks/_common.py``).
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import add_common, write_json

from clients.pools import close_pools
from clients.site import run_site
from clients.worker import WorkerJob
from fedagg.builtin import BuiltinData, BuiltinModel
from fedagg.collectives.backends.torch_dist import all_reduce_max, run_processes
from fedagg.config import SiteConfig
from fedagg.models import build_model, get_weights
from fedagg.task import SiteInfo, Task, TrainSettings, global_batches

VARIANTS = ("overlap", "no-overlap", "accum", "ddp")
_RUN_ID = 16


@dataclass
class Sample:
    epoch: list[float] = field(default_factory=list)      # per repeat: median s / epoch
    wait: list[float] = field(default_factory=list)
    hidden: list[float] = field(default_factory=list)
    overhead: list[float] = field(default_factory=list)   # rounds >= 2
    startup: list[float] = field(default_factory=list)    # round 1
    algorithm: str = ""


@dataclass(frozen=True)
class DdpConfig:
    """What every DDP worker needs (picklable)."""

    data: BuiltinData
    model: str
    batch_size: int
    epochs: int
    seed: int
    lr: float
    momentum: float
    bucket_mb: float
    threads: int


def _ddp_worker(comm: Any, cfg: DdpConfig) -> list[float] | None:
    """One DDP worker: ``cfg.epochs`` epochs; rank 0 returns the slowest worker's epoch times."""
    from torch import nn

    torch.set_num_threads(cfg.threads)
    rank, k = comm.rank, comm.world_size
    site = cfg.data(SiteInfo(0, 1, name="bench"))
    assert site.train is not None
    x, y = site.train.tensors  # type: ignore[attr-defined]
    shape, classes = cfg.data.shape()
    model = build_model(cfg.model, shape, classes, seed=0)
    model.train()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_mb,
                                              gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    times = []
    for epoch in range(cfg.epochs):
        comm.barrier()
        t0 = time.perf_counter()
        for idx in global_batches(len(y), cfg.batch_size, epoch=epoch, seed=cfg.seed):
            mine = torch.from_numpy(np.ascontiguousarray(np.array_split(idx, k)[rank]))
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(ddp(x[mine]), y[mine]).backward()
            opt.step()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        all_reduce_max(elapsed)
        times.append(float(elapsed[0]))
    return times if rank == 0 else None


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--workers", default="1,2", help="comma-separated K values")
    p.add_argument("--variants", default="overlap,no-overlap,ddp",
                   help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--mode", choices=["process", "inprocess"], default="process")
    p.add_argument("--dataset", default="fashion-mnist", choices=["digits", "fashion-mnist"])
    p.add_argument("--model", default="resnet", choices=["mlp", "cnn", "logreg", "resnet", "2nn"])
    p.add_argument("--examples", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=64, help="global batch (all K workers)")
    p.add_argument("--epochs", type=int, default=2, help="per round; epoch 0 is dropped")
    p.add_argument("--accumulation", type=int, default=4, help="M for the accum variant")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="site.bucket_mb = DDP's bucket_cap_mb")
    p.add_argument("--algorithm", default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--repeats", type=int, default=3, help="rounds per variant and K")
    p.add_argument("--fresh", action="store_true",
                   help="also one round per K on fresh workers (site.persistent = false)")
    p.add_argument("--service", action="store_true",
                   help="K > 1: train through a fedagg site-workers service (deployment path)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--markdown", action="store_true")
    add_common(p)
    a = p.parse_args(argv)
    if a.smoke:  # every variant and fresh workers, tiny: 256 digits, an MLP, 2 rounds per cell
        a.workers, a.variants, a.examples, a.repeats = "1,2", ",".join(VARIANTS), 256, 2
        a.model, a.dataset, a.batch_size, a.fresh, a.markdown = "mlp", "digits", 32, True, True

    ks = [int(k) for k in a.workers.split(",")]
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}: use {', '.join(VARIANTS)}")
    if any(a.batch_size % k for k in ks):
        p.error(f"--batch-size {a.batch_size} must be divisible by every K in {ks}")
    torch.set_num_threads(a.threads)  # the K = 1 site trains in this process
    data = BuiltinData(dataset=a.dataset, partitioner="iid", min_size=1, max_train=a.examples,
                       eval_fraction=0.0)  # the first --examples examples, one site
    task = Task(model=BuiltinModel(a.model, data), data=data)
    shape, classes = data.shape()
    w0 = get_weights(build_model(a.model, shape, classes, seed=0))
    n_params = sum(w.size for w in w0)
    cells = [(k, v) for k in ks for v in variants if not (k == 1 and v in ("no-overlap", "accum"))]
    samples = {c: Sample() for c in cells}
    fresh: dict[int, float] = {}
    t_start = time.time()
    load = [os.getloadavg()[0]]

    def fedagg_round(k: int, variant: str, rep: int, persistent: bool = True) -> Any:
        m = a.accumulation if variant == "accum" else 1
        site = SiteConfig(workers=k, mode=a.mode, algorithm=a.algorithm, bucket_mb=a.bucket_mb,  # type: ignore[arg-type]
                          overlap=variant != "no-overlap", accumulation_steps=m,
                          worker_timeout=600.0, persistent=persistent)
        job = WorkerJob(task=task, site=SiteInfo(0, 1, name="bench"), weights=w0,
                        threads=a.threads,
                        settings=TrainSettings(epochs=a.epochs, batch_size=a.batch_size * m,
                                               lr=a.lr, momentum=a.momentum, seed=rep,
                                               server_round=rep + 1))
        node = 100 * k + VARIANTS.index(variant)
        return run_site(job, site, name=f"bench-k{k}-{variant}", server_round=rep + 1,
                        owner=(_RUN_ID, node),
                        worker_service=str(sock) if service and k > 1 and persistent else None)

    service = sock = None
    if a.service:
        private = Path(tempfile.mkdtemp(prefix="fedagg-bench-svc-"))
        sock = private / "workers.sock"
        service = subprocess.Popen([sys.executable, "-m", "fedagg.cli", "site-workers",
                                    "--socket", str(sock), "--threads", str(a.threads)],
                                   stderr=subprocess.DEVNULL)
        while not sock.exists():
            if service.poll() is not None:
                p.error("the worker service did not start")
            time.sleep(0.1)
    try:
        for rep in range(a.repeats):
            order = cells[rep % len(cells):] + cells[: rep % len(cells)]
            for k, variant in order:
                s = samples[(k, variant)]
                if variant == "ddp":
                    cfg = DdpConfig(data, a.model, a.batch_size, a.epochs, rep, a.lr,
                                    a.momentum, a.bucket_mb, a.threads)
                    times = run_processes(k, _ddp_worker, cfg, timeout=7200.0,
                                          comm_timeout=600.0)[0]
                    s.epoch.append(_median(times[1:] or times))
                    s.algorithm = "DDP (gloo)"
                else:
                    res = fedagg_round(k, variant, rep)
                    per = [max(w.epoch_seconds[e] for w in res.workers) for e in range(a.epochs)]
                    met = res.metrics
                    s.epoch.append(_median(per[1:] or per))
                    s.wait.append(met["comm_wait_seconds"] / a.epochs)
                    s.hidden.append(met["hidden_buckets"] / max(met["steps"], 1.0))
                    (s.overhead if rep else s.startup).append(met["overhead_seconds"])
                    algs = [x for x in ("ring", "tree", "hierarchical", "native")
                            if met.get(f"algorithm_{x}")]
                    s.algorithm = "+".join(algs) or ("-" if k == 1 else "?")
                load.append(os.getloadavg()[0])
                print(f"rep {rep} K={k} {variant:<10} {s.epoch[-1]:.3f} s / epoch", file=sys.stderr,
                      flush=True)
        if a.fresh:
            for k in ks:
                if k > 1:
                    fresh[k] = fedagg_round(k, "overlap", a.repeats, persistent=False
                                            ).metrics["overhead_seconds"]
    finally:
        close_pools(_RUN_ID)
        if service is not None:
            service.send_signal(signal.SIGTERM)
            service.wait(60)

    head = ["K", "variant", "ms / epoch", "/ DDP", "exposed comm ms / epoch (all epochs)",
            "hidden buckets / step", "algorithm", "T1/TK", "S(K)", "round overhead s (r>=2)",
            "round 1 s"]
    rows = []
    for k, variant in cells:
        s = samples[(k, variant)]
        tk = _median(s.epoch)
        ddp = samples.get((k, "ddp"))
        ratio = (_median([x / d for x, d in zip(s.epoch, ddp.epoch, strict=True)])
                 if ddp is not None and variant != "ddp" else None)
        base = samples.get((1, "ddp" if variant == "ddp" else "overlap"))
        t1 = _median(base.epoch) if base is not None else None
        rows.append([
            str(k), variant, f"{tk * 1e3:.0f}", f"{ratio:.3f}" if ratio is not None else "-",
            f"{_median(s.wait) * 1e3:.0f}" if s.wait else "-",
            f"{_median(s.hidden):.2f}" if s.hidden else "-", s.algorithm,
            f"{t1 / tk:.2f}" if t1 else "-", f"{t1 / (k * tk):.2f}" if t1 else "-",
            f"{_median(s.overhead):.3f}" if s.overhead else "-",
            f"{_median(s.startup):.2f}" if s.startup else "-",
        ])
    print(f"# {a.mode} mode{' via fedagg site-workers' if a.service else ''}, {a.dataset} {a.model} ({n_params:,} params), {a.examples} examples, "
          f"global batch {a.batch_size}, {a.epochs} epochs per round (epoch 0 dropped), "
          f"{a.repeats} rounds per cell, bucket {a.bucket_mb} MB, algorithm {a.algorithm}, "
          f"accum M={a.accumulation}, {a.threads} torch thread(s) per worker; torch "
          f"{torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {min(load):.1f}-{max(load):.1f} (median "
          f"{statistics.median(load):.1f}), {time.time() - t_start:.0f} s")
    if fresh:
        print("# fresh workers (site.persistent = false), one round: overhead "
              + ", ".join(f"K={k} {v:.2f} s" for k, v in fresh.items()))
    if a.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        for r in [head, *rows]:
            print("  ".join(f"{c:>10}" for c in r))
    write_json(a.json, [dict(zip(head, r, strict=True)) for r in rows], argv,
               fresh_overhead_seconds=fresh, params=n_params)
    return 0


if __name__ == "__main__":
    sys.exit(main())
