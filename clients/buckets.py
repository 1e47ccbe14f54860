"""Bucketed gradient all-reduce for a site's data-parallel workers.

:class:`GradReducer` averages the gradients of a model across the site's K workers the way
PyTorch DDP does (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB, sections 3.2.3 "Gradient Bucketing" and 3.2.4 "Overlap Computation
with Communication"):

* Parameters are grouped into buckets of about ``bucket_bytes``, in *reverse* registration
  order, which is roughly the order in which backward produces their gradients.
* With ``overlap=True`` a post-accumulate-grad hook on every parameter copies its gradient into
  its bucket; as soon as a bucket is complete, a background thread (one per worker) starts
  that bucket's all-reduce with :func:`fedagg.collectives.all_reduce` while backward keeps
  computing the gradients of earlier layers. Buckets are reduced strictly in index order on
  every worker, so all workers issue the same collectives in the same order (section 3.2.3:
  "all processes must use the same bucketing order"). Parameters whose hook did not fire (no
  data on this worker in this step, or unused) are filled with zeros when the step finishes.
* With ``overlap=False`` the gradients are reduced after backward in one all-reduce over all
  of them (the baseline the overlap is measured against).
* Gradient accumulation (DDP ``no_sync``, section 3.2.4 end): the hooks of non-synchronizing
  micro-batches do nothing, gradients accumulate locally in ``param.grad``, and only the last
  micro-batch of a step triggers the all-reduce, so there is one all-reduce per optimizer step.

The reduction is a *sum*: callers scale their loss by ``1 / global_batch`` so that the summed
gradient is the mean gradient over the global batch even when workers hold different numbers
of examples (Goyal et al. 2017, "Accurate, Large Minibatch SGD", section 2.1 and appendix:
the per-worker loss must be normalized by the total, not the per-worker, batch size).

Optional low-precision transport (``comm_dtype`` bf16 / fp16): messages travel in that dtype,
accumulation is in float32, and every worker ends with bit-identical values (see
:mod:`fedagg.collectives.executor`); for ``native`` the bucket is cast, reduced by the
backend, and cast back.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from fedagg.collectives import CollectiveStats, Communicator, all_reduce
from fedagg.errors import CollectiveError, CollectiveTimeout, ConfigError, explain

__all__ = ["COMM_DTYPES", "GradReducer", "ReducerStats"]

_log = logging.getLogger(__name__)

COMM_DTYPES: dict[str, str | None] = {"float32": None, "bfloat16": "bf16", "float16": "fp16"}
_TORCH_WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16}
_POLL_S = 0.05


@dataclass
class ReducerStats:
    """Counters of one worker's gradient reductions.

    Attributes
    ----------
    calls : int
        ``all_reduce`` calls (buckets reduced).
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
    """

    calls: int = 0
    steps: int = 0
    bytes_allreduced: int = 0
    bytes_sent: int = 0
    comm_seconds: float = 0.0
    checked_calls: int = 0
    wait_seconds: float = 0.0


class _Bucket:
    def __init__(self, index: int, params: list[int], sizes: list[int], device: torch.device) -> None:
        self.index = index
        self.params = params
        self.offsets: list[int] = []
        total = 0
        for n in sizes:
            self.offsets.append(total)
            total += n
        self.flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.pending = len(params)
        self.ready = threading.Event()
        self.done = threading.Event()
        self.event: torch.cuda.Event | None = None


class GradReducer:
    """Sum the gradients of ``params`` across the workers of ``comm``, bucketed, optionally
    overlapped with backward.

    Parameters
    ----------
    params : iterable of torch.nn.Parameter
        The model's parameters (registration order); those without ``requires_grad`` are
        ignored.
    comm : Communicator
        The site's communicator (in-process or torch.distributed).
    algorithm : {"auto", "ring", "tree", "hierarchical", "native"}
        All-reduce algorithm.
    bucket_bytes : int
        Target bucket size in bytes (a parameter larger than this gets a bucket of its own).
    overlap : bool
        Start each bucket's all-reduce from the backward hooks (True) or reduce everything in
        one call after backward (False).
    comm_dtype : {"float32", "bfloat16", "float16"}
        Dtype of gradients on the wire.
    timeout : float
        Seconds any wait for a bucket may take before raising CollectiveTimeout.
    check : {"first", "always"}
        ``"first"`` (default): the first all-reduce of each bucket size exchanges the
        consistency header (length, dtype, algorithm, ... must agree on every worker, else
        CollectiveError everywhere) and pins the algorithm it resolved; later calls of that
        size run with ``check=False``. The layout is fixed at construction and identical on
        every worker, so one verification covers the run — what DDP does when it verifies
        parameter shapes across processes once at construction (Li et al. 2020, section
        4.1) — and every step saves the header's synchronisation (0.25-0.5 ms per call on
        the 2-core VM, docs/benchmarks.md). A worker that later falls out of step then fails
        on a message-size error or the timeout instead of a named mismatch. ``"always"``
        checks every call.

    Examples
    --------
    One optimizer step with M micro-batches (the last one synchronizes)::

        reducer.begin_step()
        for j, mb in enumerate(micro_batches):
            reducer.set_sync(j == len(micro_batches) - 1)
            (loss_fn(model(x[mb]), y[mb]) / global_batch).backward()
        reducer.finish_step()   # gradients are now summed over all workers
        optimizer.step()
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        comm: Communicator,
        *,
        algorithm: str = "auto",
        bucket_bytes: int = 25 << 20,
        overlap: bool = True,
        comm_dtype: str = "float32",
        timeout: float = 120.0,
        check: str = "first",
    ) -> None:
        if check not in ("first", "always"):
            raise ConfigError(
                explain("check", check, "must be 'first' or 'always'", "pass one of those")
            )
        if comm_dtype not in COMM_DTYPES:
            raise ConfigError(
                explain("site.comm_dtype", comm_dtype, f"must be one of {list(COMM_DTYPES)}",
                        "pick one of those")
            )
        if bucket_bytes < 1:
            raise ConfigError(explain("site.bucket_mb", bucket_bytes / 2**20, "must be > 0",
                                      "use e.g. 25"))
        self.params = [p for p in params if p.requires_grad]
        self.comm = comm
        self.algorithm = algorithm
        self.overlap = overlap
        self.wire = COMM_DTYPES[comm_dtype]
        self.timeout = timeout
        self.check = check
        self._verified: dict[int, str] = {}  # numel -> algorithm resolved by its checked call
        self.stats = ReducerStats()
        device = self.params[0].device if self.params else torch.device("cpu")
        self._cuda = device.type == "cuda"
        groups: list[list[int]] = []
        size = 0
        for i in reversed(range(len(self.params))):
            nbytes = self.params[i].numel() * 4
            if groups and groups[-1] and size + nbytes <= bucket_bytes:
                groups[-1].append(i)
                size += nbytes
            else:
                groups.append([i])
                size = nbytes
        self.buckets = [
            _Bucket(b, idx, [self.params[i].numel() for i in idx], device)
            for b, idx in enumerate(groups)
        ]
        self._where = {i: (b.index, k) for b in self.buckets for k, i in enumerate(b.params)}
        self._lock = threading.Lock()
        self._sync = False
        self._filled: set[int] = set()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._step_queue: list[int] = []
        self._step_cv = threading.Condition()
        self._hooks = []
        self._thread: threading.Thread | None = None
        if overlap:
            for i, p in enumerate(self.params):
                self._hooks.append(
                    p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        functools.partial(self._on_grad, i)
                    )
                )
            self._thread = threading.Thread(target=self._comm_loop, name=f"fedagg-reducer{comm.rank}",
                                            daemon=True)
            self._thread.start()

    @property
    def num_buckets(self) -> int:
        """Number of buckets (1 when ``overlap`` is off: all gradients in one call)."""
        return len(self.buckets) if self.overlap else 1

    # -- one step --------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Start an optimizer step: reset the buckets (call before the first micro-batch)."""
        self._raise_error()
        self._sync = False
        self._filled.clear()
        for b in self.buckets:
            b.pending = len(b.params)
            b.ready.clear()
            b.done.clear()
            b.event = None
        if self.overlap:
            with self._step_cv:
                self._step_queue.append(1)
                self._step_cv.notify()

    def set_sync(self, sync: bool) -> None:
        """Whether the next backward is the step's last micro-batch (its hooks reduce)."""
        self._sync = sync

    def finish_step(self) -> None:
        """Reduce whatever is left, wait for every bucket and write the sums into ``.grad``.

        Raises
        ------
        CollectiveError, CollectiveTimeout
            A reduction failed or a peer did not answer.
        """
        self.stats.steps += 1
        if not self.overlap:
            self._reduce_all_at_once()
            return
        for b in self.buckets:  # hooks that did not fire: no data on this worker, or unused
            if not b.ready.is_set():
                for k, i in enumerate(b.params):
                    if i not in self._filled:
                        self._fill(b, k, i)
                self._mark_ready(b)
        t0 = time.perf_counter()
        for b in self.buckets:
            while not b.done.wait(_POLL_S):
                self._raise_error()
                if self._thread is not None and not self._thread.is_alive():
                    raise CollectiveError("gradient reducer thread died")
            self._raise_error()
        self.stats.wait_seconds += time.perf_counter() - t0
        for b in self.buckets:
            for k, i in enumerate(b.params):
                p = self.params[i]
                view = b.flat.narrow(0, b.offsets[k], p.numel()).view_as(p)
                if p.grad is None:
                    p.grad = view.to(p.dtype).clone()
                else:
                    p.grad.copy_(view)

    def close(self) -> None:
        """Remove the hooks and stop the background thread."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._stop.set()
        with self._step_cv:
            self._step_cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    # -- internals ---------------------------------------------------------------------------
    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        if not self._sync:
            return  # no_sync: accumulate locally
        b_idx, k = self._where[i]
        b = self.buckets[b_idx]
        with self._lock:
            if i in self._filled:
                return
            self._fill(b, k, i)
            b.pending -= 1
            complete = b.pending == 0
        if complete:
            self._mark_ready(b)

    def _fill(self, b: _Bucket, k: int, i: int) -> None:
        p = self.params[i]
        view = b.flat.narrow(0, b.offsets[k], p.numel())
        if p.grad is None:
            view.zero_()
        else:
            view.copy_(p.grad.detach().reshape(-1))
        self._filled.add(i)

    def _mark_ready(self, b: _Bucket) -> None:
        if self._cuda:
            b.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            b.event.record()
        b.ready.set()

    def _comm_loop(self) -> None:
        while not self._stop.is_set():
            with self._step_cv:
                while not self._step_queue and not self._stop.is_set():
                    self._step_cv.wait(0.5)
                if self._stop.is_set():
                    return
                self._step_queue.pop(0)
            try:
                for b in self.buckets:
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
                    self._reduce(b.flat)
                    b.done.set()
            except BaseException as exc:  # handed to the training thread
                self._error = exc
                for b in self.buckets:
                    b.done.set()
                return

    def _reduce(self, flat: torch.Tensor) -> None:
        t0 = time.perf_counter()
        st = CollectiveStats()
        n = self.comm.world_size
        pinned = self._verified.get(flat.numel()) if self.check == "first" else None
        check = pinned is None
        if self.algorithm == "native" and self.wire is not None:
            low = flat.to(_TORCH_WIRE[self.wire])
            all_reduce(low, algorithm="native", op="sum", comm=self.comm, stats=st, check=check)
            flat.copy_(low)
            itemsize = 2
        else:
            all_reduce(flat, algorithm=pinned or self.algorithm, op="sum", comm=self.comm,
                       wire_dtype=self.wire, stats=st, check=check)
            itemsize = 2 if self.wire is not None else 4
        if check:
            self.stats.checked_calls += 1
            if self.check == "first":
                self._verified[flat.numel()] = st.algorithm
        payload = flat.numel() * itemsize
        self.stats.calls += 1
        self.stats.bytes_allreduced += payload
        sent = st.bytes_sent if st.bytes_sent >= 0 else 2 * (n - 1) * payload // max(n, 1)
        self.stats.bytes_sent += sent
        self.stats.comm_seconds += time.perf_counter() - t0

    def _reduce_all_at_once(self) -> None:
        parts = [
            (p.grad.detach().reshape(-1) if p.grad is not None
             else torch.zeros(p.numel(), dtype=torch.float32, device=p.device))
            for p in self.params
        ]
        flat = torch.cat(parts).to(torch.float32) if parts else torch.zeros(0)
        t0 = time.perf_counter()
        self._reduce(flat)
        self.stats.wait_seconds += time.perf_counter() - t0
        offset = 0
        for p in self.params:
            view = flat.narrow(0, offset, p.numel()).view_as(p)
            if p.grad is None:
                p.grad = view.to(p.dtype).clone()
            else:
                p.grad.copy_(view)
            offset += p.numel()
