"""The server's sum of masked uploads, and what a completed round returns.

``UploadSum`` adds each packed upload into the running ``uint32`` sum mod ``2^b`` as it
arrives (in worker threads for large vectors, bit-identical to the serial loop);
:class:`RoundResult` is the outcome of :meth:`fedagg.secagg.server.ServerState.finish_round`
(importable from :mod:`fedagg.secagg.server` and :mod:`fedagg.secagg` as well).
"""

from __future__ import annotations

import dataclasses
import queue
from concurrent.futures import Future

import numpy as np
from numpy.typing import NDArray

from fedagg.secagg import fixed_point, packing
from fedagg.secagg.threads import pool

__all__ = ["RoundResult", "UploadSum"]

Ids = tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class RoundResult:
    """Outcome of a completed round.

    Attributes
    ----------
    mean : numpy.ndarray
        Weighted mean ``sum w x / sum w`` of the counted sites (float64, flat).
    total_weight : float
        ``sum w`` of the counted sites, in the caller's units (examples).
    counted : tuple of int
        Sites whose update is in the sum (uploaded, including those that dropped later).
    dropped : tuple of int
        Participants that did not upload (removed; they must re-key to rejoin).
    frac_bits : int
        Fixed-point fractional bits used in this round.
    error_bound : float
        Worst-case absolute quantisation error of ``mean`` (for clipped inputs).
    ring_bits : int
        Width ``b`` of the ring ``Z_2^b`` (bits per masked value on the wire).
    total : numpy.ndarray or None
        The unmasked sum itself, ``dim + 1`` ``uint32`` elements mod ``2^b`` (only the low
        ``ring_bits`` bits count; the last element is the summed quantised weight). ``mean``
        is its fixed-point decoding; inputs that are not fixed-point values (packed vote
        counters uploaded with :meth:`ClientState.handle_round_encoded`) are read from here.
    """

    epoch: int
    round: int
    mean: NDArray[np.float64]
    total_weight: float
    counted: Ids
    dropped: Ids
    frac_bits: int
    error_bound: float
    ring_bits: int = fixed_point.MAX_RING_BITS
    total: NDArray[np.uint32] | None = None

    def __repr__(self) -> str:
        return (
            f"RoundResult(epoch={self.epoch}, round={self.round}, dim={self.mean.size}, "
            f"counted={list(self.counted)}, dropped={list(self.dropped)})"
        )


class UploadSum:
    """Running sum of packed uploads, added on arrival (in worker threads when ``threads > 1``).

    With one thread, :meth:`add` unpacks and adds in the caller. With more, each upload is
    handed to :func:`~fedagg.secagg.threads.pool` and added into one of up to ``threads``
    private ``uint32`` sums (a task takes a free one or makes a new one), so the server goes on
    validating the next reply meanwhile; :meth:`result` waits and adds the private sums
    (addition mod ``2^b`` commutes: the same total as the serial loop).
    """

    def __init__(self, n: int, bits: int, threads: int) -> None:
        # a small vector is added faster than a task is handed to a thread
        self.n, self.bits, self.threads = n, bits, threads if n >= 1 << 16 else 1
        self._sums: list[NDArray[np.uint32]] = []
        self._free: queue.SimpleQueue[NDArray[np.uint32]] = queue.SimpleQueue()
        self._futures: list[Future[None]] = []

    def _take(self) -> NDArray[np.uint32]:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            acc = np.zeros(self.n, np.uint32)
            self._sums.append(acc)  # list.append is atomic under the GIL
            return acc

    def _add(self, packed: NDArray[np.uint32]) -> None:
        acc = self._take()
        try:
            packing.add_unpacked(acc, packed, self.bits)
        finally:
            self._free.put(acc)

    def add(self, packed: NDArray[np.uint32]) -> None:
        """Add one upload (already checked for size and dtype)."""
        if self.threads <= 1:
            self._add(packed)
        else:
            self._futures.append(pool(self.threads).submit(self._add, packed))

    def cancel(self) -> None:
        """Drop the sum (pending additions that have not started are cancelled)."""
        for fut in self._futures:
            fut.cancel()

    def result(self) -> NDArray[np.uint32]:
        """The total (waits for pending additions; re-raises the first failure)."""
        for fut in self._futures:
            fut.result()
        if not self._sums:
            return np.zeros(self.n, np.uint32)
        total, *rest = self._sums
        for acc in rest:
            np.add(total, acc, out=total)
        return total
