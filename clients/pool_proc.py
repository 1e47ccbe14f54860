"""The process-mode worker pool: K persistent ``python -m clients.pool_worker`` processes.

:class:`ProcessPool` (see :mod:`clients.pool` for the round, the elasticity and the registry)
starts its workers once, with a private directory (mode 0700, under ``$FEDAGG_SITE_TMPDIR``
if set, else the system's temporary directory) holding a random key (0600), the workers'
logs and the control socket's address (on Linux an abstract unix socket, which has no file
and no path-length limit; elsewhere a 0600 socket file in the directory). Each worker
connects back and authenticates with the key (HMAC challenge of
``multiprocessing.connection``; nothing is unpickled before it), gets the pickled task once,
and joins a torch.distributed group through a file store in that directory (one file per
group generation; torch's ``FileStore``): other local users cannot enter the directory, so they
can neither read nor write the rendezvous, and there is no store socket to connect to. gloo's
own sockets are bound to the loopback interface. A round sends every worker the same pickled
:class:`~clients.worker.WorkerJob` *without* the task -- the global weights and the round's
settings -- and reads back progress, then one result each (weights from worker 0 only).

Workers inherit this process's ``sys.path`` (or the ``sys_path`` given, e.g. the app bundle's
as a ClientApp sent it to the worker service); the task must be picklable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Any

from clients.pool import (
    POLL_S,
    RECOVER_S,
    STARTUP_S,
    Failure,
    Progress,
    RoundInfo,
    WorkerPool,
)
from clients.worker import WorkerJob, WorkerResult
from fedagg.config import SiteConfig
from fedagg.errors import ConfigError, WorkerError, explain
from fedagg.task import SiteData

__all__ = ["ProcessPool", "sweep_stale_pools", "worker_path"]

_log = logging.getLogger(__name__)

_ROOT = Path(__file__).resolve().parents[1]  # holds clients/ and fedagg/ (repo or app bundle)
_CONSEQUENCE = ("CollectiveError", "CollectiveTimeout", "Connection closed", "Connection reset",
                "gloo", "Broken pipe")


def _start_time(pid: int) -> str | None:
    """Start time of live process ``pid`` (None if gone or a zombie: it can own nothing)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def sweep_stale_pools(root: str | Path | None = None, *, wait_for: Collection[int] = (),
                      wait_s: float = 0.0) -> int:
    """Remove pool directories (this user's) whose controller process is gone.

    A controller killed without a chance to clean up (SIGKILL, a Ray actor torn down with
    its children) leaves its directory behind; its workers exit on their own. Called when a
    pool starts and by ``fedagg simulate`` after the engine stopped. A directory whose
    controller is one of ``wait_for`` (``fedagg simulate`` passes the Ray processes it saw)
    and still alive is given up to ``wait_s`` seconds to go: Ray's workers leave only after
    they noticed that the raylet is gone, which can take seconds under load. Any other live
    controller's directory is left alone at once. Returns the number removed.
    """
    base = Path(root or os.environ.get("FEDAGG_SITE_TMPDIR") or tempfile.gettempdir())
    removed = 0
    deadline = time.monotonic() + wait_s
    waited = set(wait_for)
    while True:
        pending = 0
        for d in base.glob("fedagg-*-pool-*"):
            try:
                if d.stat().st_uid != os.getuid():
                    continue
                pid, started = (d / "owner").read_text().split()
            except (OSError, ValueError):
                continue
            if _start_time(int(pid)) != started:
                shutil.rmtree(d, ignore_errors=True)
                removed += 1
            elif int(pid) in waited:
                pending += 1
        if not pending or time.monotonic() >= deadline:
            return removed
        time.sleep(0.2)


