"""``all_reduce``: the public entry point of intra-site collectives.

Each call (1) validates the local input, (2) exchanges a small header with every peer (status,
length, dtype, algorithm, op, wire dtype, group and segment size) so that inputs that differ
across ranks raise :class:`~fedagg.errors.CollectiveError` on *every* rank instead of hanging,
then (3) runs the algorithm: a schedule through :func:`~fedagg.collectives.executor.execute`,
or the backend's own all-reduce for ``native``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from fedagg.collectives.communicator import Communicator, Request
from fedagg.collectives.cost import CostModel, choose_algorithm, get_default_cost_model
from fedagg.collectives.executor import CollectiveStats, execute
from fedagg.collectives.plan import (
    DEFAULT_SEGMENT_BYTES,
    RIDE_BYTES,
    HeaderExchange,
    Plan,
    compile_plan,
    scratch_buffer,
)
from fedagg.collectives.schedule import SCHEDULED_ALGORITHMS, get_schedule
from fedagg.errors import CollectiveError, ConfigError, explain

__all__ = ["ALGORITHMS", "DTYPES", "OPS", "all_reduce", "last_stats"]

_log = logging.getLogger(__name__)

ALGORITHMS: tuple[str, ...] = ("auto", *SCHEDULED_ALGORITHMS, "native")
OPS: tuple[str, ...] = ("sum", "avg")
DTYPES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float64: 2,
    torch.bfloat16: 3,
    torch.float16: 4,
}
_WIRE: dict[str | None, torch.dtype | None] = {
    None: None,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_ALGO_CODE = {a: i + 1 for i, a in enumerate(ALGORITHMS)}
_ALGO_OF = {c: a for a, c in _ALGO_CODE.items()}
_DTYPE_OF = {c: d for d, c in DTYPES.items()}
_WIRE_CODE: dict[torch.dtype | None, int] = {None: 0, torch.bfloat16: 1, torch.float16: 2}
"""Header code of the low-precision wire dtype (0: the tensor's own dtype)."""
_WIRE_OF = {c: d for d, c in _WIRE_CODE.items()}
_MAGIC = 0x46454441  # "FEDA"
_FIELDS = (
    "magic",
    "status",
    "numel",
    "dtype",
    "algorithm",
    "op",
    "wire_dtype",
    "group_size",
    "segment_elems",
)
_HEADER_BYTES = 8 * len(_FIELDS)
_local = threading.local()


def last_stats() -> CollectiveStats | None:
    """Counters of the last :func:`all_reduce` made by the calling thread (or ``None``)."""
    out: CollectiveStats | None = getattr(_local, "stats", None)
    return out


def _default_comm(timeout: float | None) -> Communicator:
    """A communicator over the default process group, reused while that group lives."""
    from fedagg.collectives.backends.torch_dist import TorchDistCommunicator, default_group

    group = default_group()
    cached: dict[float | None, tuple[object, Communicator]] = getattr(_local, "comms", {})
    _local.comms = cached
    hit = cached.get(timeout)
    if hit is not None and hit[0] is group:
        return hit[1]
    comm = TorchDistCommunicator() if timeout is None else TorchDistCommunicator(timeout=timeout)
    cached[timeout] = (group, comm)
    return comm


_headers: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _header_tensor(fields: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The int64 header tensor of these fields, built once per distinct header (read-only)."""
    key = (fields, device)
    out = _headers.get(key)
    if out is None:
        if len(_headers) >= 1024:
            _headers.clear()
        out = _headers[key] = torch.tensor(fields, dtype=torch.int64, device=device)
    return out


def _validate(tensor: object, algorithm: str, op: str, wire: str | None) -> ConfigError | None:
    if not isinstance(tensor, torch.Tensor):
        return ConfigError(
            explain(
                "tensor",
                type(tensor).__name__,
                "must be a torch.Tensor",
                "pass a flat gradient bucket tensor",
            )
        )
    if tensor.dtype not in DTYPES:
        return ConfigError(
            explain(
                "tensor.dtype",
                str(tensor.dtype),
                "must be float32, float64, bfloat16 or float16",
                "cast the tensor, e.g. tensor.float()",
            )
        )
    if not tensor.is_contiguous():
        return ConfigError(
            explain(
                "tensor",
                f"shape {tuple(tensor.shape)} strides {tensor.stride()}",
                "must be contiguous (reduced in place)",
                "pass tensor.contiguous() and copy the result back",
            )
        )
    if algorithm not in ALGORITHMS:
        return ConfigError(
            explain(
                "algorithm", algorithm, f"must be one of {list(ALGORITHMS)}", "pick one of those"
            )
        )
    if op not in OPS:
        return ConfigError(
            explain(
                "op",
                op,
                f"must be one of {list(OPS)}",
                "use 'sum', or 'avg' to divide by the world size",
            )
        )
    if wire not in _WIRE:
        return ConfigError(
            explain("wire_dtype", wire, "must be None, 'bf16' or 'fp16'", "pass one of those")
        )
    if wire is not None and algorithm == "native":
        return ConfigError(
            explain(
                "wire_dtype",
                wire,
                "the native all-reduce reduces in the tensor's own dtype",
                "use ring/tree/hierarchical, or wire_dtype=None",
            )
        )
    if wire is not None and tensor.dtype == torch.float64:
        return ConfigError(
            explain(
                "wire_dtype",
                wire,
                "low-precision transport needs a float32/16 tensor",
                "use wire_dtype=None for float64",
            )
        )
    return None


def _exchange_headers(comm: Communicator, header: torch.Tensor) -> list[list[int]]:
    n, rank = comm.world_size, comm.rank
    bufs = {r: torch.empty_like(header) for r in range(n) if r != rank}
    reqs = comm.exchange(
        [(header, r) for r in range(n) if r != rank], [(b, r) for r, b in bufs.items()]
    )
    for req in reqs:
        req.wait()
    mine = [int(v) for v in header.tolist()]
    return [mine if r == rank else [int(v) for v in bufs[r].tolist()] for r in range(n)]


def _exchange_header_messages(
    comm: Communicator,
    header: torch.Tensor,
    payloads: dict[int, torch.Tensor],
    before_send: Callable[[], object] | None = None,
) -> tuple[dict[int, torch.Tensor], list[tuple[Request, torch.Tensor]]]:
    """One byte message to every peer: the header, then the step-0 data that rides with it.

    Order: post the header receives, run ``before_send``, send the headers, wait for the
    peers' headers. The executor posts the call's data receives in ``before_send``: they are
    matched after the header message from the same peer (receives from one peer match in
    posting order) and are in place when the peer's data arrives after its check. (Sending
    the headers first and posting the data receives after them was measured too: no better at
    1 MB, 0.06 worse at N = 2, 16 MB in two interleaved A/B runs.)

    Every rank posts its receives with room for the header plus
    :data:`~fedagg.collectives.plan.RIDE_BYTES`, whatever its own input, so no
    message can be longer than its receive (gloo aborts the process on that); messages may be
    shorter. Returns the received messages per peer (header first, see :func:`_decode`) and
    the pending sends (request, buffer).
    """
    n, rank = comm.world_size, comm.rank
    peers = [r for r in range(n) if r != rank]
    cap = _HEADER_BYTES + RIDE_BYTES
    rbuf = scratch_buffer(len(peers) * cap, torch.uint8, header.device, "header-recv")
    regions = {p: rbuf[i * cap : (i + 1) * cap] for i, p in enumerate(peers)}
    recvs = [comm.irecv(regions[p], p) for p in peers]
    if before_send is not None:
        before_send()
    size = {
        p: _HEADER_BYTES
        + (payloads[p].numel() * payloads[p].element_size() if p in payloads else 0)
        for p in peers
    }
    sbuf = scratch_buffer(sum(size.values()), torch.uint8, header.device, "header-send")
    head = header.view(torch.uint8)
    sends: list[tuple[Request, torch.Tensor]] = []
    pos = 0
    for p in peers:
        msg = sbuf[pos : pos + size[p]]
        pos += size[p]
        msg[:_HEADER_BYTES].copy_(head)
        if p in payloads:
            msg[_HEADER_BYTES:].copy_(payloads[p].reshape(-1).view(torch.uint8))
        sends.append((comm.isend(msg, p), msg))
    for req in recvs:
        req.wait()
    return regions, sends


def _agree(header: torch.Tensor, regions: dict[int, torch.Tensor]) -> bool:
    """Whether every peer's header equals this rank's, byte for byte (the check's fast path).

    With this rank's status 0 that is exactly what :func:`_check_headers` accepts (it wants
    every field equal across ranks and every status 0), without decoding anything.
    """
    head = header.view(torch.uint8)
    return all(torch.equal(r[:_HEADER_BYTES], head) for r in regions.values())


def _decode(
    comm: Communicator, header: torch.Tensor, regions: dict[int, torch.Tensor]
) -> list[list[int]]:
    """Every rank's header as ints (this rank's own from ``header``)."""
    mine = [int(v) for v in header.tolist()]
    return [
        mine
        if r == comm.rank
        else [int(v) for v in regions[r][:_HEADER_BYTES].view(torch.int64).tolist()]
        for r in range(comm.world_size)
    ]


class _HeaderRound:
    """The header round of a scheduled all-reduce, carrying step-0 data (see ``execute``).

    Called by the Python replay as a :data:`~fedagg.collectives.plan.HeaderExchange`. The
    C++ plan runner (:mod:`fedagg.collectives.plan_runner`) runs the same round itself from
    :attr:`head` and :attr:`cap` and hands a disagreement to :meth:`failed`.
    """

    def __init__(self, comm: Communicator, header: torch.Tensor, wire: torch.dtype) -> None:
        self.comm = comm
        self.header = header
        self.wire = wire
        self.head = header.view(torch.uint8)
        """This rank's header bytes."""
        self.cap = _HEADER_BYTES + RIDE_BYTES
        """Bytes every rank posts per peer for the header message."""

    def __call__(
        self,
        payloads: dict[int, torch.Tensor],
        expects: dict[int, int],
        post: Callable[[], list[tuple[int, Request]]],
    ) -> tuple[dict[int, torch.Tensor], list[tuple[Request, torch.Tensor]]]:
        posted: list[tuple[int, Request]] = []

        def before_send() -> None:
            posted.extend(post())

        regions, pending = _exchange_header_messages(self.comm, self.header, payloads, before_send)
        if not _agree(self.header, regions):
            self.failed(regions, posted, pending)
        end = {p: _HEADER_BYTES + ln * self.wire.itemsize for p, ln in expects.items()}
        received = {p: regions[p][_HEADER_BYTES : end[p]].view(self.wire) for p in expects}
        return received, pending

    def failed(
        self,
        regions: dict[int, torch.Tensor],
        posted: list[tuple[int, Request]],
        pending: list[tuple[Request, torch.Tensor]],
    ) -> None:
        """Headers differ: fill the peers' posted receives, wait for ours, raise the error.

        ``regions`` holds every peer's header message, ``posted`` this rank's data receives
        (source, request) and ``pending`` its header sends.

        Raises
        ------
        CollectiveError
            Always (which field differs, or which rank rejected its input).
        """
        headers = _decode(self.comm, self.header, regions)
        try:
            _check_headers(headers)
        except CollectiveError:
            pending = pending + _drain(self.comm, headers)
            for src, req in posted:  # every well-formed peer drains the receives we posted
                if headers[src][0] == _MAGIC:
                    req.wait()
            for req, _ in pending:  # every peer posted a receive for these
                req.wait()
            raise
        raise CollectiveError(  # unreachable: byte-equal headers are exactly the accepted ones
            explain("header", "bytes differ", "but decode as equal", "report this as a bug")
        )


