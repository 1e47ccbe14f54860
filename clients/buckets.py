"""Bucketed gradient all-reduce for a site's data-parallel workers, as DDP's ``Reducer``.

:class:`GradReducer` sums (or averages) a model's gradients across the site's K workers the
way PyTorch DDP does (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB, section 3.2.3 "Gradient Bucketing", section 3.2.4 "Overlap
Computation with Communication", section 4.2 "Core Gradient Reduction"):

* **Buckets** of about ``bucket_bytes`` (the first one at most ``first_bucket_bytes``, 1 MiB
  as DDP, so the first all-reduce starts early), filled first in *reverse* registration
  order -- the approximation of the backward order of section 3.2.3.
* **Overlap.** With ``overlap=True`` a post-accumulate-grad hook on every parameter marks its
  gradient ready; when a bucket is complete, a background thread (one per worker) starts that
  bucket's all-reduce (:func:`fedagg.collectives.all_reduce`) while backward keeps computing
  the gradients of earlier layers. Every worker reduces the buckets strictly in index order,
  so all workers issue the same collectives in the same order (section 3.2.3: "all processes
  must use the same bucketing order"). :attr:`ReducerStats.hidden_buckets` counts the
  buckets already reduced when backward returned (the overlap that happened).
* **Layout rebuilt from the observed order** (DDP ``Reducer::rebuild_buckets``): the hooks of
  the first synchronizing step record the order in which gradients became ready; at the end
  of that step every worker adopts the lowest-ranked worker's order
  (:func:`clients.reducer_layout.agree_order`) and the buckets are rebuilt from it, so that a
  model whose forward uses its layers in another order than it registered them still fills
  bucket 0 first. Parameters that produced no gradient go last.
* **Gradient as bucket view** (DDP ``gradient_as_bucket_view=True``): ``param.grad`` is a view
  into its bucket's flat buffer. :meth:`begin_step` attaches the (zeroed) views to parameters
  whose ``.grad`` is ``None`` (``zero_grad(set_to_none=True)``) and adopts any other gradient
  tensor into its view once; autograd then accumulates straight into the bucket and the
  all-reduce result *is* the gradient: no copy into the bucket, none out of it
  (:attr:`ReducerStats.copied_params` counts the exceptions). The optimizer reads the views.
* **Gradient accumulation** (DDP ``no_sync``, end of section 3.2.4): the hooks of
  non-synchronizing micro-batches do nothing, gradients accumulate in ``param.grad`` -- in
  the bucket, with views -- and only the last micro-batch of a step triggers the
  all-reductions: one per bucket per optimizer step. Parameters whose hook did not fire in
  the synchronizing micro-batch (no data on this worker, or unused) are reduced with what
  they hold (zeros if nothing) when the step finishes.
* With ``overlap=False`` everything is one bucket reduced after backward (the baseline).

The reduction is a *sum* by default: callers scale their loss by ``1 / global_batch`` so that
the summed gradient is the mean gradient over the global batch even when workers hold
different numbers of examples (Goyal et al. 2017, "Accurate, Large Minibatch SGD", section 2.1
and appendix). ``op="avg"`` divides by K instead, as DDP does (per-worker mean losses).

``algorithm="auto"``: on NCCL always the backend's native all-reduce (NCCL's ring / tree
kernels run on the GPU without host round trips; fedagg's schedules post one grouped exchange
per step from the host, which can only add latency). Elsewhere the cost model ranks the
scheduled algorithms per bucket size (:func:`fedagg.collectives.choose_algorithm`; it has no
term for the backend's own implementation), and at the end of the first step a probe times
that choice against ``native`` on the real bucket sizes (``probe_repeats`` interleaved rounds
after one warm-up, medians averaged over the workers, so every worker picks the same); the
faster one is used from the second step on (:attr:`ReducerStats.probe`).

Low-precision transport (``comm_dtype`` bf16 / fp16): messages travel in that dtype,
accumulation is in float32, and every worker ends with bit-identical values (see
:mod:`fedagg.collectives.executor`); for ``native`` the bucket is cast, reduced by the
backend, and cast back.

BatchNorm and other buffers: gradients never depend on running statistics, but the
statistics drift apart across workers (each sees its own slice). With ``buffers=`` the
reducer copies worker 0's buffers to every worker at :meth:`begin_step` (DDP
``broadcast_buffers=True``, once per optimizer step here rather than per forward). The
reference ResNet uses GroupNorm and has no buffers (see :class:`fedagg.models.ResNet`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from clients.reducer_comm import BucketComm, CommHook, ReducerStats
from clients.reducer_layout import (
    DEFAULT_FIRST_BUCKET_BYTES,
    Bucket,
    agree_order,
    assign_buckets,
    broadcast_,
)
from fedagg.collectives import ALGORITHMS, Communicator
from fedagg.errors import CollectiveError, ConfigError, explain

__all__ = ["COMM_DTYPES", "GradReducer"]

_log = logging.getLogger(__name__)

COMM_DTYPES: dict[str, str | None] = {"float32": None, "bfloat16": "bf16", "float16": "fp16"}
_POLL_S = 0.05
_ONE_BUCKET = 1 << 62


class GradReducer:
    """Sum the gradients of ``params`` across the workers of ``comm``, bucketed, overlapped
    with backward, into gradients that are views of the buckets.

    Parameters
    ----------
    params : iterable of torch.nn.Parameter
        The model's parameters (registration order); those without ``requires_grad`` are
        ignored.
    comm : Communicator
        The site's communicator (in-process or torch.distributed).
    algorithm : {"auto", "ring", "tree", "hierarchical", "native"}
        All-reduce algorithm (``auto``: see the module docstring).
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
        CollectiveError everywhere); later calls of that size run with ``check=False``. The
        layout is identical on every worker (fixed at construction, rebuilt collectively
        from one agreed order) and ``auto``'s choice is made collectively, so one
        verification per size covers the run -- what DDP does when it verifies parameter
        shapes across processes once at construction (Li et al. 2020, section 4.1). A
        worker that later falls out of step fails on a message-size error or the timeout
        instead of a named mismatch. ``"always"`` checks every call.
    first_bucket_bytes : int
        Cap of bucket 0 (``min`` with ``bucket_bytes``); DDP's default 1 MiB.
    rebuild_buckets : bool
        Rebuild the layout from the gradient order observed in the first synchronizing step
        (``overlap=True`` only).
    gradient_as_bucket_view : bool
        Make ``param.grad`` a view of its bucket (no copies); ``False`` copies gradients in
        and the results out.
    op : {"sum", "avg"}
        ``avg`` divides the sum by the number of workers (DDP's convention).
    buffers : iterable of torch.Tensor, optional
        Tensors (BatchNorm running statistics) copied from worker 0 to every worker at each
        :meth:`begin_step`.
    probe_repeats : int
        Timed rounds per candidate of the ``auto`` probe (0: cost model only, so never
        native except on NCCL).
    comm_hook, hook_state : callable and object, optional
        A communication hook replacing each bucket's all-reduce: DDP's
        ``register_comm_hook(state, hook)`` seam (:data:`clients.reducer_comm.CommHook`; it
        gets a :class:`~clients.reducer_comm.GradBucket` and returns the reduced tensor).

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
        first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
        rebuild_buckets: bool = True,
        gradient_as_bucket_view: bool = True,
        op: str = "sum",
        buffers: Iterable[torch.Tensor] | None = None,
        probe_repeats: int = 3,
        comm_hook: CommHook | None = None,
        hook_state: Any = None,
    ) -> None:
        _validate(check, comm_dtype, bucket_bytes, first_bucket_bytes, algorithm, op,
                  probe_repeats)
        self.params = [p for p in params if p.requires_grad]
        self.comm = comm
        self.algorithm = algorithm
        self.overlap = overlap
        self.timeout = timeout
        self.as_view = gradient_as_bucket_view
        self.buffers = list(buffers or ())
        self.stats = ReducerStats()
        self._comm = BucketComm(comm, algorithm=algorithm, wire=COMM_DTYPES[comm_dtype], op=op,
                                check=check, timeout=timeout, probe_repeats=probe_repeats,
                                stats=self.stats, hook=comm_hook, hook_state=hook_state)
        self._caps = (bucket_bytes, first_bucket_bytes) if overlap else (_ONE_BUCKET,) * 2
        device = self.params[0].device if self.params else torch.device("cpu")
        self._cuda = device.type == "cuda"
        self.buckets: list[Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}
        reverse = list(reversed(range(len(self.params))))
        self._install(assign_buckets(reverse, self.params, *self._caps), migrate=False)
        self._rebuild_pending = rebuild_buckets and overlap and len(self.params) > 1
        self._observed: list[int] = []
        self._seen: set[int] = set()
        self._lock = threading.Lock()
        self._sync = False
        self._filled: set[int] = set()
        self._hooks: list[Any] = []
        if overlap:
            for i, p in enumerate(self.params):
                self._hooks.append(
                    p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        functools.partial(self._on_grad, i)
                    )
                )
            self._comm.start()

    @property
    def num_buckets(self) -> int:
        """Number of buckets (1 when ``overlap`` is off: all gradients in one call)."""
        return len(self.buckets)

    def layout(self) -> list[list[int]]:
        """The buckets as lists of parameter indices, in reduction order."""
        return [list(b.params) for b in self.buckets]

    def state_dict(self) -> dict[str, Any]:
        """What the reducer learned (plain data): the layout and ``auto``'s choice."""
        return {"layout": self.layout(), "rebuilt": not self._rebuild_pending,
                "auto_choice": self._comm.choice}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Adopt a :meth:`state_dict` of a reducer of the same model and workers (no rebuild
        or probe is then needed); call it on every worker before the first step.

        Raises
        ------
        ConfigError
            The layout does not split this reducer's parameter indices into buckets, or the
            choice is unknown.
        """
        layout = [[int(i) for i in b] for b in state.get("layout", [])]
        if sorted(i for b in layout for i in b) != list(range(len(self.params))) or not all(layout):
            raise ConfigError(explain("state['layout']", layout,
                                      f"must split indices 0..{len(self.params) - 1} into buckets",
                                      "pass the state_dict() of a reducer of the same model"))
        choice = state.get("auto_choice")
        if choice not in (None, "model", "native"):
            raise ConfigError(explain("state['auto_choice']", choice,
                                      "must be None, 'model' or 'native'",
                                      "pass the state_dict() of a GradReducer"))
        self._install(layout, migrate=True)
        self._rebuild_pending = self._rebuild_pending and not state.get("rebuilt", False)
        if self.algorithm == "auto" and self._comm.choice is None:
            self._comm.choice = choice

    # -- one step --------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Start an optimizer step (call before the first micro-batch's forward).

        Resets the buckets, copies worker 0's ``buffers`` to every worker, and attaches the
        bucket views as ``param.grad`` (zeroed where the gradient was ``None``).
        """
        self._raise_error()
        self._sync = True
        self._filled.clear()
        self._comm.step_algorithms = set()
        if self.buffers:
            broadcast_(self.comm, self.buffers)
        for b in self.buckets:
            b.reset()
            if self.as_view:
                self._attach(b)
        if self.overlap:
            self._comm.submit(self.buckets)

    def set_sync(self, sync: bool) -> None:
        """Whether the next backward is the step's last micro-batch (its hooks reduce).

        :meth:`begin_step` sets it to ``True`` (DDP's default); pass ``False`` for the
        micro-batches that only accumulate (DDP ``no_sync``).
        """
        self._sync = sync

    def finish_step(self) -> None:
        """Reduce whatever is left, wait for every bucket; ``.grad`` then holds the sums.

        After the first step this also rebuilds the layout and runs the ``auto`` probe (both
        collective: every worker does them at the same step).

        Raises
        ------
        CollectiveError, CollectiveTimeout
            A reduction failed or a peer did not answer.
        """
        self.stats.steps += 1
        if self.overlap:
            self.stats.hidden_buckets += sum(b.done.is_set() for b in self.buckets)
        for b in self.buckets:  # hooks that did not fire: no data on this worker, or unused
            if not b.ready.is_set():
                for k, i in enumerate(b.params):
                    if i not in self._filled:
                        self._fill(b, k, i)
                self._mark_ready(b)
        t0 = time.perf_counter()
        for b in self.buckets:
            if not self.overlap:
                self._comm.reduce_bucket(b.index, b.flat)
                continue
            while not b.done.wait(_POLL_S):
                self._raise_error()
                if not self._comm.alive():
                    raise CollectiveError("gradient reducer thread died")
            self._raise_error()
        self.stats.wait_seconds += time.perf_counter() - t0
        for b in self.buckets:  # parameters without a view (or views off): copy the result out
            for k, i in enumerate(b.params):
                if b.views[k] is None:
                    p = self.params[i]
                    result = b.region(k, p.numel()).view_as(p)
                    if p.grad is None:
                        p.grad = result.clone()
                    else:
                        p.grad.copy_(result)
        self.stats.algorithm = "+".join(sorted(self._comm.step_algorithms))
        if self._rebuild_pending:
            self._rebuild()
        if self.algorithm == "auto" and self._comm.choice is None:
            self._comm.probe([b.flat for b in self.buckets])

    def close(self) -> None:
        """Remove the hooks and stop the background thread (gradients stay as they are)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._comm.close()

    # -- layout ----------------------------------------------------------------------------
    def _install(self, groups: list[list[int]], *, migrate: bool) -> None:
        """Make ``groups`` the buckets; with ``migrate``, carry the current gradients over."""
        buckets = [Bucket(b, idx, self.params, self.as_view) for b, idx in enumerate(groups)]
        if migrate:
            for b in buckets:
                for k, i in enumerate(b.params):
                    p, view = self.params[i], b.views[k]
                    if p.grad is not None and view is not None:
                        view.copy_(p.grad)
                        p.grad = view
        self.buckets = buckets
        self._where = {i: (b.index, k) for b in buckets for k, i in enumerate(b.params)}

    def _rebuild(self) -> None:
        """Rebuild the buckets in the agreed observed gradient order (collective)."""
        self._rebuild_pending = False
        observed, self._observed, self._seen = self._observed, [], set()
        device = self.buckets[0].flat.device if self.buckets else None
        order = agree_order(self.comm, observed, len(self.params), device)
        if order is None:
            return
        known = set(order)
        order += [i for i in reversed(range(len(self.params))) if i not in known]
        groups = assign_buckets(order, self.params, *self._caps)
        if groups != self.layout():
            self._install(groups, migrate=True)
            self.stats.rebuilds += 1
            _log.debug("rank %d: buckets rebuilt from the observed order: %s", self.comm.rank,
                       groups)

    def _attach(self, b: Bucket) -> None:
        """Make every member's ``.grad`` its view of ``b`` (zeroed where it was None)."""
        fresh = all(self.params[i].grad is None for i in b.params)
        if fresh:
            b.flat.zero_()
        for k, i in enumerate(b.params):
            p, view = self.params[i], b.views[k]
            if view is None:
                continue
            g = p.grad
            if g is None:
                if not fresh:
                    view.zero_()
                p.grad = view
            elif not b.holds(k, g):
                view.copy_(g)
                p.grad = view
                self.stats.copied_params += 1

    # -- hooks -----------------------------------------------------------------------------
    def _raise_error(self) -> None:
        if self._comm.error is not None:
            raise self._comm.error

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        if not self._sync:
            return  # no_sync: accumulate locally
        b_idx, k = self._where[i]
        b = self.buckets[b_idx]
        with self._lock:
            if self._rebuild_pending and i not in self._seen:
                self._seen.add(i)
                self._observed.append(i)
            if i in self._filled:
                return
            self._fill(b, k, i)
            b.pending -= 1
            complete = b.pending == 0
        if complete:
            self._mark_ready(b)

    def _fill(self, b: Bucket, k: int, i: int) -> None:
        """Put parameter ``i``'s gradient into its bucket slot (nothing to do for a view)."""
        p = self.params[i]
        g, view = p.grad, b.views[k]
        if g is None:
            b.region(k, p.numel()).zero_()
            if view is not None:
                p.grad = view
        elif not b.holds(k, g):
            b.region(k, p.numel()).copy_(g.detach().reshape(-1))
            self.stats.copied_params += 1
            if view is not None:
                p.grad = view
        self._filled.add(i)

    def _mark_ready(self, b: Bucket) -> None:
        if self._cuda:
            b.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            b.event.record()
        b.ready.set()


