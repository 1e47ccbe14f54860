"""Execute a :class:`~fedagg.collectives.schedule.Schedule` on one rank over a Communicator.

Every transfer is split into segments of about ``segment_elems`` elements. In pipelined mode
(gloo, in-process) every receive of the call is posted before the first data send (each step
into its own scratch region, copy steps straight into the buffer), and as soon as segment ``k`` of every step-``s`` receive has been applied, segment ``k`` of the
step-``s + 1`` sends goes out, while the later segments of step ``s`` are still in flight: a
ring runs as a wavefront, and a tree forwards segment ``k`` upward while segment ``k + 1``
arrives from the children (the pipelined tree of the cost model). Reductions are in place,
with torch ops on whole segments.

In grouped mode (NCCL, where an unpaired receive can block a send on the same stream) each
step is posted as one :meth:`~fedagg.collectives.communicator.Communicator.exchange` and
waited on before the next.

Low-precision transport: the work buffer is float32 (or float64) and messages travel in
``wire_dtype``. Before a rank sends a ``copy`` transfer it rounds its own segment to the wire
dtype, so every rank ends with bit-identical values.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fedagg.collectives.communicator import Communicator, Request
from fedagg.collectives.schedule import Op, Schedule, Transfer, chunk_bounds

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "MAX_SEGMENTS",
    "RIDE_BYTES",
    "CollectiveStats",
    "HeaderExchange",
    "execute",
    "segments",
]

_log = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 4 << 20
"""Default pipelining segment, in bytes on the wire."""

MAX_SEGMENTS = 64
"""At most this many segments per chunk (bounds per-message overhead on huge tensors)."""

RIDE_BYTES = 1 << 20
"""A first segment of at most this many bytes (on the wire) rides in the header message.

