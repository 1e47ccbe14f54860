"""What one asynchronous dispatch sends and how its reply is checked, with the run's strategies.

The asynchronous loop (:mod:`server.asynchronous`) never builds or decodes an update itself.
For every dispatch it asks the run's own strategy classes, configured for that one dispatch:

* plain updates: fedagg's :class:`~strategies.fedavg.FedAvg` builds the train message
  (``configure_train`` on a :class:`NodeView` listing only the dispatched node) and checks
  the reply with its per-reply guards (:meth:`~strategies.fedavg.FedAvg.accept`, i.e.
  :func:`~strategies.fedavg.validate_reply`: layout, weight, round echo, shapes, dtypes,
  finite values, norm bound); the delta is the checked model minus the model sent;
* compressed updates: :class:`~strategies.compressed.Compressed` around it sends the upload
  instruction of that dispatch's ``server-round`` and decodes the reply
  (:meth:`~strategies.compressed.Compressed.decode_reply`: codec, shapes, public support,
  finite values, norm bound); error-feedback residuals stay at the site across versions;
* secure cohorts: :class:`~strategies.secure.SecureAggregation` around a :class:`CohortSink`
  runs the whole SecAgg+ protocol of one cohort (key setup when dispatched, masked uploads,
  unmasking with Shamir shares for dropped or late sites); the sink keeps the unmasked mean
  delta instead of applying it, and the buffer applies it.

Each dispatch gets a fresh strategy object, so no state of one dispatch leaks into another,
and an update is always decoded against the model and the round it was trained for.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore.run import Run

from fedagg.config import RunConfig
from fedagg.errors import ConfigError, explain
from fedagg.update import UploadSpec
from strategies.compressed import Compressed
from strategies.fedavg import FedAvg
from strategies.registry import build_strategy
from strategies.secure import SecureAggregation
from strategies.secure_privacy import DistributedPrivacy
from strategies.update import Update

__all__ = ["CohortSink", "NodeView", "check_asynchronous", "cohort_strategy", "connected_nodes",
           "decode_update", "fedavg_of", "job_strategy"]


class NodeView(Grid):
    """A Grid that lists only ``nodes`` and passes everything else to ``grid``."""

    def __init__(self, grid: Grid, nodes: Sequence[int]) -> None:
        self.grid = grid
        self.nodes = [int(n) for n in nodes]

    def set_run(self, run: Run) -> None:
        """Set the run of the underlying grid."""
        self.grid.set_run(run)

    @property
    def run(self) -> Run:
        """The underlying grid's run."""
        return self.grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        """A new message (as the underlying grid makes it)."""
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        """Only the viewed nodes."""
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Push through the underlying grid."""
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Pull through the underlying grid."""
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Send and receive through the underlying grid."""
        return self.grid.send_and_receive(messages, timeout=timeout)


def connected_nodes(grid: Grid) -> list[int]:
    """The ids of the nodes connected to ``grid`` now, sorted."""
    return sorted(int(n) for n in grid.get_node_ids())


def _take_all(strategy: FedAvg) -> None:
    """Make fedagg's FedAvg sample exactly the nodes of the view it is given, without waiting."""
    strategy.fraction_train = 1.0
    strategy.min_train_nodes = 1
    strategy.min_available_nodes = 1
    strategy.wait_timeout = 0.0


def fedavg_of(strategy: Strategy) -> FedAvg | None:
    """The fedagg FedAvg inside ``strategy`` (itself, or the inner strategy of Compressed /
    SecureAggregation); None for any other strategy."""
    inner = (strategy.aggregator if isinstance(strategy, SecureAggregation)
             else strategy.inner if isinstance(strategy, Compressed) else strategy)
    return inner if type(inner) is FedAvg else None