def _validate(check: str, comm_dtype: str, bucket_bytes: int, first_bucket_bytes: int,
              algorithm: str, op: str, probe_repeats: int) -> None:
    if check not in ("first", "always"):
        raise ConfigError(explain("check", check, "must be 'first' or 'always'", "pass one of those"))
    if comm_dtype not in COMM_DTYPES:
        raise ConfigError(explain("site.comm_dtype", comm_dtype,
                                  f"must be one of {list(COMM_DTYPES)}", "pick one of those"))
    if bucket_bytes < 1:
        raise ConfigError(explain("site.bucket_mb", bucket_bytes / 2**20, "must be > 0",
                                  "use e.g. 25"))
    if first_bucket_bytes < 1:
        raise ConfigError(explain("first_bucket_bytes", first_bucket_bytes, "must be >= 1",
                                  "use e.g. 1 << 20 (DDP's default)"))
    if algorithm not in ALGORITHMS:
        raise ConfigError(explain("site.algorithm", algorithm,
                                  f"must be one of {list(ALGORITHMS)}", "pick one of those"))
    if op not in ("sum", "avg"):
        raise ConfigError(explain("op", op, "must be 'sum' or 'avg'",
                                  "use 'sum' with losses scaled by 1 / global batch"))
    if probe_repeats < 0:
        raise ConfigError(explain("probe_repeats", probe_repeats, "must be >= 0",
                                  "use 0 to skip the probe"))
