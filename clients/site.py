"""A site's training: one worker, or K local workers as one data-parallel job; one update.

On every train message :func:`run_site` trains the user's :class:`~fedagg.task.Task`. With
``site.workers = K > 1`` it starts the site's K workers (:class:`SiteRuntime`), each trains
its share of every step (:func:`clients.worker.train_worker`), gradients are summed across
workers after every step with bucketed, overlapped all-reduce
(:class:`clients.buckets.GradReducer`, Li et al. 2020), and after ``train.local_epochs``
epochs the workers hold bit-identical weights; worker 0's are the site's update.

Worker modes (``site.mode``):

``process``
    K real processes (``python -m clients.worker``) joined by torch.distributed: gloo on CPU,
    NCCL with one GPU per worker when the process sees at least K GPUs. The ClientApp process
    hosts the rendezvous store at a port the OS picks, so concurrent simulated sites never
    collide. The job (task, settings, weights) and results travel through files in a private
    temporary directory (under ``$FEDAGG_SITE_TMPDIR`` if set, else the system's temporary
    directory); each worker builds the model and its data itself (``Task.model`` /
    ``Task.data``), so the task must be picklable. Workers inherit this process's ``sys.path``.
``inprocess``
    K threads inside the ClientApp process on an :class:`~fedagg.collectives.InProcessGroup`:
    cheap simulation of many multi-worker sites, same training code; the site's data is built
    once and shared.

Failure handling. Every worker reports its progress (``compute`` / ``comm`` phase and step).
A worker that dies, raises, or makes no progress for ``site.worker_timeout`` seconds while
not waiting for its peers fails the site: all workers started here are stopped (processes
killed by PID and reaped), the temporary directory is removed, and :class:`WorkerError` names
the worker and the cause. Raised in the ClientApp, it becomes Flower's error reply; the next
round starts fresh workers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from clients.worker import (
    JOB_FILE,
    WorkerJob,
    WorkerResult,
    error_file,
    progress_file,
    result_file,
    train_worker,
)
from fedagg.collectives import InProcessGroup
from fedagg.config import SiteConfig
from fedagg.errors import CollectiveError, ConfigError, WorkerError, explain
from fedagg.task import SiteData

__all__ = ["SiteResult", "SiteRuntime", "run_site"]

_log = logging.getLogger(__name__)

_ROOT = Path(__file__).resolve().parents[1]  # holds clients/ and fedagg/ (repo or app bundle)
_POLL_S = 0.05
_GRACE_S = 2.0
_WAITING = ("comm", "done")
STARTUP_S = 120.0
"""Extra seconds a worker may take to start (import torch, join the process group)."""


@dataclass
class SiteResult:
    """The site's update and metrics for one round."""

    weights: list[npt.NDArray[Any]]
    num_examples: int
    metrics: dict[str, float]
    workers: list[WorkerResult]


@dataclass
class _Failure:
    rank: int
    cause: str
    detail: str
    primary: bool
    when: float
    pid: int | None = None
    hung: bool = False


class _Progress:
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

    def stalled(self, timeout: float) -> list[int]:
        """Workers that are silent while not waiting for a peer, or all if every one waits.

        A worker still starting (``start`` phase: importing torch, joining the process group)
        gets :data:`STARTUP_S` more seconds.
        """
        now = time.monotonic()
        silent = [r for r, t in enumerate(self.changed)
                  if now - t > timeout + (STARTUP_S if self.phase(r) == "start" else 0.0)]
        mine = [r for r in silent if self.phase(r) not in _WAITING]
        if mine:
            return mine
        if len(silent) == len(self.changed) and silent:
            return silent  # everyone waits on everyone: report all, oldest first
        return []