def check_asynchronous(cfg: RunConfig) -> None:
    """Refuse the combinations the asynchronous loop cannot run, naming the fix.

    Raises
    ------
    ConfigError
        A strategy other than fedagg's FedAvg (the buffer applies the updates itself, with
        ``strategy.server_optimizer``), a compression mode whose public state spans rounds
        (``topk-aggregate`` supports, ``sketch``, ``vote``), deadline rounds under secure
        aggregation, or a secure cohort that cannot be formed.
    """
    a = cfg.asynchronous
    if a.mode == "off":
        return
    strategy = build_strategy(cfg)
    if fedavg_of(strategy) is None:
        raise ConfigError(explain(
            "strategy.name", cfg.strategy.name,
            f"asynchronous.mode = {a.mode!r} folds site updates into its own buffer and applies "
            "it with strategy.server_optimizer; it runs fedagg's FedAvg (plain, compressed or "
            "secure), not a strategy with its own aggregate",
            "use strategy.name = 'fedavg' (server optimizer: strategy.server_optimizer, "
            "strategy.server_lr), or asynchronous.mode = 'off'"))
    secure = isinstance(strategy, SecureAggregation)
    spec = strategy.spec if isinstance(strategy, Compressed | SecureAggregation) else None
    if spec is not None and (spec.needs_previous or getattr(spec, "sketch", False)
                             or getattr(spec, "votes", False)):
        raise ConfigError(explain(
            "compression.up", cfg.compression.up,
            "its public state spans consecutive rounds (topk-aggregate supports, FetchSGD "
            "sketch tables, vote sums), but asynchronous sites train from different versions",
            "use a per-dispatch mode: topk / randk with error feedback (reveal-indices), "
            "a 'random' or 'block' public support, or quantization"))
    if secure and a.mode == "deadline":
        raise ConfigError(explain(
            "asynchronous.mode", a.mode,
            "under secure aggregation a late masked upload cannot be unmasked once its cohort "
            "closed, so it cannot be folded into a later round",
            "use asynchronous.mode = 'fedbuff' (cohorts keyed when dispatched) or synchronous "
            "secure rounds (asynchronous.mode = 'off')"))
    if secure and a.weighting != "examples":
        raise ConfigError(explain(
            "asynchronous.weighting", a.weighting,
            "a secure cohort reveals only its example-weighted sum",
            "use asynchronous.weighting = 'examples' under secure aggregation"))
    if secure:
        concurrency = concurrency_of(cfg)
        if a.buffer_size < 2 or a.buffer_size > concurrency:
            raise ConfigError(explain(
                "asynchronous.buffer_size", a.buffer_size,
                f"is the cohort size under secure aggregation: must be in [2, concurrency = "
                f"{concurrency}]", "raise asynchronous.concurrency or lower "
                "asynchronous.buffer_size"))
        from strategies.secure_params import resolve_params

        params = resolve_params(cfg.secagg, a.buffer_size)
        k = params.neighbours_for(a.buffer_size)
        quorum = max(math.ceil(a.cohort_quorum * a.buffer_size - 1e-9), 1)
        if a.buffer_size - quorum > k - params.threshold:
            raise ConfigError(explain(
                "asynchronous.cohort_quorum", a.cohort_quorum,
                f"lets {a.buffer_size - quorum} of a cohort's {a.buffer_size} sites drop, but "
                f"with k = {k} neighbours and threshold t = {params.threshold} at most "
                f"{k - params.threshold} may", "raise asynchronous.cohort_quorum or lower "
                "secagg.threshold"))


def concurrency_of(cfg: RunConfig) -> int:
    """FedBuff's C: ``asynchronous.concurrency``, else ``run.sites x run.fraction_train``."""
    c = cfg.asynchronous.concurrency
    if c is None:
        c = max(round(cfg.run.sites * cfg.run.fraction_train), 1)
    return min(int(c), cfg.run.sites)


def job_strategy(cfg: RunConfig) -> FedAvg | Compressed:
    """A fresh FedAvg (or Compressed(FedAvg)) for one plaintext dispatch."""
    strategy = build_strategy(cfg)
    inner = fedavg_of(strategy)
    if inner is None or isinstance(strategy, SecureAggregation):
        raise ConfigError(explain("strategy.name", cfg.strategy.name,
                                  "is not a plaintext fedagg FedAvg", "see check_asynchronous"))
    _take_all(inner)
    inner.precompute_grid = False  # it checks one reply; the buffer folds (no grid pass)
    assert isinstance(strategy, FedAvg | Compressed)
    return strategy


