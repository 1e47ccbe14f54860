"""One local worker of a multi-worker site: the data-parallel training loop, and the entry
point of a worker process (``python -m clients.worker JOB_DIR RANK``).

The same :func:`train_worker` runs in both worker modes: on a thread with an in-process
communicator (``site.mode = "inprocess"``) and in a process of its own joined to the site's
other workers by torch.distributed (``site.mode = "process"``; gloo on CPU, NCCL with one GPU
per worker).

Equivalence with one worker. The site iterates *global* batches exactly like
:func:`fedagg.training.train` (same :func:`fedagg.training.batches` order, ``train.batch_size``
is the global batch). Worker ``k`` of ``K`` takes the ``k``-th contiguous slice of every global
batch (``numpy.array_split``, sizes differ by at most one; a slice may be empty when the last
batch has fewer than ``K`` examples) and optionally splits it into ``M`` micro-batches. Every
micro-batch loss is the *sum* of per-example losses divided by the global batch size, so the
gradients summed over micro-batches and workers (one bucketed all-reduce per step, see
:class:`clients.buckets.GradReducer`) equal the gradient of the mean loss over the global batch
(Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", section 2).
Every worker then applies the same SGD (momentum) step to identical weights, so the workers
stay identical and the result equals single-worker training up to float32 summation order.

This module imports neither Flower nor torch.distributed (the latter only through
:mod:`fedagg.collectives.backends.torch_dist`), so a worker process starts quickly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from clients.buckets import GradReducer
from fedagg.collectives import Communicator
from fedagg.errors import WorkerError
from fedagg.models import build_model, get_weights, set_weights
from fedagg.training import batches

__all__ = ["WorkerFault", "WorkerJob", "WorkerResult", "main", "train_worker", "weights_digest"]

_log = logging.getLogger(__name__)

Progress = Callable[[str, int], None]
"""``progress(phase, step)``: phase is ``"compute"`` or ``"comm"`` (waiting for peers)."""


@dataclass(frozen=True)
class WorkerFault:
    """An injected fault (tests and drills): worker ``rank`` dies or hangs after ``step`` steps."""

    kind: str  # "kill" | "hang"
    rank: int
    step: int


@dataclass
class WorkerJob:
    """Everything a worker needs for one round (picklable, no live handles)."""

    site: str
    model: str
    input_shape: tuple[int, int, int]
    num_classes: int
    weights: list[npt.NDArray[np.float32]]
    epochs: int
    batch_size: int
    lr: float
    momentum: float
    seed: int
    accumulation_steps: int = 1
    algorithm: str = "auto"
    bucket_mb: float = 25.0
    overlap: bool = True
    comm_dtype: str = "float32"
    timeout: float = 300.0
    fault: WorkerFault | None = None
    device: str = "cpu"
    threads: int | None = None
    port: int = 0
    parent_pid: int = 0


@dataclass
class WorkerResult:
    """What one worker reports after the round (rank 0 also carries the weights)."""

    rank: int
    digest: str
    weights: list[npt.NDArray[np.float32]] | None
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


def weights_digest(weights: list[npt.NDArray[np.float32]]) -> str:
    """SHA-256 of the weights' bytes (workers must end bit-identical)."""
    h = hashlib.sha256()
    for w in weights:
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()


def _strike(fault: WorkerFault, rank: int, stop: threading.Event | None, in_process: bool) -> None:
    if fault.kind == "kill":
        if in_process:
            raise WorkerError(f"worker {rank}: injected crash after {fault.step} steps "
                              "(faults.kill_worker)")
        _log.warning("worker %d: injected SIGKILL after %d steps (faults.kill_worker)", rank, fault.step)
        os.kill(os.getpid(), signal.SIGKILL)
    _log.warning("worker %d: injected hang after %d steps (faults.hang_worker)", rank, fault.step)
    while stop is None or not stop.is_set():
        time.sleep(0.1)
    raise WorkerError(f"worker {rank}: injected hang stopped by the site")


