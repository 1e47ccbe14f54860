"""fedagg's round driver over any Flower Message-API strategy, and what it records.

A round is Flower's own protocol, ``configure_train`` -> send the messages, receive the
replies -> ``aggregate_train`` (as ``Strategy.start()`` runs it). fedagg's server loop
(:func:`run_train_round`) runs exactly that and *adds*: the replies are handed to
``aggregate_train`` as they arrive (:func:`stream_exchange`: ``Grid.push_messages`` /
``pull_messages``, a generator, so a streaming strategy holds one reply at a time instead of
all of them), replies are filtered (stale, foreign or duplicate replies refused), transient
error replies are retried within the deadline when the strategy allows it, and bytes,
seconds and rejections are recorded. Wrappers that need
more exchanges (secure aggregation's key setup and unmasking) run them inside
``configure_train`` / ``aggregate_train`` with the Grid they were given, so they work under
``Strategy.start()`` too, and report those exchanges in :attr:`RoundLog` (``round_log``).

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

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from pydantic import BaseModel

from strategies.wire import message_nbytes, messages_nbytes

__all__ = [
    "FedaggStrategy",
    "RoundLog",
    "RoundResult",
    "exchange",
    "filter_replies",
    "run_evaluate_round",
    "run_train_round",
    "stream_exchange",
]

_log = logging.getLogger(__name__)


@dataclass
class RoundResult:
    """Outcome of one training round as the server loop records it."""

    arrays: ArrayRecord | None
    metrics: MetricRecord | None
    bytes_down: int = 0
    bytes_up: int = 0
    exchanges: int = 1
    sampled: int = 0
    replies: int = 0
    failures: int = 0
    rejected: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    aborted: str = ""
    """Why the strategy aborted the round ('' when it did not)."""


@dataclass
class RoundLog:
    """What a wrapper did inside ``configure_train`` / ``aggregate_train`` of one round.

    Attributes
    ----------
    bytes_down, bytes_up : int
        Bytes of its own exchanges (not the train messages / replies, which the driver counts).
    exchanges : int
        Its own exchanges.
    rejected : dict
        Node id -> reason, for replies it refused.
    failed : dict
        Node id -> reason, for sites that dropped.
    seconds : dict
        Phase -> seconds.
    up : dict
        Phase -> bytes up of its own exchanges.
    aborted : str
        Why the round was aborted ('' when it was not).
    """

    bytes_down: int = 0
    bytes_up: int = 0
    exchanges: int = 0
    rejected: dict[str, str] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    up: dict[str, int] = field(default_factory=dict)
    aborted: str = ""

    def tick(self, phase: str, t0: float) -> float:
        """Add the time since ``t0`` to ``phase``; returns now."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - t0
        return now


class FedaggStrategy(Strategy):
    """Mixin-style base for fedagg strategies; plain Flower strategies work too.

    Class attributes
    ----------------
    Config : type[pydantic.BaseModel] or None
        Model that validates ``strategy.options`` of the run config.
    aggregates_linearly : bool
        Whether the aggregate is a weighted mean of the updates (secure aggregation can wrap
        it: the masked sum is all it needs).
    """

    Config: ClassVar[type[BaseModel] | None] = None
    aggregates_linearly: ClassVar[bool] = False


def _is_permanent(reason: str) -> bool:
    """Errors a retry cannot fix: bad configuration or data at the site."""
    return any(tag in reason for tag in _PERMANENT)


_PERMANENT = ("ConfigError", "DataError", "ValidationError", "ProtocolError")


def filter_replies(
    sent: list[Message], replies: Iterable[Message]
) -> tuple[list[Message], dict[str, str]]:
    """Keep replies to the messages sent in this exchange; stale or foreign ones are refused.

    Flower only returns replies to the message ids we pull, so a reply that arrives after its
    round's deadline is never handed to a later round; this check makes that a guarantee of
    fedagg's own (replayed, duplicated or foreign replies are refused with a reason).
    """
    expected = {
        m.metadata.message_id: m.metadata.dst_node_id for m in sent if m.metadata.message_id
    }
    kept: list[Message] = []
    refused: dict[str, str] = {}
    seen: set[str] = set()
    for r in replies:
        rid = r.metadata.reply_to_message_id
        node = str(r.metadata.src_node_id)
        if expected and rid not in expected:
            refused[node] = (
                f"node {node}: reply to an unknown or earlier message {rid!r} (stale or foreign)"
            )
        elif rid in seen:
            refused[node] = f"node {node}: duplicate reply to message {rid!r}"
        elif expected and expected[rid] != r.metadata.src_node_id:
            refused[node] = f"node {node}: replied to a message addressed to node {expected[rid]}"
        else:
            seen.add(rid)
            kept.append(r)
    for why in refused.values():
        _log.warning("refused reply: %s", why)
    return kept, refused