def decode_update(strategy: FedAvg | Compressed, reply: Message, server_round: int,
                  sent: Sequence[np.ndarray]) -> tuple[list[np.ndarray], float, dict[str, Any]]:
    """``(delta, weight, metrics)`` of one reply, checked by the dispatch's own strategy.

    Raises
    ------
    UpdateRejected
        With the per-reply guard's reason.
    """
    if isinstance(strategy, Compressed):
        u = strategy.codec.decode(reply)
        return [np.asarray(d, np.float64) for d in u.tensors], float(u.weight), dict(u.metrics)
    u = strategy.codec().decode(reply)
    delta = [np.asarray(a, np.float64) - np.asarray(s, np.float64)
             for a, s in zip(u.tensors, sent, strict=True)]
    return delta, float(u.weight), dict(u.metrics)


class CohortSink(FedAvg):
    """Inner strategy of one secure cohort: keeps the unmasked mean delta, applies nothing.

    :class:`~strategies.secure.SecureAggregation` hands its inner strategy one update, the
    cohort's example-weighted mean delta (``aggregate_updates``); the asynchronous buffer folds
    it with the cohort's staleness weight.
    """

    aggregates_linearly: ClassVar[bool] = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        _take_all(self)
        self.captured: tuple[list[np.ndarray], float, dict[str, Any], int] | None = None

    def aggregate_updates(self, server_round: int, updates: Iterable[Update], *,
                          deltas: bool = True, sites: int | None = None
                          ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Keep ``(mean delta, total weight, metrics, sites)``; the buffer applies it."""
        got = list(updates)
        if len(got) != 1:
            raise ConfigError(explain("secure cohort", len(got), "must hand over one aggregate",
                                      "-"))
        u = got[0]
        self.captured = ([np.asarray(d, np.float64) for d in u.tensors], float(u.weight),
                         dict(u.metrics), int(sites if sites is not None else 1))
        return ArrayRecord(), MetricRecord()


def cohort_strategy(cfg: RunConfig, run_id: bytes, cohort: int, attempt: int,
                    upload_timeout: float, privacy: DistributedPrivacy | None = None
                    ) -> tuple[SecureAggregation, CohortSink]:
    """A fresh SecAgg+ instance for one cohort, with its own run id (fresh keys).

    The cohort's run id is ``SHA-256(run_id, cohort, attempt)[:16]``: bound into every key
    the cohort derives, so no mask of one cohort can cancel in another's sum. ``privacy``:
    the run's distributed DP, shared by every cohort (one ledger counts every unmasked
    cohort sum); its ring is the cohort's.
    """
    sink = CohortSink(seed=cfg.run.seed, max_update_norm=cfg.strategy.max_update_norm,
                      fraction_evaluate=0.0)
    tag = hashlib.sha256(b"fedagg/async-cohort/" + run_id
                         + f"/{cohort}/{attempt}".encode()).digest()[:16]
    c = cfg.compression
    UploadSpec.parse(c.up, support=c.support, down=c.down, secure=True)
    inner: Strategy = sink if c.up == "none" else Compressed(
        sink, up=c.up, support=c.support, seed=cfg.run.seed,
        max_update_norm=cfg.strategy.max_update_norm)
    secagg = cfg.secagg
    if privacy is not None:
        secagg = secagg.model_copy(update={"ring_bits": privacy.config.ring_bits})
    sec = SecureAggregation(inner, secagg=secagg, run_id=tag, run_seed=cfg.run.seed,
                            max_update_norm=cfg.strategy.max_update_norm,
                            upload_timeout=upload_timeout, privacy=privacy)
    return sec, sink


def config_with_round(config: ConfigRecord, server_round: int) -> ConfigRecord:
    """A copy of ``config`` (the strategies write ``server-round`` into the one they get)."""
    out = ConfigRecord(dict(config))
    out["server-round"] = server_round
    return out