def train_worker(
    job: WorkerJob,
    comm: Communicator,
    x: npt.NDArray[np.float32],
    y: npt.NDArray[np.int64],
    *,
    progress: Progress | None = None,
    stop: threading.Event | None = None,
    in_process: bool = False,
) -> WorkerResult:
    """Train this worker's share of every global batch for ``job.epochs``; return its result.

    Parameters
    ----------
    job : WorkerJob
        Model, starting weights, optimizer and site settings (identical on every worker).
    comm : Communicator
        The site's communicator; ``comm.rank`` is this worker, ``comm.world_size`` is K.
    x, y : numpy.ndarray
        The *site's* whole training partition (only this worker's slices are read).
    progress : callable, optional
        Called with ``(phase, step)`` whenever the worker starts computing or waiting for its
        peers; the site uses it to tell a hung worker from one waiting on a hung peer.
    stop : threading.Event, optional
        Set by the site to stop an injected hang (in-process mode).
    in_process : bool
        Whether this worker is a thread of the ClientApp (injected kills raise instead).
    """
    rank, k_workers = comm.rank, comm.world_size
    device = torch.device(job.device)
    beat = progress or (lambda phase, step: None)
    model: nn.Module = build_model(job.model, job.input_shape, job.num_classes)
    set_weights(model, job.weights)
    model.to(device)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=job.lr, momentum=job.momentum)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    reducer = GradReducer(
        model.parameters(), comm, algorithm=job.algorithm, bucket_bytes=int(job.bucket_mb * 2**20),
        overlap=job.overlap, comm_dtype=job.comm_dtype, timeout=job.timeout,
    )
    xt = torch.from_numpy(np.ascontiguousarray(x))
    yt = torch.from_numpy(np.ascontiguousarray(y))
    m = job.accumulation_steps
    steps, examples, loss_sum = 0, 0, 0.0
    epoch_seconds: list[float] = []
    fault = job.fault if job.fault is not None and job.fault.rank == rank else None
    t_start = time.perf_counter()
    try:
        for epoch in range(job.epochs):
            t_epoch = time.perf_counter()
            for idx in batches(len(y), job.batch_size, epoch=epoch, seed=job.seed):
                beat("compute", steps)
                if fault is not None and steps == fault.step:
                    _strike(fault, rank, stop, in_process)
                n_global = len(idx)
                mine = np.array_split(idx, k_workers)[rank]
                micro = [mb for mb in np.array_split(mine, m) if len(mb)]
                opt.zero_grad(set_to_none=True)
                reducer.begin_step()
                for j, mb in enumerate(micro):
                    reducer.set_sync(j == len(micro) - 1)
                    ib = torch.from_numpy(mb)
                    xb, yb = xt[ib].to(device), yt[ib].to(device)
                    loss = loss_fn(model(xb), yb) / n_global
                    loss.backward()
                    loss_sum += float(loss.detach()) * n_global
                    examples += len(mb)
                beat("comm", steps)
                reducer.finish_step()
                opt.step()
                steps += 1
            epoch_seconds.append(time.perf_counter() - t_epoch)
        if fault is not None and steps == fault.step:
            _strike(fault, rank, stop, in_process)
        beat("done", steps)
    finally:
        reducer.close()
    train_seconds = time.perf_counter() - t_start
    model.to("cpu")
    weights = get_weights(model)
    st = reducer.stats
    return WorkerResult(
        rank=rank, digest=weights_digest(weights), weights=weights if rank == 0 else None,
        examples=examples, loss_sum=loss_sum, steps=steps, train_seconds=train_seconds,
        compute_seconds=max(0.0, train_seconds - st.wait_seconds), comm_seconds=st.comm_seconds,
        wait_seconds=st.wait_seconds, bytes_allreduced=st.bytes_allreduced,
        bytes_sent=st.bytes_sent, allreduce_calls=st.calls, buckets=reducer.num_buckets,
        epoch_seconds=epoch_seconds,
    )


# -- process mode ------------------------------------------------------------------------------

JOB_FILE = "job.pkl"
X_FILE = "x.npy"
Y_FILE = "y.npy"


def result_file(job_dir: Path, rank: int) -> Path:
    """Where worker ``rank`` writes its :class:`WorkerResult` (pickle, written atomically)."""
    return job_dir / f"result-{rank}.pkl"


def error_file(job_dir: Path, rank: int) -> Path:
    """Where worker ``rank`` writes its traceback if it fails."""
    return job_dir / f"error-{rank}.txt"


def progress_file(job_dir: Path, rank: int) -> Path:
    """Worker ``rank``'s progress line: ``<phase> <step> <counter>``."""
    return job_dir / f"progress-{rank}.txt"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _watch_parent(parent_pid: int) -> None:
    """Exit if the launching process went away, so no worker outlives its site."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(3)


def main(argv: list[str] | None = None) -> int:
    """Worker process entry: ``python -m clients.worker JOB_DIR RANK WORLD_SIZE``."""
    args = sys.argv[1:] if argv is None else argv
    job_dir, rank, world = Path(args[0]), int(args[1]), int(args[2])
    logging.basicConfig(level=logging.WARNING, format=f"worker {rank}: %(levelname)s %(message)s")
    try:
        job: WorkerJob = pickle.loads((job_dir / JOB_FILE).read_bytes())
        if job.parent_pid:
            threading.Thread(target=_watch_parent, args=(job.parent_pid,), daemon=True).start()
        if job.threads:
            torch.set_num_threads(job.threads)
        x = np.load(job_dir / X_FILE, mmap_mode="c")
        y = np.load(job_dir / Y_FILE, mmap_mode="c")
        counter = [0]

        def progress(phase: str, step: int) -> None:
            counter[0] += 1
            _atomic_write(progress_file(job_dir, rank), f"{phase} {step} {counter[0]}".encode())

        progress("start", 0)
        from fedagg.collectives.backends import torch_dist

        backend = "gloo"
        if job.device.startswith("cuda"):
            torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
            job.device = f"cuda:{torch.cuda.current_device()}"
            backend = "nccl"
        comm = torch_dist.init_process_group(rank, world, port=job.port, backend=backend,
                                             timeout=job.timeout)
        try:
            result = train_worker(job, comm, x, y, progress=progress)
        finally:
            torch_dist.destroy_process_group()
        _atomic_write(result_file(job_dir, rank), pickle.dumps(result))
        return 0
    except BaseException:
        text = traceback.format_exc()
        try:
            _atomic_write(error_file(job_dir, rank), text.encode())
        finally:
            print(text, file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    # Run the copy imported as ``clients.worker`` (not ``__main__``) so that pickled
    # WorkerJob / WorkerResult objects name their real module.
    from clients.worker import main as _main

    raise SystemExit(_main())
