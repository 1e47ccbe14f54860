"""Multi-worker sites: K local workers train as one data-parallel job; the site replies once.

On every train message :func:`run_site` starts the site's K workers (:class:`SiteRuntime`),
each trains its share of every global batch (:func:`clients.worker.train_worker`), gradients
are summed across workers after every step with bucketed, overlapped all-reduce
(:class:`clients.buckets.GradReducer`, Li et al. 2020), and after ``train.local_epochs``
epochs the workers hold bit-identical weights; worker 0's are the site's update.

Worker modes (``site.mode``):

``process``
    K real processes (``python -m clients.worker``) joined by torch.distributed: gloo on CPU,
    NCCL with one GPU per worker when the process sees at least K GPUs. The ClientApp process
    hosts the rendezvous store at a port the OS picks, so concurrent simulated sites never
    collide. Weights, data and results travel through files in a private temporary directory
    (under ``$FEDAGG_SITE_TMPDIR`` if set, else the system's temporary directory).
``inprocess``
    K threads inside the ClientApp process on an :class:`~fedagg.collectives.InProcessGroup`:
    cheap simulation of many multi-worker sites, same training code.

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
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from clients.worker import (
    JOB_FILE,
    X_FILE,
    Y_FILE,
    WorkerFault,
    WorkerJob,
    WorkerResult,
    error_file,
    progress_file,
    result_file,
    train_worker,
)
from fedagg.collectives import InProcessGroup
from fedagg.config import SiteConfig
from fedagg.errors import CollectiveError, WorkerError, explain

if TYPE_CHECKING:  # Flower-dependent; imported lazily so SiteRuntime runs without Flower
    from clients.local import SiteUpdate
    from clients.settings import SiteSettings

__all__ = ["SiteResult", "SiteRuntime", "build_job", "run_site"]

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

    weights: list[npt.NDArray[np.float32]]
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

    def run(self, job: WorkerJob, x: npt.NDArray[np.float32], y: npt.NDArray[np.int64]) -> SiteResult:
        """Train the site for one round; return worker 0's weights and the site's metrics.

        Raises
        ------
        WorkerError
            A worker crashed, raised or hung; no worker started here is left running.
        """
        k = self.site.workers
        job = _with_site(job, self.site, self.device)
        t0 = time.perf_counter()
        if self.site.mode == "process":
            results = self._run_processes(job, x, y)
        else:
            results = self._run_threads(job, x, y)
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
        return SiteResult(weights, len(y), _metrics(results, wall, job.epochs), results)

    # -- in-process -----------------------------------------------------------------------
    def _run_threads(self, job: WorkerJob, x: npt.NDArray[np.float32],
                     y: npt.NDArray[np.int64]) -> list[WorkerResult]:
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
                    job, comms[rank], x, y, stop=stop, in_process=True,
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
    def _run_processes(self, job: WorkerJob, x: npt.NDArray[np.float32],
                       y: npt.NDArray[np.int64]) -> list[WorkerResult]:
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
            np.save(job_dir / X_FILE, np.ascontiguousarray(x))
            np.save(job_dir / Y_FILE, np.ascontiguousarray(y))
            (job_dir / JOB_FILE).write_bytes(pickle.dumps(job))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
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
        "train-loss": sum(r.loss_sum for r in results) / max(examples, 1),
        "steps": float(r0.steps),
        "compute-seconds": max(r.compute_seconds for r in results),
        "comm-seconds": max(r.comm_seconds for r in results),
        "comm-wait-seconds": max(r.wait_seconds for r in results),
        "bytes-allreduced": float(r0.bytes_allreduced),
        "bytes-sent": float(sum(r.bytes_sent for r in results)),
        "allreduce-calls": float(r0.allreduce_calls),
        "buckets": float(r0.buckets),
        "epoch-seconds": float(np.mean(per_epoch)) if per_epoch else train / max(epochs, 1),
        "train-seconds": train,
        "startup-seconds": max(0.0, wall - train),
        "site-seconds": wall,
    }


def build_job(settings: SiteSettings, weights: list[npt.NDArray[np.float32]],
              input_shape: tuple[int, int, int], num_classes: int) -> WorkerJob:
    """The :class:`WorkerJob` of one round at one site, from its :class:`SiteSettings`."""
    from clients.local import training_seed

    cfg, f = settings.cfg, settings.cfg.faults
    fault = None
    if f.worker_fault_site == settings.partition_id and f.worker_fault_round == settings.server_round:
        if f.kill_worker is not None:
            fault = WorkerFault("kill", f.kill_worker, f.worker_fault_step)
        elif f.hang_worker is not None:
            fault = WorkerFault("hang", f.hang_worker, f.worker_fault_step)
    t = cfg.train
    return WorkerJob(
        site=settings.name, model=cfg.model.name, input_shape=input_shape, num_classes=num_classes,
        weights=[np.asarray(w, dtype=np.float32) for w in weights], epochs=t.local_epochs,
        batch_size=t.batch_size, lr=t.lr, momentum=t.momentum, seed=training_seed(settings),
        fault=fault)


def run_site(settings: SiteSettings, weights: list[npt.NDArray[np.float32]]) -> SiteUpdate:
    """Train a multi-worker site for one round; return its :class:`~clients.local.SiteUpdate`.

    Raises
    ------
    WorkerError
        A worker crashed, raised or hung (the ClientApp turns it into Flower's error reply).
    """
    from clients.local import SiteUpdate, local_data

    x, y, shape, classes = local_data(settings)
    job = build_job(settings, weights, shape, classes)
    runtime = SiteRuntime(settings.cfg.site, name=settings.name, server_round=settings.server_round)
    result = runtime.run(job, x, y)
    _log.info("%s round %d: %d workers (%s, %s), %.2f s compute, %.2f s comm, %d bytes all-reduced",
              settings.name, settings.server_round, settings.cfg.site.workers, settings.cfg.site.mode,
              runtime.device, result.metrics["compute-seconds"], result.metrics["comm-seconds"],
              int(result.metrics["bytes-allreduced"]))
    return SiteUpdate(result.weights, result.num_examples, result.metrics)
