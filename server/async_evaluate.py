"""Federated evaluation inside the asynchronous loop, and the routing of replies by type.

With ``run.fraction_evaluate > 0`` the synchronous loop asks a sample of the sites to evaluate
the global model on their held-out split after each round (``run_evaluate_round``). The
asynchronous loop does the same after every ``run.evaluate_every``-th record (and the record
of the last version), without stopping training:

* **who** — a seeded sample (:meth:`~fedagg.asyncagg.AsyncServerState.choose`, tag
  ``evaluate-<record>``) of ``max(int(N x run.fraction_evaluate), 1)`` of the sites that are
  *idle*: no training job in flight, in no open secure cohort and not evaluating already. In
  FedBuff the sites whose replies filled the buffer are idle at that moment (they are
  redispatched right after). When fewer are idle than wanted, those are asked and the log
  says so; training is never held back for an evaluation;
* **how** — the run's own strategy builds the ``evaluate`` messages (``configure_evaluate``
  on a :class:`~server.async_dispatch.NodeView` of the chosen sites, ``server-round`` = the
  version) and aggregates the replies (``aggregate_evaluate``, as ``run_evaluate_round``
  does); the messages go through the same ``push_messages`` / ``pull_messages`` as the train
  messages and their replies are pulled with them;
* **routing** — :func:`route_reply`: a reply is an update only when it answers a train
  message *and* is of type ``train``; a reply to an evaluate message is only ever
  evaluation metrics, and a reply whose type does not match its message is refused;
* **records** — the metrics go into the record of the evaluated version under the
  synchronous loop's key, ``federated_eval``, once every asked site replied, or at
  ``run.round_timeout`` with what arrived (``federated_eval_sites`` replies,
  ``federated_eval_errors`` when a site failed or was refused); ``metrics.json`` is written
  again then;
* **weights** — capped as training weights are (``strategy.max_weight_ratio`` x the median;
  with fewer than three replies the median takes in the training weights of the guard
  window), named in ``federated_eval_capped`` (:meth:`AsyncEvaluation.close`);
* **end of the run** — evaluations still in flight are waited for until their
  ``run.round_timeout`` (not past ``asynchronous.max_seconds``), then dropped with a log line;
* **resume** — an open evaluation is part of the checkpointed state (record, version, nodes;
  its version's model is kept while it is open) and is **sent again** after a resume, to the
  same sites with the same model, so the record gets the same metrics as without the kill.

* **no overlap** — a site evaluating is not sent a train job (nor put in a cohort) until its
  evaluate reply is back (:meth:`AsyncEvaluation.evaluating`, :meth:`AsyncEvaluation.hold`): Flower's simulation engine would run both at
  once and keep the Context of whichever finished last, so a long evaluation could undo the
  train job's error-feedback residuals or a cohort's keys. The loop makes its seeded choices
  as before; a job for an evaluating site is held and sent when the reply (or the
  evaluation's timeout) comes, a cohort with such a member is opened then.

Evaluation never touches the training state otherwise (buffer, versions, the bytes of the
records). It can change the trajectory only through that wait, which delays a job by the
rest of its site's evaluation (tests/asynchronous/test_async_evaluate.py checks that no site
ever has both messages in flight, and that with evaluations answered at once the versions
are those of the run without them).

:class:`AsyncEvaluation` is this part of the loop (:class:`server.asynchronous.AsyncRun`), with
its own state: the evaluate messages in flight, the replies of each open evaluation and the
train jobs held for an evaluating site.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from flwr.app import Message, MessageType
from flwr.serverapp import Grid

from fedagg.asyncagg import AsyncServerState, Evaluation, Job, VirtualClock, WallClock
from fedagg.config import RunConfig
from server.async_dispatch import NodeView, config_with_round, connected_nodes, fedavg_of
from server.runner import client_config, finite_number
from strategies.registry import build_strategy
from strategies.update import RoundReport

if TYPE_CHECKING:
    from server.async_records import RunRecorder

__all__ = ["AsyncEvaluation", "EvalFlight", "EvalRun", "EvaluationLoop", "idle_sample",
           "mismatch", "route_reply"]

_log = logging.getLogger("server.asynchronous")


@dataclass
class EvalFlight:
    """A pushed evaluate message of the evaluation of record ``round``."""

    round: int
    message: Message


@dataclass
class EvalRun:
    """An evaluation in flight: the replies so far and the refused ones (node -> why)."""

    replies: list[Message] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)


def _kind(message_type: str) -> str:
    """``"train"`` / ``"evaluate"`` / ... of a Flower message type (``"train.x"`` is train)."""
    return str(message_type).split(".", 1)[0]


def route_reply(reply: Message, train: Container[str], evaluate: Container[str]) -> str:
    """Where a pulled reply goes: ``"train"``, ``"evaluate"``, ``"mismatch"`` or ``""``.

    Parameters
    ----------
    reply : Message
        A reply pulled from the Grid.
    train, evaluate : container of str
        The ids of the train and evaluate messages in flight.

    Returns
    -------
    str
        ``"train"`` for a ``train`` reply to a train message (an update, or a secure stage),
        ``"evaluate"`` for an ``evaluate`` reply to an evaluate message, ``"mismatch"`` for a
        reply whose type is not its message's (never an update, never metrics), ``""`` for a
        reply to no message in flight (already handled, expired or foreign).
    """
    rid = reply.metadata.reply_to_message_id
    want = "train" if rid in train else "evaluate" if rid in evaluate else ""
    if not want:
        return ""
    got = _kind(reply.metadata.message_type)
    if want == "train" and got == _kind(MessageType.TRAIN):
        return "train"
    if want == "evaluate" and got == _kind(MessageType.EVALUATE):
        return "evaluate"
    return "mismatch"


def mismatch(reply: Message, sent: str) -> str:
    """Why a reply whose type is not its message's (``sent``: ``"train"`` / ``"evaluate"``)
    is refused."""
    return (f"node {reply.metadata.src_node_id}: reply of type "
            f"{reply.metadata.message_type!r} to a {sent} message: refused (never treated as "
            "an update or as evaluation metrics)")


def idle_sample(nodes: Sequence[int], busy: Container[int], fraction: float,
                choose: Any, tag: str) -> tuple[list[int], int]:
    """The sites to evaluate on: a seeded choice among the idle ones.

    Parameters
    ----------
    nodes : sequence of int
        Every connected node.
    busy : container of int
        Nodes that are training (or evaluating) now.
    fraction : float
        ``run.fraction_evaluate``.
    choose : callable
        ``choose(pool, k, tag) -> nodes``, the run's seeded choice
        (:meth:`fedagg.asyncagg.AsyncServerState.choose`).
    tag : str
        The choice's tag.

    Returns
    -------
    (list of int, int)
        The chosen nodes (all idle ones when fewer are idle than wanted) and how many were
        wanted (``max(int(N x fraction), 1)``, at most ``N``, as FedAvg samples).
    """
    pool = sorted(int(n) for n in nodes)
    wanted = min(len(pool), max(int(len(pool) * fraction), 1)) if fraction > 0 else 0
    idle = [n for n in pool if n not in busy]
    if wanted == 0 or not idle:
        return [], wanted
    return list(choose(idle, min(wanted, len(idle)), tag)), wanted


class EvaluationLoop(Protocol):
    """What :class:`AsyncEvaluation` asks of the loop that runs it."""

    def pull(self, *, train: bool = True) -> list[Message]:
        """The replies pulled now (only those to evaluate messages unless ``train``)."""
        ...


class AsyncEvaluation:
    """The federated evaluation of an asynchronous run (see the module docstring).

    Owns the evaluate messages in flight (:attr:`flights`, message id -> :class:`EvalFlight`),
    the replies of each open evaluation (:attr:`runs`, record -> :class:`EvalRun`), the train
    jobs held while their site evaluates (:attr:`held`, job id -> job) and the strategy that
    builds and aggregates the evaluations. The open evaluations themselves (record, version,
    nodes) are in the run's checkpointed state.

    Parameters
    ----------
    cfg : RunConfig
        The run's configuration.
    grid : Grid
        The run's Grid (evaluate messages go through its ``push_messages``).
    state : AsyncServerState
        The run's state (busy sites, seeded choices, open evaluations, model versions).
    clock : VirtualClock or WallClock
        The run's clock.
    job_timeout : float
        ``run.round_timeout``: how long an evaluation waits for its replies.
    recorder : RunRecorder
        The run's records (the models sent; the metrics go into the evaluated record).
    loop : EvaluationLoop
        The loop, which pulls the replies (at the end of the run: only the evaluate ones).
    """

    def __init__(self, cfg: RunConfig, *, grid: Grid, state: AsyncServerState,
                 clock: VirtualClock | WallClock, job_timeout: float, recorder: RunRecorder,
                 loop: EvaluationLoop) -> None:
        self.cfg, self.grid, self.state, self.clock = cfg, grid, state, clock
        self.job_timeout, self.recorder, self.loop = job_timeout, recorder, loop
        self.flights: dict[str, EvalFlight] = {}
        self.held: dict[int, Job] = {}  # train jobs waiting for their site's evaluation
        self.runs: dict[int, EvalRun] = {}
        self._with: Any = None

    def _strategy(self) -> Any:
        """The run's strategy, its FedAvg asking exactly the nodes of the view it is given."""
        if self._with is None:
            strategy = build_strategy(self.cfg)
            inner = fedavg_of(strategy)
            if inner is not None:
                inner.fraction_evaluate, inner.min_evaluate_nodes = 1.0, 1
                inner.min_available_nodes, inner.wait_timeout = 1, 0.0
            self._with = strategy
        return self._with

    def evaluate_version(self, rec: dict[str, Any]) -> None:
        """After a record: evaluate its version on idle sites when it is due."""
        rnd, cfg = int(rec["round"]), self.cfg
        if cfg.run.fraction_evaluate <= 0 or not (rnd % cfg.run.evaluate_every == 0
                                                  or rnd >= cfg.run.rounds):
            return
        evaluating = {n for e in self.state.evaluations.values() for n in e.nodes}
        busy = self.state.busy() | evaluating
        nodes, wanted = idle_sample(connected_nodes(self.grid), busy, cfg.run.fraction_evaluate,
                                    self.state.choose, f"evaluate-{rnd}")
        if len(nodes) < wanted:
            _log.info("version %d: federated evaluation on %d idle site(s) of the %d wanted "
                      "(run.fraction_evaluate = %g; the others are training)",
                      self.state.version, len(nodes), wanted, cfg.run.fraction_evaluate)
        if not nodes:
            return
        self.send(self.state.open_evaluation(rnd, nodes, self.clock.now()))

    # -- no overlap with training ---------------------------------------------------------------
    def evaluating(self) -> set[int]:
        """Nodes with an evaluate message in flight: no train job or cohort is sent to them
        until it is back.

        Flower's simulation engine runs two messages of one node at once and then stores the
        Context of whichever finishes last: an evaluation outlasting a train job would put back
        the Context that job started from (its error-feedback residuals, a new cohort's SecAgg+
        keys). A SuperNode in deployment runs one message at a time anyway.
        """
        return {int(f.message.metadata.dst_node_id) for f in self.flights.values()}

    def hold(self, job: Job) -> bool:
        """Hold the train job ``job`` while its site evaluates (True); :meth:`release` gives
        it back once the site's evaluate reply (or the evaluation's timeout) came."""
        if job.node not in self.evaluating():
            return False
        self.held[job.job] = job
        return True

    def release(self) -> list[Job]:
        """The held train jobs whose site no longer evaluates (in job order), to send now."""
        if not self.held:
            return []
        evaluating = self.evaluating()
        out = []
        for jid, job in sorted(self.held.items()):
            if job.node not in evaluating:
                del self.held[jid]
                out.append(job)
        return out

    def holding(self, server_round: int) -> bool:
        """Whether a held train job belongs to ``server_round`` (deadline rounds)."""
        return any(j.server_round == server_round for j in self.held.values())

    # -- messages and replies -------------------------------------------------------------------
    def send(self, ev: Evaluation) -> None:
        """Build (with the run's strategy) and push the evaluate messages of ``ev``."""
        strategy = self._strategy()
        config = config_with_round(client_config(self.cfg), ev.version)
        msgs = list(strategy.configure_evaluate(ev.version, self.recorder.record(ev.version),
                                                config, NodeView(self.grid, ev.nodes)))
        if not msgs:
            self.state.close_evaluation(ev.round)
            return
        self.runs[ev.round] = EvalRun()
        for m, mid in zip(msgs, list(self.grid.push_messages(msgs)), strict=True):
            self.flights[mid] = EvalFlight(ev.round, m)
        _log.debug("version %d: evaluate sent to %d site(s)", ev.version, len(msgs))

    def route(self, reply: Message, train: Container[str]) -> str:
        """Where ``reply`` goes (:func:`route_reply`), ``train`` the train messages in flight."""
        return route_reply(reply, train, self.flights)

    def handle(self, reply: Message) -> None:
        """An evaluate reply; the evaluation closes once every asked site replied."""
        flight = self.flights.pop(reply.metadata.reply_to_message_id)
        self.runs[flight.round].replies.append(reply)
        if not any(f.round == flight.round for f in self.flights.values()):
            self.close(flight.round)

    def refuse(self, reply: Message) -> None:
        """A reply to an evaluate message whose type is not ``evaluate``: never metrics."""
        rid, node = reply.metadata.reply_to_message_id, str(reply.metadata.src_node_id)
        why = mismatch(reply, "evaluate")
        _log.warning("refused reply: %s", why)
        if rid in self.flights:
            rnd = self.flights.pop(rid).round
            self.runs[rnd].refused[node] = why
            if not any(f.round == rnd for f in self.flights.values()):
                self.close(rnd)

    def close(self, rnd: int, why: str = "") -> None:
        """Aggregate what the evaluation of record ``rnd`` got; write it into that record.

        The replies' weights (their ``num-examples``) are capped as training weights are
        (``strategy.max_weight_ratio`` x the median, by the run's own FedAvg): the median of
        the evaluation's weights, or, with fewer than three replies, of them together with the
        training weights of the guard window (the latest accepted update of each recent site),
        so one site claiming 1e300 examples cannot make the mean its own value. Caps are
        named in the record's ``federated_eval_capped``, refused replies in
        ``federated_eval_errors``.
        """
        missing = [mid for mid, f in self.flights.items() if f.round == rnd]
        for mid in missing:
            del self.flights[mid]
        run = self.runs.pop(rnd, None) or EvalRun()
        ev = self.state.close_evaluation(rnd)
        if missing:
            _log.warning("version %d: federated evaluation without %d of its %d site(s): %s",
                         ev.version, len(missing), len(ev.nodes), why or "no reply")
        good = [r for r in run.replies if not r.has_error()]
        errors = {str(r.metadata.src_node_id): r.error.reason or "error reply"
                  for r in run.replies if r.has_error()}
        errors.update(run.refused)
        strategy = self._strategy()
        inner = fedavg_of(strategy)
        if inner is not None:  # its weight cap's reference: the training weights (see close)
            inner.eval_report = RoundReport()
            inner.last_train_weights = (self.state.guards.weights
                                        if self.state.guards is not None else [])
        try:
            fed = strategy.aggregate_evaluate(ev.version, good) if good else None
        except Exception as exc:  # like the synchronous loop: the record says why, the run goes on
            fed = None
            errors["server-evaluate"] = (f"unexpected error in federated evaluation: "
                                         f"{type(exc).__name__}: {exc}"[:400])
            _log.error("version %d: %s", ev.version, errors["server-evaluate"])
        fields: dict[str, Any] = {}
        if fed is not None:
            fields["federated_eval"] = {k: v for k, v in fed.items() if finite_number(v)}
        fields["federated_eval_sites"] = len(good)
        notes = inner.eval_report if inner is not None else RoundReport()
        errors.update(notes.refused)
        if errors:
            fields["federated_eval_errors"] = errors
        if notes.capped:  # weights over max_weight_ratio x the median, capped
            fields["federated_eval_capped"] = dict(notes.capped)
            for note in notes.capped.values():
                _log.warning("version %d: federated evaluation: %s", ev.version, note)
        self.recorder.amend(rnd, fields)

    # -- time -----------------------------------------------------------------------------------
    def expire(self, *, now: float | None = None, why: str = "") -> None:
        """Close the evaluations past ``run.round_timeout`` with what they got."""
        t = self.clock.now() if now is None else now
        for rnd, ev in list(self.state.evaluations.items()):
            if rnd in self.runs and t >= ev.sent_at + self.job_timeout:
                self.close(rnd, why or f"no reply within run.round_timeout = "
                                       f"{self.job_timeout:g} s")

    def targets(self) -> list[float]:
        """When the loop must wake up for the evaluations: their timeouts and next reply."""
        out = [ev.sent_at + self.job_timeout for r, ev in self.state.evaluations.items()
               if r in self.runs]
        nxt = getattr(self.grid, "next_arrival", None)
        if callable(nxt) and self.flights:
            t = nxt(list(self.flights))
            if t is not None:
                out.append(float(t))
        return out

    def drain(self) -> None:
        """End of the run: wait for the evaluations in flight until their timeout (not past
        ``asynchronous.max_seconds``), then drop what is still missing, with a log line."""
        limit = self.cfg.asynchronous.max_seconds
        while self.flights:
            for reply in self.loop.pull(train=False):
                kind = self.route(reply, ())
                if kind == "evaluate":
                    self.handle(reply)
                elif kind:
                    self.refuse(reply)
            now = self.clock.now()
            if limit is not None and now >= limit:
                left = sorted({f.round for f in self.flights.values()})
                _log.warning("end of the run (asynchronous.max_seconds = %g): dropping the "
                             "federated evaluation in flight of record(s) %s", limit, left)
                for rnd in left:
                    self.close(rnd, "dropped at the end of the run")
                return
            self.expire(why="dropped at the end of the run: no reply within "
                            f"run.round_timeout = {self.job_timeout:g} s")
            if not self.flights:
                return
            targets = self.targets() + ([limit] if limit is not None else [])
            self.clock.wait_until(min(targets), poll=self.cfg.asynchronous.poll)

    def resend(self) -> None:
        """Resume: send the evaluations that were open at the checkpoint again (same sites,
        same model, at their original time on a virtual clock)."""
        now = self.clock.now()
        for ev in sorted(self.state.evaluations.values(), key=lambda e: e.round):
            try:
                self.state.model_of(ev.version)
            except KeyError:
                self.state.close_evaluation(ev.round)
                _log.warning("resume: the model of version %d is not in the checkpoint; its "
                             "federated evaluation is skipped", ev.version)
                continue
            if isinstance(self.clock, VirtualClock):
                self.clock.set(ev.sent_at)
            self.send(ev)
        self.clock.set(now)
        if self.state.evaluations:
            _log.info("resume: %d federated evaluation(s) sent again",
                      len(self.state.evaluations))