def exchange(
    grid: Grid,
    messages: list[Message],
    timeout: float,
    *,
    retries: int = 0,
    rebuild: Callable[[list[int]], list[Message]] | None = None,
) -> tuple[list[Message], dict[str, str], int, int]:
    """Send ``messages``, collect replies until the deadline, retry transient errors.

    Returns ``(replies, refused, bytes_down, attempts)``: :func:`stream_exchange` collected
    into a list (for exchanges whose replies are small: secure aggregation's key setup and
    unmasking, evaluation). A node whose reply is an error that looks transient is sent its
    message again (rebuilt by ``rebuild``) while time and ``retries`` allow; permanent errors
    (configuration, data, protocol) are not retried.
    """
    log = ExchangeLog()
    replies = list(stream_exchange(grid, messages, timeout, retries=retries, rebuild=rebuild,
                                   log=log))
    return replies, dict(log.refused), log.bytes_down, log.attempts


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


def stream_exchange(grid: Grid, messages: list[Message], timeout: float, *, retries: int = 0,
                    rebuild: Callable[[list[int]], list[Message]] | None = None,
                    log: ExchangeLog | None = None, poll: float = 0.05) -> Iterator[Message]:
    """Send ``messages`` and yield each reply as it arrives, until all came or the deadline.

    The streaming form of :func:`exchange` (``Grid.push_messages`` then ``pull_messages`` of
    the pending ids, as ``send_and_receive`` does, but handing each reply over at once and
    keeping none): the same filtering (a reply to an unknown or earlier message, a second
    reply to a message, a reply from another node than the one addressed are refused, named
    in ``log.refused``) and the same retries (a transient error reply is not handed over
    while ``retries`` and time allow: its node is sent its message again, rebuilt by
    ``rebuild``; permanent errors are handed over). Nodes still silent at the deadline are
    named in ``log.errors``.
    """
    log = log if log is not None else ExchangeLog()
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    log.bytes_down += messages_nbytes(messages)
    pending: dict[str, int] = {}  # message id -> node it was sent to
    tries: dict[int, int] = {}
    answered: set[str] = set()

    def push(batch: list[Message]) -> None:
        ids = [str(i) for i in grid.push_messages(batch)]
        for i, m in enumerate(batch):  # the Grid set each message's id (replies refer to it)
            mid = m.metadata.message_id or (ids[i] if i < len(ids) else f"unsent-{i}")
            pending[str(mid)] = m.metadata.dst_node_id
            tries[m.metadata.dst_node_id] = tries.get(m.metadata.dst_node_id, 0) + 1
        log.attempts = max(tries.values(), default=0)

    if messages:
        push(list(messages))
    # a Grid that computes every reply inside push_messages (server.inprocess) says so: a
    # pull that finds nothing then means the remaining nodes never answer
    ready = bool(getattr(getattr(type(grid), "push_messages", None), "replies_ready", False))
    try:
        while pending:
            arrived = list(grid.pull_messages(list(pending)))
            if not arrived:
                if ready or time.monotonic() >= deadline:
                    break
                time.sleep(poll)
                continue
            arrived.reverse()
            while arrived:
                r = arrived.pop()  # the list never holds a reply that was handed over
                rid = r.metadata.reply_to_message_id
                node = r.metadata.src_node_id
                if rid in answered:
                    log.refused[str(node)] = f"node {node}: duplicate reply to message {rid!r}"
                elif rid not in pending:
                    log.refused[str(node)] = (f"node {node}: reply to an unknown or earlier "
                                              f"message {rid!r} (stale or foreign)")
                elif pending[rid] != node:
                    log.refused[str(node)] = (f"node {node}: replied to a message addressed "
                                              f"to node {pending[rid]}")
                else:
                    del pending[rid]
                    answered.add(rid)
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
                    continue
                _log.warning("refused reply: %s", log.refused[str(node)])
            if pending and time.monotonic() >= deadline:
                break
        for node in pending.values():
            log.errors.setdefault(str(node), f"no reply within {timeout:.0f} s")
    finally:
        log.seconds += time.perf_counter() - t0


