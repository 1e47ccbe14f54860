"""In-process communicator: one thread per rank, one FIFO queue per ordered pair of ranks.

Sends copy the tensor into the destination's queue and complete at once, so no send ever
blocks and no schedule can deadlock; receives block (with the communicator's timeout) until
the matching message arrived. Used by unit tests and by single-process simulation of a site.

Examples
--------
>>> import torch
>>> from fedagg.collectives import all_reduce
>>> from fedagg.collectives.backends.inprocess import run_inprocess
>>> out = run_inprocess(3, lambda comm: all_reduce(torch.ones(4), comm=comm).tolist())
>>> out[0]
[3.0, 3.0, 3.0, 3.0]
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar, cast, overload

import torch

from fedagg.collectives.communicator import DEFAULT_TIMEOUT_S, Request
from fedagg.errors import CollectiveError, CollectiveTimeout, ConfigError, explain

__all__ = ["InProcessCommunicator", "InProcessGroup", "run_inprocess"]

_log = logging.getLogger(__name__)
_POLL_S = 0.05

T = TypeVar("T")


class _Done:
    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True


class _Recv:
    def __init__(
        self,
        group: InProcessGroup,
        box: queue.Queue[torch.Tensor],
        buf: torch.Tensor,
        src: int,
        dst: int,
        timeout: float,
    ) -> None:
        self._group, self._box, self._buf = group, box, buf
        self._src, self._dst, self._timeout = src, dst, timeout
        self._done = False

    def done(self) -> bool:
        return self._done

    def wait(self) -> None:
        if self._done:
            return
        deadline = time.monotonic() + self._timeout
        while True:
            self._group.check_aborted()
            try:
                msg = self._box.get(timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))
                break
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise CollectiveTimeout(
                        explain(
                            "recv",
                            f"rank {self._dst} <- rank {self._src}",
                            f"no message within timeout={self._timeout}s",
                            "check that every rank calls the same collectives in the same "
                            "order, or raise the timeout",
                        )
                    ) from None
        # Like gloo, a byte buffer takes a shorter message (its prefix is filled).
        short = msg.dtype == self._buf.dtype == torch.uint8 and msg.numel() < self._buf.numel()
        if short:
            self._buf[: msg.numel()].copy_(msg)
            self._done = True
            return
        if msg.dtype != self._buf.dtype or msg.numel() != self._buf.numel():
            raise CollectiveError(
                explain(
                    "recv",
                    f"{msg.numel()} x {msg.dtype} from rank {self._src}",
                    f"does not match the posted buffer {self._buf.numel()} x "
                    f"{self._buf.dtype} on rank {self._dst}",
                    "call all_reduce with the same length and dtype on every rank",
                )
            )
        self._buf.copy_(msg.view_as(self._buf))
        self._done = True


class InProcessGroup:
    """Shared state of ``world_size`` in-process ranks (queues, barrier, abort flag).

    Parameters
    ----------
    world_size : int
        Number of ranks, >= 1.
    timeout : float
        Seconds a receive or barrier may wait.
    """

    def __init__(self, world_size: int, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(
                explain(
                    "world_size",
                    world_size,
                    "must be an int >= 1",
                    "pass the number of in-process ranks",
                )
            )
        if not timeout > 0:
            raise ConfigError(explain("timeout", timeout, "must be > 0", "pass seconds, e.g. 60"))
        self.world_size = world_size
        self.timeout = float(timeout)
        self._boxes = {
            (s, d): queue.Queue[torch.Tensor]()
            for s in range(world_size)
            for d in range(world_size)
            if s != d
        }
        self._barrier = threading.Barrier(world_size)
        self._aborted = threading.Event()
        self._abort_reason = ""
        self._slots: list[torch.Tensor | None] = [None] * world_size

    def communicators(self) -> list[InProcessCommunicator]:
        """One communicator per rank, to hand to ``world_size`` threads."""
        return [InProcessCommunicator(self, r) for r in range(self.world_size)]

    def abort(self, reason: str = "a peer failed") -> None:
        """Make every pending and future wait of this group raise CollectiveError."""
        self._abort_reason = reason
        self._aborted.set()
        self._barrier.abort()

    def check_aborted(self) -> None:
        """Raise CollectiveError if :meth:`abort` was called."""
        if self._aborted.is_set():
            raise CollectiveError(f"in-process group aborted: {self._abort_reason}")

    def box(self, src: int, dst: int) -> queue.Queue[torch.Tensor]:
        """The FIFO carrying messages from ``src`` to ``dst``."""
        return self._boxes[(src, dst)]

    def barrier_wait(self, rank: int) -> None:
        """Wait on the shared barrier, translating timeouts and aborts."""
        self.check_aborted()
        try:
            self._barrier.wait(timeout=self.timeout)
        except threading.BrokenBarrierError:
            self.check_aborted()
            raise CollectiveTimeout(
                explain(
                    "barrier",
                    f"rank {rank}",
                    f"not all ranks arrived within timeout={self.timeout}s",
                    "check that every rank calls the same collectives",
                )
            ) from None

    def native_all_reduce(self, rank: int, tensor: torch.Tensor, op: str) -> None:
        """Reference all-reduce: every rank sums all deposited tensors in rank order."""
        self._slots[rank] = tensor.detach().clone()
        self.barrier_wait(rank)
        slots = list(self._slots)
        self.barrier_wait(rank)
        shapes = {(t.numel(), t.dtype) for t in slots if t is not None}
        if len(shapes) != 1:
            raise CollectiveError(
                explain(
                    "tensor",
                    sorted(map(str, shapes)),
                    "length and dtype differ across ranks",
                    "pass the same length and dtype on every rank",
                )
            )
        acc_dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        total = torch.zeros(tensor.numel(), dtype=acc_dtype)
        for t in slots:
            if t is not None:
                total += t.reshape(-1).to(acc_dtype)
        if op == "avg":
            total /= self.world_size
        tensor.copy_(total.view_as(tensor))


class InProcessCommunicator:
    """One rank of an :class:`InProcessGroup`; implements the Communicator protocol."""

    def __init__(self, group: InProcessGroup, rank: int) -> None:
        self._group = group
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._group.world_size

    @property
    def timeout(self) -> float:
        return self._group.timeout

    @property
    def pipelined(self) -> bool:
        return True

    def _peer(self, peer: int, name: str) -> None:
        if not 0 <= peer < self.world_size or peer == self._rank:
            raise CollectiveError(
                explain(
                    name,
                    peer,
                    f"must be another rank in [0, {self.world_size})",
                    "fix the schedule",
                )
            )

    def isend(self, tensor: torch.Tensor, dst: int) -> Request:
        self._peer(dst, "dst")
        self._group.check_aborted()
        self._group.box(self._rank, dst).put(tensor.detach().clone())
        return _Done()

    def irecv(self, tensor: torch.Tensor, src: int) -> Request:
        self._peer(src, "src")
        return _Recv(
            self._group, self._group.box(src, self._rank), tensor, src, self._rank, self.timeout
        )

    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
    ) -> list[Request]:
        out = [self.isend(t, d) for t, d in sends]
        out.extend(self.irecv(t, s) for t, s in recvs)
        return out

    def barrier(self) -> None:
        self._group.barrier_wait(self._rank)

    def native_all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        self._group.native_all_reduce(self._rank, tensor, op)


@overload
def run_inprocess(
    world_size: int,
    fn: Callable[[InProcessCommunicator], T],
    *,
    timeout: float = ...,
    return_exceptions: Literal[False] = ...,
) -> list[T]: ...


@overload
def run_inprocess(
    world_size: int,
    fn: Callable[[InProcessCommunicator], T],
    *,
    timeout: float = ...,
    return_exceptions: Literal[True],
) -> list[T | BaseException]: ...


def run_inprocess(
    world_size: int,
    fn: Callable[[InProcessCommunicator], T],
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    return_exceptions: bool = False,
) -> list[T] | list[T | BaseException]:
    """Run ``fn(comm)`` on ``world_size`` threads, one per rank; return results by rank.

    Parameters
    ----------
    world_size : int
        Number of ranks.
    fn : callable
        Called once per rank with that rank's communicator.
    timeout : float
        Per-wait timeout of the group.
    return_exceptions : bool
        If true, a rank's exception is returned in its slot (and the group is not aborted).
        If false (default), the first failure aborts the group, so the other ranks stop
        waiting, and the exception of the lowest failing rank is re-raised.
    """
    group = InProcessGroup(world_size, timeout=timeout)
    comms = group.communicators()
    results: list[T | BaseException | None] = [None] * world_size
    failed: list[int] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(comms[rank])
        except BaseException as exc:  # handed to the caller below
            results[rank] = exc
            failed.append(rank)
            if not return_exceptions:
                group.abort(f"rank {rank} raised {type(exc).__name__}: {exc}")

    threads = [
        threading.Thread(target=body, args=(r,), name=f"fedagg-rank{r}", daemon=True)
        for r in range(world_size)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed and not return_exceptions:
        first = min(failed)
        for r in sorted(failed):
            _log.debug("rank %d failed: %r", r, results[r])
        err = results[first]
        if isinstance(err, BaseException):
            raise err
    return [cast("T | BaseException", r) for r in results]
