"""The communication side of :class:`clients.buckets.GradReducer`: one bucket's all-reduce,
``auto``'s choice, the counters, and the thread that reduces buckets while backward runs.

:class:`BucketComm` reduces flat bucket buffers with :func:`fedagg.collectives.all_reduce`:
it resolves the algorithm (``auto``: the cost model's schedule or the backend's native
all-reduce, see :meth:`BucketComm.probe`), exchanges the consistency header once per bucket
size (``check="first"``), casts for a low-precision wire and fills :class:`ReducerStats`.
With :meth:`BucketComm.start` it also runs the background thread of the overlap (Li et al.
2020, "PyTorch Distributed", VLDB, section 3.2.4): for each submitted step it waits for
bucket 0, 1, ... in index order to be marked ready by the backward hooks and reduces each
one as soon as it is, so every worker issues the same collectives in the same order.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from clients.reducer_layout import Bucket
from fedagg.collectives import (
    CollectiveStats,
    Communicator,
    all_reduce,
    choose_algorithm,
    get_default_cost_model,
)
from fedagg.errors import CollectiveTimeout, explain

__all__ = ["BucketComm", "CommHook", "GradBucket", "ReducerStats", "allreduce_hook"]

_log = logging.getLogger(__name__)

_TORCH_WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16}
_POLL_S = 0.05


@dataclass
class ReducerStats:
    """Counters of one worker's gradient reductions.

    Attributes
    ----------
    calls : int
        ``all_reduce`` calls for gradients (buckets reduced; the auto probe is not counted).
    steps : int
        Synchronizing steps (one per optimizer step).
    bytes_allreduced : int
        Payload bytes handed to all-reduce, in the wire dtype (numel x itemsize per call).
    bytes_sent : int
        Bytes this worker put on the wire (schedules: counted; native: ring estimate
        ``2 (K-1)/K x payload``).
    comm_seconds : float
        Wall time spent inside all-reduce calls (overlapped or not).
    checked_calls : int
        Calls that exchanged the consistency header (see ``GradReducer(check=...)``).
    wait_seconds : float
        Time the training thread blocked waiting for reductions after backward (the part of
        communication that was *not* hidden behind computation).
    hidden_buckets : int
        Buckets whose all-reduce had already finished when ``finish_step`` was called (the
        overlap that happened), summed over steps.
    copied_params : int
        Gradients copied into a bucket because ``param.grad`` was not its bucket view.
    rebuilds : int
        Times the bucket layout was rebuilt from the observed gradient order (0 or 1).
    algorithm : str
        Algorithm(s) the last step's reductions ran, ``+``-joined (``"native"``, ``"ring"``).
    probe : dict of str to float
        ``algorithm="auto"``: median seconds of one step's reductions per candidate, averaged
        over the workers (e.g. ``{"ring": 0.004, "native": 0.003}``).
    probe_seconds : float
        Time the probe took on this worker.
    """

    calls: int = 0
    steps: int = 0
    bytes_allreduced: int = 0
    bytes_sent: int = 0
    comm_seconds: float = 0.0
    checked_calls: int = 0
    wait_seconds: float = 0.0
    hidden_buckets: int = 0
    copied_params: int = 0
    rebuilds: int = 0
    algorithm: str = ""
    probe: dict[str, float] = field(default_factory=dict)
    probe_seconds: float = 0.0


@dataclass
class GradBucket:
    """One bucket of gradients handed to a communication hook (as DDP's ``GradBucket``).

    Attributes
    ----------
    index : int
        The bucket's position in reduction order (the same on every worker).
    buffer : torch.Tensor
        The flat gradients of the bucket (this worker's sum over its micro-batches). The hook
        returns the reduced tensor (or reduces ``buffer`` in place and returns None).
    world_size, rank : int
        The site's workers and this one.
    reduce : callable
        ``reduce(tensor)``: fedagg's own all-reduce of ``tensor`` in place (the configured
        algorithm, wire dtype and counters), for hooks that transform before / after it.
    """

    index: int
    buffer: torch.Tensor
    world_size: int
    rank: int
    reduce: Callable[[torch.Tensor], None]


CommHook = Callable[[Any, GradBucket], "torch.Tensor | None"]
"""``hook(state, bucket) -> reduced tensor | None``: replaces a bucket's all-reduce, like
PyTorch DDP's ``register_comm_hook(state, hook)`` (Li et al. 2020, "PyTorch Distributed",
VLDB; ``torch.distributed.algorithms.ddp_comm_hooks``), except that it returns the tensor
instead of a Future (fedagg already runs it off the training thread, overlapped with
backward). The hook must issue the same collectives in the same order on every worker."""


def allreduce_hook(state: Any, bucket: GradBucket) -> torch.Tensor:
    """The default: fedagg's all-reduce of the bucket, unchanged."""
    del state
    bucket.reduce(bucket.buffer)
    return bucket.buffer