def _peer_plan(header: list[int], rank: int, world_size: int) -> tuple[Plan, torch.dtype] | None:
    """The plan (and wire dtype) a peer with this header posted receives for, if it did.

    A rank posts its data receives before the header check when its own input was valid and
    the algorithm has a schedule; its plan follows from its header alone.
    """
    magic, status, numel, dcode, acode, _, wcode, group, seg = header
    alg, dtype = _ALGO_OF.get(acode), _DTYPE_OF.get(dcode)
    if magic != _MAGIC or status != 0 or alg not in SCHEDULED_ALGORITHMS or dtype is None:
        return None
    if wcode not in _WIRE_OF or seg < 1 or numel < 0:
        return None
    wire = _WIRE_OF[wcode] or dtype
    try:
        schedule = get_schedule(alg, world_size, numel, group_size=group or None)
    except ConfigError:
        return None
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    plan = compile_plan(
        schedule, rank, work_dtype=acc, wire_dtype=wire, segment_elems=seg, header=True
    )
    return plan, wire


def _drain(comm: Communicator, headers: list[list[int]]) -> list[tuple[Request, torch.Tensor]]:
    """After a failed header check, fill the data receives the peers posted before the check.

    Every rank that passed its own validation posted its data receives before the header
    check (see ``before_send``). When the check fails on every rank, each rank sends each such
    peer the messages that peer's plan expects from it, zero-filled and of exactly the posted
    lengths, so that no receive stays posted to swallow a later call's messages. Returns the
    pending sends.
    """
    if not comm.pipelined:
        return []
    out: list[tuple[Request, torch.Tensor]] = []
    for peer, head in enumerate(headers):
        if peer == comm.rank:
            continue
        found = _peer_plan(head, peer, comm.world_size)
        if found is None:
            continue
        plan, wire = found
        for _, src, _, _, ln in plan.recvs:
            if src == comm.rank:
                buf = torch.zeros(ln, dtype=wire)
                out.append((comm.isend(buf, peer), buf))
    return out


