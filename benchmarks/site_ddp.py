"""A fedagg site's data-parallel step vs plain torch DDP, side by side, in one run.

For every K in ``--workers``, K fresh processes join one gloo group on 127.0.0.1
(:func:`fedagg.collectives.backends.torch_dist.run_processes`) and train the same model on
the same data with the same global batch (each worker takes its ``1/K`` slice of every global
batch, as :func:`clients.worker.train_worker` does) in every variant:

``ddp``          ``torch.nn.parallel.DistributedDataParallel`` (``gradient_as_bucket_view=True``,
                 ``bucket_cap_mb=--bucket-mb``; per-worker mean loss, DDP averages)
``<algorithm>``  the site's :class:`clients.buckets.GradReducer` (``ring``, ``tree``,
                 ``hierarchical``, ``native`` or ``auto``; loss = per-example sum / global batch,
                 sum all-reduce -- the site's loss scaling); append ``:no-overlap`` for one
                 all-reduce after backward

Every variant of a repeat starts from the same initial weights with a fresh optimizer (and
reducer / DDP wrapper); the first ``--warmup`` steps are dropped (they include DDP's and the
reducer's bucket rebuild and ``auto``'s probe, which run at the end of step 1), then
``--steps`` steps are timed after a barrier and the slowest worker's time is kept. The
variants are interleaved over ``--repeats`` (the order rotates every repeat, so slow phases of a
shared machine hit every variant). Reported: median ms per step; ``/ DDP``, the median over
repeats of (variant / DDP in the same repeat); exposed communication (time the training
thread waited for reductions after backward); buckets already reduced when backward returned;
the algorithm that ran; ``T1/TK`` and ``S(K) = T1 / (K TK)`` of each variant against the same
variant at K = 1 (fixed global batch; 1.0 = perfect scaling). References: Li et al. 2020
(PyTorch DDP, sections 3.2.3-3.2.4), He et al. 2016 (ResNet).

Usage (one torch thread per worker; the recorded figures need a quiet machine)::

    python benchmarks/site_ddp.py --workers 1,2 --repeats 5 --markdown
    python benchmarks/site_ddp.py --workers 1,2,4,8 --repeats 5 --markdown   # >= 8 cores
    python benchmarks/site_ddp.py --smoke   # K = 1, 2, every algorithm, 2 steps, digits (CI)

``--json PATH`` writes the table's rows with the command, date, machine and commit
(``benchmarks/_common.py``).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from _common import add_common, write_json
from torch import nn

from clients.buckets import GradReducer
from fedagg.collectives.backends.torch_dist import all_reduce_max, run_processes
from fedagg.data import load_dataset
from fedagg.models import build_model
from fedagg.training import batches

FEDAGG_ALGORITHMS = ("ring", "tree", "hierarchical", "native", "auto")


@dataclass(frozen=True)
class Config:
    """What every worker needs (picklable)."""

    dataset: str
    model: str
    examples: int
    batch_size: int
    steps: int
    warmup: int
    repeats: int
    variants: tuple[str, ...]
    bucket_mb: float
    first_bucket_mb: float
    comm_dtype: str
    threads: int
    lr: float
    momentum: float


def _step_indices(n: int, cfg: Config, rep: int) -> list[np.ndarray]:
    """``warmup + steps`` global batches of the seeded epoch order (cycling epochs)."""
    out: list[np.ndarray] = []
    epoch = 0
    while len(out) < cfg.warmup + cfg.steps:
        out += [b for b in batches(n, cfg.batch_size, epoch=epoch, seed=rep)
                if len(b) == cfg.batch_size]
        epoch += 1
    return out[: cfg.warmup + cfg.steps]


def _run_variant(comm: Any, cfg: Config, variant: str, base: nn.Module, xt: torch.Tensor,
                 yt: torch.Tensor, steps: list[np.ndarray]) -> dict[str, Any]:
    rank, k = comm.rank, comm.world_size
    model = copy.deepcopy(base)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    name, _, mode = variant.partition(":")
    reducer: GradReducer | None = None
    ddp: nn.Module | None = None
    if name == "ddp":
        ddp = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=cfg.bucket_mb, gradient_as_bucket_view=True,
            forward_sync_buffers=True)
    else:
        reducer = GradReducer(
            model.parameters(), comm, algorithm=name, bucket_bytes=int(cfg.bucket_mb * 2**20),
            first_bucket_bytes=int(cfg.first_bucket_mb * 2**20), overlap=mode != "no-overlap",
            comm_dtype=cfg.comm_dtype, timeout=300.0, buffers=list(model.buffers()))
    sum_loss = nn.CrossEntropyLoss(reduction="sum")
    wait0 = hidden0 = 0.0
    t0 = 0.0
    for s, idx in enumerate(steps):
        if s == cfg.warmup:
            comm.barrier()
            t0 = time.perf_counter()
            if reducer is not None:
                wait0, hidden0 = reducer.stats.wait_seconds, reducer.stats.hidden_buckets
        mine = torch.from_numpy(np.array_split(idx, k)[rank])
        xb, yb = xt[mine], yt[mine]
        opt.zero_grad(set_to_none=True)
        if ddp is not None:
            logits: torch.Tensor = ddp(xb)
            nn.functional.cross_entropy(logits, yb).backward()  # type: ignore[no-untyped-call]
        else:
            assert reducer is not None
            reducer.begin_step()
            (sum_loss(model(xb), yb) / len(idx)).backward()
            reducer.finish_step()
        opt.step()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    all_reduce_max(elapsed)
    out: dict[str, Any] = {"step_s": float(elapsed[0]) / cfg.steps}
    if reducer is not None:
        st = reducer.stats
        out.update(wait_s=(st.wait_seconds - wait0) / cfg.steps,
                   hidden=(st.hidden_buckets - hidden0) / cfg.steps, buckets=reducer.num_buckets,
                   algorithm=st.algorithm, probe=dict(st.probe))
        reducer.close()
    return out


def _bench_worker(comm: Any, cfg: Config) -> dict[str, list[dict[str, Any]]] | None:
    """One worker: every variant, interleaved over the repeats; rank 0 returns the samples."""
    torch.set_num_threads(cfg.threads)
    ds = load_dataset(cfg.dataset)
    xt = torch.from_numpy(np.ascontiguousarray(ds.x_train[: cfg.examples]))
    yt = torch.from_numpy(np.ascontiguousarray(ds.y_train[: cfg.examples]))
    base = build_model(cfg.model, ds.input_shape, ds.num_classes, seed=0)
    samples: dict[str, list[dict[str, Any]]] = {v: [] for v in cfg.variants}
    n = len(cfg.variants)
    for rep in range(cfg.repeats):
        steps = _step_indices(len(yt), cfg, rep)
        for variant in cfg.variants[rep % n:] + cfg.variants[: rep % n]:
            samples[variant].append(_run_variant(comm, cfg, variant, base, xt, yt, steps))
    return samples if comm.rank == 0 else None


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--workers", default="1,2", help="comma-separated K values")
    p.add_argument("--variants", default="ddp,ring,tree,native,auto",
                   help="ddp and GradReducer algorithms, optionally ':no-overlap'")
    p.add_argument("--dataset", default="fashion-mnist", choices=["fashion-mnist", "digits"])
    p.add_argument("--model", default="resnet")
    p.add_argument("--examples", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=64, help="global batch (all K workers)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant and repeat")
    p.add_argument("--warmup", type=int, default=3, help="dropped steps (>= 2: rebuild, probe)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's default bucket_cap_mb")
    p.add_argument("--first-bucket-mb", type=float, default=1.0, help="DDP's first bucket")
    p.add_argument("--comm-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per K")
    p.add_argument("--markdown", action="store_true")
    add_common(p)
    a = p.parse_args(argv)
    if a.smoke:  # every GradReducer algorithm and one no-overlap next to DDP, tiny sizes
        a.workers, a.dataset, a.examples, a.batch_size = "1,2", "digits", 256, 32
        a.variants = "ddp,ring,ring:no-overlap,tree,hierarchical,native,auto"
        a.steps, a.warmup, a.repeats, a.markdown = 2, 2, 1, True

    variants = tuple(v.strip() for v in a.variants.split(",") if v.strip())
    for v in variants:
        name, _, mode = v.partition(":")
        if name not in ("ddp", *FEDAGG_ALGORITHMS) or mode not in ("", "no-overlap") or (
                name == "ddp" and mode):
            p.error(f"unknown variant {v!r}: use ddp or {'/'.join(FEDAGG_ALGORITHMS)}"
                    "[:no-overlap]")
    if "ddp" not in variants:
        variants = ("ddp", *variants)
    ks = [int(k) for k in a.workers.split(",")]
    if a.warmup < 2:
        p.error("--warmup must be >= 2 (step 1 rebuilds the buckets and runs auto's probe)")
    if any(a.batch_size % k for k in ks):
        p.error(f"--batch-size {a.batch_size} must be divisible by every K in {ks}")
    cfg = Config(a.dataset, a.model, a.examples, a.batch_size, a.steps, a.warmup, a.repeats,
                 variants, a.bucket_mb, a.first_bucket_mb, a.comm_dtype, a.threads, a.lr,
                 a.momentum)
    ds = load_dataset(a.dataset)
    n_params = sum(q.numel() for q in build_model(a.model, ds.input_shape, ds.num_classes,
                                                   seed=0).parameters())
    t_start = time.time()
    results: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for k in ks:
        t_k = time.time()
        out = run_processes(k, _bench_worker, cfg, timeout=a.timeout, comm_timeout=600.0)
        results[k] = out[0]
        print(f"K={k}: {time.time() - t_k:.0f} s", file=sys.stderr, flush=True)

    head = ["K", "variant", "ms / step", "/ DDP", "exposed comm ms", "hidden buckets / step",
            "buckets", "algorithm", "T1/TK", "S(K)"]
    rows = []
    for k in ks:
        ddp_times = [s["step_s"] for s in results[k]["ddp"]]
        for v in variants:
            ss = results[k][v]
            tk = _median([s["step_s"] for s in ss])
            ratio = _median([s["step_s"] / d for s, d in zip(ss, ddp_times, strict=True)])
            t1 = _median([s["step_s"] for s in results[1][v]]) if 1 in results else None
            algs = sorted({s.get("algorithm", "") for s in ss} - {""})
            probe = ss[-1].get("probe") or {}
            alg = "/".join(algs) or "gloo"
            if probe:
                alg += " (probe " + ", ".join(f"{n} {t * 1e3:.1f}" for n, t in probe.items()) + " ms)"
            rows.append([
                str(k), v, f"{tk * 1e3:.1f}", f"{ratio:.2f}",
                f"{_median([s['wait_s'] for s in ss]) * 1e3:.1f}" if "wait_s" in ss[0] else "-",
                f"{_median([s['hidden'] for s in ss]):.1f}" if "hidden" in ss[0] else "-",
                str(ss[0].get("buckets", "-")), alg,
                f"{t1 / tk:.2f}" if t1 else "-", f"{t1 / (k * tk):.2f}" if t1 else "-",
            ])
    print(f"# site vs DDP: {a.dataset} {a.model} ({n_params:,} params), global batch "
          f"{a.batch_size}, {a.repeats} repeats x {a.steps} timed steps (+{a.warmup} warm-up), "
          f"bucket {a.bucket_mb} MB (first {a.first_bucket_mb} MB), wire {a.comm_dtype}, "
          f"{a.threads} torch thread(s) per worker, gloo on 127.0.0.1; torch {torch.__version__}, "
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
    write_json(a.json, [dict(zip(head, r, strict=True)) for r in rows], argv, params=n_params,
               samples={str(k): v for k, v in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
