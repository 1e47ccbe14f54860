"""torch.distributed point-to-point communicator (gloo on CPU, NCCL on GPU).

This is the only fedagg module that imports :mod:`torch.distributed`.

Examples
--------
Inside a process that called ``torch.distributed.init_process_group("gloo", ...)``::

    from fedagg.collectives import all_reduce
    from fedagg.collectives.backends.torch_dist import TorchDistCommunicator

    comm = TorchDistCommunicator(timeout=60.0)
    all_reduce(grad_bucket, algorithm="ring", op="avg", comm=comm)
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist

from fedagg.collectives.backends import group_sockets
from fedagg.collectives.communicator import DEFAULT_TIMEOUT_S, Request
from fedagg.errors import CollectiveError, CollectiveTimeout, ConfigError, WorkerError, explain

__all__ = [
    "TorchDistCommunicator",
    "all_reduce_max",
    "destroy_process_group",
    "file_store",
    "free_port",
    "host_store",
    "init_process_group",
    "is_initialized",
    "loopback_interface",
    "run_processes",
]

_log = logging.getLogger(__name__)


def is_initialized() -> bool:
    """Whether the default torch.distributed process group exists."""
    return bool(dist.is_available() and dist.is_initialized())


def default_group() -> Any:
    """The default process group object (``None`` before ``init_process_group``)."""
    if not is_initialized():
        return None
    return dist.distributed_c10d._get_default_group()


def _translate(exc: Exception, what: str, timeout: float) -> CollectiveError:
    text = str(exc)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return CollectiveTimeout(
            explain(
                what,
                text.splitlines()[0][:160],
                f"no answer within timeout={timeout}s",
                "check that every rank calls the same collectives in the same order, "
                "or raise the timeout",
            )
        )
    return CollectiveError(
        explain(
            what,
            text.splitlines()[0][:160] if text else type(exc).__name__,
            "the torch.distributed operation failed",
            "check that every rank passes the same length and dtype, and that no peer crashed",
        )
    )


class _Work:
    def __init__(self, work: Any, what: str, timeout: float) -> None:
        self._work = work
        self._what = what
        self._timeout = timeout

    def wait(self) -> None:
        if self._work is None:
            return
        try:
            self._work.wait(timedelta(seconds=self._timeout))
        except Exception as exc:  # torch raises RuntimeError / DistBackendError subclasses
            raise _translate(exc, self._what, self._timeout) from exc
        self._work = None

    def done(self) -> bool:
        if self._work is None:
            return True
        try:
            return bool(self._work.is_completed())
        except Exception:  # a failed operation: wait() raises the translated error
            return True


_directional: dict[int, tuple[Any, Any, Any]] = {}
_directional_lock = threading.Lock()


def _direction_groups(base: Any, ranks: list[int]) -> tuple[Any, Any]:
    """Two gloo groups over ``ranks``: one for messages to a higher rank, one to a lower.

    Created once per base group (collectively, by every member, like ``new_group``) and
    shared by all communicators over it.
    """
    with _directional_lock:  # two threads must not create them twice (ranks would disagree)
        hit = _directional.get(id(base))
        if hit is not None and hit[0] is base:
            return hit[1], hit[2]
        with group_sockets.owned():
            up = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
            down = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
        _directional[id(base)] = (base, up, down)
        return up, down


class TorchDistCommunicator:
    """A Communicator over a torch.distributed process group.

    On gloo, point-to-point messages travel on two extra groups over the same ranks, one per
    direction (to a higher rank / to a lower rank), so that between two ranks each TCP pair
    carries data one way. gloo writes a send on the calling thread while holding the pair's
    mutex, and the pair's I/O thread, woken by incoming data, spins on that mutex meanwhile;
    with one pair per direction a rank's writes never hold the lock its incoming data needs.
    Hand-written N = 2 ring, paired vs native gloo: 16 MB 1.06-1.29x split vs 0.89-0.92x on
    one group; 1 MB 0.90-1.03x vs 0.76-0.82x (docs/benchmarks.md). Constructing the
    communicator is then collective over the group's ranks (the first time per group).

    Parameters
    ----------
    group : ProcessGroup, optional
        Group to communicate in; the default (world) group if ``None``. Ranks passed to
        :meth:`isend` / :meth:`irecv` are ranks *within* the group.
    timeout : float
        Seconds any wait may block before raising CollectiveTimeout.
    directional : bool
        Use the two per-direction groups for point-to-point messages (gloo only; every rank
        must pass the same value). ``False`` sends everything on ``group``.

    Raises
    ------
    CollectiveError
        If torch.distributed has not been initialized.
    """

    def __init__(
        self, group: Any = None, timeout: float = DEFAULT_TIMEOUT_S, directional: bool = True
    ) -> None:
        if not is_initialized():
            raise CollectiveError(
                explain(
                    "torch.distributed",
                    "not initialized",
                    "comm=None / TorchDistCommunicator needs the default process group",
                    "call torch.distributed.init_process_group(...) first, or pass "
                    "comm=InProcessGroup(n).communicators()[rank]",
                )
            )
        if not timeout > 0:
            raise ConfigError(explain("timeout", timeout, "must be > 0", "pass seconds"))
        self._group = group
        self._timeout = float(timeout)
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)
        self._backend = str(dist.get_backend(group)).lower()
        self._pg = group if group is not None else dist.distributed_c10d._get_default_group()
        self._globals = [
            r if group is None else dist.get_global_rank(group, r) for r in range(self._world)
        ]
        self._up = self._down = group  # the groups of messages to a higher / lower rank
        if directional and self.pipelined and self._world > 1:
            self._up, self._down = _direction_groups(self._pg, self._globals)
            self._pg_up, self._pg_down = self._up, self._down
        else:
            self._pg_up = self._pg_down = self._pg

    @property
    def rank(self) -> int:
        return int(self._rank)

    @property
    def world_size(self) -> int:
        return int(self._world)

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def backend(self) -> str:
        """Name of the torch.distributed backend (``"gloo"``, ``"nccl"``)."""
        return self._backend

    @property
    def pipelined(self) -> bool:
        return "nccl" not in self._backend

    def _peer(self, peer: int) -> int:
        if not 0 <= peer < self._world or peer == self._rank:
            raise CollectiveError(
                explain(
                    "peer", peer, f"must be another rank in [0, {self._world})", "fix the schedule"
                )
            )
        return self._globals[peer]

    def isend(self, tensor: torch.Tensor, dst: int) -> Request:
        try:
            group = self._up if self._rank < dst else self._down
            work = dist.isend(tensor, self._peer(dst), group=group)
        except CollectiveError:
            raise
        except Exception as exc:
            raise _translate(exc, "isend", self._timeout) from exc
        return _Work(work, f"send {self._rank}->{dst}", self._timeout)

    def irecv(self, tensor: torch.Tensor, src: int) -> Request:
        try:
            group = self._up if src < self._rank else self._down
            work = dist.irecv(tensor, self._peer(src), group=group)
        except CollectiveError:
            raise
        except Exception as exc:
            raise _translate(exc, "irecv", self._timeout) from exc
        return _Work(work, f"recv {self._rank}<-{src}", self._timeout)

    def run_plan(
        self,
        runner: Any,
        work: torch.Tensor,
        scratch: torch.Tensor,
        head: torch.Tensor | None,
        rbuf: torch.Tensor | None,
        sbuf: torch.Tensor | None,
        cap: int,
    ) -> tuple[bool, list[tuple[int, Request]], list[Request]]:
        """Run a compiled plan on the C++ runner (:mod:`fedagg.collectives.plan_runner`).

        Used by :func:`fedagg.collectives.executor.execute` on a pipelined group; ``head``,
        ``rbuf``, ``sbuf``, ``cap`` describe the consistency-header round (``None`` / 0
        without it). Returns ``(agree, posted data receives as (source, request), pending
        header sends)``; the lists are empty when the headers agreed and the plan ran.

        Raises
        ------
        CollectiveTimeout
            A peer did not answer within :attr:`timeout`.
        CollectiveError
            The transport failed.
        """
        try:
            ok, posted, sources, sends = runner.run(
                self._pg_up,
                self._pg_down,
                self._rank,
                self._world,
                work,
                scratch,
                head,
                rbuf,
                sbuf,
                cap,
                max(1, int(self._timeout * 1000)),
            )
        except Exception as exc:
            raise _translate(exc, "all-reduce plan", self._timeout) from exc
        return (
            bool(ok),
            [
                (int(s), _Work(w, f"recv {self._rank}<-{s}", self._timeout))
                for s, w in zip(sources, posted, strict=True)
            ],
            [_Work(w, f"header send from {self._rank}", self._timeout) for w in sends],
        )

    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
    ) -> list[Request]:
        if self.pipelined:
            out = [self.isend(t, d) for t, d in sends]
            out.extend(self.irecv(t, s) for t, s in recvs)
            return out
        ops = [dist.P2POp(dist.isend, t, self._peer(d), self._group) for t, d in sends]
        ops += [dist.P2POp(dist.irecv, t, self._peer(s), self._group) for t, s in recvs]
        if not ops:
            return []
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as exc:
            raise _translate(exc, "batch_isend_irecv", self._timeout) from exc
        reqs: list[Request] = [_Work(w, "batch_isend_irecv", self._timeout) for w in works]
        return reqs

    def barrier(self) -> None:
        try:
            if "gloo" in self._backend:
                dist.monitored_barrier(self._group, timeout=timedelta(seconds=self._timeout))
            else:
                work = dist.barrier(self._group, async_op=True)
                _Work(work, "barrier", self._timeout).wait()
        except CollectiveError:
            raise
        except Exception as exc:
            raise _translate(exc, "barrier", self._timeout) from exc

    def native_all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        try:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
        except Exception as exc:
            raise _translate(exc, "all_reduce", self._timeout) from exc
        _Work(work, "all_reduce", self._timeout).wait()
        if op == "avg":
            tensor.div_(self._world)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise max across the default group, in place (for benchmark bookkeeping)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def _entry(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        try:
            out = fn(TorchDistCommunicator(timeout=timeout), *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_processes(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "gloo",
    timeout: float = 60.0,
    comm_timeout: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(comm, *args)`` in ``world_size`` fresh processes joined by torch.distributed.

    Processes are started with the ``spawn`` method, rendezvous over TCP on 127.0.0.1 (a free
    port) and get a :class:`TorchDistCommunicator`. ``fn`` must be importable (module level)
    and return something picklable.

    Parameters
    ----------
    backend : {"gloo", "nccl"}
        torch.distributed backend; NCCL puts rank ``r`` on GPU ``r``.
    timeout : float
        Seconds for the whole run; on expiry the processes started here are killed.
    comm_timeout : float
        Timeout of each process's communicator and process group.

    Returns
    -------
    list
        ``fn``'s return value per rank.

    Raises
    ------
    WorkerError
        A process raised (its traceback is in the message) or died.
    CollectiveTimeout
        The run did not finish within ``timeout``.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(r, world_size, port, backend, comm_timeout, fn, args, queue),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        while len(results) + len(failures) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectiveTimeout(
                    explain(
                        "run_processes",
                        f"{world_size} x {getattr(fn, '__name__', fn)}",
                        f"did not finish within timeout={timeout}s",
                        "raise the timeout or look for a rank that hangs",
                    )
                )
            try:
                rank, ok, payload = queue.get(timeout=min(left, 0.5))
            except Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and queue.empty():
                    time.sleep(0.2)
                    if queue.empty():
                        failures.append(f"process exited with code {dead[0].exitcode}")
                        break
                continue
            if ok:
                results[rank] = payload
            else:
                failures.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise WorkerError("\n".join(failures))
    return [results[r] for r in range(world_size)]


def host_store(timeout: float = DEFAULT_TIMEOUT_S) -> tuple[Any, int]:
    """Host a rendezvous TCPStore listening on 127.0.0.1 only; return ``(store, port)``.

    The store listens on a socket bound here to the loopback address at a port the OS picks
    (torch's own TCPStore server would listen on every interface), so no other machine can
    reach it and concurrent sites cannot pick the same port. It is **not** authenticated:
    every local user can connect, read and write keys. fedagg's site workers therefore
    rendezvous through :func:`file_store` in their pool's private directory instead.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = int(listener.getsockname()[1])
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, None, True, timeout=timedelta(seconds=timeout),
            wait_for_workers=False, master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server listens on this very descriptor now, and owns it
    return store, int(store.port)


def file_store(path: str) -> Any:
    """A rendezvous store in the file ``path`` (torch's ``FileStore``; created if missing).

    Only processes that can open ``path`` reach it: put it in a directory that only this user
    can enter (mode 0700), and no other local user can read or write a key -- there is no
    socket to connect to. The file is never removed by the store (remove it once the group is
    formed and left, or with its directory).
    """
    return dist.FileStore(path, -1)  # type: ignore[attr-defined]


def loopback_interface() -> str:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS)."""
    for _, name in socket.if_nameindex():
        try:
            with open(f"/sys/class/net/{name}/flags") as fh:
                if int(fh.read().strip(), 16) & 0x8:  # IFF_LOOPBACK
                    return name
        except (OSError, ValueError):
            continue
    return "lo0" if sys.platform == "darwin" else "lo"


def init_process_group(
    rank: int,
    world_size: int,
    *,
    port: int | None = None,
    store_path: str | None = None,
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT_S,
    host: str = "127.0.0.1",
) -> TorchDistCommunicator:
    """Join the default process group through a rendezvous store; return its communicator.

    The group's gloo sockets are bound to the loopback interface (``GLOO_SOCKET_IFNAME`` is set
    to it in this process): these groups join processes of one machine, and gloo would
    otherwise listen on the address the host name resolves to, reachable from the network.

    Parameters
    ----------
    rank, world_size : int
        This process's rank and the number of processes.
    port : int, optional
        Port of a TCPStore at ``host`` (see :func:`host_store`).
    store_path : str, optional
        The file of a :func:`file_store` (in a private directory): instead of ``port``.
    backend : {"gloo", "nccl"}
        torch.distributed backend (NCCL needs ``torch.cuda.set_device`` first).
    timeout : float
        Seconds for the rendezvous, for the process group and for the communicator's waits.

    Raises
    ------
    ConfigError
        Neither or both of ``port`` and ``store_path`` given.
    """
    if (port is None) == (store_path is None):
        raise ConfigError(explain("init_process_group", f"port={port}, store_path={store_path}",
                                  "exactly one rendezvous is needed",
                                  "pass store_path (a file in a private directory) or port"))
    if backend == "gloo":
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    with group_sockets.owned():
        if store_path is not None:
            store = file_store(store_path)
        elif port is not None:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                host, port, None, False, timeout=timedelta(seconds=timeout)
            )
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout)
        )
    return TorchDistCommunicator(timeout=timeout)


def destroy_process_group(*, close_leftovers: bool = False) -> int:
    """Destroy every process group if one exists (idempotent).

    Parameters
    ----------
    close_leftovers : bool
        Then shut down the sockets of the destroyed groups that an operation still in flight
        keeps open (:func:`fedagg.collectives.backends.group_sockets.shutdown_leftovers`):
        leaving a *broken* group, so that its peers' pending receives fail at once. Call it
        after the last reference to the group is dropped and garbage collected.

    Returns
    -------
    int
        How many leftover sockets were shut down.
    """
    if is_initialized():
        dist.destroy_process_group()
    return group_sockets.shutdown_leftovers() if close_leftovers else 0
