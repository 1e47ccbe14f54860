"""The asynchronous server loop: FedBuff and deadline rounds over Flower's Grid push / pull.

Chosen by ``asynchronous.mode`` (:func:`server.runner.run_server` hands over to
:func:`run_async_server`); the math and the state are Flower-free
(:mod:`fedagg.asyncagg`), every message is built and every reply checked by the run's own
strategies (:mod:`server.async_dispatch`).

``fedbuff`` (Nguyen et al. 2022, Algorithm 1)
    Keep ``C`` sites training (``push_messages``); pull replies as they arrive
    (``pull_messages``), fold each checked update into the buffer with its staleness weight,
    apply the buffer after ``K`` updates (a new model *version*) and dispatch the newest
    model to every freed site. Under secure aggregation sites are dispatched ``K`` at a time
    as a *cohort* that agrees SecAgg+ keys when dispatched; a cohort's masked uploads are one
    buffer, unmasked as a sum (docs/protocols/async-secagg.md).
``deadline``
    Synchronous rounds with a deadline: round ``r`` dispatches the version of round ``r - 1``
    to its sampled free sites and closes at ``asynchronous.deadline`` (or when all of them
    replied); it applies what arrived, including late updates of earlier rounds with their
    staleness weight.

Events are handled one at a time in arrival order (ties: dispatch order), and freed sites are
dispatched after every batch of simultaneous arrivals, so a run is a deterministic function
of the seed and the arrival order. After every applied buffer the whole state (model,
version, optimizer, buffer, in-flight dispatches and the models they train from) is
checkpointed atomically; a resumed run sends the in-flight dispatches again (at their
original times on a virtual clock), so it replays the same arrival order and the same
versions as an uninterrupted run (tests/asynchronous/test_async_resume.py).

Every arriving update is judged by the median-relative guards against the other sites' latest
accepted updates before it is folded (:mod:`fedagg.asyncagg.guards`: norm bombs refused, lying
weights capped).

Buffers are fair: a buffer holds at most one update per site, and a FedBuff site gets one job
per buffer. A site whose reply arrived while a buffer is open (folded, refused or failed) is
not dispatched again until that buffer is applied (it waits; nothing it sent is refused for
it), so however fast a site answers it takes one slot per buffer and cannot flood the guards
or advance the versions past the other sites. FedBuff applies the buffer after ``K`` updates,
or earlier once every connected site is waiting for it (fewer than ``K`` sites can fill it).

With ``run.fraction_evaluate > 0`` idle sites evaluate the new versions while training goes
on (:mod:`server.async_evaluate`, which also routes replies by message type; evaluation
weights are capped as training weights are).

:class:`AsyncRun` is the loop; its parts are objects with their own state, each in its module:
the secure cohorts (:class:`server.async_cohorts.SecureCohorts`), the records, checkpoints,
outputs and the resume (:class:`server.async_records.RunRecorder`) and the federated
evaluation (:class:`server.async_evaluate.AsyncEvaluation`).
"""

from __future__ import annotations

import logging
import math
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Message
from flwr.serverapp import Grid

from fedagg.aggregate import ServerOptimizer, model_change_problem
from fedagg.asyncagg import (
    AsyncServerState,
    GuardWindow,
    Job,
    StalenessWeight,
    UpdateBuffer,
    VirtualClock,
    WallClock,
)
from fedagg.config import RunConfig
from fedagg.errors import ConfigError, RunFailed, UpdateRejected, explain
from server.async_cohorts import SecureCohorts
from server.async_dispatch import (
    NodeView,
    check_asynchronous,
    concurrency_of,
    config_with_round,
    connected_nodes,
    decode_update,
    job_strategy,
)
from server.async_evaluate import AsyncEvaluation, mismatch
from server.async_records import RunRecorder
from server.checkpoint import Checkpoint
from server.runner import (
    EvaluateFn,
    ModelFn,
    RoundCallback,
    client_config,
    initial_model,
    wait_for_sites,
)
from strategies.base import filter_replies
from strategies.compressed import Compressed
from strategies.fedavg import FedAvg
from strategies.secure import SecureAggregation
from strategies.secure_privacy import DistributedPrivacy
from strategies.update import partition_of
from strategies.wire import message_nbytes, record_to_arrays

