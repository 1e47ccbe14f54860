"""One local worker of a site: the data-parallel training loop of a user's :class:`Task`, and
the entry point of a worker process (``python -m clients.worker JOB_DIR RANK WORLD``).

The same :func:`train_worker` runs a site of one worker, the K threads of an in-process site
(``site.mode = "inprocess"``, an in-process communicator) and the K processes of a
process-mode site (torch.distributed: gloo on CPU, NCCL with one GPU per worker).

Equivalence with one worker (data as a map-style ``Dataset``). The site iterates *global*
batches of ``train.batch_size`` in a seeded order (:func:`fedagg.task.global_batches`); worker
``k`` of ``K`` takes the ``k``-th contiguous slice of every global batch (sizes differ by at
most one; a slice may be empty when the last batch has fewer than ``K`` examples) and
optionally splits it into ``M`` micro-batches. Each micro-batch's mean loss is scaled by its
share of the global batch, so the gradients summed over micro-batches and workers (one
bucketed all-reduce per step, :class:`clients.buckets.GradReducer`) equal the gradient of the
mean loss over the global batch (Goyal et al. 2017, "Accurate, Large Minibatch SGD", section
2). Every worker then applies the same optimizer step to identical weights, so the workers
stay identical and the result equals single-worker training up to float32 summation order.

Data as one loader per worker shard (``SiteData.train_loader``): every worker runs as many
steps as the shortest shard and the gradients are averaged over workers and micro-batches,
as PyTorch DDP does (Li et al. 2020, VLDB, section 3.2).

Persistent workers (:mod:`clients.pool`) pass a :class:`~clients.worker_state.WorkerState`:
the model, the data, the reducer (and its learned layout) and, with ``site.keep_optimizer``,
the optimizer state then outlive the round; only the global weights and the round's settings
are new. Without one, everything is built for this call and the reducer is closed at the end.

This module imports neither Flower nor torch.distributed, so a worker process starts quickly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from clients.reducer_comm import ReducerStats
from clients.worker_state import WorkerState
from fedagg.collectives import Communicator, all_reduce
from fedagg.errors import DataError, WorkerError, explain
from fedagg.task import (
    SiteData,
    SiteInfo,
    StepContext,
    Task,
    TrainSettings,
    batch_size_of,
    fetch,
    get_weights,
    global_batches,
    to_device,
)

__all__ = ["WorkerFault", "WorkerJob", "WorkerLost", "WorkerResult", "train_worker",
           "weights_digest"]

_log = logging.getLogger(__name__)

Progress = Callable[[str, int], None]
"""``progress(phase, step)``: phase is ``"compute"`` or ``"comm"`` (waiting for peers)."""


class WorkerLost(WorkerError):
    """This worker is gone: an injected crash of an in-process worker (stands for a dead
    process), handled by the site like a process killed by a signal."""


@dataclass(frozen=True)
class WorkerFault:
    """An injected fault (tests and drills): worker ``rank`` dies or hangs after ``step`` steps."""

    kind: str  # "kill" | "hang"
    rank: int
    step: int


@dataclass
class WorkerJob:
    """Everything a worker needs for one round (picklable, no live handles).

    ``keep_optimizer`` keeps a persistent worker's optimizer state across rounds;
    ``attempt`` > 0 marks a redo of the round after a lost worker (the kept optimizer state
    is then restored to the start of the round).
    """

    task: Task
    site: SiteInfo
    settings: TrainSettings
    weights: list[npt.NDArray[Any]]
    accumulation_steps: int = 1
    algorithm: str = "auto"
    bucket_mb: float = 25.0
    overlap: bool = True
    comm_dtype: str = "float32"
    timeout: float = 300.0
    fault: WorkerFault | None = None
    device: str = "cpu"
    threads: int | None = None
    keep_optimizer: bool = False
    attempt: int = 0


@dataclass
class WorkerResult:
    """What one worker reports after the round (rank 0 also carries the weights).

    The reducer counters (``comm_seconds`` ... ``copied_params``) are this round's; ``probe``
    is set in the round that ran ``auto``'s probe, ``auto_choice`` whenever ``auto`` decided.
    """

    rank: int
    digest: str
    weights: list[npt.NDArray[Any]] | None
    examples: int
    loss_sum: float
    steps: int
    train_seconds: float
    compute_seconds: float
    comm_seconds: float
    wait_seconds: float
    bytes_allreduced: int
    bytes_sent: int
    allreduce_calls: int
    buckets: int
    epoch_seconds: list[float] = field(default_factory=list)
    epoch_examples: int = 0
    world_size: int = 1
    hidden_buckets: int = 0
    copied_params: int = 0
    rebuilds: int = 0
    algorithm: str = ""
    probe: dict[str, float] = field(default_factory=dict)
    probe_seconds: float = 0.0
    auto_choice: str | None = None
    setup_seconds: float = 0.0
    optimizer_rounds: int = 0
    layout: dict[str, Any] | None = None
    site_examples: int | None = None


def weights_digest(weights: list[npt.NDArray[Any]]) -> str:
    """SHA-256 of the weights' bytes (workers must end bit-identical)."""
    h = hashlib.sha256()
    for w in weights:
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()


