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
from collections.abc import Iterable
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

    def train_round(self, grid: Grid, server_round: int, arrays: ArrayRecord,
                    config: ConfigRecord, timeout: float) -> RoundResult:
        """Run one training round: by default a single configure / send / aggregate exchange."""
        return default_train_round(self, grid, server_round, arrays, config, timeout)


def default_train_round(strategy: Strategy, grid: Grid, server_round: int, arrays: ArrayRecord,
                        config: ConfigRecord, timeout: float) -> RoundResult:
    """configure_train -> send_and_receive -> aggregate_train, measuring bytes and seconds."""
    t0 = time.perf_counter()
    messages = list(strategy.configure_train(server_round, arrays, config, grid))
    bytes_down = sum(message_nbytes(m) for m in messages)
    t1 = time.perf_counter()
    replies = list(grid.send_and_receive(messages, timeout=timeout)) if messages else []
    t2 = time.perf_counter()
    ok = [r for r in replies if not r.has_error()]
    bytes_up = sum(message_nbytes(r) for r in ok)
    new_arrays, metrics = strategy.aggregate_train(server_round, replies)
    t3 = time.perf_counter()
    rejected = dict(getattr(strategy, "last_rejected", {}) or {})
    return RoundResult(
        arrays=new_arrays, metrics=metrics, bytes_down=bytes_down, bytes_up=bytes_up, exchanges=1,
        sampled=len(messages), replies=len(ok), failures=len(replies) - len(ok) + (len(messages) - len(replies)),
        rejected=rejected, seconds={"configure": t1 - t0, "exchange": t2 - t1, "aggregate": t3 - t2},
    )


def run_train_round(strategy: Strategy, grid: Grid, server_round: int, arrays: ArrayRecord,
                    config: ConfigRecord, timeout: float) -> RoundResult:
    """Dispatch to ``strategy.train_round`` when it has one, else the default driver."""
    driver = getattr(strategy, "train_round", None)
    if callable(driver):
        result: RoundResult = driver(grid, server_round, arrays, config, timeout)
        return result
    return default_train_round(strategy, grid, server_round, arrays, config, timeout)


def error_replies(replies: Iterable[Message]) -> list[tuple[int, str]]:
    """(node id, reason) for every reply that carries an error."""
    return [(r.metadata.src_node_id, r.error.reason) for r in replies if r.has_error()]


def options_dict(model: BaseModel | None) -> dict[str, Any]:
    """A validated options model as a plain dict ({} for None)."""
    return model.model_dump() if model is not None else {}