class SiteRuntime:
    """Runs one round of a site's K workers in the configured mode.

    Parameters
    ----------
    site : SiteConfig
        Workers, mode, algorithm, bucket size, accumulation, comm dtype, overlap, timeout.
    name : str
        Site name for messages and logs.
    server_round : int
        Round number for messages.
    device : str, optional
        ``"cpu"`` or ``"cuda"``; default: ``$FEDAGG_SITE_DEVICE``, else CUDA in process mode
        when at least K GPUs are visible, else CPU.
    """

    def __init__(self, site: SiteConfig, *, name: str = "site", server_round: int = 0,
                 device: str | None = None) -> None:
        self.site = site
        self.name = name
        self.server_round = server_round
        self.device = device or os.environ.get("FEDAGG_SITE_DEVICE") or self._default_device()

    def _default_device(self) -> str:
        if self.site.mode != "process":
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= self.site.workers else "cpu"

    def run(self, job: WorkerJob, data: SiteData | None = None) -> SiteResult:
        """Train the site for one round; return worker 0's weights and the site's metrics.

        ``data`` (in-process mode) is the site's data if the caller built it already.

        Raises
        ------
        WorkerError
            A worker crashed, raised or hung; no worker started here is left running.
        """
        k = self.site.workers
        job = _with_site(job, self.site, self.device)
        t0 = time.perf_counter()
        if self.site.mode == "process":
            results = self._run_processes(job)
        else:
            results = self._run_threads(job, data if data is not None else job.task.data(job.site))
        wall = time.perf_counter() - t0
        digests = {r.digest for r in results}
        if len(digests) != 1:
            raise WorkerError(explain(
                f"{self.name}: worker weights", f"{len(digests)} different digests over {k} workers",
                "all workers must end the round with identical weights",
                "report this as a bug (the all-reduce must give every worker the same sums)"))
        weights = results[0].weights
        if weights is None:
            raise WorkerError(f"{self.name}: worker 0 returned no weights")
        size = None if self.site.mode == "process" else (data.train_size() if data else None)
        examples = size if size is not None else sum(r.epoch_examples for r in results)
        return SiteResult(weights, examples, _metrics(results, wall, job.settings.epochs), results)

    # -- in-process -----------------------------------------------------------------------
    def _run_threads(self, job: WorkerJob, data: SiteData) -> list[WorkerResult]:
        k = self.site.workers
        group = InProcessGroup(k, timeout=job.timeout)
        comms = group.communicators()
        results: list[WorkerResult | None] = [None] * k
        failures: list[_Failure] = []
        progress = _Progress(k)
        stop = threading.Event()
        lock = threading.Lock()

        def body(rank: int) -> None:
            try:
                results[rank] = train_worker(
                    job, comms[rank], data=data, stop=stop, in_process=True,
                    progress=lambda phase, step: progress.update(rank, f"{phase} {step}"))
            except BaseException as exc:  # reported by the site below
                with lock:
                    failures.append(_Failure(
                        rank, f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                        traceback.format_exc(limit=-4), not isinstance(exc, CollectiveError),
                        time.monotonic()))
                group.abort(f"worker {rank} failed")

        threads = [threading.Thread(target=body, args=(r,), name=f"{self.name}-worker{r}", daemon=True)
                   for r in range(k)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads) and not failures:
            time.sleep(_POLL_S)
            for r in progress.stalled(self.site.worker_timeout):
                failures.append(self._hung(r, progress, None))
        if failures:
            group.abort("the site is stopping its workers")
            stop.set()
            deadline = time.monotonic() + _GRACE_S
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            stuck = [t.name for t in threads if t.is_alive()]
            if stuck:
                _log.error("%s: in-process workers still running after abort (abandoned): %s",
                           self.name, stuck)
            self._raise(failures, "inprocess")
        return [r for r in results if r is not None]

    # -- processes --------------------------------------------------------------------------
    def _run_processes(self, job: WorkerJob) -> list[WorkerResult]:
        from fedagg.collectives.backends.torch_dist import host_store

        k = self.site.workers
        job_dir = Path(tempfile.mkdtemp(prefix=f"fedagg-{self.name}-r{self.server_round}-",
                                        dir=os.environ.get("FEDAGG_SITE_TMPDIR") or None))
        procs: list[subprocess.Popen[bytes]] = []
        logs = []
        try:
            store, port = host_store(job.timeout)
            job.port, job.parent_pid = port, os.getpid()
            job.threads = job.threads or max(1, (os.cpu_count() or 1) // k)
            (job_dir / JOB_FILE).write_bytes(_pickle_job(job))
            # the workers import what this process imports (the user's task module too)
            paths = [str(_ROOT), *(p for p in sys.path if p and Path(p).is_dir()),
                     *filter(None, [os.environ.get("PYTHONPATH")])]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
            for r in range(k):
                log = open(job_dir / f"worker-{r}.log", "wb")  # noqa: SIM115 -- closed below
                logs.append(log)
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "clients.worker", str(job_dir), str(r), str(k)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                    cwd=str(job_dir)))
            _log.info("%s: started %d worker processes %s (port %d, %s)", self.name, k,
                      [p.pid for p in procs], port, self.device)
            failures = self._watch(procs, job_dir)
            if failures:
                self._raise(failures, "process")
            out = []
            for r in range(k):
                out.append(pickle.loads(result_file(job_dir, r).read_bytes()))
            del store
            return out
        finally:
            _reap(procs)
            for log in logs:
                log.close()
            shutil.rmtree(job_dir, ignore_errors=True)

    def _watch(self, procs: list[subprocess.Popen[bytes]], job_dir: Path) -> list[_Failure]:
        k = len(procs)
        progress = _Progress(k)
        failures: dict[int, _Failure] = {}
        first: float | None = None
        while True:
            for r, p in enumerate(procs):
                with contextlib.suppress(OSError):
                    progress.update(r, progress_file(job_dir, r).read_text())
                rc = p.poll()
                if rc is None or r in failures:
                    continue
                if rc == 0 and result_file(job_dir, r).exists():
                    continue
                failures[r] = _process_failure(r, p, rc, job_dir)
            if first is None:
                for r in progress.stalled(self.site.worker_timeout):
                    if r not in failures:
                        failures[r] = self._hung(r, progress, procs[r].pid)
            if failures and first is None:
                first = time.monotonic()
                for r in failures:
                    if failures[r].hung:
                        _kill(procs[r])  # stop the hung one; its peers fail over to us
            if first is None and all(p.poll() == 0 for p in procs):
                return []
            if first is not None and (time.monotonic() - first > _GRACE_S
                                      or all(p.poll() is not None for p in procs)):
                return list(failures.values())
            time.sleep(_POLL_S)

    def _hung(self, rank: int, progress: _Progress, pid: int | None) -> _Failure:
        phase, step = progress.phase(rank), progress.step(rank)
        silent = time.monotonic() - progress.changed[rank]
        return _Failure(
            rank, f"hung: no progress for {silent:.1f} s (site.worker_timeout = "
            f"{self.site.worker_timeout} s; last seen in phase {phase!r} at step {step})",
            "", True, progress.changed[rank], pid, hung=True)

    def _raise(self, failures: list[_Failure], mode: str) -> None:
        k = self.site.workers
        main = min(failures, key=lambda f: (not f.primary, f.when, f.rank))
        others = [f for f in failures if f is not main]
        if main.hung:
            fix = ("find what blocks that worker, or raise site.worker_timeout; the next round "
                   "starts fresh workers")
        elif "signal" in main.cause or "exited" in main.cause:
            fix = "see the worker's log below (out of memory? killed by the OS?); the next round " \
                  "starts fresh workers"
        else:
            fix = "fix the error in the worker's traceback below; the next round starts fresh workers"
        who = f"{self.name}: worker {main.rank} of {k}"
        text = explain(
            who, f"pid {main.pid}" if main.pid else f"{mode} thread",
            f"{main.cause} in round {self.server_round} ({mode} mode); the site's update was "
            f"discarded and all {k} workers were stopped", fix)
        if main.detail:
            text += f"\n--- worker {main.rank} ---\n{main.detail.rstrip()}"
        for f in sorted(others, key=lambda f: f.rank):
            text += f"\nalso: worker {f.rank}: {f.cause}"
        _log.error("%s", text)
        raise WorkerError(text)


