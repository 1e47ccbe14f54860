"""fedagg's round driver over any Flower Message-API strategy, and what it records.

A round is Flower's own protocol, ``configure_train`` -> ``grid.send_and_receive`` ->
``aggregate_train`` (as ``Strategy.start()`` runs it). fedagg's server loop
(:func:`run_train_round`) runs exactly that and *adds*: replies are filtered (stale, foreign
or duplicate replies refused), transient error replies are retried within the deadline when
the strategy allows it, and bytes, seconds and rejections are recorded. Wrappers that need
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

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from pydantic import BaseModel

from strategies.wire import message_nbytes

__all__ = [
    "FedaggStrategy",
    "RoundLog",
    "RoundResult",
    "exchange",
    "filter_replies",
    "run_evaluate_round",
    "run_train_round",
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

    Returns ``(replies, refused, bytes_down, attempts)``. A node whose reply is an error that
    looks transient is sent its message again (rebuilt by ``rebuild``) while time and
    ``retries`` allow; permanent errors (configuration, data, protocol) are not retried.
    """
    deadline = time.monotonic() + timeout
    bytes_down = sum(message_nbytes(m) for m in messages)
    pending = list(messages)
    final: dict[int, Message] = {}
    refused: dict[str, str] = {}
    attempts = 0
    while pending:
        attempts += 1
        left = max(deadline - time.monotonic(), 0.001)
        got, bad = filter_replies(pending, grid.send_and_receive(pending, timeout=left))
        refused.update(bad)
        for r in got:
            final[r.metadata.src_node_id] = r
        retry_nodes = [
            r.metadata.src_node_id
            for r in got
            if r.has_error() and not _is_permanent(r.error.reason or "")
        ]
        if not retry_nodes or attempts > retries or rebuild is None or time.monotonic() >= deadline:
            break
        _log.info("retrying %d site(s) after transient errors (attempt %d)", len(retry_nodes),
                  attempts + 1)
        pending = rebuild(retry_nodes)
        bytes_down += sum(message_nbytes(m) for m in pending)
    return list(final.values()), refused, bytes_down, attempts


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
    """configure_train -> send_and_receive -> aggregate_train, measuring bytes and seconds.

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
    replies, refused, bytes_down, attempts = (
        exchange(grid, messages, timeout, retries=retries if allowed else 0, rebuild=rebuild)
        if messages else ([], {}, 0, 0))
    t2 = time.perf_counter()
    ok = [r for r in replies if not r.has_error()]
    errors = {str(r.metadata.src_node_id): r.error.reason or "error reply"
              for r in replies if r.has_error()}
    answered = {r.metadata.src_node_id for r in replies}
    for node in by_node:
        if node not in answered:
            errors.setdefault(str(node), f"no reply within {timeout:.0f} s")
    bytes_up = sum(message_nbytes(r) for r in ok)
    new_arrays, metrics = strategy.aggregate_train(server_round, replies)
    t3 = time.perf_counter()
    rejected = {**refused, **dict(getattr(strategy, "last_rejected", {}) or {})}
    seconds = {"configure": t1 - t0, "exchange": t2 - t1, "aggregate": t3 - t2}
    result = RoundResult(
        arrays=new_arrays, metrics=metrics, bytes_down=bytes_down, bytes_up=bytes_up,
        exchanges=max(attempts, 1), sampled=len(messages), replies=len(ok),
        failures=len(messages) - len(ok), rejected=rejected, seconds=seconds, errors=errors)
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
