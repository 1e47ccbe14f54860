"""Helpers for the multi-worker site tests: real settings, real data, no mocks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from clients.faults import worker_fault
from clients.settings import NodeConfig, SiteSettings
from clients.site import run_site
from clients.site_round import SiteResult
from clients.worker import WorkerJob
from fedagg.builtin import builtin_task
from fedagg.config import RunConfig, validate_model
from fedagg.models import build_model, get_weights
from fedagg.task import SiteData


def settings(*, partition: int = 0, server_round: int = 1, **sections: dict[str, Any]) -> SiteSettings:
    """Site settings for digits, IID, 2 sites of 300 examples, 1 epoch (overridable)."""
    base: dict[str, Any] = {
        "run": {"sites": 2, "seed": 5},
        "data": {"dataset": "digits", "partitioner": "iid", "max_train_examples": 600,
                 "eval_fraction": 0.0},
        "model": {"name": "mlp"},
        "train": {"local_epochs": 1, "batch_size": 23, "lr": 0.1, "momentum": 0.9},
        "site": {"worker_timeout": 60.0},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    cfg = validate_model(RunConfig, base)
    node = NodeConfig(partition_id=partition, num_partitions=cfg.run.sites)
    return SiteSettings(cfg=cfg, node=node, server_round=server_round, node_id=partition + 1)


def local_data(s: SiteSettings) -> SiteData:
    """The site's data as the built-in task gives it."""
    return builtin_task(s.cfg).data(s.site_info())


def initial_weights(s: SiteSettings) -> list[np.ndarray]:
    shape, classes = builtin_task(s.cfg).data.shape()  # type: ignore[attr-defined]
    return get_weights(build_model(s.cfg.model.name, shape, classes, seed=11))


def job(s: SiteSettings, weights: list[np.ndarray]) -> WorkerJob:
    """The round's WorkerJob, as the ClientApp builds it."""
    return WorkerJob(task=builtin_task(s.cfg), site=s.site_info(), settings=s.train_settings(),
                     weights=weights, fault=worker_fault(s))


def train(s: SiteSettings, weights: list[np.ndarray]) -> SiteResult:
    """Train the site for one round (``site.workers`` workers), as the ClientApp does."""
    return run_site(job(s, weights), s.cfg.site, name=s.name, server_round=s.server_round)


def train_single(s: SiteSettings, weights: list[np.ndarray]) -> SiteResult:
    """The same round with one worker (the reference)."""
    one = s.cfg.model_copy(update={"site": s.cfg.site.model_copy(update={"workers": 1})})
    return train(SiteSettings(cfg=one, node=s.node, server_round=s.server_round,
                              node_id=s.node_id), weights)


def delta_rel_diff(a: list[np.ndarray], b: list[np.ndarray], w0: list[np.ndarray]) -> float:
    """||(a - w0) - (b - w0)|| / ||b - w0||: relative difference of two updates."""
    da = np.concatenate([(x - w).ravel() for x, w in zip(a, w0, strict=True)]).astype(np.float64)
    db = np.concatenate([(x - w).ravel() for x, w in zip(b, w0, strict=True)]).astype(np.float64)
    return float(np.linalg.norm(da - db) / np.linalg.norm(db))


def child_pids() -> set[int]:
    """PIDs of this process's live (non-zombie) children, from /proc."""
    me, out = os.getpid(), set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and fields[0] != "Z":
            out.add(int(d.name))
    return out



def run(s: SiteSettings, weights: list[np.ndarray], *, owner: tuple[int, int] | None = None,
        task: Any = None) -> SiteResult:
    """One round as the ClientApp runs it for Flower run/node ``owner`` (persistent pool)."""
    j = job(s, weights)
    if task is not None:
        j.task = task
    return run_site(j, s.cfg.site, name=s.name, server_round=s.server_round, owner=owner)


_owners = iter(range(10_000, 1_000_000))


def new_owner(node: int = 1) -> tuple[int, int]:
    """A Flower (run id, node id) no other test uses: its own pool in the registry."""
    return next(_owners), node


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: not gone, and not a zombie whose threads have all exited (a
    killed multi-threaded process shows its leader as a zombie while its other threads are
    still exiting; its sockets close only after them)."""
    try:
        status = (Path("/proc") / str(pid) / "status").read_text()
    except OSError:
        return False
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    zombie = fields.get("State", "").strip().startswith("Z")
    return not zombie or int(fields.get("Threads", "1").strip() or 1) > 1


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """Wait until none of ``pids`` runs; those still running after ``timeout``."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]
