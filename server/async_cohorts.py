"""Secure FedBuff: the cohorts of the asynchronous loop (docs/protocols/async-secagg.md).

Under secure aggregation sites are dispatched ``K`` (``asynchronous.buffer_size``) at a time
as a *cohort* with its own SecAgg+ instance (:func:`server.async_dispatch.cohort_strategy`):
keyed and sent its masked-upload requests when dispatched (:meth:`SecureCohorts.send`),
closed once ``asynchronous.cohort_quorum`` of its sites uploaded or all replied
(:meth:`SecureCohorts.handle_upload`, :meth:`SecureCohorts.quorum`) and then, with
``asynchronous.cohort_grace`` > 0, after a grace period for its other members
(:attr:`CohortRun.close_at`, a time on the loop's clock: :meth:`SecureCohorts.expire` closes
it, :meth:`SecureCohorts.targets` wakes the loop for it; members carrying a held update are
waited for up to the cohort's own time again), or at ``run.round_timeout``; closing unmasks
the cohort's sum, with the masks of its dropped and late sites removed from Shamir shares,
and folds it into the buffer as one update of its dispatched version
(:meth:`SecureCohorts.close`). A late upload of a closed cohort is refused: under its own self
mask it is never unmasked; its site carries the update into its next cohort instead
(:mod:`server.async_carry`, ``asynchronous.carry_late``).

:class:`SecureCohorts` is this part of the loop (:class:`server.asynchronous.AsyncRun`), with
its own state: the open cohorts' protocol instances and uploads, and the carry book.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from flwr.app import Message
from flwr.serverapp import Grid

from fedagg.asyncagg import AsyncServerState, Job, VirtualClock, WallClock
from fedagg.config import RunConfig
from fedagg.errors import PrivacyBudgetSpent, UpdateRejected
from server.async_carry import Carry, CarryBook
from server.async_dispatch import (
    CohortSink,
    NodeView,
    cohort_strategy,
    config_with_round,
    connected_nodes,
)
from server.runner import client_config
from strategies.secure import SecureAggregation
from strategies.secure_privacy import DistributedPrivacy
from strategies.wire import CARRY_KEY

if TYPE_CHECKING:
    from server.async_evaluate import AsyncEvaluation
    from server.async_records import RunRecorder

__all__ = ["CohortLoop", "CohortRun", "SecureCohorts"]

_log = logging.getLogger("server.asynchronous")  # the name these records had before the split


@dataclass
class CohortRun:
    """An open secure cohort: its protocol instance and the uploads received so far."""

    sec: SecureAggregation
    sink: CohortSink
    nodes: list[int]
    replies: dict[int, Message] = field(default_factory=dict)
    close_at: float | None = None  # quorum reached: close then (the grace period's end)
    grace_at: float | None = None  # the grace period's end, without waiting for carriers
    carried: dict[int, tuple[Carry, int]] = field(default_factory=dict)  # (carry, older by)

    def carriers_out(self) -> bool:
        """Whether a member asked to carry a held update has not answered yet."""
        return any(n not in self.replies for n in self.carried)


class CohortLoop(Protocol):
    """What :class:`SecureCohorts` asks of the loop that runs it."""

    def push(self, job: Job, strategy: Any, message: Message) -> None:
        """Push the train message of ``job`` (built by ``strategy``) and track its reply."""
        ...

    def apply(self) -> None:
        """Apply the (full) buffer: a new version, its record and checkpoint."""
        ...


class SecureCohorts:
    """The secure cohorts of a FedBuff run (see the module docstring).

    Owns the open cohorts (:attr:`open`, cohort id -> :class:`CohortRun`: the SecAgg+
    instance, its sink and the uploads so far) and the carry book (:attr:`carry`,
    :mod:`server.async_carry`). Which sites a cohort has, its version and attempt are in the
    run's checkpointed state (:attr:`fedagg.asyncagg.AsyncServerState.cohorts`).

    Parameters
    ----------
    cfg : RunConfig
        The run's configuration.
    grid : Grid
        The run's Grid.
    state : AsyncServerState
        The run's state (jobs, cohorts, the buffer).
    clock : VirtualClock or WallClock
        The run's clock.
    concurrency : int
        FedBuff's ``C``: at most this many sites train for the open cohorts.
    job_timeout : float
        ``run.round_timeout``: how long a cohort stays open at most.
    secure : bool
        Whether the run aggregates securely (the carry book is enabled only then).
    recorder : RunRecorder
        The run's records: the tally the cohorts' figures go into, the model versions sent,
        the run id bound into every cohort's keys.
    evaluation : AsyncEvaluation
        The run's federated evaluation (no cohort gets an evaluating site).
    loop : CohortLoop
        The loop that pushes the cohorts' messages and applies the buffer.
    """

    def __init__(self, cfg: RunConfig, *, grid: Grid, state: AsyncServerState,
                 clock: VirtualClock | WallClock, concurrency: int, job_timeout: float,
                 secure: bool, recorder: RunRecorder, evaluation: AsyncEvaluation,
                 loop: CohortLoop, privacy: DistributedPrivacy | None = None) -> None:
        self.cfg, self.grid, self.state, self.clock = cfg, grid, state, clock
        self.concurrency, self.job_timeout = concurrency, job_timeout
        self.recorder, self.evaluation, self.loop = recorder, evaluation, loop
        self.carry = CarryBook.from_config(cfg, concurrency=concurrency, secure=secure,
                                           staleness=state.staleness_weight)
        self.open: dict[int, CohortRun] = {}
        self.privacy = privacy
        """The run's distributed DP: one ledger for every cohort (each unmasked cohort sum is
        one participation of its members, counted for every site; checkpointed by the
        recorder)."""
        self.stopped = ""
        """Why no further cohort opens (the privacy budget is spent), '' while they do."""

    def open_next(self) -> bool:
        """Open the next cohort if ``K`` sites are free and ``K`` slots of ``C`` are (True).

        C counts the sites still training for an open cohort. One that uploaded only waits
        for its cohort's unmask (it is sent nothing else meanwhile), so its slot goes to the
        next cohort; a late member of a closed cohort stays busy (it is not sent anything until
        it answers) but no longer holds a slot either. Sites holding a carriable update go
        first (:mod:`server.async_carry`), the others are a seeded choice. A cohort with an
        evaluating member is opened only once its evaluation is back, with the same choice.
        """
        if self.stopped:
            return False
        busy = self.state.busy()
        free = [n for n in connected_nodes(self.grid) if n not in busy]
        k = self.cfg.asynchronous.buffer_size
        active = sum(self.training(c.cohort, c.members) for c in self.state.cohorts.values())
        if len(free) < k or active + k > self.concurrency:
            return False
        first = self.carry.first(free, k, self.state.version)
        rest = [n for n in free if n not in first]
        pick = sorted(first + (self.state.choose(rest, k - len(first), "cohort")
                               if len(first) < k else []))
        if set(pick) & self.evaluation.evaluating():
            return False
        cohort = self.state.open_cohort(pick, self.clock.now())
        self.send(cohort.cohort)
        return True

    def send(self, cohort_id: int) -> None:
        """Key a cohort (SecAgg+ setup over its sites) and push its masked-upload requests."""
        c = self.state.cohorts[cohort_id]
        sec, sink = cohort_strategy(self.cfg, self.recorder.run_id, c.cohort, c.attempt,
                                    self.job_timeout, self.privacy)
        config = config_with_round(client_config(self.cfg), c.server_round)
        try:
            msgs = list(sec.configure_train(c.server_round, self.recorder.record(c.version),
                                            config, NodeView(self.grid, c.members)))
        except PrivacyBudgetSpent as exc:  # no cohort opens again; the open ones finish
            self.state.close_cohort(cohort_id)
            self.stopped = str(exc)
            _log.warning("cohort %d not opened: %s", cohort_id, exc)
            return
        log = sec.report
        if not msgs:
            self.state.close_cohort(cohort_id)
            tally = self.recorder.tally
            tally.bytes_up += log.bytes_up
            tally.bytes_down += log.bytes_down
            for node, why in log.errors.items():
                tally.errors[str(node)] = why
            tally.errors[f"cohort {cohort_id}"] = log.aborted or "no site could be keyed"
            _log.warning("cohort %d: %s", cohort_id, log.aborted)
            return
        run = CohortRun(sec, sink, [m.metadata.dst_node_id for m in msgs])
        self.open[cohort_id] = run
        if self.carry.enabled:
            for m, (request, carry) in zip(msgs, self.carry.requests(run.nodes, c.version).values(),
                                           strict=True):
                m.content.config_records[CARRY_KEY] = request.to_record()
                if carry is not None:
                    run.carried[m.metadata.dst_node_id] = (carry, c.version - carry.version)
        for m in msgs:
            job = self.state.dispatch(m.metadata.dst_node_id, self.clock.now(),
                                      server_round=c.server_round, cohort=cohort_id)
            self.loop.push(job, sec, m)

    def handle_upload(self, job: Job, reply: Message) -> None:
        """A cohort member's reply: counted towards its quorum; the cohort closes once all
        replied, or at its quorum after the grace period (a late upload is refused)."""
        run = self.open.get(job.cohort)
        if run is None:
            carried = self.carry.replied(job.node, not reply.has_error())
            self.recorder.tally.refused[str(job.node)] = (
                f"node {job.node}: masked upload for cohort {job.cohort} arrived after the cohort "
                "closed: it was counted as dropped, its masks were removed with Shamir shares, "
                "and this upload, under its own self mask, is never unmasked"
                + ("; the site carries its update into its next cohort" if carried else ""))
            return
        run.replies[job.node] = reply
        if len(run.replies) >= len(run.nodes):
            self.close(job.cohort)
            return
        uploaded = sum(1 for r in run.replies.values() if not r.has_error())
        now = self.clock.now()
        if run.close_at is None and uploaded >= self.quorum(len(run.nodes)):
            # the quorum is in: wait a share of the time it took for the slower members (with
            # fixed site speeds the one left out is always the slowest site, and its data with it)
            took = max(now - self.state.cohorts[job.cohort].started_at, 0.0)
            grace = self.cfg.asynchronous.cohort_grace
            run.grace_at = now + grace * took
            # a carried upload is finished work one message away: wait for it up to the cohort's
            # own time again, or it is lost to this cohort and bounces into the next one
            run.close_at = now + max(grace, 1.0) * took if run.carriers_out() else run.grace_at
        if run.close_at is not None and run.grace_at is not None and not run.carriers_out():
            run.close_at = min(run.close_at, run.grace_at)
        if run.close_at is not None and now >= run.close_at:
            self.close(job.cohort)

    def training(self, cohort_id: int, members: tuple[int, ...]) -> int:
        """Members of an open cohort that have not answered its upload request yet (the sites
        FedBuff's concurrency ``C`` counts for it)."""
        run = self.open.get(cohort_id)
        return len(members) if run is None else len(set(members) - set(run.replies))

    def quorum(self, n: int) -> int:
        """The uploads a cohort of ``n`` sites waits for (``asynchronous.cohort_quorum``)."""
        return max(math.ceil(self.cfg.asynchronous.cohort_quorum * n - 1e-9), 1)

    def expire(self, now: float) -> None:
        """Close the cohorts that waited ``run.round_timeout`` or whose grace period after
        their quorum ended."""
        for cid, run in list(self.open.items()):
            c = self.state.cohorts[cid]
            grace_over = run.close_at is not None and now >= run.close_at
            if grace_over or now >= c.started_at + self.job_timeout:
                self.close(cid)

    def targets(self) -> list[float]:
        """When the loop must wake up for the open cohorts: their timeouts and grace ends."""
        out = [self.state.cohorts[c].started_at + self.job_timeout for c in self.open]
        out += [r.close_at for r in self.open.values() if r.close_at is not None]
        return out

    def close(self, cohort_id: int) -> None:
        """Unmask the cohort's sum (Shamir recovery of its dropped / late sites); fold, apply."""
        run = self.open.pop(cohort_id)
        c = self.state.close_cohort(cohort_id)
        tally = self.recorder.tally
        stale = self.carry.too_stale(run.carried, self.state.version - c.version)
        for node, why in stale.items():
            run.replies.pop(node, None)
            tally.refused[str(node)] = why
        replies = [r for r in run.replies.values()]
        tally.replied += sum(1 for r in replies if not r.has_error())
        run.sec.aggregate_train(c.server_round, replies)
        log = run.sec.report
        tally.bytes_up += log.bytes_up
        tally.bytes_down += log.bytes_down
        uploaded = sum(1 for r in replies if not r.has_error())
        for key, why in log.errors.items():
            if not key.lstrip("-").isdigit():
                tally.errors.setdefault(key, why)
                continue
            node = int(key)
            if node not in run.replies:  # closed before it uploaded: late, not failed
                why = (f"cohort {cohort_id} closed ({uploaded} of {len(run.nodes)} uploads, "
                       f"asynchronous.cohort_quorum = {self.cfg.asynchronous.cohort_quorum}, "
                       f"cohort_grace = {self.cfg.asynchronous.cohort_grace:g}) "
                       "before this site uploaded: counted as dropped, its masks removed with "
                       "Shamir shares")
            tally.errors.setdefault(str(node), why)
        for who, why in log.refused.items():
            tally.refused.setdefault(str(who), why)
        server = run.sec.server
        if server is not None:
            proofs = {run.sec.sites.node(i): p for i, p in server.drop_proofs.items()}
            late = [n for n in run.nodes if n not in run.replies and n not in run.carried]
            self.carry.removed(late, proofs, server_round=c.server_round, version=c.version)
        result = run.sec.last_result
        if run.sink.captured is None or result is None:
            why = log.aborted or "secure aggregation returned no aggregate"
            tally.errors[f"cohort {cohort_id}"] = why
            _log.warning("cohort %d: %s", cohort_id, why)
            return
        delta, weight, _, sites = run.sink.captured
        tally.secagg = {
            "cohort": cohort_id, "cohort_version": c.version, "cohort_round": c.server_round,
            "cohort_nodes": sorted(run.sec.sites.node(i) for i in result.counted),
            "secagg_counted": len(result.counted), "secagg_dropped": len(result.dropped),
            "secagg_error_bound": float(result.error_bound),
            "cohort_carried": {str(n): {"round": cr.round, "version": cr.version, "older": older}
                               for n, (cr, older) in sorted(run.carried.items())
                               if run.sec.sites.index(n) in result.counted}}
        if self.privacy is not None and run.sec.last_private is not None:
            tally.secagg.update({k.replace("-", "_"): v for k, v in
                                 self.privacy.metrics(run.sec.last_private).items()})
        try:
            self.state.fold(delta, node=-1, partition=-1, job=cohort_id, version=c.version,
                            weight=weight, count=sites)
        except UpdateRejected as exc:
            tally.refused[f"cohort {cohort_id}"] = str(exc)
            return
        self.loop.apply()