class BucketComm:
    """All-reduce of bucket buffers for one worker (see the module docstring).

    Parameters
    ----------
    comm : Communicator
        The site's communicator.
    algorithm : str
        ``auto`` or an algorithm of :data:`fedagg.collectives.ALGORITHMS`.
    wire : {None, "bf16", "fp16"}
        Wire dtype.
    op : {"sum", "avg"}
        Reduction.
    check : {"first", "always"}
        When to exchange the consistency header.
    timeout : float
        Seconds the thread waits for a bucket to be marked ready.
    probe_repeats : int
        Timed rounds per candidate of :meth:`probe` (0: no probe).
    stats : ReducerStats
        Counters to fill.
    hook, hook_state : callable and object, optional
        A communication hook (:data:`CommHook`) and its state, replacing each gradient
        bucket's all-reduce.
    """

    def __init__(
        self,
        comm: Communicator,
        *,
        algorithm: str,
        wire: str | None,
        op: str,
        check: str,
        timeout: float,
        probe_repeats: int,
        stats: ReducerStats,
        hook: CommHook | None = None,
        hook_state: Any = None,
    ) -> None:
        self.comm = comm
        self.hook = hook
        self.hook_state = hook_state
        self.algorithm = algorithm
        self.wire = wire
        self.op = op
        self.check = check
        self.timeout = timeout
        self.probe_repeats = probe_repeats
        self.stats = stats
        self.choice: str | None = None
        """``auto``: ``"model"`` (the cost model's schedule), ``"native"``, or ``None`` until
        :meth:`probe` decided."""
        if algorithm == "auto":
            if "nccl" in str(getattr(comm, "backend", "")).lower():
                self.choice = "native"  # NCCL: its own kernels, never host-driven schedules
            elif comm.world_size == 1 or probe_repeats == 0:
                self.choice = "model"
        self.step_algorithms: set[str] = set()
        self.error: BaseException | None = None
        self._verified: set[int] = set()  # bucket sizes whose header was exchanged
        self._stop = threading.Event()
        self._queue: list[list[Bucket]] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    # -- one reduction ---------------------------------------------------------------------
    def resolve(self, flat: torch.Tensor, mode: str | None = None) -> str:
        """The algorithm for one bucket (``mode`` overrides ``auto``'s choice: the probe)."""
        if self.algorithm != "auto":
            return self.algorithm
        if (mode or self.choice) == "native":
            return "native"
        itemsize = 2 if self.wire is not None else flat.element_size()
        return choose_algorithm(self.comm.world_size, flat.numel() * itemsize,
                                model=get_default_cost_model())

    def reduce_bucket(self, index: int, flat: torch.Tensor) -> None:
        """Reduce one gradient bucket in place: through the hook if there is one."""
        if self.hook is None:
            self.reduce(flat)
            return
        out = self.hook(self.hook_state, GradBucket(index, flat, self.comm.world_size,
                                                    self.comm.rank, self.reduce))
        if out is not None and out is not flat:
            if tuple(out.shape) != tuple(flat.shape):
                raise ValueError(explain("comm hook result", tuple(out.shape),
                                         f"must have the bucket's shape {tuple(flat.shape)}",
                                         "return the reduced bucket buffer"))
            flat.copy_(out)

    def reduce(self, flat: torch.Tensor, mode: str | None = None, record: bool = True) -> None:
        """All-reduce ``flat`` in place (``record=False``: not counted, for the probe)."""
        t0 = time.perf_counter()
        st = CollectiveStats()
        n = self.comm.world_size
        alg = self.resolve(flat, mode)
        check = self.check == "always" or flat.numel() not in self._verified
        if alg == "native" and self.wire is not None:
            low = flat.to(_TORCH_WIRE[self.wire])
            all_reduce(low, algorithm="native", op=self.op, comm=self.comm, stats=st, check=check)
            flat.copy_(low)
            itemsize = 2
        else:
            all_reduce(flat, algorithm=alg, op=self.op, comm=self.comm,
                       wire_dtype=None if alg == "native" else self.wire, stats=st, check=check)
            itemsize = 2 if self.wire is not None else flat.element_size()
        if self.check == "first":
            self._verified.add(flat.numel())
        if not record:
            return
        if check:
            self.stats.checked_calls += 1
        self.step_algorithms.add(st.algorithm)
        payload = flat.numel() * itemsize
        self.stats.calls += 1
        self.stats.bytes_allreduced += payload
        sent = st.bytes_sent if st.bytes_sent >= 0 else 2 * (n - 1) * payload // max(n, 1)
        self.stats.bytes_sent += sent
        self.stats.comm_seconds += time.perf_counter() - t0

    def probe(self, sizes_like: Sequence[torch.Tensor]) -> None:
        """``auto``: time the cost model's schedule against native; keep the faster.

        Collective (every worker calls it at the same step). ``probe_repeats`` interleaved
        rounds (candidate order alternating) over zeroed scratch copies of the buckets, after
        one warm-up round; each worker's median per candidate is averaged over the workers by
        an all-reduce, so every worker reads the same numbers and picks the same algorithm
        (ties: the schedule).
        """
        t_start = time.perf_counter()
        candidates = ["model", "native"]
        scratch = [torch.zeros_like(t) for t in sizes_like]
        times: dict[str, list[float]] = {c: [] for c in candidates}
        for r in range(self.probe_repeats + 1):
            for c in candidates if r % 2 == 0 else candidates[::-1]:
                t0 = time.perf_counter()
                for s in scratch:
                    self.reduce(s, mode=c, record=False)
                if r > 0:
                    times[c].append(time.perf_counter() - t0)
        medians = torch.tensor([statistics.median(times[c]) for c in candidates],
                               dtype=torch.float64)
        all_reduce(medians, algorithm="native", op="avg", comm=self.comm)
        self.choice = candidates[int(torch.argmin(medians).item())]
        names = "+".join(sorted({self.resolve(s, "model") for s in scratch}))
        self.stats.probe = {names: float(medians[0]), "native": float(medians[1])}
        self.stats.probe_seconds += time.perf_counter() - t_start
        _log.debug("rank %d: auto probe %s -> %s", self.comm.rank, self.stats.probe, self.choice)

    # -- the overlap thread ----------------------------------------------------------------
    def start(self) -> None:
        """Start the background thread that reduces submitted steps' buckets."""
        self._thread = threading.Thread(target=self._loop, name=f"fedagg-reducer{self.comm.rank}",
                                        daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        """Whether the background thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, buckets: list[Bucket]) -> None:
        """Reduce these buckets, in order, as each becomes ready (one optimizer step)."""
        with self._cv:
            self._queue.append(buckets)
            self._cv.notify()

    def close(self) -> None:
        """Stop the thread (a step in progress is abandoned)."""
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._cv:
                while not self._queue and not self._stop.is_set():
                    self._cv.wait(0.5)
                if self._stop.is_set():
                    return
                buckets = self._queue.pop(0)
            try:
                for b in buckets:
                    deadline = time.monotonic() + self.timeout
                    while not b.ready.wait(_POLL_S):
                        if self._stop.is_set():
                            return
                        if time.monotonic() > deadline:
                            raise CollectiveTimeout(explain(
                                "bucket", b.index, f"not filled within {self.timeout}s",
                                "every step must run backward or finish_step()"))
                    if b.event is not None:
                        b.event.synchronize()
                    self.reduce_bucket(b.index, b.flat)
                    b.done.set()
            except BaseException as exc:  # handed to the training thread
                self.error = exc
                for b in buckets:
                    b.done.set()
                return