With the consistency header on (:func:`fedagg.collectives.api.all_reduce`), segment 0 of the
first step-0 transfer between two ranks travels inside the header message when it is this
small: one message less per peer, which is what counts for small tensors. Every rank posts
the header receive with room for this many payload bytes before it knows its peers' inputs,
so the bound is a constant, never a per-call value. Larger segments go separately, after the
check, as without the header.
"""


@dataclass
class CollectiveStats:
    """Counters of one all-reduce call on one rank (for metrics).

    Attributes
    ----------
    algorithm : str
        Algorithm actually run (``auto`` resolved).
    world_size, rank, numel : int
        Shape of the call.
    dtype, wire_dtype : str
        Tensor dtype and dtype on the wire.
    bytes_sent, bytes_received : int
        Payload bytes this rank sent / received (excluding the header).
    messages_sent : int
        Point-to-point messages sent (segments), excluding the header.
    steps : int
        Schedule steps (0 for ``native``).
    header_bytes : int
        Bytes this rank sent for the consistency header.
    seconds : float
        Wall time of the call on this rank.
    """

    algorithm: str = ""
    world_size: int = 1
    rank: int = 0
    numel: int = 0
    dtype: str = ""
    wire_dtype: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    steps: int = 0
    header_bytes: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def segments(offset: int, length: int, segment_elems: int) -> list[tuple[int, int]]:
    """Split a chunk into at most :data:`MAX_SEGMENTS` near-equal non-empty segments."""
    if length <= 0:
        return []
    count = min(MAX_SEGMENTS, max(1, -(-length // max(1, segment_elems))))
    return chunk_bounds(length, count, offset)


_cache = threading.local()


def _scratch(
    numel: int, dtype: torch.dtype, device: torch.device, purpose: str = "recv"
) -> torch.Tensor:
    """A per-thread buffer of at least ``numel`` elements, reused across calls."""
    pool: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = getattr(_cache, "pool", {})
    _cache.pool = pool
    buf = pool.get((purpose, dtype, device))
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        pool[(purpose, dtype, device)] = buf
    return buf


class _Received:
    """A receive that already completed (its data came with the consistency header)."""

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True


class _Run:
    """State of one schedule execution on one rank."""

    def __init__(
        self,
        schedule: Schedule,
        comm: Communicator,
        work: torch.Tensor,
        wire_dtype: torch.dtype,
        segment_elems: int,
        stats: CollectiveStats,
    ) -> None:
        self.comm = comm
        self.work = work
        self.wire = wire_dtype
        self.convert = wire_dtype != work.dtype
        self.stats = stats
        self.prog = schedule.program(comm.rank)
        self.segs = [segments(off, ln, segment_elems) for off, ln in schedule.chunks]
        self.ride_elems = RIDE_BYTES // wire_dtype.itemsize
        per_step = [sum(self.chunk_elems(t) for t in recvs) for _, recvs in self.prog]
        # Every receive of the call is posted before the first data send (prepost_all), so
        # each step gets its own scratch region: (N-1)/N * D wire elements for a ring.
        self.offsets = [sum(per_step[:i]) for i in range(len(per_step))]
        self.scratch = _scratch(sum(per_step), self.wire, work.device)
        self.readers: dict[tuple[int, int], list[Request]] = {}
        self.sends: list[tuple[Request, torch.Tensor]] = []
        self.posted: dict[int, list[tuple[Transfer, int, torch.Tensor, Request]]] = {}
        self.early_sent: set[tuple[Transfer, int]] = set()  # step-0 segments sent with the header
        self.early_recv: dict[tuple[Transfer, int], torch.Tensor] = {}  # ... and received

    def rides(self, transfers: list[Transfer], peer: int, outgoing: bool) -> Transfer | None:
        """The step-0 transfer whose segment 0 travels in the header message to/from ``peer``.

        The first non-empty transfer of step 0 between this rank and ``peer`` (both ends see
        the same one: they filter the same step in the same order), if its segment 0 is at
        most :data:`RIDE_BYTES` and it is not a ``copy`` with a low-precision wire (which
        rounds the local value on sending).
        """
        for t in transfers:
            if (t.dst if outgoing else t.src) == peer and self.segs[t.chunk]:
                if self.convert and t.op is Op.COPY:
                    return None
                return t if self.segs[t.chunk][0][1] <= self.ride_elems else None
        return None

    def header_payloads(self) -> dict[int, torch.Tensor]:
        """Per peer, the step-0 data that rides with this rank's header (counted as sent)."""
        out: dict[int, torch.Tensor] = {}
        if not self.prog:
            return out
        for dst in {t.dst for t in self.prog[0][0]}:
            t = self.rides(self.prog[0][0], dst, outgoing=True)
            if t is not None:
                out[dst] = self.payload(t, 0)
                self.count_send(out[dst])
                self.early_sent.add((t, 0))
        return out

    def header_expects(self) -> dict[int, int]:
        """Per peer, how many wire elements ride with its header to this rank."""
        out: dict[int, int] = {}
        if not self.prog:
            return out
        for src in {t.src for t in self.prog[0][1]}:
            t = self.rides(self.prog[0][1], src, outgoing=False)
            if t is not None:
                out[src] = self.segs[t.chunk][0][1]
        return out

    def accept_header_payloads(self, received: dict[int, torch.Tensor]) -> None:
        """Hand over the step-0 data that came with the peers' headers (wire dtype views)."""
        if not self.prog:
            return
        for src, data in received.items():
            t = self.rides(self.prog[0][1], src, outgoing=False)
            if t is not None:
                self.early_recv[(t, 0)] = data

    def chunk_elems(self, t: Transfer) -> int:
        return sum(ln for _, ln in self.segs[t.chunk])

    def nseg(self, transfers: list[Transfer]) -> int:
        return max((len(self.segs[t.chunk]) for t in transfers), default=0)

    def payload(self, t: Transfer, k: int) -> torch.Tensor:
        off, ln = self.segs[t.chunk][k]
        view = self.work[off : off + ln]
        if not self.convert:
            return view
        out = view.to(self.wire)
        if t.op is Op.COPY:  # round our own copy too, so all ranks end bit-identical
            view.copy_(out)
        return out

    def count_send(self, payload: torch.Tensor) -> None:
        self.stats.bytes_sent += payload.numel() * payload.element_size()
        self.stats.messages_sent += 1

    def issue_sends(self, step: int, k: int) -> None:
        for t in self.prog[step][0]:
            if k < len(self.segs[t.chunk]):
                if step == 0 and (t, k) in self.early_sent:
                    continue
                data = self.payload(t, k)
                req = self.comm.isend(data, t.dst)
                self.count_send(data)
                self.sends.append((req, data))
                if not self.convert:
                    self.readers.setdefault((t.chunk, k), []).append(req)

    def post_recvs(self, step: int) -> None:
        recvs = self.prog[step][1]
        items: list[tuple[Transfer, int, torch.Tensor, Request]] = []
        pos = self.offsets[step]
        for k in range(self.nseg(recvs)):
            for t in recvs:
                if k < len(self.segs[t.chunk]):
                    ln = self.segs[t.chunk][k][1]
                    early = self.early_recv.pop((t, k), None) if step == 0 else None
                    if early is not None:
                        items.append((t, k, early, _Received()))
                        continue
                    tmp = self.scratch[pos : pos + ln]
                    pos += ln
                    items.append((t, k, tmp, self.comm.irecv(tmp, t.src)))
        self.posted[step] = items

    def apply(self, t: Transfer, k: int, tmp: torch.Tensor) -> None:
        off, ln = self.segs[t.chunk][k]
        view = self.work[off : off + ln]
        self.stats.bytes_received += tmp.numel() * tmp.element_size()
        if tmp.data_ptr() == view.data_ptr():
            return  # received in place (direct copy step)
        for req in self.readers.pop((t.chunk, k), ()):
            req.wait()  # a pending send still reads this segment
        if t.op is Op.REDUCE:
            view.add_(tmp)
        else:
            view.copy_(tmp)

    def is_direct(self, step: int) -> bool:
        """Copy-only steps receive straight into the buffer (no scratch, no extra memcpy)."""
        recvs = self.prog[step][1]
        return not self.convert and bool(recvs) and all(t.op is Op.COPY for t in recvs)

    def post_direct(self, step: int, k: int) -> None:
        """Post segment ``k`` of a direct step: the receive lands in the buffer itself."""
        for t in self.prog[step][1]:
            if k < len(self.segs[t.chunk]):
                early = self.early_recv.pop((t, k), None) if step == 0 else None
                if early is not None:
                    self.posted[step].append((t, k, early, _Received()))
                    continue
                off, ln = self.segs[t.chunk][k]
                view = self.work[off : off + ln]
                self.posted[step].append((t, k, view, self.comm.irecv(view, t.src)))

    def prepare(self, step: int) -> None:
        """Post every receive of ``step`` (called for all steps before the first data send).

        Segments are posted in order: receives from one peer are matched in posting order.
        """
        if self.is_direct(step):
            self.posted[step] = []
            for k in range(self.nseg(self.prog[step][1])):
                self.post_direct(step, k)
        else:
            self.post_recvs(step)

    def advance(self, step: int, k: int) -> None:
        """Segment ``k`` of every earlier step is applied: start segment ``k`` of ``step``."""
        self.issue_sends(step, k)

    def run_pipelined(self) -> None:
        """Post every receive of the call, then run the steps as a wavefront.

        Posting all receives (each step into its own scratch region, copy steps straight
        into the buffer) before the first data send lets every message land in a buffer that
        is already waiting, instead of queueing in the sender's socket until the receiver
        reaches that step: on gloo, on the idle 2-core VM, this took an N = 2 ring from
        0.6-0.7x to 0.9-1.0x of gloo's native all-reduce at 1-16 MB (docs/benchmarks.md).
        A copy receive posted early cannot overwrite data this rank still sends: the final
        value of a chunk depends on this rank's contribution to it, which the peers have
        therefore read out of its socket before they can send the final value back. Receives
        from one peer are matched in posting order (step-major), the order sends leave in.
        """
        n = len(self.prog)
        if n == 0:
            return
        for s in range(n):
            self.prepare(s)
        for k in range(max(self.nseg(self.prog[0][0]), self.nseg(self.prog[0][1]))):
            self.advance(0, k)
        for s in range(n):
            items = self.posted.pop(s)
            nk = self.nseg(self.prog[s][1])
            i = 0
            for k in range(nk):
                while i < len(items) and items[i][1] == k:
                    t, _, tmp, req = items[i]
                    req.wait()
                    self.apply(t, k, tmp)
                    i += 1
                if s + 1 < n:
                    self.advance(s + 1, k)
            if s + 1 < n:
                nxt = self.prog[s + 1]
                for k in range(nk, max(self.nseg(nxt[0]), self.nseg(nxt[1]))):
                    self.advance(s + 1, k)
        for req, _ in self.sends:
            req.wait()

    def run_grouped(self) -> None:
        for sends, recvs in self.prog:
            out: list[tuple[torch.Tensor, int]] = []
            for k in range(self.nseg(sends)):
                for t in sends:
                    if k < len(self.segs[t.chunk]):
                        data = self.payload(t, k)
                        self.count_send(data)
                        out.append((data, t.dst))
            inc: list[tuple[Transfer, int, torch.Tensor]] = []
            pos = 0
            for k in range(self.nseg(recvs)):
                for t in recvs:
                    if k < len(self.segs[t.chunk]):
                        ln = self.segs[t.chunk][k][1]
                        inc.append((t, k, self.scratch[pos : pos + ln]))
                        pos += ln
            reqs = self.comm.exchange(out, [(tmp, t.src) for t, _, tmp in inc])
            for req in reqs:
                req.wait()
            for t, k, tmp in inc:
                self.apply(t, k, tmp)