def _strike(fault: WorkerFault, rank: int, stop: threading.Event | None, in_process: bool) -> None:
    if fault.kind == "kill":
        if in_process:
            raise WorkerLost(f"worker {rank}: injected crash after {fault.step} steps "
                             "(faults.kill_worker)")
        _log.warning("worker %d: injected SIGKILL after %d steps (faults.kill_worker)", rank, fault.step)
        os.kill(os.getpid(), signal.SIGKILL)
    _log.warning("worker %d: injected hang after %d steps (faults.hang_worker)", rank, fault.step)
    while stop is None or not stop.is_set():
        time.sleep(0.1)
    raise WorkerError(f"worker {rank}: injected hang stopped by the site")


def _dataset_steps(data: SiteData, settings: TrainSettings, epoch: int, rank: int, k: int,
                   m: int) -> Iterator[list[tuple[Any, float, int]]]:
    """Dataset mode: per step, this worker's micro-batches ``(batch, scale, n)``."""
    assert data.train is not None
    n_all = len(data.train)  # type: ignore[arg-type]
    if n_all == 0:
        raise DataError(explain("SiteData.train", "0 examples", "must not be empty",
                                "give the site some training data"))
    for idx in global_batches(n_all, settings.batch_size, epoch=epoch, seed=settings.seed):
        n_global = len(idx)
        mine = np.array_split(idx, k)[rank]
        yield [(fetch(data.train, mb), len(mb) / n_global, len(mb))
               for mb in np.array_split(mine, m) if len(mb)]


def _loader_steps(loader: Iterable[Any], steps: int, k: int, m: int
                  ) -> Iterator[list[tuple[Any, float, int]]]:
    """Loader mode: ``steps`` steps of ``m`` consecutive batches, averaged over ``k`` workers."""
    it = iter(loader)
    for _ in range(steps):
        micro = []
        for _ in range(m):
            try:
                batch = next(it)
            except StopIteration:
                break
            micro.append((batch, 1.0 / (k * m), batch_size_of(batch)))
        if not micro:
            return
        yield micro


def _shortest(comm: Communicator, length: int, timeout: float) -> int:
    """The smallest ``length`` over the site's workers (one tiny all-reduce)."""
    if comm.world_size == 1:
        return length
    counts = torch.zeros(comm.world_size, dtype=torch.float64)
    counts[comm.rank] = float(length)
    all_reduce(counts, comm=comm, algorithm="ring", timeout=timeout)
    return int(counts.min())


def _loader_len(loader: Iterable[Any]) -> int:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        raise DataError(explain("SiteData.train_loader(rank, world_size)",
                                type(loader).__name__, "must have a length (len(loader))",
                                "return a torch DataLoader over a sized dataset")) from None


