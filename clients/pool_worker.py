"""A persistent worker process of a site: ``python -m clients.pool_worker POOL_DIR MEMBER PPID``.

Started by :class:`clients.pool_proc.ProcessPool`; it lives for the whole run and serves one
command at a time from its controller over an authenticated local socket
(``multiprocessing.connection``, HMAC challenge with the key in the pool's private 0700
directory):

``("setup", task, threads, device)``   unpickle the user's :class:`~fedagg.task.Task` (once)
``("group", gen, rank, world, store, timeout, layout, optimizer)``
                                       leave the current process group, join the new one
                                       (torch.distributed, gloo on CPU / NCCL on GPU) through
                                       the file store ``store`` in the pool's private
                                       directory, with the site's agreed reducer layout (and
                                       optimizer state)
``("train", job)``                     train one round (:func:`clients.worker.train_worker`
                                       with this worker's :class:`WorkerState`); reply
                                       ``("result", WorkerResult)`` or ``("error", text, kind)``
                                       then ``("released",)`` once the group is left
``("optimizer",)``                     reply the kept optimizer state (for a replacement)
``("stop",)``                          leave the group and exit

While training, a heartbeat thread sends ``("progress", "<phase> <step> <n>")`` when the
state changed (at most every 50 ms), so that the controller tells a hung worker from one
waiting on a peer. The process exits when the controller's connection closes or its parent
process is gone (no orphans).

Leaving a broken group. gloo cannot abort a pending operation in place; its sockets close
only when every object holding the group is freed. After a failed round the worker therefore
drops the reducer (its thread, hooks and bucket views), the communicator, the cached
per-direction groups and the default group, and collects garbage. An operation still in
flight in one of gloo's own threads (a receive from a survivor that gave up on the round)
keeps its group's sockets open even then, so the sockets the groups opened that are still
open are shut down last
(:mod:`fedagg.collectives.backends.group_sockets`): its peers' pending receives then fail at
once ("connection closed by peer") instead of waiting for the timeout, and each of them
leaves in turn.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import pickle
import shutil
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any, NoReturn

import torch

from clients.worker import WorkerLost, WorkerResult, train_worker
from clients.worker_state import WorkerState
from fedagg.collectives import Communicator
from fedagg.errors import CollectiveError

__all__ = ["main"]

_log = logging.getLogger(__name__)
_BEAT_S = 0.05
_POOL_DIR: Path | None = None


def _orphaned(code: int = 0) -> NoReturn:
    """The controller is gone (killed?): remove the pool's directory it left, and exit."""
    if _POOL_DIR is not None:
        shutil.rmtree(_POOL_DIR, ignore_errors=True)
    os._exit(code)


class _Channel:
    """The connection to the controller; sends from several threads are serialised."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()
        self.state = ""
        self._sent = ""
        self.counter = 0

    def send(self, msg: tuple[Any, ...]) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._lock:
                self.conn.send_bytes(data)
        except OSError:
            _orphaned()  # the controller is gone: so is this worker

    def progress(self, phase: str, step: int) -> None:
        self.counter += 1
        self.state = f"{phase} {step} {self.counter}"

    def beat(self) -> None:
        while True:
            time.sleep(_BEAT_S)
            state = self.state
            if state != self._sent:
                self._sent = state
                self.send(("progress", state))


def _watch_parent(parent_pid: int) -> NoReturn:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            _orphaned(3)


def _release(state: WorkerState) -> None:
    """Leave the process group so that its sockets close (see the module docstring)."""
    from fedagg.collectives.backends import torch_dist

    state.release_group()
    # the per-direction groups are cached by the backend; they hold the group's sockets
    torch_dist._directional.clear()
    torch_dist.destroy_process_group()
    gc.collect()
    # what an operation still in flight keeps open (gloo cannot abort it): shut it down, so
    # that a peer waiting on this worker fails now instead of at the group's timeout
    left = torch_dist.destroy_process_group(close_leftovers=True)
    if left:
        _log.info("left the group: shut down %d sockets an abandoned operation kept open", left)


def _join(msg: tuple[Any, ...], device: str) -> tuple[Communicator, str]:
    from fedagg.collectives.backends import torch_dist

    _, _gen, rank, world, store, timeout, _layout, _opt = msg
    backend = "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
        device = f"cuda:{torch.cuda.current_device()}"
        backend = "nccl"
    comm = torch_dist.init_process_group(rank, world, store_path=store, backend=backend,
                                         timeout=timeout)
    return comm, device


def _kind(exc: BaseException) -> str:
    if isinstance(exc, WorkerLost):
        return "lost"
    return "collective" if isinstance(exc, CollectiveError) else "raised"


def serve(chan: _Channel, conn: Connection) -> int:
    """The command loop (see the module docstring); returns the exit status."""
    state = WorkerState()
    task: Any = None
    device = "cpu"
    base_device = "cpu"
    comm: Communicator | None = None
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            _orphaned()  # the controller closed the connection without "stop": it is gone
        op = msg[0]
        if op == "setup":
            task = pickle.loads(msg[1])
            if msg[2]:
                torch.set_num_threads(int(msg[2]))
            base_device = device = str(msg[3])
            chan.send(("ready",))
        elif op == "group":
            if comm is not None:
                comm = None
                _release(state)
            try:
                comm, device = _join(msg, base_device)
                state.adopt_layout(msg[6])
                if msg[7] is not None:
                    state.pending_optimizer = msg[7]
                chan.send(("grouped", msg[1]))
            except BaseException as exc:
                chan.send(("error", traceback.format_exc(limit=-6), _kind(exc)))
        elif op == "train":
            job = msg[1]
            job.task, job.device = task, device
            failed: tuple[str, str] | None = None
            try:
                assert comm is not None, "train before group"
                result: WorkerResult = train_worker(job, comm, progress=chan.progress, state=state)
                chan.progress("done", result.steps)
                chan.send(("result", result))
            except BaseException as exc:
                failed = (traceback.format_exc(limit=-8), _kind(exc))
            if failed is not None:
                # outside the except block: the exception's frames (which hold the reducer and
                # the communicator) are gone, so the group can really be freed
                chan.send(("error", *failed))
                comm = None
                _release(state)
                chan.send(("released",))
        elif op == "optimizer":
            chan.send(("optimizer", state.optimizer_state()))
        elif op == "stop":
            comm = None
            _release(state)
            return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m clients.pool_worker POOL_DIR MEMBER PARENT_PID``."""
    global _POOL_DIR
    args = sys.argv[1:] if argv is None else argv
    pool_dir, member, parent = Path(args[0]), int(args[1]), int(args[2])
    _POOL_DIR = pool_dir
    logging.basicConfig(level=logging.WARNING,
                        format=f"worker {member}: %(levelname)s %(name)s: %(message)s")
    # a worker that does not leave a broken group is asked for its stacks before it is killed
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    key = (pool_dir / "key").read_bytes()
    conn = Client((pool_dir / "address").read_text(), family="AF_UNIX", authkey=key)
    chan = _Channel(conn)
    chan.send(("hello", member, os.getpid()))
    threading.Thread(target=chan.beat, name="fedagg-heartbeat", daemon=True).start()
    try:
        rc = serve(chan, conn)
    finally:
        conn.close()
    # Skip the interpreter's teardown (seconds of C++ destructors after torch.distributed):
    # the group is left, nothing is buffered.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    # Run the copy imported as ``clients.pool_worker`` (not ``__main__``) so that pickled
    # objects name their real modules.
    from clients.pool_worker import main as _main

    raise SystemExit(_main())
