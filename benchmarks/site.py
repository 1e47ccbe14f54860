"""Multi-worker site benchmark: time per local epoch for K workers, overlap and accumulation.

Runs :class:`clients.site.SiteRuntime` (the code a site runs in every round) on a fixed data
set and model, for every K in ``--workers`` and these variants, interleaved over ``--repeats``
(the order rotates every repeat, so slow phases of a shared machine hit every variant):

``overlap``   bucketed all-reduce started from the backward hooks (batch ``--batch-size``)
``no-overlap``  one all-reduce of all gradients after backward (same batch)
``accum``     gradient accumulation: global batch ``M x --batch-size`` in M micro-batches of
              the same size as above, one all-reduce per M (DDP ``no_sync``): same compute per
              example, 1/M of the all-reduces

Time per epoch is measured inside the workers (max over workers, process start-up excluded);
epoch 0 of every run is a warm-up and dropped. Figures are medians. Scaling efficiency as the
issue defines it: ``S(K) = T1 / (K * TK)`` with ``T1``, ``TK`` the per-epoch times of the
``overlap`` variant (1.0 = perfect scaling at a fixed global batch); speedup = ``T1 / TK``.
References: Li et al. 2020 (PyTorch DDP, bucketing and overlap); Goyal et al. 2017.

Usage::

    python benchmarks/site.py --workers 1,2 --mode process --repeats 3 --markdown
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

from clients.site import SiteRuntime
from clients.worker import WorkerJob
from fedagg.builtin import BuiltinData, BuiltinModel
from fedagg.config import SiteConfig
from fedagg.data import load_dataset
from fedagg.models import build_model, get_weights
from fedagg.task import SiteInfo, Task, TrainSettings


@dataclass
class Sample:
    epoch: list[float] = field(default_factory=list)
    comm: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    calls: float = 0.0
    bytes: float = 0.0
    startup: list[float] = field(default_factory=list)


def _variants(ks: list[int], accum: int) -> list[tuple[int, str]]:
    out = []
    for k in ks:
        out.append((k, "overlap"))
        if k > 1:
            out += [(k, "no-overlap"), (k, "accum")]
    if accum <= 1:
        out = [v for v in out if v[1] != "accum"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="1,2", help="comma-separated K values")
    p.add_argument("--mode", choices=["process", "inprocess"], default="process")
    p.add_argument("--dataset", default="digits", choices=["digits", "fashion-mnist"])
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn", "logreg"])
    p.add_argument("--examples", type=int, default=1400)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=3, help="per run; epoch 0 is dropped")
    p.add_argument("--accumulation", type=int, default=4, help="M for the accum variant")
    p.add_argument("--bucket-mb", type=float, default=0.025)
    p.add_argument("--algorithm", default="ring")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default=None, help="cpu or cuda (default: SiteRuntime's choice)")
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args(argv)

    ks = [int(k) for k in a.workers.split(",")]
    ds = load_dataset(a.dataset)
    data = BuiltinData(dataset=a.dataset, partitioner="iid", min_size=1, max_train=a.examples,
                       eval_fraction=0.0)  # the first --examples examples, one site
    task = Task(model=BuiltinModel(a.model, data), data=data)
    w0 = get_weights(build_model(a.model, ds.input_shape, ds.num_classes, seed=0))
    n_params = sum(w.size for w in w0)
    variants = _variants(ks, a.accumulation)
    samples = {v: Sample() for v in variants}
    t_start = time.time()
    for rep in range(a.repeats):
        order = variants[rep % len(variants):] + variants[: rep % len(variants)]
        for k, name in order:
            m = a.accumulation if name == "accum" else 1
            site = SiteConfig(workers=k, mode=a.mode, algorithm=a.algorithm, bucket_mb=a.bucket_mb,
                              overlap=name != "no-overlap", accumulation_steps=m,
                              worker_timeout=600.0)
            job = WorkerJob(task=task, site=SiteInfo(0, 1, name="bench"), weights=w0,
                            settings=TrainSettings(epochs=a.epochs, batch_size=a.batch_size * m,
                                                   lr=0.05, momentum=0.9, seed=rep))
            res = SiteRuntime(site, name="bench", device=a.device).run(job)
            s = samples[(k, name)]
            per_epoch = [max(w.epoch_seconds[e] for w in res.workers) for e in range(a.epochs)]
            s.epoch += per_epoch[1:] if a.epochs > 1 else per_epoch
            s.comm.append(res.metrics["comm_seconds"] / a.epochs)
            s.wait.append(res.metrics["comm_wait_seconds"] / a.epochs)
            s.calls = res.metrics["allreduce_calls"] / a.epochs
            s.bytes = res.metrics["bytes_allreduced"] / a.epochs
            s.startup.append(res.metrics["startup_seconds"])
            print(f"rep {rep} K={k} {name:<10} epoch {statistics.median(per_epoch[1:] or per_epoch):.3f} s "
                  f"startup {res.metrics['startup_seconds']:.1f} s", file=sys.stderr, flush=True)

    t1 = statistics.median(samples[(1, "overlap")].epoch) if (1, "overlap") in samples else None
    rows = []
    for k, name in variants:
        s = samples[(k, name)]
        tk = statistics.median(s.epoch)
        same = statistics.median(samples[(k, "overlap")].epoch)
        eff = f"{t1 / (k * tk):.2f}" if t1 and name == "overlap" else "-"
        speed = f"{t1 / tk:.2f}" if t1 and name == "overlap" else "-"
        rows.append([str(k), name, f"{tk * 1e3:.1f}", f"{tk / same:.2f}",
                     f"{statistics.median(s.comm) * 1e3:.1f}", f"{statistics.median(s.wait) * 1e3:.1f}",
                     f"{s.calls:.0f}", f"{s.bytes / 1e6:.2f}", f"{statistics.median(s.startup):.1f}",
                     speed, eff])
    head = ["K", "variant", "ms / epoch", "x overlap", "comm ms / epoch", "exposed comm ms",
            "all-reduces / epoch", "MB all-reduced / epoch", "start-up s", "T1/TK", "S(K)"]
    print(f"# {a.mode} mode, {a.dataset} {a.model} ({n_params} params), {a.examples} examples, "
          f"batch {a.batch_size}, accum M={a.accumulation}, bucket {a.bucket_mb} MB, {a.algorithm}, "
          f"{a.repeats} repeats x {a.epochs - 1 if a.epochs > 1 else 1} timed epochs; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}, {time.time() - t_start:.0f} s")
    if a.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        for r in [head, *rows]:
            print("  ".join(f"{c:>12}" for c in r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
