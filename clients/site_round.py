"""What one site round is made of: the job with the site's options, and the result its workers
agree on.

:func:`with_site` copies the site's reducer options, device and timeout into a worker job;
:func:`site_result` checks that the workers ended the round with identical weights and builds
the site's update and metrics (listed in :mod:`clients.site`). Both the in-process site
(:func:`clients.site.run_site`) and the site worker service (:mod:`clients.service`) use them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from clients.pool import RoundInfo
from clients.worker import WorkerJob, WorkerResult
from fedagg.config import SiteConfig
from fedagg.errors import WorkerError, explain

__all__ = ["ALGORITHM_NAMES", "SiteResult", "default_device", "site_result", "with_site"]

ALGORITHM_NAMES = ("ring", "tree", "hierarchical", "native")


@dataclass
class SiteResult:
    """The site's update and metrics for one round."""

    weights: list[npt.NDArray[Any]]
    num_examples: int
    metrics: dict[str, float]
    workers: list[WorkerResult]


def default_device(site: SiteConfig) -> str:
    """``$FEDAGG_SITE_DEVICE``, else CUDA in process mode with >= K GPUs, else CPU."""
    env = os.environ.get("FEDAGG_SITE_DEVICE")
    if env:
        return env
    if site.mode != "process" or site.workers == 1:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= site.workers else "cpu"


def with_site(job: WorkerJob, site: SiteConfig, device: str) -> WorkerJob:
    """Copy the site's reducer options, device and timeout into ``job`` (in place)."""
    job.accumulation_steps = site.accumulation_steps
    job.algorithm = site.algorithm
    job.bucket_mb = site.bucket_mb
    job.overlap = site.overlap
    job.comm_dtype = site.comm_dtype
    job.keep_optimizer = site.keep_optimizer
    job.device = device
    # the site's own watchdog (worker_timeout) fires before a blocked collective gives up
    job.timeout = site.worker_timeout * 1.5 + 5.0
    return job


def site_result(results: list[WorkerResult], info: RoundInfo, wall: float, site: SiteConfig, *,
                name: str, epochs: int) -> SiteResult:
    """Check that the workers agree and build the site's update and metrics."""
    digests = {r.digest for r in results}
    if len(digests) != 1:
        raise WorkerError(explain(
            f"{name}: worker weights", f"{len(digests)} different digests over {len(results)} "
            "workers", "all workers must end the round with identical weights",
            "report this as a bug (the all-reduce must give every worker the same sums)"))
    r0 = results[0]
    if r0.weights is None:
        raise WorkerError(f"{name}: worker 0 returned no weights")
    examples = r0.site_examples if r0.site_examples is not None else sum(
        r.epoch_examples for r in results)
    return SiteResult(r0.weights, examples, _metrics(results, info, wall, site, epochs), results)


def _metrics(results: list[WorkerResult], info: RoundInfo, wall: float, site: SiteConfig,
             epochs: int) -> dict[str, float]:
    examples = sum(r.examples for r in results)
    per_epoch = [max(r.epoch_seconds[e] for r in results) for e in range(epochs)
                 if all(len(r.epoch_seconds) > e for r in results)]
    train = max(r.train_seconds for r in results)
    r0 = results[0]
    out = {
        "workers": float(len(results)),
        "workers_configured": float(site.workers),
        "workers_lost": float(info.lost),
        "workers_started": float(info.started),
        "round_attempts": float(info.attempts),
        "train_loss": sum(r.loss_sum for r in results) / max(examples, 1),
        "steps": float(r0.steps),
        "compute_seconds": max(r.compute_seconds for r in results),
        "comm_seconds": max(r.comm_seconds for r in results),
        "comm_wait_seconds": max(r.wait_seconds for r in results),
        "bytes_allreduced": float(r0.bytes_allreduced),
        "bytes_sent": float(sum(r.bytes_sent for r in results)),
        "allreduce_calls": float(r0.allreduce_calls),
        "buckets": float(r0.buckets),
        "hidden_buckets": float(r0.hidden_buckets),
        "copied_params": float(max(r.copied_params for r in results)),
        "bucket_rebuilds": float(r0.rebuilds),
        "optimizer_rounds": float(r0.optimizer_rounds),
        "epoch_seconds": float(np.mean(per_epoch)) if per_epoch else train / max(epochs, 1),
        "train_seconds": train,
        "startup_seconds": info.startup_seconds,
        "redo_seconds": info.redo_seconds,
        "overhead_seconds": max(0.0, wall - train),
        "site_seconds": wall,
    }
    for alg in ALGORITHM_NAMES:
        if alg in r0.algorithm.split("+"):
            out[f"algorithm_{alg}"] = 1.0
    if r0.auto_choice is not None:
        out["auto_native"] = 1.0 if r0.auto_choice == "native" else 0.0
    if r0.probe:
        out["probe_seconds"] = max(r.probe_seconds for r in results)
        for cand, seconds in r0.probe.items():
            label = "native" if cand == "native" else "schedule"
            out[f"probe_{label}_seconds"] = float(seconds)
    return out