HeaderExchange = Callable[
    [dict[int, torch.Tensor], dict[int, int]],
    tuple[dict[int, torch.Tensor], list[tuple[Request, torch.Tensor]]],
]
"""``(payloads, expects) -> (received, pending_sends)``: the consistency-header round.

``payloads`` maps a peer to the step-0 data (wire dtype) that should ride in this rank's header
message to it; ``expects`` maps a peer to the number of wire elements its header message
carries for this rank. The callable exchanges the headers, raises if they disagree, and returns
the received data per peer (``expects[peer]`` elements each) and its pending sends (request and
the buffer it reads), which the executor waits on before returning.
"""


def execute(
    schedule: Schedule,
    comm: Communicator,
    work: torch.Tensor,
    *,
    wire_dtype: torch.dtype | None = None,
    segment_elems: int = DEFAULT_SEGMENT_BYTES // 4,
    stats: CollectiveStats | None = None,
    header: HeaderExchange | None = None,
) -> CollectiveStats:
    """Run this rank's part of ``schedule`` on the flat buffer ``work``, in place.

    Parameters
    ----------
    schedule : Schedule
        Must have ``world_size == comm.world_size`` and ``numel == work.numel()``; every rank
        must pass an equal schedule and the same ``segment_elems`` and ``wire_dtype``
        (:func:`fedagg.collectives.all_reduce` checks this with a header exchange).
    comm : Communicator
        Transport of this rank.
    work : torch.Tensor
        1-D contiguous accumulation buffer (float32 or float64).
    wire_dtype : torch.dtype, optional
        Dtype of messages; defaults to ``work.dtype``.
    segment_elems : int
        Pipelining segment length in elements.
    stats : CollectiveStats, optional
        Counters to add to; a new object is returned if omitted.
    header : HeaderExchange, optional
        Called once before any other message: on a pipelined communicator, a small segment 0
        of the first step-0 transfer between two ranks travels inside the header message
        (one message less per peer, see :data:`RIDE_BYTES`); otherwise it is called with
        nothing to carry.

    Returns
    -------
    CollectiveStats
        The counters (bytes and messages sent / received, steps).
    """
    stats = CollectiveStats() if stats is None else stats
    run = _Run(
        schedule, comm, work, work.dtype if wire_dtype is None else wire_dtype, segment_elems, stats
    )
    if header is not None:
        if comm.pipelined:
            received, pending = header(run.header_payloads(), run.header_expects())
            run.accept_header_payloads(received)
        else:
            _, pending = header({}, {})
        run.sends.extend(pending)
    if comm.pipelined:
        run.run_pipelined()
    else:
        run.run_grouped()
        for req, _ in run.sends:
            req.wait()
    stats.steps += schedule.num_steps
    return stats
