"""The whole asynchronous server state, Flower-free: versions, buffer, in-flight dispatches.

:class:`AsyncServerState` is what the asynchronous loop (``server/asynchronous.py``) decides
with and what its checkpoint holds:

* the global model and its **version** (number of buffers applied), the server optimizer
  (:class:`fedagg.aggregate.ServerOptimizer`: plain ``w + Delta``, SGD with a server learning
  rate, FedAvgM, FedAdam) and the :class:`~fedagg.asyncagg.buffer.UpdateBuffer`;
* every **in-flight dispatch** (:class:`Job`: node, the version it trains from, its
  ``server-round``, when it left) and every open secure **cohort**, and the models of the
  versions they reference (so a resumed run can send them again);
* the per-site ``server-round`` counters and the dispatch / cohort counters;
* the :class:`~fedagg.asyncagg.guards.GuardWindow` of the median-relative guards (the
  scalars of the last accepted updates) and the federated **evaluations** in flight
  (:class:`Evaluation`: the record and version they evaluate, the nodes asked).

FedBuff (Nguyen et al. 2022, Algorithm 1): :meth:`fold` each arriving update with its
staleness weight, :meth:`apply` the buffer when it is full. An update more than
``max_staleness`` versions old is refused (:class:`~fedagg.errors.UpdateRejected`, naming the
site) and never reaches the model, and so is a norm bomb or capped a lying weight when the
state has guards (:mod:`fedagg.asyncagg.guards`). Site choices are seeded functions of the
counters, so the whole run is a deterministic function of the seed and the arrival order.

**Fair buffers.** A buffer holds at most one update per site (:meth:`fold` refuses a second
one) and the guard window one entry per site. FedBuff keeps it so without refusing anyone: a
site whose reply arrived while a buffer is open (folded, refused or failed: :attr:`waiting`)
is not dispatched again until that buffer is taken, so a site that answers 50 times as fast as
the others gets one job, and one slot, per buffer, and the versions (hence the staleness of
the other sites' updates) no longer advance with its speed.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.accumulate import delta_norm
from fedagg.aggregate import ServerOptimizer
from fedagg.asyncagg.buffer import BufferEntry, BufferResult, UpdateBuffer
from fedagg.asyncagg.guards import GuardWindow
from fedagg.asyncagg.staleness import StalenessWeight
from fedagg.errors import ConfigError, UpdateRejected, explain

__all__ = ["Applied", "AsyncServerState", "Cohort", "Evaluation", "Job"]

Arrays = list[NDArray[Any]]
Check = Callable[[Arrays, Arrays], str]
"""``check(new_model, old_model) -> problem`` ('' when the new model may be committed)."""


@dataclass(frozen=True)
class Job:
    """One dispatch: ``node`` trains from model ``version``, sent at ``dispatched_at``.

    ``job`` is the run-wide dispatch number (the order of dispatch); ``server_round`` is the
    round number the site sees (its own job count in FedBuff, the round in deadline mode, the
    cohort number under secure aggregation); ``cohort`` is ``-1`` outside a secure cohort.
    """

    job: int
    node: int
    version: int
    server_round: int
    dispatched_at: float
    cohort: int = -1


@dataclass(frozen=True)
class Cohort:
    """Sites dispatched together under buffered secure aggregation (one SecAgg+ instance).

    ``attempt`` counts re-dispatches of the same cohort after a resume (fresh keys each time).
    """

    cohort: int
    version: int
    server_round: int
    members: tuple[int, ...]
    started_at: float
    attempt: int = 0


@dataclass(frozen=True)
class Evaluation:
    """A federated evaluation of model ``version`` (record ``round``) sent to ``nodes``."""

    round: int
    version: int
    nodes: tuple[int, ...]
    sent_at: float


@dataclass(frozen=True)
class Applied:
    """A buffer taken out: the model ``version`` after it, what was in it, the model.

    ``problem`` is ``''`` when the new model was committed; otherwise why the model-integrity
    check refused it (the version, the model and the optimizer's state are then unchanged and
    the buffer's updates are dropped, as a refused synchronous round drops its updates).
    """

    version: int
    result: BufferResult
    model: Arrays
    problem: str = ""

    @property
    def committed(self) -> bool:
        """Whether the model changed."""
        return not self.problem


class AsyncServerState:
    """Versions, buffer, optimizer and in-flight dispatches of an asynchronous run.

    Parameters
    ----------
    model : sequence of ndarray
        The initial global model (version 0).
    buffer : UpdateBuffer
        ``K`` and the normalisation.
    staleness : StalenessWeight
        ``w(s)``.
    max_staleness : int, optional
        Refuse updates more than this many versions old (None: never).
    optimizer : ServerOptimizer
        How a buffer's mean delta is applied (server learning rate or FedOpt).
    seed : int
        Seed of the site choices.
    guards : GuardWindow, optional
        The median-relative guards applied on arrival (None: none).
    """

    def __init__(self, model: Sequence[NDArray[Any]], *, buffer: UpdateBuffer,
                 staleness: StalenessWeight, max_staleness: int | None,
                 optimizer: ServerOptimizer, seed: int = 0,
                 guards: GuardWindow | None = None) -> None:
        if max_staleness is not None and (isinstance(max_staleness, bool) or max_staleness < 0):
            raise ConfigError(explain("asynchronous.max_staleness", max_staleness,
                                      "must be a whole number >= 0 or unset",
                                      "use e.g. 10, or leave it unset to accept any age"))
        self.model: Arrays = [np.asarray(a).copy() for a in model]
        self.version = 0
        self.buffer = buffer
        self.staleness_weight = staleness
        self.max_staleness = max_staleness
        self.optimizer = optimizer
        self.seed = int(seed)
        self.guards = guards
        self.evaluations: dict[int, Evaluation] = {}
        self.jobs: dict[int, Job] = {}
        self.cohorts: dict[int, Cohort] = {}
        self.site_rounds: dict[int, int] = {}
        self.next_job = 1
        self.next_cohort = 1
        self.round = 0
        self.round_started = 0.0
        self.now = 0.0
        self.waiting: set[int] = set()
        """FedBuff: sites whose reply arrived since the open buffer opened (folded, refused or
        failed): not dispatched again until the buffer is taken (:meth:`apply`)."""
        self._versions: dict[int, Arrays] = {0: self.model}

    # -- dispatch ------------------------------------------------------------------------------
    def busy(self) -> set[int]:
        """Nodes with a dispatch in flight (or in an open cohort)."""
        out = {j.node for j in self.jobs.values()}
        for c in self.cohorts.values():
            out.update(c.members)
        return out

    def in_buffer(self) -> set[int]:
        """Sites with an update in the open buffer (a buffer holds at most one per site)."""
        return {e.node for e in self.buffer.entries if e.node >= 0}

    def choose(self, free: Iterable[int], k: int, tag: str) -> list[int]:
        """A seeded choice of ``k`` nodes among ``free`` (all of them when ``k >= len``)."""
        pool = sorted(set(int(n) for n in free))
        if k >= len(pool):
            return pool
        rng = random.Random(f"{self.seed}-{tag}-{self.next_job}-{self.next_cohort}")
        return sorted(rng.sample(pool, k))

    def dispatch(self, node: int, now: float, *, server_round: int | None = None,
                 cohort: int = -1) -> Job:
        """Register a dispatch of the current version to ``node``.

        ``server_round`` defaults to the node's own job count (1, 2, ...), so that a site
        never trains twice with the same round seed.
        """
        rnd = self.site_rounds.get(int(node), 0) + 1 if server_round is None else server_round
        self.site_rounds[int(node)] = max(self.site_rounds.get(int(node), 0), int(rnd))
        job = Job(self.next_job, int(node), self.version, int(rnd), float(now), int(cohort))
        self.next_job += 1
        self.jobs[job.job] = job
        return job

    def open_cohort(self, members: Sequence[int], now: float) -> Cohort:
        """Open a secure cohort of ``members`` at the current version (server round = its
        number)."""
        c = Cohort(self.next_cohort, self.version, self.next_cohort,
                   tuple(sorted(int(m) for m in members)), float(now))
        self.next_cohort += 1
        self.cohorts[c.cohort] = c
        return c

    def close_cohort(self, cohort: int) -> Cohort:
        """Forget an open cohort (its members are free unless a job of theirs is in flight)."""
        c = self.cohorts.pop(cohort)
        self._collect()
        return c

    def arrive(self, job: int) -> Job:
        """Take ``job`` out of flight (its reply came, failed or timed out).

        Raises
        ------
        KeyError
            Not in flight (unknown, or already taken).
        """
        out = self.jobs.pop(job)
        self._collect()
        return out

    # -- buffer --------------------------------------------------------------------------------
    def staleness(self, version: int) -> int:
        """Versions the model moved on since ``version``."""
        return self.version - int(version)

    def admit(self, version: int, site: str) -> int:
        """The staleness of an update from ``version``, or UpdateRejected beyond the bound."""
        s = self.staleness(version)
        if self.max_staleness is not None and s > self.max_staleness:
            raise UpdateRejected(explain(
                f"{site}.staleness", s,
                f"must be <= asynchronous.max_staleness = {self.max_staleness} (trained from "
                f"version {version}, the model is at version {self.version})",
                "the update is refused and never reaches the model; raise "
                "asynchronous.max_staleness or lower asynchronous.concurrency"))
        return s

    def fold(self, delta: Sequence[NDArray[Any]], *, node: int, partition: int, job: int,
             version: int, weight: float, count: int = 1) -> BufferEntry:
        """Fold one checked update (or a cohort's mean, ``node = -1``) with its staleness weight.

        A site's second update into the same buffer is refused (one update per site per
        buffer; the loop does not dispatch a site whose update is in the open buffer). With
        :attr:`guards`, the update is then judged against the window of the other sites' latest
        accepted updates (delta norm by :func:`fedagg.accumulate.delta_norm`, block-wise): a
        norm bomb is refused, a lying weight is folded at the cap (the entry's ``weight``; a
        cohort's sum is never capped: its members' weights are masked), and an accepted update
        becomes its site's entry in the window.

        Raises
        ------
        UpdateRejected
            Older than ``max_staleness``, a second update of the site in the open buffer, or a
            norm bomb (nothing is folded).
        """
        site = f"node {node}" if node >= 0 else f"cohort {job}"
        s = self.admit(version, site)
        if node >= 0 and int(node) in self.in_buffer():
            raise UpdateRejected(explain(
                f"{site}.update", f"job {job}",
                "must be the site's only update in the open buffer (a buffer holds at most one "
                "update per site)", "the update is refused and never reaches the model; the "
                "site is sent the next version once the buffer is taken"))
        verdict = None
        if self.guards is not None:
            verdict = self.guards.judge(delta_norm(delta), float(weight), site=site,
                                        cap=node >= 0, node=int(node) if node >= 0 else -1)
            weight = verdict.weight
        entry = BufferEntry(int(node), int(partition), int(job), int(version), s,
                            float(self.staleness_weight(s)), float(weight), int(count))
        self.buffer.fold(delta, entry)
        if verdict is not None and self.guards is not None:
            self.guards.accept(verdict)
        return entry

    def apply(self, check: Check | None = None) -> Applied:
        """Apply the buffer's mean delta through the optimizer: a new version.

        Parameters
        ----------
        check : callable, optional
            ``check(new, old) -> problem`` (``''``: fine), the model-integrity check; a
            problem leaves the model, the version and the optimizer's state as they were.

        Raises
        ------
        ConfigError
            The buffer is empty.
        """
        result = self.buffer.take()
        self.waiting.clear()  # a new buffer: every site may be dispatched again
        before = copy.deepcopy(self.optimizer.state_dict())
        new = self.optimizer.step(self.model, result.delta)
        problem = check(new, self.model) if check is not None else ""
        if problem:
            self.optimizer.load_state_dict(before)  # a refused model leaves no momentum behind
            return Applied(self.version, result, self.model, problem)
        self.model = new
        self.version += 1
        self._versions[self.version] = self.model
        self._collect()
        return Applied(self.version, result, self.model)

    # -- federated evaluation ----------------------------------------------------------------------
    def open_evaluation(self, round: int, nodes: Sequence[int], now: float) -> Evaluation:
        """Register a federated evaluation of the current version (record ``round``); its model
        is kept (and checkpointed) until :meth:`close_evaluation`."""
        ev = Evaluation(int(round), self.version, tuple(sorted(int(n) for n in nodes)),
                        float(now))
        self.evaluations[ev.round] = ev
        return ev

    def close_evaluation(self, round: int) -> Evaluation:
        """Forget the evaluation of record ``round`` (done, timed out or dropped)."""
        ev = self.evaluations.pop(int(round))
        self._collect()
        return ev

    # -- versions --------------------------------------------------------------------------------
    def model_of(self, version: int) -> Arrays:
        """The global model of ``version`` (kept while a dispatch references it).

        Raises
        ------
        KeyError
            No in-flight dispatch references it any more.
        """
        return self._versions[int(version)]

    def _collect(self) -> None:
        keep = {self.version, *(j.version for j in self.jobs.values()),
                *(c.version for c in self.cohorts.values()),
                *(e.version for e in self.evaluations.values())}
        for v in [v for v in self._versions if v not in keep]:
            del self._versions[v]

    # -- checkpoint ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything above as plain data (arrays, ints, floats, lists, dicts)."""
        self._collect()
        return {
            "version": self.version, "model": [a.copy() for a in self.model],
            "versions": {str(v): [a.copy() for a in m] for v, m in self._versions.items()
                         if v != self.version},
            "buffer": self.buffer.state_dict(), "optimizer": self.optimizer.state_dict(),
            "jobs": [asdict(j) for j in sorted(self.jobs.values(), key=lambda j: j.job)],
            "cohorts": [{**asdict(c), "members": list(c.members)}
                        for c in sorted(self.cohorts.values(), key=lambda c: c.cohort)],
            "site_rounds": {str(k): v for k, v in sorted(self.site_rounds.items())},
            "next_job": self.next_job, "next_cohort": self.next_cohort, "round": self.round,
            "round_started": self.round_started, "now": self.now,
            "waiting": sorted(self.waiting),
            "guard_window": self.guards.state_dict() if self.guards is not None else None,
            "evaluations": [{**asdict(e), "nodes": list(e.nodes)}
                            for e in sorted(self.evaluations.values(), key=lambda e: e.round)],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (one without ``guard_window``, ``evaluations`` or
        ``waiting``, from before they existed, gives an empty window, no evaluation in flight
        and no site waiting)."""
        self.version = int(state["version"])
        self.model = [np.asarray(a).copy() for a in state["model"]]
        self._versions = {int(v): [np.asarray(a).copy() for a in m]
                          for v, m in state["versions"].items()}
        self._versions[self.version] = self.model
        self.buffer.load_state_dict(state["buffer"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.jobs = {int(j["job"]): Job(int(j["job"]), int(j["node"]), int(j["version"]),
                                        int(j["server_round"]), float(j["dispatched_at"]),
                                        int(j["cohort"])) for j in state["jobs"]}
        self.cohorts = {int(c["cohort"]): Cohort(int(c["cohort"]), int(c["version"]),
                                                 int(c["server_round"]),
                                                 tuple(int(m) for m in c["members"]),
                                                 float(c["started_at"]), int(c["attempt"]))
                        for c in state["cohorts"]}
        self.site_rounds = {int(k): int(v) for k, v in state["site_rounds"].items()}
        self.next_job, self.next_cohort = int(state["next_job"]), int(state["next_cohort"])
        self.round, self.round_started = int(state["round"]), float(state["round_started"])
        self.now = float(state["now"])
        self.waiting = {int(n) for n in state.get("waiting") or []}
        if self.guards is not None:
            self.guards.load_state_dict(state.get("guard_window"))
        self.evaluations = {int(e["round"]): Evaluation(int(e["round"]), int(e["version"]),
                                                        tuple(int(n) for n in e["nodes"]),
                                                        float(e["sent_at"]))
                            for e in state.get("evaluations") or []}
