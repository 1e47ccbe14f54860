"""Secure FedBuff: the cohorts of the asynchronous loop (docs/protocols/async-secagg.md).

Under secure aggregation sites are dispatched ``K`` (``asynchronous.buffer_size``) at a time
as a *cohort* with its own SecAgg+ instance (:func:`server.async_dispatch.cohort_strategy`):
keyed and sent its masked-upload requests when dispatched (``_send_cohort``), closed once
``asynchronous.cohort_quorum`` of its sites uploaded or all replied (``_handle_upload``,
``_quorum``) and then, with ``asynchronous.cohort_grace`` > 0, after a grace period for its
other members (``_CohortRun.close_at``, a time on the loop's clock: ``_expire`` closes it,
``_wait`` wakes for it; members carrying a held update are waited for up to the cohort's
own time again), or at ``run.round_timeout``; closing unmasks the cohort's sum, with the masks of
its dropped and late sites removed from Shamir shares, and folds it into the buffer as one
update of its dispatched version (``_close_cohort``). A late upload of a closed cohort is
refused: under its own self mask it is never unmasked; its site carries the update into its
next cohort instead (:mod:`server.async_carry`, ``asynchronous.carry_late``).

Methods of :class:`server.asynchronous._AsyncRun`, defined here and bound in its class body.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flwr.app import Message

from fedagg.asyncagg import Job
from fedagg.errors import UpdateRejected
from server.async_carry import Carry
from server.async_dispatch import CohortSink, NodeView, cohort_strategy, config_with_round
from server.runner import client_config
from strategies.secure import SecureAggregation
from strategies.wire import CARRY_KEY

if TYPE_CHECKING:
    from server.asynchronous import _AsyncRun

__all__: list[str] = []  # _AsyncRun's methods and their record type (bound in server.asynchronous)

_log = logging.getLogger("server.asynchronous")  # the name these records had before the split


@dataclass
class _CohortRun:
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


def _open_cohort(self: _AsyncRun) -> bool:
    """Open the next cohort if ``K`` sites are free and ``K`` slots of ``C`` are (True).

    C counts the sites still training for an open cohort. One that uploaded only waits for
    its cohort's unmask (it is sent nothing else meanwhile), so its slot goes to the next
    cohort; a late member of a closed cohort stays busy (it is not sent anything until it
    answers) but no longer holds a slot either. Sites holding a carriable update go first
    (:mod:`server.async_carry`), the others are a seeded choice.
    """
    busy = self.state.busy()
    free = [n for n in self._nodes() if n not in busy]
    k = self.cfg.asynchronous.buffer_size
    active = sum(self._training(c.cohort, c.members) for c in self.state.cohorts.values())
    if len(free) < k or active + k > self.concurrency:
        return False
    first = self.carry.first(free, k, self.state.version)
    rest = [n for n in free if n not in first]
    pick = sorted(first + (self.state.choose(rest, k - len(first), "cohort")
                           if len(first) < k else []))
    if set(pick) & self._evaluating():
        return False
    cohort = self.state.open_cohort(pick, self.clock.now())
    self._send_cohort(cohort.cohort)
    return True


def _send_cohort(self: _AsyncRun, cohort_id: int) -> None:
    """Key a cohort (SecAgg+ setup over its sites) and push its masked-upload requests."""
    c = self.state.cohorts[cohort_id]
    sec, sink = cohort_strategy(self.cfg, self.run_id, c.cohort, c.attempt, self.job_timeout)
    config = config_with_round(client_config(self.cfg), c.server_round)
    msgs = list(sec.configure_train(c.server_round, self._record(c.version), config,
                                    NodeView(self.grid, c.members)))
    log = sec.report
    if not msgs:
        self.state.close_cohort(cohort_id)
        self.tally.bytes_up += log.bytes_up
        self.tally.bytes_down += log.bytes_down
        for node, why in log.errors.items():
            self.tally.errors[str(node)] = why
        self.tally.errors[f"cohort {cohort_id}"] = log.aborted or "no site could be keyed"
        _log.warning("cohort %d: %s", cohort_id, log.aborted)
        return
    run = _CohortRun(sec, sink, [m.metadata.dst_node_id for m in msgs])
    self.cohorts[cohort_id] = run
    if self.carry.enabled:
        for m, (request, carry) in zip(msgs, self.carry.requests(run.nodes, c.version).values(),
                                       strict=True):
            m.content.config_records[CARRY_KEY] = request.to_record()
            if carry is not None:
                run.carried[m.metadata.dst_node_id] = (carry, c.version - carry.version)
    for m in msgs:
        job = self.state.dispatch(m.metadata.dst_node_id, self.clock.now(),
                                  server_round=c.server_round, cohort=cohort_id)
        self._push(job, sec, m)


def _handle_upload(self: _AsyncRun, job: Job, reply: Message) -> None:
    run = self.cohorts.get(job.cohort)
    if run is None:
        carried = self.carry.replied(job.node, not reply.has_error())
        self.tally.refused[str(job.node)] = (
            f"node {job.node}: masked upload for cohort {job.cohort} arrived after the cohort "
            "closed: it was counted as dropped, its masks were removed with Shamir shares, "
            "and this upload, under its own self mask, is never unmasked"
            + ("; the site carries its update into its next cohort" if carried else ""))
        return
    run.replies[job.node] = reply
    if len(run.replies) >= len(run.nodes):
        self._close_cohort(job.cohort)
        return
    uploaded = sum(1 for r in run.replies.values() if not r.has_error())
    now = self.clock.now()
    if run.close_at is None and uploaded >= self._quorum(len(run.nodes)):
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
        self._close_cohort(job.cohort)


def _training(self: _AsyncRun, cohort_id: int, members: tuple[int, ...]) -> int:
    """Members of an open cohort that have not answered its upload request yet (the sites
    FedBuff's concurrency ``C`` counts for it)."""
    run = self.cohorts.get(cohort_id)
    return len(members) if run is None else len(set(members) - set(run.replies))


def _quorum(self: _AsyncRun, n: int) -> int:
    return max(math.ceil(self.cfg.asynchronous.cohort_quorum * n - 1e-9), 1)


def _close_cohort(self: _AsyncRun, cohort_id: int) -> None:
    """Unmask the cohort's sum (Shamir recovery of its dropped / late sites); fold, apply."""
    run = self.cohorts.pop(cohort_id)
    c = self.state.close_cohort(cohort_id)
    stale = self.carry.too_stale(run.carried, self.state.version - c.version)
    for node, why in stale.items():
        run.replies.pop(node, None)
        self.tally.refused[str(node)] = why
    replies = [r for r in run.replies.values()]
    self.tally.replied += sum(1 for r in replies if not r.has_error())
    run.sec.aggregate_train(c.server_round, replies)
    log = run.sec.report
    self.tally.bytes_up += log.bytes_up
    self.tally.bytes_down += log.bytes_down
    uploaded = sum(1 for r in replies if not r.has_error())
    for key, why in log.errors.items():
        if not key.lstrip("-").isdigit():
            self.tally.errors.setdefault(key, why)
            continue
        node = int(key)
        if node not in run.replies:  # closed before it uploaded: late, not failed
            why = (f"cohort {cohort_id} closed ({uploaded} of {len(run.nodes)} uploads, "
                   f"asynchronous.cohort_quorum = {self.cfg.asynchronous.cohort_quorum}, "
                   f"cohort_grace = {self.cfg.asynchronous.cohort_grace:g}) "
                   "before this site uploaded: counted as dropped, its masks removed with "
                   "Shamir shares")
        self.tally.errors.setdefault(str(node), why)
    for who, why in log.refused.items():
        self.tally.refused.setdefault(str(who), why)
    server = run.sec.server
    if server is not None:
        proofs = {run.sec.sites.node(i): p for i, p in server.drop_proofs.items()}
        late = [n for n in run.nodes if n not in run.replies and n not in run.carried]
        self.carry.removed(late, proofs, server_round=c.server_round, version=c.version)
    result = run.sec.last_result
    if run.sink.captured is None or result is None:
        why = log.aborted or "secure aggregation returned no aggregate"
        self.tally.errors[f"cohort {cohort_id}"] = why
        _log.warning("cohort %d: %s", cohort_id, why)
        return
    delta, weight, _, sites = run.sink.captured
    self.tally.secagg = {
        "cohort": cohort_id, "cohort_version": c.version, "cohort_round": c.server_round,
        "cohort_nodes": sorted(run.sec.sites.node(i) for i in result.counted),
        "secagg_counted": len(result.counted), "secagg_dropped": len(result.dropped),
        "secagg_error_bound": float(result.error_bound),
        "cohort_carried": {str(n): {"round": cr.round, "version": cr.version, "older": older}
                           for n, (cr, older) in sorted(run.carried.items())
                           if run.sec.sites.index(n) in result.counted}}
    try:
        self.state.fold(delta, node=-1, partition=-1, job=cohort_id, version=c.version,
                        weight=weight, count=sites)
    except UpdateRejected as exc:
        self.tally.refused[f"cohort {cohort_id}"] = str(exc)
        return
    self._apply()