def _check_headers(headers: list[list[int]]) -> None:
    bad = [r for r, h in enumerate(headers) if h[0] != _MAGIC]
    if bad:
        raise CollectiveError(
            explain(
                "header",
                f"ranks {bad}",
                "sent a malformed header",
                "call all_reduce (not another collective) on every rank",
            )
        )
    failed = [r for r, h in enumerate(headers) if h[1] != 0]
    if failed:
        raise CollectiveError(
            explain(
                "input",
                f"ranks {failed}",
                "rejected their local input (see the ConfigError on those ranks)",
                "fix the tensor / arguments passed on those ranks",
            )
        )
    for i, name in enumerate(_FIELDS[2:], start=2):
        values = [h[i] for h in headers]
        if len(set(values)) > 1:
            shown = values
            if name == "dtype":
                names = {c: str(d).removeprefix("torch.") for c, d in _DTYPE_OF.items()}
                shown = [names.get(v, v) for v in values]  # type: ignore[misc]
            elif name == "algorithm":
                shown = [_ALGO_OF.get(v, v) for v in values]  # type: ignore[misc]
            raise CollectiveError(
                explain(
                    name,
                    shown,
                    "differs across ranks (values listed by rank)",
                    "pass the same length, dtype, algorithm, op and options on every rank "
                    "(and the same cost model when algorithm='auto')",
                )
            )