def worker_path() -> list[str]:
    """The import path workers need: this checkout / bundle, then this process's path."""
    paths = [str(_ROOT), *(p for p in sys.path if p and Path(p).is_dir()),
             *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return list(dict.fromkeys(paths))


@dataclass
class _Member:
    id: int
    proc: subprocess.Popen[bytes]
    log: Path
    conn: Connection | None = None
    broken: bool = False

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def send(self, data: bytes) -> bool:
        if self.conn is None or self.broken:
            return False
        try:
            self.conn.send_bytes(data)
            return True
        except OSError:
            self.broken = True
            return False

    def recv(self) -> tuple[Any, ...] | None:
        assert self.conn is not None
        try:
            msg: tuple[Any, ...] = pickle.loads(self.conn.recv_bytes())
            return msg
        except (EOFError, OSError):
            self.broken = True
            return None


def _msg(*parts: Any) -> bytes:
    return pickle.dumps(parts, protocol=pickle.HIGHEST_PROTOCOL)


class ProcessPool(WorkerPool):
    """K persistent worker processes of one site (see the module docstring)."""

    mode = "process"

    def __init__(self, site: SiteConfig, *, name: str = "site", device: str = "cpu",
                 task_blob: bytes | None = None, sys_path: list[str] | None = None) -> None:
        super().__init__(site, name=name, device=device)
        self.members: list[_Member] = []
        self._task_blob = task_blob
        self._sys_path = sys_path or worker_path()
        self._next_id = 0
        self._store: str | None = None  # the current generation's file store
        self._dir: Path | None = None
        self._listener: Listener | None = None
        self._accepted: queue.Queue[Connection] = queue.Queue()
        self.threads = 0
        self.started_pids: list[int] = []

    @property
    def size(self) -> int:
        return len(self.members)

    def pids(self) -> list[int]:
        """PIDs of the current workers, by rank."""
        return [m.pid for m in self.members]

    # -- start-up ---------------------------------------------------------------------------------
    def _open(self) -> Path:
        if self._dir is None:
            root = os.environ.get("FEDAGG_SITE_TMPDIR") or None
            sweep_stale_pools(root)
            self._dir = Path(tempfile.mkdtemp(prefix=f"fedagg-{self.name}-pool-", dir=root))
            os.chmod(self._dir, 0o700)
            (self._dir / "owner").write_text(f"{os.getpid()} {_start_time(os.getpid())}")
            key = secrets.token_bytes(32)
            fd = os.open(self._dir / "key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(key)
            if sys.platform.startswith("linux"):
                # abstract namespace: no file, so no AF_UNIX path-length limit (108 bytes)
                # under a long $FEDAGG_SITE_TMPDIR; access is the HMAC key in the 0700 dir
                address = "\0fedagg-pool-" + secrets.token_hex(12)
            else:
                address = str(self._dir / "ctl.sock")
            self._listener = Listener(address, family="AF_UNIX", authkey=key)
            if not address.startswith("\0"):
                os.chmod(address, 0o600)
            (self._dir / "address").write_text(address)
            threading.Thread(target=self._accept, args=(self._listener,), daemon=True,
                             name=f"{self.name}-pool-accept").start()
        return self._dir

    def _accept(self, listener: Listener) -> None:
        while not self.closed:
            try:
                conn = listener.accept()
            except OSError:
                return  # closed
            except Exception as exc:  # a client that failed the challenge
                _log.warning("%s: refused a connection to the worker pool: %s", self.name, exc)
                continue
            self._accepted.put(conn)

    def _spawn(self, n: int, blob: bytes) -> list[_Member]:
        pool_dir = self._open()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(self._sys_path)}
        new: list[_Member] = []
        for _ in range(n):
            mid, self._next_id = self._next_id, self._next_id + 1
            log = pool_dir / f"worker-{mid}.log"
            with open(log, "wb") as fh:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "clients.pool_worker", str(pool_dir), str(mid),
                     str(os.getpid())],
                    stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, env=env,
                    cwd=str(pool_dir))
            new.append(_Member(mid, proc, log))
            self.started_pids.append(proc.pid)
        _log.info("%s: started %d worker processes %s", self.name, n, [m.pid for m in new])
        by_id = {m.id: m for m in new}
        waiting = set(by_id)
        deadline = time.monotonic() + STARTUP_S + self.site.worker_timeout
        while waiting:
            for m in new:
                if m.id in waiting and m.proc.poll() is not None:
                    raise WorkerError(self._start_error(m, "exited during start-up"))
            if time.monotonic() > deadline:
                raise WorkerError(self._start_error(by_id[min(waiting)], "did not connect"))
            try:
                conn = self._accepted.get(timeout=POLL_S)
            except queue.Empty:
                continue
            try:
                hello = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                continue
            m2 = by_id.get(int(hello[1])) if hello[0] == "hello" else None
            if m2 is None:
                conn.close()
                continue
            m2.conn = conn
            waiting.discard(m2.id)
        setup = _msg("setup", blob, self.threads, self.device)
        for m in new:
            m.send(setup)
        self._expect(new, "ready")
        return new

    def _start_error(self, m: _Member, what: str) -> str:
        return explain(f"{self.name}: worker process {m.pid}", what,
                       "a site worker must start, connect to its pool and load the task",
                       "see its log below; is the task importable in a fresh process?") + \
            f"\n--- worker log ---\n{_tail(m.log)}"

    def _expect(self, members: list[_Member], what: str) -> None:
        """Wait for reply ``what`` from every member (start-up and group changes)."""
        pending = {m.id: m for m in members}
        deadline = time.monotonic() + STARTUP_S + self.site.worker_timeout
        while pending:
            conns = [m.conn for m in pending.values() if m.conn is not None]
            for conn in wait(conns, timeout=POLL_S):
                m = next(x for x in pending.values() if x.conn is conn)
                msg = m.recv()
                if msg is None:
                    continue
                if msg[0] == what:
                    del pending[m.id]
                elif msg[0] == "error":
                    raise WorkerError(explain(
                        f"{self.name}: worker process {m.pid}", f"failed before {what!r}",
                        "a site worker must load the task and join its group",
                        "fix the error below") + f"\n--- worker {m.id} ---\n{msg[1].rstrip()}")
            for m in list(pending.values()):
                if m.broken or m.proc.poll() is not None:
                    raise WorkerError(self._start_error(m, f"exited before {what!r}"))
            if time.monotonic() > deadline:
                m = next(iter(pending.values()))
                raise WorkerError(self._start_error(m, f"no {what!r} within the start-up time"))

    def _ensure(self, job: WorkerJob, info: RoundInfo) -> None:
        for m in self.members:  # drain what came in since the last round; EOF: the worker died
            while m.conn is not None and not m.broken and m.conn.poll(0):
                if m.recv() is None:
                    break
        dead = [m for m in self.members if m.broken or m.proc.poll() is not None]
        if dead:
            _log.warning("%s: %d worker process(es) %s died since the last round; replacing",
                         self.name, len(dead), [m.pid for m in dead])
            self._kill(dead)
            self.members = [m for m in self.members if m not in dead]
            self._dirty = True
        need = self.k - len(self.members)
        if not need and not self._dirty:
            return
        blob = self._task_blob
        if blob is None:
            blob = _pickle_task(job)
            self._task_blob = blob
        self.threads = job.threads or max(1, (os.cpu_count() or 1) // self.k)
        optimizer = None
        if job.keep_optimizer and need and self.members:
            optimizer = self._optimizer_of(self.members[0])
        new = self._spawn(need, blob) if need else []
        info.started += len(new)
        self.members += new
        self._regroup(list(range(len(self.members))), optimizer)

    def _optimizer_of(self, m: _Member) -> dict[str, Any] | None:
        if not m.send(_msg("optimizer")):
            return None
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline and m.conn is not None:
            if wait([m.conn], timeout=POLL_S):
                msg = m.recv()
                if msg is None:
                    return None
                if msg[0] == "optimizer":
                    state: dict[str, Any] | None = msg[1]
                    return state
        return None

    def _regroup(self, ranks: list[int], optimizer: dict[str, Any] | None) -> None:
        self.members = [self.members[r] for r in ranks]
        timeout = self.site.worker_timeout * 1.5 + 5.0
        self.generation += 1
        store = str(self._open() / f"store-{self.generation}")  # in the 0700 directory
        for rank, m in enumerate(self.members):
            m.send(_msg("group", self.generation, rank, len(self.members), store, timeout,
                        self.layout, optimizer))
        self._expect(self.members, "grouped")
        old, self._store = self._store, store
        if old is not None:  # every worker left that generation's group
            with contextlib.suppress(OSError):
                os.unlink(old)
        self._dirty = False

    def _drop(self, ranks: list[int]) -> None:
        gone = [self.members[r] for r in ranks]
        self._kill(gone)
        self.members = [m for m in self.members if m not in gone]
        self._dirty = True

    # -- one attempt ------------------------------------------------------------------------------
    def _attempt(self, job: WorkerJob, data: SiteData | None
                 ) -> tuple[list[WorkerResult], list[Failure]]:
        members = list(self.members)
        k = len(members)
        payload = _msg("train", dataclasses.replace(job, task=None))  # type: ignore[arg-type]
        for m in members:
            m.send(payload)
        progress = Progress(k)
        results: dict[int, WorkerResult] = {}
        failures: dict[int, Failure] = {}
        released: set[int] = set()
        first: float | None = None
        timeout = self.site.worker_timeout
        t_round = time.monotonic()
        while True:
            conns = {id(m.conn): r for r, m in enumerate(members)
                     if m.conn is not None and not m.broken}
            if conns:
                ready = wait([members[r].conn for r in conns.values()],  # type: ignore[misc]
                             timeout=POLL_S)
            else:
                ready = []
                time.sleep(POLL_S)
            for conn in ready:
                r = conns[id(conn)]
                msg = members[r].recv()
                if msg is None:
                    continue
                if msg[0] == "progress":
                    progress.update(r, msg[1])
                elif msg[0] == "result":
                    results[r] = msg[1]
                elif msg[0] == "error":
                    failures.setdefault(r, _raised(r, msg[1], msg[2], members[r].pid))
                elif msg[0] == "released":
                    released.add(r)
            for r, m in enumerate(members):
                rc = m.proc.poll()
                if rc is not None and r not in results and not (r in failures
                                                                and failures[r].lost):
                    failures[r] = _died(r, m, rc)
            if first is None:
                for r in progress.stalled(timeout, skip=set(results)):
                    if r not in failures:
                        failures[r] = progress.hung(r, timeout, members[r].pid)
                        self._kill([members[r]])
            if failures and first is None:
                first = time.monotonic()
                _log.info("%s: worker failure after %.2f s of the round: %s", self.name,
                          first - t_round, "; ".join(f"worker {f.rank}: {f.cause[:80]}"
                                                     for f in failures.values()))
            if not failures and len(results) == k:
                return list(results.values()), []
            if first is not None:
                settled = all(r in results or r in released or (r in failures and failures[r].lost)
                              for r in range(k))
                if settled or time.monotonic() - first > RECOVER_S:
                    _log.info("%s: workers settled %.2f s after the failure", self.name,
                              time.monotonic() - first)
                    for r in range(k):
                        if not (r in results or r in released or (r in failures
                                                                  and failures[r].lost)):
                            failures[r] = Failure(
                                r, f"did not leave the broken group within {RECOVER_S:.0f} s",
                                _stacks(members[r]), primary=False, lost=True,
                                pid=members[r].pid)
                            _log.warning("%s: worker %d did not leave the broken group within "
                                         "%.0f s; its threads:\n%s", self.name, r, RECOVER_S,
                                         failures[r].detail)
                            self._kill([members[r]])
                    return list(results.values()), list(failures.values())

    def _recover(self, failures: list[Failure]) -> list[int]:
        lost = sorted({f.rank for f in failures if f.lost})
        self._kill([self.members[r] for r in lost])
        return [r for r in range(len(self.members)) if r not in lost]

    # -- shutdown ---------------------------------------------------------------------------------
    def _kill(self, members: list[_Member]) -> None:
        for m in members:
            if m.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(m.pid, signal.SIGKILL)
        for m in members:
            try:
                m.proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                _log.error("worker process %d did not exit after SIGKILL", m.pid)
            if m.conn is not None:
                m.conn.close()
            m.broken = True

    def close(self) -> None:
        """Ask every worker to exit, kill those that do not within 5 s (by PID), reap them."""
        self.closed = True
        members, self.members = self.members, []
        stop = _msg("stop")
        for m in members:
            m.send(stop)
        deadline = time.monotonic() + 5.0
        for m in members:
            with contextlib.suppress(subprocess.TimeoutExpired):
                m.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        self._kill(members)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
            self._listener = None
        self._store = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _raised(rank: int, text: str, kind: str, pid: int) -> Failure:
    last = text.strip().splitlines()[-1] if text.strip() else "an error"
    detail = "\n".join(text.strip().splitlines()[-8:])
    if kind == "lost":
        return Failure(rank, f"lost: {last[:300]}", detail, primary=True, lost=True, pid=pid)
    consequence = kind == "collective" or any(s in text for s in _CONSEQUENCE)
    return Failure(rank, f"raised {last[:300]}", detail, primary=not consequence, pid=pid)


def _died(rank: int, m: _Member, rc: int) -> Failure:
    if rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = str(-rc)
        cause = f"died: killed by signal {sig} (exit code {rc})"
    else:
        cause = f"died: exited with code {rc}"
    return Failure(rank, cause, _tail(m.log), primary=True, lost=True, pid=m.pid)


def _stacks(m: _Member, wait_s: float = 1.0) -> str:
    """Every thread's stack of a stuck worker (it dumps them to its log on SIGUSR1)."""
    before = m.log.stat().st_size if m.log.exists() else 0
    with contextlib.suppress(ProcessLookupError):
        os.kill(m.pid, signal.SIGUSR1)
    time.sleep(wait_s)
    try:
        with open(m.log, "rb") as fh:
            fh.seek(before)
            return fh.read(20_000).decode(errors="replace").strip()
    except OSError:
        return ""


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def _pickle_task(job: WorkerJob) -> bytes:
    """The task as bytes for the worker processes; an unpicklable task is named, with the fix."""
    try:
        return pickle.dumps(job.task)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ConfigError(explain(
            "site.mode", "process",
            f"the Task must be picklable to reach the worker processes ({exc})",
            "define the model, data, loss, optimizer and step functions at module level "
            "(not lambdas or nested functions), or use site.mode = 'inprocess'")) from None
