"""The registry of a process's persistent site worker pools: one per site, kept across rounds.

:func:`pool_for` keeps one pool per site keyed by :class:`PoolKey` = (Flower run id, node id,
task identity), so two simulated sites served by one ClientApp host (a Ray actor) never share
a pool, and a new run or task gets fresh workers; a pool whose shape changed is closed and
started anew. :func:`make_pool` makes one of ``site.mode`` (threads:
:class:`clients.pool.ThreadPool`; processes: :class:`clients.pool_proc.ProcessPool`). Pools
idle for ``site.pool_idle_timeout`` seconds are closed by a reaper thread, and all of them at
interpreter exit (:func:`close_pools`). In deployment the registry lives in the site's worker
service (:mod:`clients.service`).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import pickle
import threading
import time
from dataclasses import dataclass

from clients.pool import ThreadPool, WorkerPool, pool_shape
from clients.pool_proc import ProcessPool
from fedagg.config import SiteConfig
from fedagg.task import Task

__all__ = ["PoolKey", "close_pools", "live_pools", "make_pool", "pool_for", "task_identity"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolKey:
    """Which site's pool: Flower run id, node id and the task's identity."""

    run_id: int
    node_id: int
    task: str


def task_identity(task: Task) -> tuple[str, bytes | None]:
    """``(identity, pickled task)``: SHA-256 of the pickled task (``id`` if unpicklable)."""
    try:
        blob = pickle.dumps(task)
    except (pickle.PicklingError, AttributeError, TypeError):
        return f"object-{id(task):x}", None
    return hashlib.sha256(blob).hexdigest()[:32], blob


def make_pool(site: SiteConfig, *, name: str, device: str, task_blob: bytes | None = None,
              sys_path: list[str] | None = None) -> WorkerPool:
    """A new pool of ``site.workers`` workers in ``site.mode`` (started at its first round)."""
    if site.mode == "process":
        return ProcessPool(site, name=name, device=device, task_blob=task_blob, sys_path=sys_path)
    return ThreadPool(site, name=name, device=device)


_POOLS: dict[PoolKey, WorkerPool] = {}
_POOLS_LOCK = threading.Lock()
_reaper: threading.Thread | None = None


def pool_for(key: PoolKey, site: SiteConfig, *, name: str, device: str,
             task_blob: bytes | None = None, sys_path: list[str] | None = None) -> WorkerPool:
    """The site's persistent pool for ``key`` (made on first use, rebuilt if its shape changed)."""
    global _reaper
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is not None and (pool.closed or pool.shape != pool_shape(site, device)):
            _log.info("%s: worker pool %s, starting a new one", name,
                      "was closed" if pool.closed else "changed shape")
            with pool.lock:
                pool.close()
            pool = None
        if pool is None:
            pool = make_pool(site, name=name, device=device, task_blob=task_blob,
                             sys_path=sys_path)
            _POOLS[key] = pool
        pool.site = site  # elasticity and timeouts of this round's config
        if _reaper is None or not _reaper.is_alive():
            _reaper = threading.Thread(target=_reap_idle, name="fedagg-pool-reaper", daemon=True)
            _reaper.start()
        return pool


def close_pools(run_id: int | None = None) -> int:
    """Close the registry's pools (of one run, or all); the number closed."""
    with _POOLS_LOCK:
        keys = [k for k in _POOLS if run_id is None or k.run_id == run_id]
        pools = [_POOLS.pop(k) for k in keys]
    for pool in pools:
        with contextlib.suppress(Exception):
            pool.close()
    return len(pools)


def live_pools() -> dict[PoolKey, WorkerPool]:
    """The registry's open pools (a copy)."""
    with _POOLS_LOCK:
        return {k: p for k, p in _POOLS.items() if not p.closed}


def _reap_idle() -> None:
    while True:
        time.sleep(1.0)
        now = time.monotonic()
        with _POOLS_LOCK:
            idle = [(k, p) for k, p in _POOLS.items()
                    if p.closed or now - p.last_used > p.site.pool_idle_timeout]
        for key, pool in idle:
            if not pool.lock.acquire(blocking=False):
                continue  # training right now
            try:
                if not pool.closed:
                    _log.info("%s: closing the worker pool idle for %.0f s", pool.name,
                              now - pool.last_used)
                pool.close()
            finally:
                pool.lock.release()
            with _POOLS_LOCK:
                if _POOLS.get(key) is pool:
                    del _POOLS[key]


atexit.register(close_pools)