def round_log(strategy: Strategy) -> RoundLog | None:
    """The wrapper's :class:`RoundLog` of the round just run, if it keeps one."""
    log = getattr(strategy, "round_log", None)
    return log if isinstance(log, RoundLog) else None


def run_train_round(
    strategy: Strategy,
    grid: Grid,
    server_round: int,
    arrays: ArrayRecord,
    config: ConfigRecord,
    timeout: float,
    *,
    retries: int = 0,
) -> RoundResult:
    """configure_train -> send, stream the replies -> aggregate_train, measuring bytes and seconds.

    ``aggregate_train`` gets the replies as they arrive (:func:`stream_exchange`); its
    ``"exchange"`` seconds are the time spent waiting for them, ``"aggregate"`` the rest.
    Replies are filtered (stale / foreign / duplicate replies refused); transient error replies
    are retried within the deadline when ``retries > 0`` and the strategy allows it
    (``allows_retries``; secure aggregation does not: a message must not be answered twice).
    """
    t0 = time.perf_counter()
    messages = list(strategy.configure_train(server_round, arrays, config, grid))
    by_node = {m.metadata.dst_node_id: m for m in messages}

    def rebuild(nodes: list[int]) -> list[Message]:
        return [Message(content=by_node[n].content, dst_node_id=n,
                        message_type=by_node[n].metadata.message_type) for n in nodes]

    t1 = time.perf_counter()
    allowed = bool(getattr(strategy, "allows_retries", True))
    ex = ExchangeLog()
    replies = stream_exchange(grid, messages, timeout, retries=retries if allowed else 0,
                              rebuild=rebuild, log=ex)
    try:  # the strategy takes the replies as they arrive (a generator, never listed here)
        new_arrays, metrics = strategy.aggregate_train(server_round, replies)
    finally:  # what it did not take (it stopped early, or raised) is received and dropped,
        for _ in replies:  # so no reply of this round is left behind on the Grid
            pass
    t3 = time.perf_counter()
    rejected = {**ex.refused, **dict(getattr(strategy, "last_rejected", {}) or {})}
    ok = ex.ok
    seconds = {"configure": t1 - t0, "exchange": ex.seconds,
               "aggregate": max(t3 - t1 - ex.seconds, 0.0)}
    result = RoundResult(
        arrays=new_arrays, metrics=metrics, bytes_down=ex.bytes_down, bytes_up=ex.bytes_up,
        exchanges=max(ex.attempts, 1), sampled=len(messages), replies=ok,
        failures=len(messages) - ok, rejected=rejected, seconds=seconds, errors=dict(ex.errors))
    log = round_log(strategy)
    if log is not None:
        result.bytes_down += log.bytes_down
        result.bytes_up += log.bytes_up
        result.exchanges += log.exchanges
        for who, why in log.rejected.items():
            result.rejected.setdefault(who, why)
        for failed_node, reason in log.failed.items():
            result.errors.setdefault(str(failed_node), reason)
        for phase, sec in log.seconds.items():
            result.seconds[phase] = result.seconds.get(phase, 0.0) + sec
        result.failures = max(result.failures, len(log.failed))
        result.aborted = log.aborted
    return result


def run_evaluate_round(strategy: Strategy, grid: Grid, server_round: int, arrays: ArrayRecord,
                       config: ConfigRecord, timeout: float) -> MetricRecord | None:
    """Federated evaluation: configure_evaluate -> send_and_receive -> aggregate_evaluate."""
    messages = list(strategy.configure_evaluate(server_round, arrays, config, grid))
    if not messages:
        return None
    replies, _, _, _ = exchange(grid, messages, timeout)
    return strategy.aggregate_evaluate(server_round, replies)


def options_dict(model: BaseModel | None) -> dict[str, Any]:
    """A validated options model as a plain dict ({} for None)."""
    return model.model_dump() if model is not None else {}
