"""What fedagg's strategies share, and the exchange of one round's messages with the sites.

* :class:`FedaggStrategy` -- what a fedagg strategy declares (``Config``,
  ``aggregates_linearly``, ``allows_retries``, its round's :attr:`~FedaggStrategy.report`,
  ``aggregate_stream``);
* :class:`ReplyGate` -- the one place that decides whether a reply counts;
* :func:`stream_exchange` / :func:`exchange` -- send a round's messages and receive the replies
  that count as they arrive (``Grid.push_messages`` / ``pull_messages``; transient errors
  retried within the deadline), counting bytes and seconds (:class:`ExchangeLog`).

The round itself is :func:`strategies.loop.run_train_round`. Wrappers that need
more exchanges (secure aggregation's key setup and unmasking) run them inside
``configure_train`` / ``aggregate_train`` with the Grid they were given, so they work under
``Strategy.start()`` too, and report them in their :attr:`FedaggStrategy.report`. Whether a
reply counts is decided in one place, :class:`ReplyGate`, which the synchronous exchanges and
the asynchronous loop both use.

Plugins subclass a Flower strategy (or fedagg's :class:`~strategies.fedavg.FedAvg`),
optionally declare a pydantic ``Config`` model for their options and a
``from_config(options, run_config)`` classmethod, and are registered by name
(:mod:`strategies.registry`, docs/plugins.md). A strategy whose aggregate is a weighted mean
of the updates (and so can run on a masked sum) says so with ``aggregates_linearly = True``.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from pydantic import BaseModel

from strategies.update import RoundReport
from strategies.wire import message_nbytes, messages_nbytes

__all__ = [
    "ExchangeLog",
    "FedaggStrategy",
    "ReplyGate",
    "RoundResult",
    "exchange",
    "filter_replies",
    "stream_exchange",
]

_log = logging.getLogger(__name__)


@dataclass
class RoundResult:
    """Outcome of one training round: the new model (None: unchanged), its metrics, the report."""

    arrays: ArrayRecord | None
    metrics: MetricRecord | None
    report: RoundReport = field(default_factory=RoundReport)


class FedaggStrategy(Strategy):
    """Mixin-style base for fedagg strategies; plain Flower strategies work too.

    Class attributes
    ----------------
    Config : type[pydantic.BaseModel] or None
        Model that validates ``strategy.options`` of the run config.
    aggregates_linearly : bool
        Whether the aggregate is a weighted mean of the updates (secure aggregation can wrap
        it: the masked sum is all it needs).

    Attributes
    ----------
    report : RoundReport
        What the strategy did in the round being aggregated (reset by ``configure_train``):
        updates refused or capped with their reasons, the accepted sites, its own exchanges'
        bytes and seconds. fedagg's round loop merges it into the round's report.
    eval_report : RoundReport
        The same for the last federated evaluation (reset by ``configure_evaluate``): error
        replies, refused replies, capped weights, dropped metrics (empty for a strategy that
        notes nothing).
    """

    Config: ClassVar[type[BaseModel] | None] = None
    aggregates_linearly: ClassVar[bool] = False
    allows_retries: ClassVar[bool] = True
    """Whether a site may be sent its train message again after a transient error (secure
    aggregation: never, a message must not be answered twice)."""
    report: RoundReport

    @property
    def eval_report(self) -> RoundReport:
        """What the last federated evaluation did (see the class docstring)."""
        report = self.__dict__.get("_eval_report")
        if not isinstance(report, RoundReport):
            report = self.__dict__["_eval_report"] = RoundReport()
        return report

    @eval_report.setter
    def eval_report(self, report: RoundReport) -> None:
        self.__dict__["_eval_report"] = report

    def aggregate_stream(self, server_round: int, replies: Iterable[Message]
                         ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """What fedagg's round loop calls with the replies as they arrive (a generator).

        The same aggregate as ``aggregate_train``; a strategy with an engine of its own
        (fedagg's FedAvg) folds the replies straight into it here, without what Flower's
        ``aggregate_train`` does around it.
        """
        return self.aggregate_train(server_round, replies)


class ReplyGate:
    """The one place that decides whether a reply counts (every loop of fedagg uses it).

    It knows the messages in flight (message id -> the node it was sent to) and admits a reply
    only once, only to a message it knows, only from the node the message was addressed to; a
    replayed, foreign or misdirected reply is refused with the reason.
    """

    def __init__(self) -> None:
        self.pending: dict[str, int] = {}
        self.answered: set[str] = set()

    def sent(self, message_id: str, node: int) -> None:
        """Expect one reply to ``message_id`` from ``node``."""
        self.pending[message_id] = node

    def forget(self, message_id: str) -> None:
        """Stop expecting a reply to ``message_id`` (given up on)."""
        self.pending.pop(message_id, None)

    def admit(self, reply: Message) -> str:
        """'' when ``reply`` counts (it is then no longer pending), else why not."""
        rid = reply.metadata.reply_to_message_id
        node = reply.metadata.src_node_id
        if rid in self.answered:
            return f"node {node}: duplicate reply to message {rid!r}"
        if rid not in self.pending:
            return f"node {node}: reply to an unknown or earlier message {rid!r} (stale or foreign)"
        if self.pending[rid] != node:
            return f"node {node}: replied to a message addressed to node {self.pending[rid]}"
        del self.pending[rid]
        self.answered.add(rid)
        return ""


def _is_permanent(reason: str) -> bool:
    """Errors a retry cannot fix: bad configuration or data at the site."""
    return any(tag in reason for tag in _PERMANENT)


_PERMANENT = ("ConfigError", "DataError", "ValidationError", "ProtocolError")


def filter_replies(sent: list[Message], replies: Iterable[Message]
                   ) -> tuple[list[Message], dict[str, str]]:
    """The replies of ``replies`` that count for the messages ``sent`` (:class:`ReplyGate`);
    refused ones named (node id -> reason) and logged."""
    gate = ReplyGate()
    for m in sent:
        if m.metadata.message_id:
            gate.sent(m.metadata.message_id, m.metadata.dst_node_id)
    kept: list[Message] = []
    refused: dict[str, str] = {}
    for r in replies:
        why = gate.admit(r) if gate.pending or gate.answered else ""
        if why:
            refused[str(r.metadata.src_node_id)] = why
            _log.warning("refused reply: %s", why)
        else:
            kept.append(r)
    return kept, refused


def exchange(grid: Grid, messages: list[Message], timeout: float, *,
             report: RoundReport | None = None) -> list[Message]:
    """Send ``messages`` and collect the replies that count until the deadline (a list).

    :func:`stream_exchange` collected into a list, for exchanges whose replies are small
    (secure aggregation's key setup and unmasking, evaluation); what it saw (bytes, refused
    replies, silent nodes, one more exchange) goes into ``report``.
    """
    log = ExchangeLog()
    replies = list(stream_exchange(grid, messages, timeout, log=log))
    if report is not None:
        log.into(report)
    return replies


@dataclass
class ExchangeLog:
    """What :func:`stream_exchange` saw (filled in while it runs)."""

    bytes_down: int = 0
    bytes_up: int = 0
    """Serialized size of the replies handed over (error replies excluded)."""
    attempts: int = 0
    replies: int = 0
    """Replies handed over (error replies included)."""
    ok: int = 0
    """Replies handed over that are not error replies."""
    refused: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    """Node id -> reason, for error replies and nodes that did not answer in time."""
    seconds: float = 0.0
    """Seconds spent sending and waiting for replies (not in the consumer)."""

    def into(self, report: RoundReport) -> None:
        """Add what the exchange saw to ``report`` (one more exchange)."""
        report.bytes_down += self.bytes_down
        report.bytes_up += self.bytes_up
        report.exchanges += max(self.attempts, 1)
        for who, why in self.refused.items():
            report.refused.setdefault(who, why)
        for who, why in self.errors.items():
            report.errors.setdefault(who, why)


def stream_exchange(grid: Grid, messages: list[Message], timeout: float, *, retries: int = 0,
                    rebuild: Callable[[list[int]], list[Message]] | None = None,
                    log: ExchangeLog | None = None, poll: float = 0.05) -> Iterator[Message]:
    """Send ``messages`` and yield each reply as it arrives, until all came or the deadline.

    ``Grid.push_messages`` then ``pull_messages`` of the pending ids, as ``send_and_receive``
    does, but handing each reply over at once and keeping none. Whether a reply counts is the
    :class:`ReplyGate`'s decision (a reply to an unknown or earlier message, a second reply, a
    reply from another node than the one addressed are refused, named in ``log.refused``). A
    transient error reply is not handed over while ``retries`` and time allow: its node is
    sent its message again, rebuilt by ``rebuild``; permanent errors are handed over. Nodes
    still silent at the deadline are named in ``log.errors``.
    """
    log = log if log is not None else ExchangeLog()
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    log.bytes_down += messages_nbytes(messages)
    gate = ReplyGate()
    tries: dict[int, int] = {}

    def push(batch: list[Message]) -> None:
        ids = [str(i) for i in grid.push_messages(batch)]
        for i, m in enumerate(batch):  # the Grid set each message's id (replies refer to it)
            mid = m.metadata.message_id or (ids[i] if i < len(ids) else f"unsent-{i}")
            gate.sent(str(mid), m.metadata.dst_node_id)
            tries[m.metadata.dst_node_id] = tries.get(m.metadata.dst_node_id, 0) + 1
        log.attempts = max(tries.values(), default=0)

    if messages:
        push(list(messages))
    # a Grid that computes every reply inside push_messages (server.inprocess) says so: a
    # pull that finds nothing then means the remaining nodes never answer
    ready = bool(getattr(getattr(type(grid), "push_messages", None), "replies_ready", False))
    try:
        while gate.pending:
            arrived = list(grid.pull_messages(list(gate.pending)))
            if not arrived:
                if ready or time.monotonic() >= deadline:
                    break
                time.sleep(poll)
                continue
            arrived.reverse()
            while arrived:
                r = arrived.pop()  # the list never holds a reply that was handed over
                why = gate.admit(r)
                node = r.metadata.src_node_id
                if why:
                    log.refused[str(node)] = why
                    _log.warning("refused reply: %s", why)
                    continue
                if (r.has_error() and not _is_permanent(r.error.reason or "")
                        and rebuild is not None and tries.get(node, 1) <= retries
                        and time.monotonic() < deadline):
                    _log.info("retrying site %d after a transient error (attempt %d)", node,
                              tries.get(node, 1) + 1)
                    again = rebuild([node])
                    log.bytes_down += messages_nbytes(again)
                    push(again)
                    continue
                log.replies += 1
                if r.has_error():
                    log.errors[str(node)] = r.error.reason or "error reply"
                else:
                    log.ok += 1
                    log.bytes_up += message_nbytes(r)
                log.seconds += time.perf_counter() - t0
                yield r
                del r
                gc.collect(1)  # Flower's self-referencing record views of a used reply
                t0 = time.perf_counter()
            if gate.pending and time.monotonic() >= deadline:
                break
        for node in gate.pending.values():
            log.errors.setdefault(str(node), f"no reply within {timeout:.0f} s")
    finally:
        log.seconds += time.perf_counter() - t0


def options_dict(model: BaseModel | None) -> dict[str, Any]:
    """A validated options model as a plain dict ({} for None)."""
    return model.model_dump() if model is not None else {}
