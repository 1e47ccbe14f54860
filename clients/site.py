"""A site's training: one worker, or K local workers as one data-parallel job; one update.

On every train message :func:`run_site` trains the user's :class:`~fedagg.task.Task`. With
``site.workers = K > 1`` the site's K workers each train their share of every step
(:func:`clients.worker.train_worker`), gradients are summed across workers after every step
with bucketed, overlapped all-reduce (:class:`clients.buckets.GradReducer`, Li et al. 2020),
and after ``train.local_epochs`` epochs the workers hold bit-identical weights; worker 0's
are the site's update.

Where the workers run:

* ``site.persistent`` (default) and a caller that names the site (the ClientApp passes the
  Flower run id and node id): the site's :class:`~clients.pool.WorkerPool` from the registry
  of this process (:func:`clients.pools.pool_for`), started at the first round and reused
  until the run ends -- the workers keep their process group, model, data, reducer layout and
  (``site.keep_optimizer``) optimizer state; a round sends only the global weights and the
  round's settings. (A one-worker site keeps a pool only with ``site.keep_optimizer``.) A
  pool holds its site's model and data: in a simulation of many multi-worker sites on few
  Ray actors, ``site.persistent = false`` trades start-up time for memory.
* ``worker_service`` (a SuperNode's ``worker-service`` node-config key): the site-local
  worker service an operator started next to the SuperNode (``fedagg site-workers``,
  :mod:`clients.service`), which holds the pool across Flower's per-message ClientApp
  processes.
* otherwise a pool for this one round, closed before returning (fresh workers every round).

Worker modes (``site.mode``): ``process`` -- K real processes (``python -m
clients.pool_worker``) joined by torch.distributed, gloo on CPU, NCCL with one GPU per worker
when the process sees at least K GPUs (:mod:`clients.pool_proc`); ``inprocess`` -- K threads
on an in-process group, the site's data built once and shared (:class:`clients.pool.ThreadPool`).
A site of one worker trains in this process.

Failures (:mod:`clients.pool`): with ``site.elastic`` (default) a worker that dies or hangs
mid-round is dropped, the survivors re-form the group and redo the round, and the lost one is
replaced at the next round; a worker that raises fails the site with :class:`WorkerError`
naming the worker and the cause (Flower's error reply); no worker is left running.

Metrics of the reply (per round; Flower's metric records hold numbers only):
``workers`` (workers whose training the update holds), ``workers_configured``,
``workers_lost``, ``round_attempts`` (1 = no redo), ``workers_started`` (processes or
threads started this round: 0 from round 2 on with a persistent pool), ``startup_seconds``
(starting and grouping workers), ``overhead_seconds`` (everything outside local training:
start-up, weight hand-off, reply), ``redo_seconds``, ``train_seconds``, ``compute_seconds``,
``comm_seconds`` (inside all-reduce calls, overlapped or not), ``comm_wait_seconds`` (exposed
communication: the training thread waited), ``bytes_allreduced``, ``bytes_sent``,
``allreduce_calls``, ``buckets``, ``hidden_buckets`` (bucket reductions already finished when
backward returned), ``copied_params`` (gradients that were not bucket views),
``bucket_rebuilds``, ``algorithm_<name>`` = 1 for each algorithm that ran (``ring``, ``tree``,
``hierarchical``, ``native``), ``auto_native`` (``auto``: 1 if it chose the backend's native
all-reduce, 0 for the cost model's schedule), ``probe_seconds`` and ``probe_<name>_seconds``
(the round that ran ``auto``'s probe), ``optimizer_rounds`` (rounds of local optimizer state
carried in), ``epoch_seconds``, ``site_seconds``, ``train_loss``, ``steps``.
"""

from __future__ import annotations

import logging
import time

from clients.pools import PoolKey, make_pool, pool_for, task_identity
from clients.service import ServiceClient
from clients.site_round import SiteResult, default_device, site_result, with_site
from clients.worker import WorkerJob
from fedagg.config import SiteConfig
from fedagg.task import SiteData