def _pickle_job(job: WorkerJob) -> bytes:
    """The job as bytes for the worker processes; an unpicklable task is named, with the fix."""
    try:
        return pickle.dumps(job)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ConfigError(explain(
            "site.mode", "process",
            f"the Task must be picklable to reach the worker processes ({exc})",
            "define the model, data, loss, optimizer and step functions at module level "
            "(not lambdas or nested functions), or use site.mode = 'inprocess'")) from None


def _process_failure(rank: int, p: subprocess.Popen[bytes], rc: int, job_dir: Path) -> _Failure:
    err = error_file(job_dir, rank)
    if err.exists():
        tb = err.read_text(errors="replace")
        last = tb.strip().splitlines()[-1] if tb.strip() else f"exit code {rc}"
        consequence = any(s in tb for s in ("CollectiveError", "CollectiveTimeout", "Connection closed",
                                            "Connection reset", "gloo", "Broken pipe"))
        return _Failure(rank, f"raised {last[:300]}", "\n".join(tb.strip().splitlines()[-8:]),
                        not consequence, time.monotonic(), p.pid)
    if rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = str(-rc)
        cause = f"died: killed by signal {sig} (exit code {rc})"
    elif rc == 0:
        cause = "exited without a result"
    else:
        cause = f"died: exited with code {rc} without a traceback"
    return _Failure(rank, cause, _tail(job_dir / f"worker-{rank}.log"), True, time.monotonic(), p.pid)


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def _kill(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            p.kill()


def _reap(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill (by PID) and wait for every worker process started here that is still running."""
    deadline = time.monotonic() + 5.0
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        _kill(p)
        try:
            p.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            _log.error("worker process %d did not exit after SIGKILL", p.pid)


def _with_site(job: WorkerJob, site: SiteConfig, device: str) -> WorkerJob:
    job.accumulation_steps = site.accumulation_steps
    job.algorithm = site.algorithm
    job.bucket_mb = site.bucket_mb
    job.overlap = site.overlap
    job.comm_dtype = site.comm_dtype
    job.device = device
    # the site's own watchdog (worker_timeout) fires before a blocked collective gives up
    job.timeout = site.worker_timeout * 1.5 + 5.0
    return job


def _metrics(results: list[WorkerResult], wall: float, epochs: int) -> dict[str, float]:
    examples = sum(r.examples for r in results)
    per_epoch = [max(r.epoch_seconds[e] for r in results) for e in range(epochs)
                 if all(len(r.epoch_seconds) > e for r in results)]
    train = max(r.train_seconds for r in results)
    r0 = results[0]
    return {
        "workers": float(len(results)),
        "train_loss": sum(r.loss_sum for r in results) / max(examples, 1),
        "steps": float(r0.steps),
        "compute_seconds": max(r.compute_seconds for r in results),
        "comm_seconds": max(r.comm_seconds for r in results),
        "comm_wait_seconds": max(r.wait_seconds for r in results),
        "bytes_allreduced": float(r0.bytes_allreduced),
        "bytes_sent": float(sum(r.bytes_sent for r in results)),
        "allreduce_calls": float(r0.allreduce_calls),
        "buckets": float(r0.buckets),
        "epoch_seconds": float(np.mean(per_epoch)) if per_epoch else train / max(epochs, 1),
        "train_seconds": train,
        "startup_seconds": max(0.0, wall - train),
        "site_seconds": wall,
    }


def run_site(job: WorkerJob, site: SiteConfig, *, name: str = "site", server_round: int = 0,
             data: SiteData | None = None) -> SiteResult:
    """Train a site for one round: one worker here, or ``site.workers`` as one data-parallel job.

    Raises
    ------
    WorkerError
        A worker crashed, raised or hung (the ClientApp turns it into Flower's error reply).
    """
    if site.workers == 1:
        t0 = time.perf_counter()
        job = _with_site(job, site, os.environ.get("FEDAGG_SITE_DEVICE") or "cpu")
        data = data if data is not None else job.task.data(job.site)
        comm = InProcessGroup(1, timeout=job.timeout).communicators()[0]
        r = train_worker(job, comm, data=data)
        wall = time.perf_counter() - t0
        assert r.weights is not None
        size = data.train_size()
        metrics = {"train_loss": r.loss_sum / max(r.examples, 1), "workers": 1.0,
                   "steps": float(r.steps), "compute_seconds": r.train_seconds,
                   "train_seconds": r.train_seconds, "site_seconds": wall}
        return SiteResult(r.weights, size if size is not None else r.epoch_examples, metrics, [r])
    runtime = SiteRuntime(site, name=name, server_round=server_round)
    result = runtime.run(job, data)
    _log.info("%s round %d: %d workers (%s, %s), %.2f s compute, %.2f s comm, %d bytes all-reduced",
              name, server_round, site.workers, site.mode, runtime.device,
              result.metrics["compute_seconds"], result.metrics["comm_seconds"],
              int(result.metrics["bytes_allreduced"]))
    return result
