"""Persistent, elastic site workers: a pool of K workers that lives for the whole run.

A site with ``site.workers = K > 1`` trains every round on a :class:`WorkerPool`. With
``site.persistent`` (the default) the pool outlives the train message: its K workers keep
their process group, the model, the data shard, the gradient reducer with its learned layout
and ``auto`` choice and, with ``site.keep_optimizer``, the optimizer state
(:class:`clients.worker_state.WorkerState`); each round sends them only the new global
weights and the round's settings, as a DDP job keeps its processes across iterations (Li et al.
2020, "PyTorch Distributed", VLDB, section 4.1).

Where the pool lives. :func:`clients.pools.pool_for` keeps one pool per site in a
module-level registry (:mod:`clients.pools`) keyed by :class:`~clients.pools.PoolKey` =
(Flower run id, node id, task identity), so two simulated sites
served by one ClientApp host (a Ray actor) never share a pool, and a new run or task gets
fresh workers. In deployment, where Flower starts a fresh ClientApp
process for every message, the registry lives in the site's worker service
(:mod:`clients.service`). Without a key (``site.persistent = false``, benchmarks, tests) a
pool serves one round.

Elastic rounds (the semantics of torchelastic's agent, adapted: PyTorch docs, "torchrun
(Elastic Launch)", membership changes and ``--max-restarts``). A worker that dies (killed by
a signal, out of memory) or hangs (no progress for ``site.worker_timeout`` seconds while not
waiting for a peer; it is then killed) no longer fails the site when ``site.elastic``: the
survivors leave the broken group, form a new one of K' = K - lost workers, and train the
round again from the round's global weights (the kept optimizer state restored to the round's
start). The data is re-sharded by construction -- worker k of K' takes the k-th slice of every
global batch (or ``train_loader(k, K')``) -- so the redone round gives the update K workers
would have given (within float32 summation order). The reply's metrics say so
(``workers``, ``workers_lost``, ``round_attempts``). The next round replaces the lost
workers: the group has K workers again. A worker that *raises* (a bug in the
user's step, bad data) fails the site as before: redoing would raise again. So do fewer than
``site.min_workers`` survivors. If no worker survived (the whole pool died, e.g. killed
together between rounds), the pool is started again once within the round and the round
redone. A failed site's pool is closed; the next round starts a new one.

Shutdown. :meth:`WorkerPool.close` stops every worker it started (processes: asked to exit,
then killed by PID and reaped); the registry closes pools idle for ``site.pool_idle_timeout``
seconds and, at interpreter exit, all of them; a worker process also exits on its own when its
controller's connection closes or its parent process goes away, so none outlives the site.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from clients.worker import WorkerJob, WorkerLost, WorkerResult, train_worker
from clients.worker_state import WorkerState
from fedagg.collectives import InProcessGroup
from fedagg.config import SiteConfig
from fedagg.errors import CollectiveError, WorkerError, explain
from fedagg.task import SiteData

__all__ = ["POLL_S", "RECOVER_S", "STARTUP_S", "Failure", "Progress", "RoundInfo",
           "ThreadPool", "WorkerPool", "pool_shape"]

_log = logging.getLogger(__name__)

POLL_S = 0.05
RECOVER_S = 15.0
"""Seconds the survivors of a lost worker get to leave the broken group (else: lost too)."""
STARTUP_S = 120.0
"""Extra seconds a worker may take to start (import torch, join the process group)."""
_WAITING = ("comm", "done")


@dataclass
class RoundInfo:
    """How a round went at the pool level (for the site's metrics)."""

    attempts: int = 1
    lost: int = 0
    started: int = 0
    startup_seconds: float = 0.0
    redo_seconds: float = 0.0
    generation: int = 0
    causes: list[str] = field(default_factory=list)


@dataclass
class Failure:
    """One worker's failure in one attempt."""

    rank: int
    cause: str
    detail: str = ""
    primary: bool = True   # the root cause (not a peer's symptom)
    lost: bool = False     # died or hung: the survivors may go on without it
    when: float = field(default_factory=time.monotonic)
    pid: int | None = None
    hung: bool = False


class Progress:
    """Last progress state of each worker and when it last changed."""

    def __init__(self, k: int) -> None:
        now = time.monotonic()
        self.state: list[str] = ["start 0"] * k
        self.changed: list[float] = [now] * k

    def update(self, rank: int, state: str) -> None:
        """Record worker ``rank``'s state ``"<phase> <step> [<counter>]"``."""
        if state != self.state[rank]:
            self.state[rank], self.changed[rank] = state, time.monotonic()

    def phase(self, rank: int) -> str:
        return self.state[rank].split()[0]

    def step(self, rank: int) -> str:
        parts = self.state[rank].split()
        return parts[1] if len(parts) > 1 else "?"

    def stalled(self, timeout: float, skip: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """Workers silent for ``timeout`` while not waiting for a peer (all, if all wait)."""
        now = time.monotonic()
        silent = [r for r, t in enumerate(self.changed) if r not in skip
                  and now - t > timeout + (STARTUP_S if self.phase(r) == "start" else 0.0)]
        mine = [r for r in silent if self.phase(r) not in _WAITING]
        if mine:
            return mine
        if silent and len(silent) == len(self.changed) - len(skip):
            return silent
        return []

    def hung(self, rank: int, timeout: float, pid: int | None) -> Failure:
        silent = time.monotonic() - self.changed[rank]
        return Failure(rank, f"hung: no progress for {silent:.1f} s (site.worker_timeout = "
                       f"{timeout} s; last seen in phase {self.phase(rank)!r} at step "
                       f"{self.step(rank)})", primary=True, lost=True, pid=pid, hung=True,
                       when=self.changed[rank])


class WorkerPool:
    """K workers of one site that train round after round (base of both modes).

    Parameters
    ----------
    site : SiteConfig
        Workers, mode, reducer options, timeouts, elasticity.
    name : str
        Site name for messages and logs.
    device : str
        ``"cpu"`` or ``"cuda"``.
    """

    mode = "base"

    def __init__(self, site: SiteConfig, *, name: str = "site", device: str = "cpu") -> None:
        self.site = site
        self.name = name
        self.device = device
        self.k = site.workers
        self.lock = threading.Lock()
        self.closed = False
        self.generation = 0
        self.rounds = 0
        self.last_used = time.monotonic()
        self.layout: dict[str, Any] | None = None  # the reducer state every member adopts
        self._dirty = True  # the next round must (re)form the group

    @property
    def shape(self) -> tuple[Any, ...]:
        """What fixes the workers: a pool whose shape differs from the site's is rebuilt."""
        return pool_shape(self.site, self.device)

    # -- the elastic round ----------------------------------------------------------------------
    def run(self, job: WorkerJob, data: SiteData | None = None, *, server_round: int = 0
            ) -> tuple[list[WorkerResult], RoundInfo]:
        """Train one round on the pool's workers; elastic as the module docstring says.

        Raises
        ------
        WorkerError
            A worker raised, too few survived, or the pool could not be (re)started; every
            worker of this pool is stopped then.
        """
        with self.lock:
            if self.closed:
                raise WorkerError(f"{self.name}: the worker pool was closed")
            self.last_used = time.monotonic()
            info = RoundInfo()
            t0 = time.monotonic()
            try:
                self._ensure(job, info)
            except BaseException:
                self.close()
                raise
            info.startup_seconds = time.monotonic() - t0
            fault = job.fault
            attempt = 0
            restarted = False
            while True:
                job.attempt, job.fault = attempt, fault if attempt == 0 else None
                t_attempt = time.monotonic()
                k_now = self.size
                if k_now == 0 or self.closed:
                    self.close()
                    raise WorkerError(explain(
                        f"{self.name}: worker pool", "no workers" if k_now == 0 else "closed",
                        f"a round needs the pool's workers (round {server_round})",
                        "retry the round: the next one starts a new pool; report this if it "
                        "repeats"))
                results, failures = self._attempt(job, data)
                lost = [f for f in failures if f.lost]
                if not failures or (results and len(lost) == len(failures)
                                    and len(results) == k_now - len(lost)):
                    if lost:  # the round completed; the lost ones are replaced next round
                        self._drop([f.rank for f in lost])
                        info.lost += len(lost)
                        info.causes += [f"worker {f.rank}: {f.cause}" for f in lost]
                    info.attempts, info.generation = attempt + 1, self.generation
                    self.rounds += 1
                    if results and results[0].layout is not None:
                        self.layout = results[0].layout
                    self.last_used = time.monotonic()
                    job.fault = fault
                    return sorted(results, key=lambda r: r.rank), info
                blocking = [f for f in failures if f.primary and not f.lost]
                if not self.site.elastic or not lost or blocking:
                    self.close()
                    self._raise(failures, server_round, k=k_now)
                survivors = self._recover(failures)
                info.lost += k_now - len(survivors)
                info.causes += [f"worker {f.rank}: {f.cause}" for f in lost]
                if not survivors and not restarted:
                    # every worker is gone (e.g. killed together just before the round): the
                    # pool is dead; start it again once and redo the round
                    _log.warning("%s round %d: all %d workers lost (%s); restarting the pool",
                                 self.name, server_round, k_now,
                                 "; ".join(f.cause for f in lost))
                    restarted = True
                    try:
                        self._drop(list(range(self.size)))
                        self._ensure(job, info)
                    except BaseException:
                        self.close()
                        raise
                    info.redo_seconds += time.monotonic() - t_attempt
                    attempt += 1
                    continue
                if len(survivors) < self.site.min_workers:
                    self.close()
                    self._raise(failures, server_round, k=k_now, left=len(survivors))
                _log.warning("%s round %d: %d of %d workers lost (%s); redoing the round with %d",
                             self.name, server_round, k_now - len(survivors), k_now,
                             "; ".join(f.cause for f in lost), len(survivors))
                try:
                    self._regroup(survivors, None)
                except BaseException:
                    self.close()
                    raise
                info.redo_seconds += time.monotonic() - t_attempt
                attempt += 1

    # -- what each mode provides ------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Workers in the current group."""
        raise NotImplementedError

    def _ensure(self, job: WorkerJob, info: RoundInfo) -> None:
        """Start or replace workers so that K form the group (counts into ``info``)."""
        raise NotImplementedError

    def _attempt(self, job: WorkerJob, data: SiteData | None
                 ) -> tuple[list[WorkerResult], list[Failure]]:
        raise NotImplementedError

    def _recover(self, failures: list[Failure]) -> list[int]:
        """Drop the lost workers; the current ranks of those that can go on."""
        raise NotImplementedError

    def _regroup(self, ranks: list[int], optimizer: dict[str, Any] | None) -> None:
        raise NotImplementedError

    def _drop(self, ranks: list[int]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop every worker of this pool (idempotent)."""
        self.closed = True

    # -- errors ----------------------------------------------------------------------------------
    def _raise(self, failures: list[Failure], server_round: int, *, k: int,
               left: int | None = None) -> None:
        main = min(failures, key=lambda f: (not f.primary, f.when, f.rank))
        others = [f for f in failures if f is not main]
        if left is not None:
            rule = (f"{main.cause} in round {server_round} ({self.mode} mode); only {left} "
                    f"worker(s) survived, fewer than site.min_workers = {self.site.min_workers}")
            fix = "lower site.min_workers, or find why the workers die (see below)"
        else:
            rule = (f"{main.cause} in round {server_round} ({self.mode} mode); the site's update "
                    f"was discarded and all {k} workers were stopped")
            if main.hung:
                fix = ("find what blocks that worker, or raise site.worker_timeout; the next "
                       "round starts fresh workers")
            elif main.lost:
                fix = ("see the worker's log below (out of memory? killed by the OS?); set "
                       "site.elastic = true to finish rounds with the survivors; the next round "
                       "starts fresh workers")
            else:
                fix = ("fix the error in the worker's traceback below; the next round starts "
                       "fresh workers")
        text = explain(f"{self.name}: worker {main.rank} of {k}",
                       f"pid {main.pid}" if main.pid else f"{self.mode} thread", rule, fix)
        if main.detail:
            text += f"\n--- worker {main.rank} ---\n{main.detail.rstrip()}"
        for f in sorted(others, key=lambda f: f.rank):
            text += f"\nalso: worker {f.rank}: {f.cause}"
        _log.error("%s", text)
        raise WorkerError(text)


# -- in-process workers ---------------------------------------------------------------------------
class ThreadPool(WorkerPool):
    """K workers as threads of this process over an :class:`~fedagg.collectives.InProcessGroup`.

    The threads of a round are cheap to start; what persists is each worker's
    :class:`~clients.worker_state.WorkerState` and the site's data (built once, shared).
    """

    mode = "inprocess"

    def __init__(self, site: SiteConfig, *, name: str = "site", device: str = "cpu") -> None:
        super().__init__(site, name=name, device=device)
        self.states: list[WorkerState] = []
        self.group: InProcessGroup | None = None
        self._data: SiteData | None = None
        self._data_key: Any = None
        self._threads: list[threading.Thread] = []
        self.comms: list[Any] = []

    @property
    def size(self) -> int:
        return len(self.states)

    def _ensure(self, job: WorkerJob, info: RoundInfo) -> None:
        if len(self.states) < self.k or self._dirty:
            optimizer = (self.states[0].optimizer_state()
                         if job.keep_optimizer and self.states and len(self.states) < self.k
                         else None)
            new = self.k - len(self.states)
            self.states += [WorkerState() for _ in range(new)]
            info.started += new
            self._regroup(list(range(self.k)), optimizer)

    def _regroup(self, ranks: list[int], optimizer: dict[str, Any] | None) -> None:
        self.states = [self.states[r] for r in ranks]
        for st in self.states:
            st.release_group()
            st.adopt_layout(self.layout)
            if optimizer is not None:
                st.pending_optimizer = optimizer
        self.group = InProcessGroup(len(self.states), timeout=self.site.worker_timeout * 1.5 + 5.0)
        self.comms = self.group.communicators()  # kept: the reducers are bound to them
        self.generation += 1
        self._dirty = False

    def _drop(self, ranks: list[int]) -> None:
        self.states = [st for r, st in enumerate(self.states) if r not in ranks]
        self._dirty = True

    def _site_data(self, job: WorkerJob, data: SiteData | None) -> SiteData:
        if data is not None:
            return data
        if self._data is None or self._data_key != job.site:
            self._data, self._data_key = job.task.data(job.site), job.site
        return self._data

    def _attempt(self, job: WorkerJob, data: SiteData | None
                 ) -> tuple[list[WorkerResult], list[Failure]]:
        assert self.group is not None
        k, group = len(self.states), self.group
        site_data = self._site_data(job, data)
        comms = self.comms
        results: list[WorkerResult | None] = [None] * k
        failures: list[Failure] = []
        progress = Progress(k)
        stop = threading.Event()
        lock = threading.Lock()
        ended = threading.Semaphore(0)  # released as each worker ends: no poll lost per job

        def body(rank: int) -> None:
            try:
                results[rank] = train_worker(
                    job, comms[rank], data=site_data, stop=stop, in_process=True,
                    state=self.states[rank],
                    progress=lambda phase, step: progress.update(rank, f"{phase} {step}"))
            except BaseException as exc:  # reported by the pool below
                first = str(exc).splitlines()[0] if str(exc) else ""
                with lock:
                    if any(f.rank == rank and f.hung for f in failures):
                        return  # the hung worker, stopped by the site: already reported
                    failures.append(Failure(
                        rank, f"raised {type(exc).__name__}: {first}",
                        traceback.format_exc(limit=-4),
                        primary=not isinstance(exc, CollectiveError),
                        lost=isinstance(exc, WorkerLost)))
                group.abort(f"worker {rank} failed")
            finally:
                ended.release()

        threads = [threading.Thread(target=body, args=(r,), name=f"{self.name}-worker{r}",
                                    daemon=True) for r in range(k)]
        for t in threads:
            t.start()
        running = k
        while running and not failures:
            running -= ended.acquire(timeout=POLL_S)
            for r in progress.stalled(self.site.worker_timeout):
                with lock:
                    failures.append(progress.hung(r, self.site.worker_timeout, None))
        if failures:
            group.abort("the site is stopping its workers")
            stop.set()
            deadline = time.monotonic() + 2.0
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            for r, t in enumerate(threads):
                if t.is_alive() and not any(f.rank == r for f in failures):
                    failures.append(Failure(r, "did not stop after the abort (abandoned)",
                                            primary=False, lost=True))
        self._threads = threads
        return [r for r in results if r is not None], failures

    def _recover(self, failures: list[Failure]) -> list[int]:
        lost = {f.rank for f in failures if f.lost}
        alive = [r for r, t in enumerate(self._threads) if not t.is_alive()]
        return [r for r in range(len(self.states)) if r not in lost and r in alive]

    def close(self) -> None:
        if self.group is not None:
            self.group.abort("the site's worker pool was closed")
        for st in self.states:
            st.release_group()
        self.states, self.group, self._data = [], None, None
        self.closed = True


def pool_shape(site: SiteConfig, device: str) -> tuple[Any, ...]:
    """What fixes a pool's workers: a pool whose shape differs from the site's is rebuilt."""
    return (site.workers, site.mode, device, site.algorithm, site.bucket_mb, site.overlap,
            site.comm_dtype, site.worker_timeout)
