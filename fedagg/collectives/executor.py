"""Execute a :class:`~fedagg.collectives.schedule.Schedule` on one rank over a Communicator.

Every transfer is split into segments of about ``segment_elems`` elements. In pipelined mode
(gloo, in-process) every receive of the call is posted before the first data send (each step
into its own scratch region, copy steps straight into the buffer), and as soon as segment
``k`` of every step-``s`` receive has been applied, segment ``k`` of the step-``s + 1`` sends
goes out, while the later segments of step ``s`` are still in flight: a ring runs as a
wavefront, and a tree forwards segment ``k`` upward while segment ``k + 1`` arrives from the
children (the pipelined tree of the cost model). Reductions are in place, with torch ops on
whole segments. What a rank does is worked out once per schedule, rank and options
(:func:`fedagg.collectives.plan.compile_plan`, cached on the schedule) and replayed on every call.

In grouped mode (NCCL, where an unpaired receive can block a send on the same stream) each
step is posted as one :meth:`~fedagg.collectives.communicator.Communicator.exchange` and
waited on before the next.

Low-precision transport: the work buffer is float32 (or float64) and messages travel in
``wire_dtype``. Before a rank sends a ``copy`` transfer it rounds its own segment to the wire
dtype, so every rank ends with bit-identical values.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from fedagg.collectives import plan_runner
from fedagg.collectives.communicator import Communicator, Request
from fedagg.collectives.plan import (
    DEFAULT_SEGMENT_BYTES,
    DIRECT,
    REDUCE,
    SEND,
    HeaderExchange,
    Plan,
    compile_plan,
    scratch_buffer,
    segments,
)
from fedagg.collectives.schedule import Schedule
from fedagg.collectives.transfer import Op, Transfer

__all__ = ["CollectiveStats", "execute"]

_log = logging.getLogger(__name__)

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
    runner : str
        What ran the schedule: ``cpp`` (the C++ plan runner), ``python`` (the Python
        replay), ``grouped`` (step by step, NCCL) or ``native`` (the backend's all-reduce).
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
    runner: str = ""
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def _wire(view: torch.Tensor, wire: torch.dtype, round_copy: bool) -> torch.Tensor:
    """``view`` as it goes on the wire (rounded in place too for a low-precision copy)."""
    if view.dtype == wire:
        return view
    out = view.to(wire)
    if round_copy:  # round our own copy too, so all ranks end bit-identical
        view.copy_(out)
    return out


def _replay(
    plan: Plan,
    comm: Communicator,
    work: torch.Tensor,
    wire: torch.dtype,
    header: HeaderExchange | None,
) -> None:
    """Run a pipelined plan: post its receives, then its sends and reductions in order."""
    got: list[torch.Tensor | None] = [None] * plan.slots
    reqs: list[Request | None] = [None] * plan.slots
    readers: list[Request | None] = [None] * plan.readers
    sends: list[tuple[Request, torch.Tensor]] = []
    scratch = scratch_buffer(plan.scratch, wire, work.device)

    def post() -> list[tuple[int, Request]]:
        posted: list[tuple[int, Request]] = []
        for slot, src, direct, off, ln in plan.recvs:
            buf = (work if direct else scratch)[off : off + ln]
            got[slot] = buf
            req = reqs[slot] = comm.irecv(buf, src)
            posted.append((src, req))
        return posted

    if header is not None:
        payloads = {dst: _wire(work[off : off + ln], wire, False) for dst, off, ln in plan.ride_out}
        received, pending = header(payloads, {src: ln for _, src, ln in plan.ride_in}, post)
        sends.extend(pending)
        for slot, src, _ in plan.ride_in:
            got[slot] = received[src]
    else:
        post()
    for code, a, off, ln, b, c in plan.ops:
        if code == SEND:
            data = _wire(work[off : off + ln], wire, bool(b))
            req = comm.isend(data, a)
            sends.append((req, data))
            if c[0] >= 0:
                readers[c[0]] = req
            continue
        pending_recv = reqs[a]
        if pending_recv is not None:
            pending_recv.wait()
        if b == DIRECT:
            continue
        for r in c:
            reader = readers[r]
            if reader is not None:
                reader.wait()  # a pending send still reads this segment
        src_buf = got[a]
        assert src_buf is not None  # every slot is filled before its APPLY; not input
        view = work[off : off + ln]
        if b == REDUCE:
            view.add_(src_buf)
        else:
            view.copy_(src_buf)
    for req, _ in sends:
        req.wait()


def _run_grouped(
    schedule: Schedule,
    comm: Communicator,
    work: torch.Tensor,
    wire: torch.dtype,
    segment_elems: int,
    stats: CollectiveStats,
) -> None:
    """Each step as one grouped exchange, waited on before the next (NCCL)."""
    segs = [segments(off, ln, segment_elems) for off, ln in schedule.chunks]
    prog = schedule.program(comm.rank)

    def nseg(transfers: list[Transfer]) -> int:
        return max((len(segs[t.chunk]) for t in transfers), default=0)

    scratch = scratch_buffer(
        max((sum(ln for t in r for _, ln in segs[t.chunk]) for _, r in prog), default=0),
        wire,
        work.device,
    )
    for sends, recvs in prog:
        out: list[tuple[torch.Tensor, int]] = []
        for k in range(nseg(sends)):
            for t in sends:
                if k < len(segs[t.chunk]):
                    off, ln = segs[t.chunk][k]
                    data = _wire(work[off : off + ln], wire, t.op is Op.COPY)
                    stats.bytes_sent += data.numel() * data.element_size()
                    stats.messages_sent += 1
                    out.append((data, t.dst))
        inc: list[tuple[Transfer, int, torch.Tensor]] = []
        pos = 0
        for k in range(nseg(recvs)):
            for t in recvs:
                if k < len(segs[t.chunk]):
                    ln = segs[t.chunk][k][1]
                    inc.append((t, k, scratch[pos : pos + ln]))
                    pos += ln
        for req in comm.exchange(out, [(tmp, t.src) for t, _, tmp in inc]):
            req.wait()
        for t, k, tmp in inc:
            off, ln = segs[t.chunk][k]
            stats.bytes_received += tmp.numel() * tmp.element_size()
            view = work[off : off + ln]
            if t.op is Op.REDUCE:
                view.add_(tmp)
            else:
                view.copy_(tmp)


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
    wire = work.dtype if wire_dtype is None else wire_dtype
    if comm.pipelined:
        plan = compile_plan(
            schedule,
            comm.rank,
            work_dtype=work.dtype,
            wire_dtype=wire,
            segment_elems=segment_elems,
            header=header is not None,
        )
        runner = plan_runner.runner_for(plan, comm, header)
        if runner is not None:
            plan_runner.run(runner, plan, comm, work, wire, header)
            stats.runner = "cpp"
        else:
            _replay(plan, comm, work, wire, header)
            stats.runner = "python"
        stats.bytes_sent += plan.sent * wire.itemsize
        stats.bytes_received += plan.received * wire.itemsize
        stats.messages_sent += plan.messages
    else:
        pending: list[tuple[Request, torch.Tensor]] = []
        if header is not None:
            _, pending = header({}, {}, list)
        _run_grouped(schedule, comm, work, wire, segment_elems, stats)
        stats.runner = "grouped"
        for req, _ in pending:
            req.wait()
    stats.steps += schedule.num_steps
    return stats