__all__ = ["SiteRuntime", "run_site"]

_log = logging.getLogger(__name__)


def _effective(site: SiteConfig) -> SiteConfig:
    """One worker always trains in this process."""
    return site if site.workers > 1 else site.model_copy(update={"mode": "inprocess"})


def run_site(job: WorkerJob, site: SiteConfig, *, name: str = "site", server_round: int = 0,
             data: SiteData | None = None, owner: tuple[int, int] | None = None,
             worker_service: str | None = None, service_token: str | None = None,
             device: str | None = None) -> SiteResult:
    """Train a site for one round (see the module docstring for where the workers run).

    Parameters
    ----------
    job : WorkerJob
        The round: task, site info, settings, global weights (and an injected fault).
    site : SiteConfig
        The run config's ``[site]`` section (node-config overrides applied).
    name, server_round : str, int
        For messages and logs.
    data : SiteData, optional
        The site's data if the caller built it (in-process workers).
    owner : (run_id, node_id), optional
        The Flower run and node this site is: with ``site.persistent`` its pool is kept.
    worker_service, service_token : str, optional
        The socket of a site worker service and its token file (default: ``<socket>.token``).
    device : str, optional
        ``"cpu"`` / ``"cuda"``; default :func:`default_device`.

    Raises
    ------
    WorkerError
        A worker raised, too few survived, or the workers could not start; no worker
        started for this round is left running (the ClientApp turns it into Flower's error
        reply).
    """
    if worker_service:
        client = ServiceClient(worker_service, token_file=service_token)
        return client.train(job, site, name=name, server_round=server_round, owner=owner)
    t0 = time.perf_counter()
    eff = _effective(site)
    job = with_site(job, eff, device or default_device(eff))
    # One worker keeps a pool only for its optimizer state: otherwise there is nothing to
    # start, and a simulation of many one-worker sites would hold every site's data.
    keep = eff.persistent and (eff.workers > 1 or eff.keep_optimizer)
    if owner is not None and keep:
        identity, blob = task_identity(job.task)
        pool = pool_for(PoolKey(owner[0], owner[1], identity), eff, name=name, device=job.device,
                        task_blob=blob)
        results, info = pool.run(job, data, server_round=server_round)
    else:
        pool = make_pool(eff, name=name, device=job.device)
        try:
            results, info = pool.run(job, data, server_round=server_round)
        finally:
            with pool.lock:
                pool.close()
    result = site_result(results, info, time.perf_counter() - t0, eff, name=name,
                         epochs=job.settings.epochs)
    m = result.metrics
    _log.info("%s round %d: %d/%d workers (%s, %s), %.2f s train, %.2f s overhead, "
              "%.2f s exposed comm, %d bytes all-reduced", name, server_round, int(m["workers"]),
              eff.workers, eff.mode, job.device, m["train_seconds"], m["overhead_seconds"],
              m["comm_wait_seconds"], int(m["bytes_allreduced"]))
    return result


class SiteRuntime:
    """One round of a site's K fresh workers (no pool kept): what ``site.persistent = false``
    runs, kept for benchmarks and scripts.

    Parameters
    ----------
    site : SiteConfig
        Workers, mode, reducer options, timeout.
    name : str
        Site name for messages and logs.
    server_round : int
        Round number for messages.
    device : str, optional
        Default :func:`default_device`.
    """

    def __init__(self, site: SiteConfig, *, name: str = "site", server_round: int = 0,
                 device: str | None = None) -> None:
        self.site = site
        self.name = name
        self.server_round = server_round
        self.device = device or default_device(site)

    def run(self, job: WorkerJob, data: SiteData | None = None) -> SiteResult:
        """Train the site for one round on fresh workers; see :func:`run_site`."""
        return run_site(job, self.site.model_copy(update={"persistent": False}), name=self.name,
                        server_round=self.server_round, data=data, device=self.device)