def train_worker(
    job: WorkerJob,
    comm: Communicator,
    *,
    data: SiteData | None = None,
    progress: Progress | None = None,
    stop: threading.Event | None = None,
    in_process: bool = False,
    state: WorkerState | None = None,
) -> WorkerResult:
    """Train this worker's share of every step for ``settings.epochs``; return its result.

    Parameters
    ----------
    job : WorkerJob
        The task, the site, the round's settings and starting weights (same on every worker).
    comm : Communicator
        The site's communicator; ``comm.rank`` is this worker, ``comm.world_size`` is K.
    data : SiteData, optional
        The site's data, when the caller built it already (in-process sites build it once);
        else ``job.task.data(job.site)`` is called here (once per ``state``).
    progress : callable, optional
        Called with ``(phase, step)`` whenever the worker starts computing or waiting for its
        peers; the site uses it to tell a hung worker from one waiting on a hung peer.
    stop : threading.Event, optional
        Set by the site to stop an injected hang (in-process mode).
    in_process : bool
        Whether this worker is a thread of the ClientApp (injected kills raise instead).
    state : WorkerState, optional
        A persistent worker's state (model, data, reducer, optimizer state) to reuse and
        update; without it everything is built here and released at the end. After an
        exception the caller calls ``state.release_group()`` before the communicator goes.
    """
    t_setup = time.perf_counter()
    own = state is None
    st = state if state is not None else WorkerState()
    rank, k_workers = comm.rank, comm.world_size
    device = torch.device(job.device)
    beat = progress or (lambda phase, step: None)
    task, settings = job.task, job.settings
    model = st.prepare_model(task, job.weights, device)
    site_data = data if data is not None else st.site_data(task, job.site)
    global_params = [p.detach().clone() for p in model.parameters()]
    opt = st.prepare_optimizer(task, model, settings, keep=job.keep_optimizer,
                               redo=job.attempt > 0)
    carried = st.optimizer_rounds
    step_fn = task.step()
    reducer = None
    if k_workers > 1:
        reducer = st.reducer(model, comm, hooks=(task.comm_hook, task.hook_state),
                             algorithm=job.algorithm, bucket_bytes=int(job.bucket_mb * 2**20),
                             overlap=job.overlap, comm_dtype=job.comm_dtype, timeout=job.timeout)
    before = dataclasses.replace(reducer.stats) if reducer is not None else ReducerStats()
    m = job.accumulation_steps
    if k_workers == 1 or not in_process:  # dropout & co. reproducible (threads share one RNG)
        torch.manual_seed(settings.seed)
    loader: Iterable[Any] = ()
    loader_steps = 0
    if site_data.train_loader is not None:
        loader = st.loader(site_data, rank, k_workers)
        loader_steps = -(-_shortest(comm, _loader_len(loader), job.timeout) // m)
    steps, examples, loss_sum, epoch_examples = 0, 0, 0.0, 0
    epoch_seconds: list[float] = []
    fault = job.fault if job.fault is not None and job.fault.rank == rank else None
    t_start = time.perf_counter()
    try:
        for epoch in range(settings.epochs):
            t_epoch = time.perf_counter()
            plan = (_dataset_steps(site_data, settings, epoch, rank, k_workers, m)
                    if site_data.train is not None
                    else _loader_steps(loader, loader_steps, k_workers, m))
            for micro in plan:
                beat("compute", steps)
                if fault is not None and steps == fault.step:
                    _strike(fault, rank, stop, in_process)
                opt.zero_grad(set_to_none=True)
                if reducer is not None:
                    reducer.begin_step()
                ctx = StepContext(config=settings.config, global_params=global_params,
                                  server_round=settings.server_round, epoch=epoch, step=steps,
                                  rank=rank, world_size=k_workers, device=device)
                for j, (batch, scale, n) in enumerate(micro):
                    if reducer is not None:
                        reducer.set_sync(j == len(micro) - 1)
                    loss = step_fn(model, to_device(batch, device), ctx)
                    torch.autograd.backward(loss * scale)
                    loss_sum += float(loss.detach()) * n
                    examples += n
                    if epoch == 0:
                        epoch_examples += n
                if reducer is not None:
                    beat("comm", steps)
                    reducer.finish_step()
                opt.step()
                steps += 1
            epoch_seconds.append(time.perf_counter() - t_epoch)
        if fault is not None and steps == fault.step:
            _strike(fault, rank, stop, in_process)
        beat("done", steps)
    finally:
        if own:
            st.release_group()
    train_seconds = time.perf_counter() - t_start
    st.finish_round(job.keep_optimizer)
    layout = st.remember_layout()
    if device.type != "cpu":
        model.to("cpu")
    weights = get_weights(model)
    stats = reducer.stats if reducer is not None else ReducerStats()
    wait = stats.wait_seconds - before.wait_seconds
    choice = layout.get("auto_choice") if layout is not None else None
    return WorkerResult(
        rank=rank, digest=weights_digest(weights), weights=weights if rank == 0 else None,
        examples=examples, loss_sum=loss_sum, steps=steps, train_seconds=train_seconds,
        compute_seconds=max(0.0, train_seconds - wait),
        comm_seconds=stats.comm_seconds - before.comm_seconds, wait_seconds=wait,
        bytes_allreduced=stats.bytes_allreduced - before.bytes_allreduced,
        bytes_sent=stats.bytes_sent - before.bytes_sent,
        allreduce_calls=stats.calls - before.calls,
        buckets=reducer.num_buckets if reducer is not None else 0,
        epoch_seconds=epoch_seconds, epoch_examples=epoch_examples, world_size=k_workers,
        hidden_buckets=stats.hidden_buckets - before.hidden_buckets,
        copied_params=stats.copied_params - before.copied_params,
        rebuilds=stats.rebuilds - before.rebuilds, algorithm=stats.algorithm,
        probe=dict(stats.probe) if stats.probe_seconds > before.probe_seconds else {},
        probe_seconds=stats.probe_seconds - before.probe_seconds,
        auto_choice=choice if job.algorithm == "auto" else None,
        setup_seconds=t_start - t_setup, optimizer_rounds=carried,
        layout=layout if rank == 0 else None, site_examples=site_data.train_size(),
    )