__all__ = ["AsyncRun", "check_async_resume", "run_async_server"]

_log = logging.getLogger(__name__)
_KILL_ENV = "FEDAGG_TEST_KILL_AT"  # "<round>:after-apply" or "arrival:<n>" (tests)


@dataclass
class _Flight:
    """A pushed message waiting for its reply."""

    job: Job
    strategy: Any  # FedAvg | Compressed | SecureAggregation of this dispatch
    message: Message


def _kill_if(point: str) -> None:
    if os.environ.get(_KILL_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


class AsyncRun:
    """One asynchronous run (see the module docstring).

    The loop itself: dispatch (:meth:`send_job`, :meth:`push`), pull, handle each reply,
    expire, deadline rounds, wait, :meth:`run`. Its parts hold their own state: the records,
    outputs, checkpoints and the resume (:attr:`recorder`, a
    :class:`~server.async_records.RunRecorder`), the federated evaluation (:attr:`evaluation`,
    an :class:`~server.async_evaluate.AsyncEvaluation`) and the secure cohorts
    (:attr:`cohorts`, :class:`~server.async_cohorts.SecureCohorts`). The loop owns the train
    messages in flight (:attr:`flights`) and the run's state (:attr:`state`), which the parts
    share.
    """

    def __init__(self, grid: Grid, cfg: RunConfig, run_dir: str | Path | None,
                 on_round: RoundCallback | None, model_fn: ModelFn | None,
                 evaluate_fn: EvaluateFn | None) -> None:
        check_asynchronous(cfg)
        self.grid, self.cfg = grid, cfg
        a = cfg.asynchronous
        self.mode, self.secure = a.mode, bool(cfg.strategy.secure
                                               or cfg.strategy.name.strip() == "secure")
        model, keys, arrays = initial_model(cfg, model_fn)
        clock = getattr(grid, "clock", None)
        self.clock: VirtualClock | WallClock = (clock if isinstance(clock, VirtualClock | WallClock)
                                                else WallClock())
        s = cfg.strategy
        self.state = AsyncServerState(
            record_to_arrays(arrays)[1],
            buffer=UpdateBuffer(a.buffer_size if a.mode == "fedbuff" else 1, a.weighting),
            staleness=StalenessWeight(a.staleness, a.staleness_a, a.staleness_b),
            max_staleness=a.max_staleness,
            optimizer=ServerOptimizer(s.server_optimizer, lr=s.server_lr, beta1=s.server_momentum),
            seed=cfg.run.seed,
            guards=GuardWindow(a.guard_window, norm_outlier_factor=s.norm_outlier_factor,
                               max_weight_ratio=s.max_weight_ratio))
        self.concurrency = concurrency_of(cfg)
        self.job_timeout = float(cfg.run.round_timeout)
        self.flights: dict[str, _Flight] = {}
        self.arrivals = 0
        privacy = (DistributedPrivacy(cfg.privacy, cfg.run.rounds)
                   if self.secure and cfg.privacy.on else None)
        self.recorder = RunRecorder(
            cfg, grid=grid, state=self.state, clock=self.clock, model=model, keys=keys,
            out=Path(run_dir) if run_dir else None, mode=self.mode, secure=self.secure,
            on_round=on_round, evaluate_fn=evaluate_fn, model_fn=model_fn, privacy=privacy)
        self.evaluation = AsyncEvaluation(
            cfg, grid=grid, state=self.state, clock=self.clock, job_timeout=self.job_timeout,
            recorder=self.recorder, loop=self)
        self.cohorts = SecureCohorts(
            cfg, grid=grid, state=self.state, clock=self.clock, concurrency=self.concurrency,
            job_timeout=self.job_timeout, secure=self.secure, recorder=self.recorder,
            evaluation=self.evaluation, loop=self, privacy=privacy)

    # -- buffers ------------------------------------------------------------------------------------
    def _take(self) -> dict[str, Any]:
        """Apply the buffer (model-integrity checked); the record of it (not yet emitted)."""
        max_change = self.cfg.strategy.max_model_change

        def check(new: list[np.ndarray], old: list[np.ndarray]) -> str:
            return model_change_problem(new, old, max_change=max_change)

        applied = self.state.apply(check)
        res = applied.result
        summary = ""
        if not applied.committed:
            summary = (f"round {len(self.recorder.records)}: the aggregated model was not "
                       f"committed (global model unchanged at version {self.state.version}): "
                       f"{applied.problem}")
            self.recorder.tally.refused["server"] = summary
            _log.error("%s", summary)
        rec = self.recorder.new_record(applied.committed, summary, in_flight=len(self.flights))
        hist = res.staleness_histogram()
        stale = [e.staleness for e in res.entries for _ in range(e.count)]
        rec.update(updates=res.count, staleness=hist,
                   staleness_mean=float(np.mean(stale)) if stale else 0.0,
                   staleness_max=max(stale, default=0),
                   sites=[e.partition for e in res.entries if e.partition >= 0])
        _log.info("async %s: version %d from %d updates (staleness %s), %d in flight",
                  self.mode, self.state.version, res.count, hist, len(self.flights))
        return rec

    def apply(self, why: str = "") -> None:
        """FedBuff: apply the buffer, record (``why``: a buffer applied before it was full),
        checkpoint."""
        rec = self._take()
        if why and "summary" not in rec:
            rec["summary"] = f"round {rec['round']}: {why}"
        self.recorder.emit(rec)
        self.evaluation.evaluate_version(rec)
        _kill_if(f"{rec['round']}:after-apply")
        self.recorder.checkpoint()

    @property
    def done(self) -> bool:
        """Whether the run is over: ``run.rounds`` records, ``asynchronous.max_seconds``, or
        the privacy budget spent (no cohort opens, none is open)."""
        if len(self.recorder.records) - 1 >= self.cfg.run.rounds:
            return True
        if self.cohorts.stopped and not self.cohorts.open:
            return True
        limit = self.cfg.asynchronous.max_seconds
        return limit is not None and self.clock.now() >= limit

    # -- dispatch ---------------------------------------------------------------------------------
    def push(self, job: Job, strategy: Any, message: Message) -> None:
        """Push the train message of ``job`` (built by ``strategy``) and track its reply."""
        self.recorder.tally.bytes_down += message_nbytes(message)
        self.recorder.tally.dispatched += 1
        [mid] = list(self.grid.push_messages([message]))
        self.flights[mid] = _Flight(job, strategy, message)

    def send_job(self, job: Job) -> None:
        """Build (with a fresh FedAvg / Compressed) and push the train message of ``job``;
        held while its site evaluates (:meth:`AsyncEvaluation.hold`, sent by
        :meth:`_release_held`)."""
        if self.evaluation.hold(job):
            return
        strategy = job_strategy(self.cfg)
        config = config_with_round(client_config(self.cfg), job.server_round)
        msgs = list(strategy.configure_train(job.server_round, self.recorder.record(job.version),
                                             config, NodeView(self.grid, [job.node])))
        if len(msgs) != 1:
            raise ConfigError(explain("dispatch", len(msgs), "must be one message per site",
                                      "check strategy.options"))
        self.push(job, strategy, msgs[0])

    def _release_held(self) -> None:
        """Send the held train jobs whose site no longer evaluates."""
        for job in self.evaluation.release():
            self.send_job(job)

    def _fill(self) -> None:
        """FedBuff: dispatch the newest model to free sites until ``C`` are busy.

        A site whose evaluation is still in flight (:meth:`AsyncEvaluation.evaluating`) gets
        its train job once the evaluate reply is back (:meth:`send_job` holds it); a cohort
        with such a member is opened only then, with the same seeded choice.
        """
        if self.mode != "fedbuff" or self.done:
            return
        while True:
            if self.secure:
                if not self.cohorts.open_next():
                    return
            else:
                nodes = connected_nodes(self.grid)
                if self._close_waiting_buffer(nodes):
                    if self.done:
                        return
                    continue
                busy, waiting = self.state.busy(), self.state.waiting  # one job per buffer
                free = [n for n in nodes if n not in busy and n not in waiting]
                if not free or len(busy) >= self.concurrency:
                    return
                [node] = self.state.choose(free, 1, "fedbuff")
                self.send_job(self.state.dispatch(node, self.clock.now()))

    def _start_round(self) -> None:
        """Deadline mode: open the next round and dispatch it to its sampled free sites."""
        st = self.state
        st.round += 1
        st.round_started = self.clock.now()
        nodes = connected_nodes(self.grid)
        k = max(int(len(nodes) * self.cfg.run.fraction_train), 1)
        busy = st.busy() | st.in_buffer()  # a buffer kept from the last round: its sites wait
        for node in st.choose(nodes, k, f"round-{st.round}"):
            if node not in busy:
                self.send_job(st.dispatch(node, self.clock.now(), server_round=st.round))

    # -- replies ----------------------------------------------------------------------------------
    def pull(self, *, train: bool = True) -> list[Message]:
        """Replies to the train (unless not ``train``) and evaluate messages in flight."""
        evaluating = self.evaluation.flights
        sent = [f.message for f in self.flights.values()] if train else []
        sent += [f.message for f in evaluating.values()]
        if not sent:
            return []
        pull = getattr(self.grid, "pull_due", self.grid.pull_messages)  # DelayedGrid: no waiting
        got = list(pull([*self.flights, *evaluating] if train else [*evaluating]))
        kept, refused = filter_replies(sent, got)
        self.recorder.tally.refused.update(refused)
        order = {mid: f.job.job for mid, f in self.flights.items()}
        return sorted(kept, key=lambda r: order.get(r.metadata.reply_to_message_id, 0)) \
            if not self.clock.virtual else kept  # a DelayedGrid returns arrival order

    def _came_back(self, job: Job) -> None:
        """FedBuff: the plaintext job's site waits for the open buffer to be applied (one job
        per site per buffer), whatever its reply was."""
        if self.mode == "fedbuff" and job.cohort < 0:
            self.state.waiting.add(job.node)

    def _close_waiting_buffer(self, nodes: list[int]) -> bool:
        """FedBuff: when every connected site is waiting for the open buffer (fewer than ``K``
        could fill it), apply it with what it holds, or, empty, let them all go again. Whether
        anything was done."""
        st = self.state
        if not nodes or not set(nodes) <= st.waiting:
            return False
        if not st.buffer.count:
            st.waiting.clear()  # every site's reply refused or failed: nothing to apply
            return True
        self.apply(f"buffer applied with {st.buffer.count} of asynchronous.buffer_size = "
                   f"{st.buffer.size} updates: every connected site has replied since it "
                   "opened (one job per site per buffer)")
        return True

    def _handle(self, reply: Message) -> None:
        flight = self.flights.pop(reply.metadata.reply_to_message_id)
        job = self.state.arrive(flight.job.job)
        self._came_back(job)
        node = str(job.node)
        self.arrivals += 1
        self.recorder.tally.bytes_up += message_nbytes(reply)
        if isinstance(flight.strategy, SecureAggregation):
            self.cohorts.handle_upload(job, reply)
        elif reply.has_error():
            self.recorder.tally.errors[node] = reply.error.reason or "error reply"
        else:
            self._handle_update(job, flight.strategy, reply)
        _kill_if(f"arrival:{self.arrivals}")

    def _handle_update(self, job: Job, strategy: FedAvg | Compressed, reply: Message) -> None:
        node = str(job.node)
        tally = self.recorder.tally
        try:
            self.state.admit(job.version, f"node {node}")  # refuse stale updates before decoding
            inner = strategy.inner if isinstance(strategy, Compressed) else strategy
            assert isinstance(inner, FedAvg)
            delta, weight, metrics = decode_update(strategy, reply, job.server_round,
                                                   inner.current_global[1])
            entry = self.state.fold(delta, node=job.node, partition=partition_of(metrics),
                                    job=job.job, version=job.version, weight=weight)
        except UpdateRejected as exc:
            tally.refused[node] = str(exc)
            _log.warning("refused update: %s", exc)
            return
        if entry.weight < weight:  # the median-relative weight cap (fedagg.asyncagg.guards)
            tally.capped[node] = (
                f"node {node}: weight {weight:.6g} capped to {entry.weight:.6g} (strategy."
                f"max_weight_ratio = {self.cfg.strategy.max_weight_ratio:g} x the median weight "
                "of the last accepted updates and this one)")
            _log.warning("%s", tally.capped[node])
            weight = entry.weight
        tally.replied += 1
        loss = metrics.get("train_loss", metrics.get("train-loss"))
        if isinstance(loss, int | float) and math.isfinite(loss):
            tally.loss += float(loss) * weight
            tally.loss_weight += weight
        if self.mode == "fedbuff" and self.state.buffer.full:
            self.apply()
        _log.debug("folded node %s (staleness %d)", node, entry.staleness)

    def _refuse(self, reply: Message) -> None:
        """A reply whose type is not its message's: never an update, never metrics."""
        rid = reply.metadata.reply_to_message_id
        if rid not in self.flights:
            self.evaluation.refuse(reply)
            return
        why = mismatch(reply, "train")
        _log.warning("refused reply: %s", why)
        flight = self.flights.pop(rid)
        self._came_back(self.state.arrive(flight.job.job))
        self.recorder.tally.refused[str(reply.metadata.src_node_id)] = why

    # -- time --------------------------------------------------------------------------------------
    def _expire(self) -> None:
        """Give up on dispatches past ``run.round_timeout``; close cohorts that waited as long
        or whose grace period after their quorum ended; close the evaluations past their
        timeout."""
        now = self.clock.now()
        for mid, f in list(self.flights.items()):
            if now >= f.job.dispatched_at + self.job_timeout:
                del self.flights[mid]
                self._came_back(self.state.arrive(f.job.job))
                self.recorder.tally.errors[str(f.job.node)] = (
                    f"no reply within run.round_timeout = {self.job_timeout:g} s")
        self.cohorts.expire(now)
        self.evaluation.expire()

    def _deadline(self) -> None:
        """Deadline mode: close the round at its deadline (or when all its sites replied).

        The round's buffer (its own updates and late ones of earlier rounds, each with its
        staleness weight) is applied, the next round is dispatched from the new version, and
        then the record and the checkpoint (which so holds the next round's dispatches) are
        written.
        """
        st = self.state
        if self.mode != "deadline" or self.done:
            return
        if st.round == 0:
            self._start_round()
            self.recorder.checkpoint()
            return
        mine = any(f.job.server_round == st.round for f in self.flights.values()) or \
            self.evaluation.holding(st.round)  # held: sent after its site's evaluation
        sent = any(v == st.round for v in st.site_rounds.values())
        over = self.clock.now() >= st.round_started + self.cfg.asynchronous.deadline
        if not over and (mine or not sent):
            return
        need = max(self.cfg.run.min_sites, 1)
        if st.buffer.count >= need:
            rec = self._take()
        else:
            why = (f"{st.buffer.count} update(s) by the deadline < run.min_sites = {need}"
                   + (" (kept for the next round)" if st.buffer.count else ""))
            rec = self.recorder.new_record(
                False, f"round {len(self.recorder.records)}: nothing aggregated: {why}",
                in_flight=len(self.flights))
            rec.update(updates=0, staleness={})
            _log.warning("%s", rec["summary"])
        self.recorder.emit(rec)
        self.evaluation.evaluate_version(rec)
        _kill_if(f"{rec['round']}:after-apply")
        if not self.done:
            self._start_round()
        self.recorder.checkpoint()

    def _wait(self) -> None:
        now = self.clock.now()
        targets = [f.job.dispatched_at + self.job_timeout for f in self.flights.values()]
        targets += self.cohorts.targets()
        if self.mode == "deadline" and self.state.round:
            targets.append(self.state.round_started + self.cfg.asynchronous.deadline)
        if self.cfg.asynchronous.max_seconds is not None:
            targets.append(self.cfg.asynchronous.max_seconds)
        nxt = getattr(self.grid, "next_arrival", None)
        if callable(nxt):
            t = nxt(list(self.flights))
            if t is not None:
                targets.append(float(t))
        targets += self.evaluation.targets()
        if not self.flights and not self.evaluation.flights and not any(t > now for t in targets):
            raise RunFailed(f"asynchronous run stalled at version {self.state.version}: no "
                            "dispatch in flight and no site free to dispatch to",
                            self.recorder.records)
        self.clock.wait_until(min(targets) if targets else now + self.cfg.asynchronous.poll,
                              poll=self.cfg.asynchronous.poll)

    def _due(self) -> bool:
        """Whether a reply is already due (a DelayedGrid says; on a real grid: pull again)."""
        nxt = getattr(self.grid, "next_arrival", None)
        if not callable(nxt) or not (self.flights or self.evaluation.flights):
            return False
        t = nxt([*self.flights, *self.evaluation.flights])
        return t is not None and t <= self.clock.now()

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        """Run to the end (resuming first with ``run.resume``); the records."""
        cfg = self.cfg
        if cfg.run.resume:
            self.recorder.resume(send_job=self.send_job, send_cohort=self.cohorts.send,
                                 resend_evaluations=self.evaluation.resend)
            _log.info("resuming asynchronous run at version %d (%d dispatches sent again)",
                      self.state.version, len(self.flights))
        self.recorder.write_config()
        wait_for_sites(self.grid, cfg)
        if not cfg.run.resume:
            self.recorder.start()
        while not self.done:
            for reply in self.pull():
                kind = self.evaluation.route(reply, self.flights)
                if kind == "train":
                    self._handle(reply)
                elif kind == "evaluate":
                    self.evaluation.handle(reply)
                elif kind:
                    self._refuse(reply)
                if self.done:
                    break
            if self.done:
                break
            self._expire()
            self._release_held()
            self._deadline()
            self._fill()
            if self.done:
                break
            if not self._due():
                self._wait()
        self.evaluation.drain()
        if self.cohorts.stopped:  # the privacy budget: say so in the last record
            self.recorder.records[-1]["stopped"] = self.cohorts.stopped
        self.recorder.finish()
        return self.recorder.records


def run_async_server(grid: Grid, cfg: RunConfig, run_dir: str | Path | None, *,
                     on_round: RoundCallback | None = None, model_fn: ModelFn | None = None,
                     evaluate_fn: EvaluateFn | None = None) -> list[dict[str, Any]]:
    """Run ``run.rounds`` asynchronous versions (FedBuff) or deadline rounds.

    Same parameters, outputs (``metrics.json`` with one record per applied buffer,
    ``checkpoint.npz``, ``model.npz`` / ``model.pt``, the plot) and errors as
    :func:`server.runner.run_server`, which calls it when ``asynchronous.mode`` is not
    ``"off"``. The clock is the Grid's (``DelayedGrid.clock``, simulated time) or the wall
    clock.

    Raises
    ------
    ConfigError
        A combination the asynchronous loop cannot run (:func:`check_asynchronous`).
    RunFailed
        No buffer changed the model, or the run stalled.
    """
    return AsyncRun(grid, cfg, run_dir, on_round, model_fn, evaluate_fn).run()


def check_async_resume(cfg: RunConfig, *, model_fn: ModelFn | None = None) -> Checkpoint:
    """What a resume of the asynchronous run ``cfg`` would load, checked before any engine
    starts (nothing is sent or written).

    ``fedagg simulate --resume`` calls it for a FedBuff or deadline run (the synchronous
    :func:`server.runner.check_resume` would hand the asynchronous state to a synchronous
    strategy), so that a refused resume exits with status 2 and an intact one goes on.

    Raises
    ------
    CheckpointError
        As :meth:`RunRecorder.load_checkpoint`.
    ConfigError
        A configuration the asynchronous loop cannot run.
    """
    run = AsyncRun(None, cfg, None, None, model_fn, None)  # type: ignore[arg-type]
    return run.recorder.load_checkpoint()
