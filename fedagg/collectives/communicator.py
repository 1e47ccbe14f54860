"""The transport seam: the :class:`Communicator` protocol every all-reduce runs over.

Algorithms never talk to a transport directly; they post non-blocking point-to-point
messages through a communicator and wait on the returned :class:`Request` s. Two backends
implement it:

* :class:`fedagg.collectives.backends.torch_dist.TorchDistCommunicator` -- torch.distributed
  point-to-point (gloo on CPU, NCCL on GPU). The only module that imports torch.distributed.
* :class:`fedagg.collectives.backends.inprocess.InProcessCommunicator` -- threads and queues,
  for unit tests and simulation.

Every wait has a timeout: a peer that never answers raises
:class:`~fedagg.errors.CollectiveTimeout` instead of hanging.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

__all__ = ["DEFAULT_TIMEOUT_S", "Communicator", "Request", "sendrecv"]

DEFAULT_TIMEOUT_S = 120.0
"""Default seconds a rank waits for a peer before raising CollectiveTimeout."""


@runtime_checkable
class Request(Protocol):
    """Handle of one posted send or receive."""

    def wait(self) -> None:
        """Block until the operation completed (receive: data is in the buffer).

        Raises
        ------
        CollectiveTimeout
            The peer did not answer within the communicator's timeout.
        CollectiveError
            The transport failed or the message did not fit the buffer.
        """
        ...

    def done(self) -> bool:
        """Whether the operation completed (never blocks; errors surface in :meth:`wait`)."""
        ...


@runtime_checkable
class Communicator(Protocol):
    """Point-to-point messaging among ``world_size`` ranks, plus a barrier.

    Messages between one ordered pair of ranks are matched in the order they were posted, so
    both sides must post them in the same order (the executor does, from the schedule).
    """

    @property
    def rank(self) -> int:
        """This rank, in ``[0, world_size)``."""
        ...

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        ...

    @property
    def timeout(self) -> float:
        """Seconds any single wait may block before raising CollectiveTimeout."""
        ...

    @property
    def pipelined(self) -> bool:
        """Whether single sends and receives may be interleaved freely.

        ``False`` for NCCL, where unrelated point-to-point calls to one peer share a stream and
        a receive posted before a send can deadlock; the executor then posts each step as one
        :meth:`exchange`.
        """
        ...

    def isend(self, tensor: torch.Tensor, dst: int) -> Request:
        """Post a send of ``tensor`` (contiguous) to ``dst`` without blocking.

        The tensor must not be modified until the request completed.
        """
        ...

    def irecv(self, tensor: torch.Tensor, src: int) -> Request:
        """Post a receive from ``src`` into ``tensor`` (same length and dtype as sent).

        A ``torch.uint8`` buffer also takes a shorter message, which fills its prefix (as gloo
        does for any buffer); the consistency header relies on that. A longer message is an
        error (gloo aborts the process), so receives must never be shorter than the message.
        """
        ...

    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
    ) -> list[Request]:
        """Post ``sends`` and ``recvs`` together (grouped where the backend needs it).

        Because everything is posted before anything is waited on, paired exchanges cannot
        deadlock. Returns the requests of ``sends`` then ``recvs``, in order.
        """
        ...

    def barrier(self) -> None:
        """Block until every rank reached the barrier (or raise CollectiveTimeout)."""
        ...

    def native_all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        """The backend's own all-reduce of ``tensor`` in place; ``op`` is ``"sum"``/``"avg"``."""
        ...


def sendrecv(
    comm: Communicator,
    send: torch.Tensor | None,
    dst: int | None,
    recv: torch.Tensor | None,
    src: int | None,
) -> None:
    """Paired blocking send and receive that cannot deadlock.

    Both operations are posted before either is waited on, so two ranks that ``sendrecv`` to
    each other (or around a ring) always make progress.

    Parameters
    ----------
    comm : Communicator
        The transport.
    send, dst : torch.Tensor and int, or None
        What to send and to whom; ``None`` to only receive.
    recv, src : torch.Tensor and int, or None
        Buffer to receive into and from whom; ``None`` to only send.
    """
    sends = [(send, dst)] if send is not None and dst is not None else []
    recvs = [(recv, src)] if recv is not None and src is not None else []
    for req in comm.exchange(sends, recvs):
        req.wait()
