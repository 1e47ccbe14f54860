"""What fedagg's server loop expects of a strategy, and the default round driver.

Any Flower Message-API strategy (``flwr.serverapp.strategy.Strategy``) works with fedagg's
server: a round is ``configure_train`` -> ``grid.send_and_receive`` -> ``aggregate_train``.
A strategy that needs more than one exchange per round (secure aggregation) implements
:meth:`FedaggStrategy.train_round` and drives the exchanges itself.

Plugins subclass a Flower strategy (or :class:`FedaggStrategy`), optionally declare a pydantic
``Config`` model for their options and a ``from_config(options, run_config)`` classmethod, and
are registered by name (see :mod:`strategies.registry` and docs/plugins.md).
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

from strategies._records import message_nbytes

__all__ = ["FedaggStrategy", "RoundResult", "run_train_round"]

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


class FedaggStrategy(Strategy):
    """Mixin-style base for fedagg strategies; plain Flower strategies work too.

    Class attributes
    ----------------
    Config : type[pydantic.BaseModel] or None
        Model that validates ``strategy.options`` of the run config.
    """

    Config: ClassVar[type[BaseModel] | None] = None

    def train_round(
        self,
        grid: Grid,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        timeout: float,
    ) -> RoundResult:
        """Run one training round: by default a single configure / send / aggregate exchange."""
        return default_train_round(self, grid, server_round, arrays, config, timeout)


def _is_permanent(reason: str) -> bool:
    """Errors a retry cannot fix: bad configuration or data at the site."""
    return any(tag in reason for tag in _PERMANENT)


_PERMANENT = ("ConfigError", "DataError", "ValidationError")


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
    strategy: Strategy,
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
    ``retries`` allow; permanent errors (configuration, data) are not retried.
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
        _log.info(
            "retrying %d site(s) after transient errors (attempt %d)",
            len(retry_nodes),
            attempts + 1,
        )
        pending = rebuild(retry_nodes)
        bytes_down += sum(message_nbytes(m) for m in pending)
    return list(final.values()), refused, bytes_down, attempts


def default_train_round(
    strategy: Strategy,
    grid: Grid,
    server_round: int,
    arrays: ArrayRecord,
    config: ConfigRecord,
    timeout: float,
) -> RoundResult:
    """configure_train -> send_and_receive -> aggregate_train, measuring bytes and seconds.

    Replies are filtered (stale / foreign / duplicate replies refused), transient error replies
    are retried within the deadline when the strategy has ``retries > 0``.
    """
    t0 = time.perf_counter()
    messages = list(strategy.configure_train(server_round, arrays, config, grid))
    by_node = {m.metadata.dst_node_id: m for m in messages}

    def rebuild(nodes: list[int]) -> list[Message]:
        return [
            Message(
                content=by_node[n].content,
                dst_node_id=n,
                message_type=by_node[n].metadata.message_type,
            )
            for n in nodes
        ]

    t1 = time.perf_counter()
    retries = int(getattr(strategy, "retries", 0) or 0)
    replies, refused, bytes_down, attempts = (
        exchange(strategy, grid, messages, timeout, retries=retries, rebuild=rebuild)
        if messages
        else ([], {}, 0, 0)
    )
    t2 = time.perf_counter()
    ok = [r for r in replies if not r.has_error()]
    bytes_up = sum(message_nbytes(r) for r in ok)
    new_arrays, metrics = strategy.aggregate_train(server_round, replies)
    t3 = time.perf_counter()
    rejected = {**refused, **dict(getattr(strategy, "last_rejected", {}) or {})}
    return RoundResult(
        arrays=new_arrays,
        metrics=metrics,
        bytes_down=bytes_down,
        bytes_up=bytes_up,
        exchanges=max(attempts, 1),
        sampled=len(messages),
        replies=len(ok),
        failures=len(messages) - len(ok),
        rejected=rejected,
        seconds={"configure": t1 - t0, "exchange": t2 - t1, "aggregate": t3 - t2},
    )


def run_train_round(
    strategy: Strategy,
    grid: Grid,
    server_round: int,
    arrays: ArrayRecord,
    config: ConfigRecord,
    timeout: float,
) -> RoundResult:
    """Dispatch to ``strategy.train_round`` when it has one, else the default driver."""
    driver = getattr(strategy, "train_round", None)
    if callable(driver):
        result: RoundResult = driver(grid, server_round, arrays, config, timeout)
        return result
    return default_train_round(strategy, grid, server_round, arrays, config, timeout)


def error_replies(replies: Iterable[Message]) -> list[tuple[int, str]]:
    """(node id, reason) for every reply that carries an error."""
    return [(r.metadata.src_node_id, r.error.reason or "") for r in replies if r.has_error()]


def options_dict(model: BaseModel | None) -> dict[str, Any]:
    """A validated options model as a plain dict ({} for None)."""
    return model.model_dump() if model is not None else {}
