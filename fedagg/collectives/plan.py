"""One rank's part of an all-reduce schedule, compiled into a :class:`Plan` of messages and
reductions (:func:`compile_plan`), and the buffers and segments a plan is run with.

Every transfer is split into segments of about ``segment_elems`` elements (:func:`segments`).
In a plan every receive of the call is posted before the first data send (each step into its
own scratch region, copy steps straight into the buffer), and as soon as segment ``k`` of
every step-``s`` receive has been applied, segment ``k`` of the step-``s + 1`` sends goes out.
A plan is worked out once per schedule, rank and options (cached on the schedule) and replayed
on every call, by the Python replay (:mod:`fedagg.collectives.executor`) or the C++ plan runner
(:mod:`fedagg.collectives.plan_runner`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fedagg.collectives.communicator import Request
from fedagg.collectives.schedule import Schedule, chunk_bounds
from fedagg.collectives.transfer import Op, Transfer

__all__ = [
    "APPLY",
    "COPY",
    "DEFAULT_SEGMENT_BYTES",
    "DIRECT",
    "MAX_SEGMENTS",
    "REDUCE",
    "RIDE_BYTES",
    "SEND",
    "HeaderExchange",
    "Plan",
    "compile_plan",
    "scratch_buffer",
    "segments",
]

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


def segments(offset: int, length: int, segment_elems: int) -> list[tuple[int, int]]:
    """Split a chunk into at most :data:`MAX_SEGMENTS` near-equal non-empty segments."""
    if length <= 0:
        return []
    count = min(MAX_SEGMENTS, max(1, -(-length // max(1, segment_elems))))
    return chunk_bounds(length, count, offset)


_cache = threading.local()


def scratch_buffer(
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


SEND, APPLY = 0, 1
"""Op codes of a :class:`Plan`."""

DIRECT, REDUCE, COPY = 0, 1, 2
"""What an ``APPLY`` op does: nothing (received in place), add, or overwrite."""


@dataclass(frozen=True)
class Plan:
    """One rank's part of a schedule, compiled: every message and reduction in issue order.

    A plan is what :func:`execute` does on a pipelined communicator, worked out once per
    ``(schedule, rank, wire dtype, segment size, header)`` and cached on the schedule
    (:meth:`~fedagg.collectives.schedule.Schedule.cache`), so that a training loop that
    all-reduces the same buckets every step pays the bookkeeping once: per call only the
    torch.distributed calls, tensor views and reductions remain (about 150 us of Python per
    call before, on the 2-core VM; docs/benchmarks.md).

    Attributes
    ----------
    ride_out : tuple of (dst, offset, length)
        Step-0 data that travels in this rank's header message to ``dst``.
    ride_in : tuple of (slot, src, length)
        Step-0 data that arrives in ``src``'s header message (``length`` wire elements).
    recvs : tuple of (slot, src, direct, offset, length)
        Receives posted right after the header, in order: into the work buffer at ``offset``
        (``direct``, copy steps) or into the scratch buffer at ``offset``.
    ops : tuple
        ``(SEND, dst, offset, length, round_copy, reader)``: send ``work[offset:][:length]``
        (in the wire dtype; ``round_copy``: also round this rank's own copy to it); a
        ``reader >= 0`` names the request so that a later reduction into the same segment
        waits for it. ``(APPLY, slot, offset, length, kind, readers)``: wait for receive
        ``slot``, wait for the sends ``readers``, then reduce / copy it into the buffer.
    slots, readers, scratch : int
        Number of receive slots and reader ids, scratch length in wire elements.
    sent, received, messages : int
        Wire elements sent (header payloads included) / received, and messages sent.
    """

    ride_out: tuple[tuple[int, int, int], ...]
    ride_in: tuple[tuple[int, int, int], ...]
    recvs: tuple[tuple[int, int, bool, int, int], ...]
    ops: tuple[tuple[int, int, int, int, int, tuple[int, ...]], ...]
    slots: int
    readers: int
    scratch: int
    sent: int
    received: int
    messages: int
    native: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The plan's C++ runner once built (:func:`~.plan_runner.runner_for`), under ``"runner"``."""


class _Planner:
    """Works out one rank's messages and reductions for a schedule (see :class:`Plan`).

    Every receive of the call is posted before the first data send (each step into its own
    scratch region, copy steps straight into the buffer); as soon as segment ``k`` of every
    step-``s`` receive has been applied, segment ``k`` of the step-``s + 1`` sends goes out.
    Posting all receives first lets every message land in a buffer that is already waiting,
    instead of queueing in the sender's socket until the receiver reaches that step: on
    gloo, on the idle 2-core VM, this took an N = 2 ring from 0.6-0.7x to 0.9-1.0x of gloo's
    native all-reduce at 1-16 MB (docs/benchmarks.md). A copy receive posted early cannot
    overwrite data this rank still sends: the final value of a chunk depends on this rank's
    contribution to it, which the peers have therefore read out of its socket before they
    can send the final value back. Receives from one peer are matched in posting order
    (step-major), the order sends leave in.
    """

    def __init__(
        self, schedule: Schedule, rank: int, convert: bool, wire_itemsize: int, segment_elems: int
    ) -> None:
        self.convert = convert
        self.prog = schedule.program(rank)
        self.segs = [segments(off, ln, segment_elems) for off, ln in schedule.chunks]
        self.ride_elems = RIDE_BYTES // wire_itemsize
        per_step = [sum(self.chunk_elems(t) for t in recvs) for _, recvs in self.prog]
        self.offsets = [sum(per_step[:i]) for i in range(len(per_step))]
        self.scratch = sum(per_step)
        self.recvs: list[tuple[int, int, bool, int, int]] = []
        self.ops: list[tuple[int, int, int, int, int, tuple[int, ...]]] = []
        self.ride_out: list[tuple[int, int, int]] = []
        self.ride_in: list[tuple[int, int, int]] = []
        self.slots = 0
        self.nreaders = 0
        self.sent = self.received = self.messages = 0
        self.readers: dict[tuple[int, int], list[int]] = {}
        self.posted: dict[int, list[tuple[Transfer, int, int, bool]]] = {}
        self.early_sent: set[tuple[Transfer, int]] = set()  # step-0 segments in the header
        self.early_recv: dict[tuple[Transfer, int], int] = {}  # ... and their receive slots

    def chunk_elems(self, t: Transfer) -> int:
        return sum(ln for _, ln in self.segs[t.chunk])

    def nseg(self, transfers: list[Transfer]) -> int:
        return max((len(self.segs[t.chunk]) for t in transfers), default=0)

    def slot(self) -> int:
        self.slots += 1
        return self.slots - 1

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

    def plan_header(self) -> None:
        """Step-0 data that rides in the header messages, both ways."""
        if not self.prog:
            return
        sends, recvs = self.prog[0]
        for dst in sorted({t.dst for t in sends}):
            t = self.rides(sends, dst, outgoing=True)
            if t is not None:
                off, ln = self.segs[t.chunk][0]
                self.ride_out.append((dst, off, ln))
                self.sent += ln
                self.messages += 1
                self.early_sent.add((t, 0))
        for src in sorted({t.src for t in recvs}):
            t = self.rides(recvs, src, outgoing=False)
            if t is not None:
                slot = self.slot()
                self.ride_in.append((slot, src, self.segs[t.chunk][0][1]))
                self.early_recv[(t, 0)] = slot

    def issue_sends(self, step: int, k: int) -> None:
        for t in self.prog[step][0]:
            if k < len(self.segs[t.chunk]):
                if step == 0 and (t, k) in self.early_sent:
                    continue
                off, ln = self.segs[t.chunk][k]
                reader = -1
                if not self.convert:  # the send reads the buffer itself, not a converted copy
                    reader = self.nreaders
                    self.nreaders += 1
                    self.readers.setdefault((t.chunk, k), []).append(reader)
                round_copy = int(self.convert and t.op is Op.COPY)
                self.ops.append((SEND, t.dst, off, ln, round_copy, (reader,)))
                self.sent += ln
                self.messages += 1

    def post(self, step: int, t: Transfer, k: int, direct: bool, scratch_at: int) -> int:
        """Post segment ``k`` of ``t`` (or take it from the header); return its length."""
        ln = self.segs[t.chunk][k][1]
        early = self.early_recv.pop((t, k), None) if step == 0 else None
        if early is not None:
            self.posted[step].append((t, k, early, False))
            return 0
        slot = self.slot()
        off = self.segs[t.chunk][k][0] if direct else scratch_at
        self.recvs.append((slot, t.src, direct, off, ln))
        self.posted[step].append((t, k, slot, direct))
        return 0 if direct else ln

    def prepare(self, step: int) -> None:
        """Post every receive of ``step`` (all steps before the first data send), in order."""
        recvs = self.prog[step][1]
        direct = not self.convert and bool(recvs) and all(t.op is Op.COPY for t in recvs)
        self.posted[step] = []
        pos = self.offsets[step]
        for k in range(self.nseg(recvs)):
            for t in recvs:
                if k < len(self.segs[t.chunk]):
                    pos += self.post(step, t, k, direct, pos)

    def apply(self, t: Transfer, k: int, slot: int, direct: bool) -> None:
        off, ln = self.segs[t.chunk][k]
        self.received += ln
        if direct:
            self.ops.append((APPLY, slot, off, ln, DIRECT, ()))
            return
        waits = tuple(self.readers.pop((t.chunk, k), ()))
        kind = REDUCE if t.op is Op.REDUCE else COPY
        self.ops.append((APPLY, slot, off, ln, kind, waits))

    def build(self, header: bool) -> Plan:
        if header:
            self.plan_header()
        n = len(self.prog)
        for s in range(n):
            self.prepare(s)
        if n:
            for k in range(max(self.nseg(self.prog[0][0]), self.nseg(self.prog[0][1]))):
                self.issue_sends(0, k)
        for s in range(n):
            items = self.posted.pop(s)
            nk = self.nseg(self.prog[s][1])
            i = 0
            for k in range(nk):
                while i < len(items) and items[i][1] == k:
                    t, _, slot, direct = items[i]
                    self.apply(t, k, slot, direct)
                    i += 1
                if s + 1 < n:
                    self.issue_sends(s + 1, k)
            if s + 1 < n:
                nxt = self.prog[s + 1]
                for k in range(nk, max(self.nseg(nxt[0]), self.nseg(nxt[1]))):
                    self.issue_sends(s + 1, k)
        return Plan(
            tuple(self.ride_out),
            tuple(self.ride_in),
            tuple(self.recvs),
            tuple(self.ops),
            self.slots,
            self.nreaders,
            self.scratch,
            self.sent,
            self.received,
            self.messages,
        )


def compile_plan(
    schedule: Schedule,
    rank: int,
    *,
    work_dtype: torch.dtype,
    wire_dtype: torch.dtype,
    segment_elems: int,
    header: bool,
) -> Plan:
    """The :class:`Plan` of ``rank`` (cached on ``schedule``)."""
    key = ("plan", rank, work_dtype, wire_dtype, segment_elems, header and RIDE_BYTES)
    cache = schedule.cache
    plan = cache.get(key)
    if plan is None:
        planner = _Planner(
            schedule, rank, wire_dtype != work_dtype, wire_dtype.itemsize, segment_elems
        )
        plan = planner.build(header)
        cache[key] = plan
    assert isinstance(plan, Plan)  # the cache only holds plans under this key
    return plan


HeaderExchange = Callable[
    [dict[int, torch.Tensor], dict[int, int], Callable[[], list[tuple[int, Request]]]],
    tuple[dict[int, torch.Tensor], list[tuple[Request, torch.Tensor]]],
]
"""``(payloads, expects, post) -> (received, pending_sends)``: the consistency-header round.

``payloads`` maps a peer to the step-0 data (wire dtype) that should ride in this rank's header
message to it; ``expects`` maps a peer to the number of wire elements its header message
carries for this rank. ``post`` posts the call's data receives and returns them as
``(src, request)``; the callable runs it after posting the header receives and before sending
the headers, so that data a peer sends right after its check finds its receive waiting. The
callable exchanges the headers, raises if they disagree (after the peers have filled the
posted receives, see :func:`fedagg.collectives.api.all_reduce`), and returns the received
data per peer (``expects[peer]`` elements each) and its pending sends (request and the buffer
it reads), which the executor waits on before returning.
"""