def all_reduce(
    tensor: torch.Tensor,
    *,
    algorithm: str = "auto",
    op: str = "sum",
    comm: Communicator | None = None,
    wire_dtype: str | None = None,
    group_size: int | None = None,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    model: CostModel | None = None,
    check: bool = True,
    stats: CollectiveStats | None = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """Sum (or average) ``tensor`` across all ranks, in place; return it.

    Parameters
    ----------
    tensor : torch.Tensor
        Contiguous float32, float64, bfloat16 or float16 tensor, any shape; the same length
        and dtype on every rank.
    algorithm : {"auto", "ring", "tree", "hierarchical", "native"}
        ``auto`` picks the cheapest for ``(N, D)`` with the cost model.
    op : {"sum", "avg"}
        ``avg`` divides the sum by the world size.
    comm : Communicator, optional
        Transport; ``None`` uses the initialized default torch.distributed process group.
    wire_dtype : {None, "bf16", "fp16"}
        Low-precision transport: messages in that dtype, accumulation in float32.
        bfloat16 / float16 tensors are always accumulated in float32.
    group_size : int, optional
        Ranks per group for ``hierarchical`` (workers per node).
    segment_bytes : int
        Pipelining segment size, in bytes on the wire.
    model : CostModel, optional
        Cost model for ``auto`` (default :func:`~fedagg.collectives.cost.get_default_cost_model`).
    check : bool
        Exchange the consistency header first (one small message to every peer). With
        ``False``, mismatched inputs may fail with a less precise error or a timeout.
    stats : CollectiveStats, optional
        Filled with this call's counters; also available from :func:`last_stats`.
    timeout : float, optional
        Timeout of the default communicator (``comm=None`` only).

    Returns
    -------
    torch.Tensor
        ``tensor`` itself, now holding the reduction.

    Raises
    ------
    ConfigError
        Bad local input (dtype, non-contiguous, unknown algorithm / op / wire dtype).
    CollectiveError
        Inputs differ across ranks, or a peer reported bad input, or the transport failed.
    CollectiveTimeout
        A peer did not answer within the communicator's timeout.
    """
    t0 = time.perf_counter()
    if comm is None:
        comm = _default_comm(timeout)
    n = comm.world_size
    error = _validate(tensor, algorithm, op, wire_dtype)
    if error is None and (
        isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes < 1
    ):
        error = ConfigError(
            explain("segment_bytes", segment_bytes, "must be an int >= 1", "pass e.g. 1 << 20")
        )
    wire = _WIRE.get(wire_dtype) if error is None else None
    resolved = algorithm
    numel = tensor.numel() if isinstance(tensor, torch.Tensor) else 0
    if error is None:
        wire = wire if wire is not None else tensor.dtype
        if algorithm == "auto":
            resolved = choose_algorithm(
                n,
                numel * wire.itemsize,
                model=model if model else get_default_cost_model(),
                group_size=group_size,
            )
        if resolved != "native":
            try:  # before the header: a rank that cannot build it must still send its header
                schedule = get_schedule(resolved, n, numel, group_size=group_size)
            except ConfigError as exc:
                error = exc
    seg_elems = (
        max(1, segment_bytes // (wire.itemsize if wire is not None else 4))
        if isinstance(segment_bytes, int)
        else 1
    )
    hook: HeaderExchange | None = None
    if check and n > 1:
        device = tensor.device if isinstance(tensor, torch.Tensor) else torch.device("cpu")
        header = _header_tensor(
            (
                _MAGIC,
                0 if error is None else 1,
                numel,
                DTYPES.get(tensor.dtype, -1) if isinstance(tensor, torch.Tensor) else -1,
                _ALGO_CODE.get(resolved, -1),
                OPS.index(op) if op in OPS else -1,
                _WIRE_CODE.get(_WIRE.get(wire_dtype), -1),
                group_size or 0,
                seg_elems,
            ),
            device,
        )
        if comm.pipelined and error is None and resolved != "native":
            assert wire is not None  # narrowed above; not input validation
            hook = _HeaderRound(comm, header, wire)  # the header rides with step-0 data
        else:
            pending: list[tuple[Request, torch.Tensor]] = []
            if comm.pipelined:
                regions, pending = _exchange_header_messages(comm, header, {})
                headers = _decode(comm, header, regions)
            else:
                headers = _exchange_headers(comm, header)
            try:
                if error is not None:
                    raise error
                _check_headers(headers)
            except (ConfigError, CollectiveError):
                pending += _drain(comm, headers)
                raise
            finally:
                for req, _ in pending:
                    req.wait()
    elif error is not None:
        raise error
    st = CollectiveStats() if stats is None else stats
    st.algorithm, st.world_size, st.rank, st.numel = resolved, n, comm.rank, numel
    st.dtype = str(tensor.dtype).removeprefix("torch.")
    st.header_bytes = 9 * 8 * (n - 1) if check else 0
    if resolved == "native":
        st.wire_dtype = st.dtype
        st.runner = "native"
        if n > 1 and numel > 0:
            comm.native_all_reduce(tensor, op)
            st.bytes_sent = -1  # unknown: the backend's own algorithm
    else:
        assert wire is not None  # narrowed above; not input validation
        st.wire_dtype = str(wire).removeprefix("torch.")
        acc = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        flat = tensor.view(-1)
        work = flat if flat.dtype == acc else flat.to(acc)
        execute(
            schedule, comm, work, wire_dtype=wire, segment_elems=seg_elems, stats=st, header=hook
        )
        if op == "avg" and n > 1:
            work.div_(n)
        if work is not flat:
            flat.copy_(work)
    st.seconds = time.perf_counter() - t0
    _local.stats = st
    _log.debug("all_reduce %s", st)
    return tensor
