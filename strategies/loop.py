"""fedagg's round loop over any Flower Message-API strategy: one round, end to end.

A round is Flower's own protocol, ``configure_train`` -> send the messages, receive the
replies -> ``aggregate_train`` (as ``Strategy.start()`` runs it). :func:`run_train_round` runs
exactly that and *adds*: the replies are handed over as they arrive
(:func:`strategies.base.stream_exchange`, a generator: a streaming strategy holds one reply at a
time), whether a reply counts is the :class:`strategies.base.ReplyGate`'s decision, transient
error replies are retried within the deadline when the strategy allows it, a compressed
strategy below a Flower wrapper that reads models from replies gets its replies decoded at the
edge, and the round's :class:`~strategies.update.RoundReport` (bytes, seconds, refusals) is the
exchange's merged with the strategy's own. ``fedagg simulate``'s synchronous rounds, the
ServerApp and the benchmarks run rounds through it; the asynchronous loop
(:mod:`server.asynchronous`) uses the same gate, codecs and carrier per dispatch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from strategies.base import ExchangeLog, FedaggStrategy, RoundResult, exchange, stream_exchange
from strategies.compressed import Compressed
from strategies.update import RoundReport
from strategies.wrapper import wrapped

__all__ = ["edge_codec", "run_evaluate_round", "run_train_round"]


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
    Replies are filtered by the :class:`ReplyGate`; transient error replies are retried within
    the deadline when ``retries > 0`` and the strategy allows it (``allows_retries``; secure
    aggregation does not: a message must not be answered twice). The round's report is the
    exchange's merged with the strategy's own (:attr:`FedaggStrategy.report`).
    """
    t0 = time.perf_counter()
    messages = list(strategy.configure_train(server_round, arrays, config, grid))
    by_node = {m.metadata.dst_node_id: m for m in messages}

    def rebuild(nodes: list[int]) -> list[Message]:
        return [Message(content=by_node[n].content, dst_node_id=n,
                        message_type=by_node[n].metadata.message_type) for n in nodes]

    t1 = time.perf_counter()
    allowed = not (isinstance(strategy, FedaggStrategy) and not strategy.allows_retries)
    ex = ExchangeLog()
    replies = stream_exchange(grid, messages, timeout, retries=retries if allowed else 0,
                              rebuild=rebuild, log=ex)
    aggregate = (strategy.aggregate_stream if isinstance(strategy, FedaggStrategy)
                 else strategy.aggregate_train)
    edge = edge_codec(strategy)
    stream: Iterable[Message] = (replies if edge is None
                                 else edge.edge_decoded(server_round, replies))
    try:  # the strategy takes the replies as they arrive (a generator, never listed here)
        new_arrays, metrics = aggregate(server_round, stream)
    finally:  # what it did not take (it stopped early, or raised) is received and dropped,
        for _ in replies:  # so no reply of this round is left behind on the Grid
            pass
    t3 = time.perf_counter()
    report = RoundReport(sampled=len(messages))
    if isinstance(strategy, FedaggStrategy):
        report.merge(strategy.report)
    if edge is not None:
        report.merge(edge.report)
    ex.into(report)
    report.replies = ex.ok
    report.sampled = max(report.sampled, len(messages))
    report.add_time("configure", t1 - t0)
    report.add_time("exchange", ex.seconds)
    report.add_time("aggregate", max(t3 - t1 - ex.seconds, 0.0))
    return RoundResult(arrays=new_arrays, metrics=metrics, report=report)


def edge_codec(strategy: Strategy) -> Any:
    """The compressed strategy whose replies fedagg's loop must decode before ``strategy``
    sees them: one below a Flower wrapper that reads models from the replies (server-side DP
    clipping). None when the outermost compressing strategy is fedagg's own (it decodes)."""
    below = wrapped(strategy) if not isinstance(strategy, FedaggStrategy) else None
    while below is not None:
        if isinstance(below, Compressed) and not below.spec.dense:
            return below
        if isinstance(below, FedaggStrategy):
            return None
        below = wrapped(below)
    return None


def run_evaluate_round(strategy: Strategy, grid: Grid, server_round: int, arrays: ArrayRecord,
                       config: ConfigRecord, timeout: float, *,
                       report: RoundReport | None = None) -> MetricRecord | None:
    """Federated evaluation: configure_evaluate -> send_and_receive -> aggregate_evaluate.

    ``report``, when given, gets what the exchange saw and what the strategy noted
    (:attr:`FedaggStrategy.eval_report`: refused replies, capped weights, dropped metrics).
    """
    messages = list(strategy.configure_evaluate(server_round, arrays, config, grid))
    if not messages:
        return None
    seen = RoundReport()
    try:
        return strategy.aggregate_evaluate(server_round,
                                           exchange(grid, messages, timeout, report=seen))
    finally:
        if report is not None:
            if isinstance(strategy, FedaggStrategy):
                report.merge(strategy.eval_report)
            report.merge(seen)

