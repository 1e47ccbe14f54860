"""What fedagg's wrapper strategies share: delegation to ``inner``, and updates handed to it.

:class:`Compressed` and :class:`SecureAggregation` take ANY Flower Message-API strategy as
``inner`` (fedagg's FedAvg, a plugin, ``flwr.serverapp.strategy.FedAdam``...), as Flower's own
differential-privacy wrappers do. They change what travels; the inner strategy still samples
the sites (its ``configure_train`` builds the messages, with its own config keys) and decides
the aggregate. Decoded updates reach the inner strategy

* without Flower records, when it has fedagg's ``aggregate_updates`` (fedagg's FedAvg and its
  subclasses);
* otherwise as ordinary train replies (``"arrays"`` = the model the site's update implies,
  ``"metrics"`` with the weight), which is what every Flower strategy understands.

Secure aggregation can only hand over *one* update, the weighted mean of the round, so it
accepts only inner strategies whose aggregate is a weighted mean (:func:`is_linear`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp import strategy as flwr_strategy
from flwr.serverapp.strategy import Strategy

from fedagg.aggregate import UpdateGuards
from fedagg.errors import ConfigError, ProtocolError, explain
from strategies.base import FedaggStrategy, RoundLog
from strategies.checks import guard_updates
from strategies.wire import arrays_to_record

__all__ = ["StrategyWrapper", "inner_aggregate", "is_linear", "model_record_key",
           "streams_updates"]

_log = logging.getLogger(__name__)

_FLOWER_LINEAR = tuple(getattr(flwr_strategy, n) for n in (
    "FedAvg", "FedAvgM", "FedProx", "FedOpt", "FedAdam", "FedYogi", "FedAdagrad")
    if hasattr(flwr_strategy, n))
_FLOWER_PASS_THROUGH = tuple(getattr(flwr_strategy, n) for n in (
    "DifferentialPrivacyClientSideFixedClipping",) if hasattr(flwr_strategy, n))


def is_linear(strategy: Strategy) -> tuple[bool, str]:
    """Whether ``strategy``'s aggregate is a weighted mean of the updates, and why not.

    True for fedagg strategies declaring ``aggregates_linearly``, for Flower's FedAvg,
    FedAvgM, FedProx and the FedOpt family (FedAdam, FedYogi, FedAdagrad) — exactly those
    classes, not subclasses that may override the aggregate (Krum, FedMedian, ... subclass
    FedAvg) — and for Flower's client-side fixed-clipping DP wrapper around a linear one.
    """
    cls = type(strategy)
    flag = getattr(cls, "aggregates_linearly", None)
    if isinstance(flag, bool):
        if not flag:
            return False, f"{cls.__name__} declares aggregates_linearly = False"
        if (_overridden_after(cls, "aggregates_linearly", "aggregate_train")
                or _overridden_after(cls, "aggregates_linearly", "aggregate_updates")):
            return False, (f"{cls.__name__} overrides the aggregation of the class that "
                           "declared aggregates_linearly = True; declare it again if its "
                           "aggregate is still a weighted mean")
        return True, ""
    if type(strategy) in _FLOWER_LINEAR:
        return True, ""
    if type(strategy) in _FLOWER_PASS_THROUGH:
        return is_linear(strategy.strategy)  # type: ignore[attr-defined]
    return False, (f"{type(strategy).__name__} is not known to aggregate by a weighted mean "
                   "(robust aggregators such as Krum, FedMedian or a trimmed mean need every "
                   "site's update, which secure aggregation never reveals)")


def _overridden_after(cls: type, owner_attr: str, attr: str) -> bool:
    """Whether a subclass below the class defining ``owner_attr`` redefines ``attr``.

    A plugin that subclasses fedagg's FedAvg and overrides ``aggregate_train`` (a trimmed
    mean) must get replies, not the inherited weighted-mean shortcut.
    """
    mro = cls.__mro__
    owner = next((c for c in mro if owner_attr in vars(c)), None)
    if owner is None:
        return False
    return any(attr in vars(c) for c in mro[:mro.index(owner)])


def model_record_key(content: RecordDict, preferred: str = "arrays") -> str:
    """The key of the model's ArrayRecord in a train message built by the inner strategy."""
    recs = list(content.array_records)
    if preferred in recs:
        return preferred
    if len(recs) != 1:
        raise ProtocolError(explain("inner strategy's train message", sorted(recs),
                                    "must hold the global model in one ArrayRecord",
                                    "wrap a strategy that sends one ArrayRecord"))
    return recs[0]


def as_reply(reply: Message, content: RecordDict) -> Message:
    """A reply with ``reply``'s metadata (sender, message ids) and new content."""
    out: Message = Message(content=content, metadata=reply.metadata)  # type: ignore[call-overload]
    return out


def streams_updates(inner: Strategy) -> bool:
    """Whether ``inner`` takes decoded updates directly (fedagg's ``aggregate_updates``, not
    overridden by a subclass's ``aggregate_train``): they can then be streamed to it, sparse
    tensors as they are (:class:`fedagg.accumulate.Sparse`)."""
    direct = getattr(inner, "aggregate_updates", None)
    return callable(direct) and not _overridden_after(type(inner), "aggregate_updates",
                                                      "aggregate_train")


def inner_aggregate(inner: Strategy, server_round: int,
                    updates: Iterable[tuple[list[np.ndarray], float, dict[str, Any], Message]],
                    keys: list[str], current: list[np.ndarray], *, sites: int | None = None,
                    guards: UpdateGuards | None = None, rejected: dict[str, str] | None = None
                    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """Hand checked deltas to ``inner``: directly, or as the train replies they imply.

    ``updates`` holds ``(delta, weight, metrics, original reply)``; an iterator is streamed to
    a direct ``inner`` (:func:`streams_updates`) one update at a time, never listed; ``current`` is the global
    model the deltas are taken against (full precision). fedagg's FedAvg applies its own
    round-level guards (and says what they refused, added to ``rejected``); for any other
    strategy ``guards`` (default: the defaults of :class:`fedagg.aggregate.UpdateGuards`) run
    here, before the replies are built: norm bombs are refused and weights capped.
    """
    out_rejected = rejected if rejected is not None else {}
    if streams_updates(inner):
        if isinstance(getattr(inner, "last_rejected", None), dict):
            inner.last_rejected = {}  # type: ignore[attr-defined]
        out: tuple[ArrayRecord | None, MetricRecord | None] = inner.aggregate_updates(  # type: ignore[attr-defined]
            server_round, ((d, w, m, r.metadata.src_node_id) for d, w, m, r in updates),
            **({"sites": sites} if sites is not None else {}))
        for who, why in dict(getattr(inner, "last_guarded", {}) or {}).items():
            out_rejected.setdefault(str(who), why)
        return out
    updates = list(updates)  # a Flower strategy gets replies: all of them, as Flower does
    by_node = {r.metadata.src_node_id: r for _, _, _, r in updates}
    kept, weights = guard_updates(
        [(d, w, m, r.metadata.src_node_id) for d, w, m, r in updates],
        guards if guards is not None else UpdateGuards(), current, deltas=True,
        server_round=server_round, rejected=out_rejected)
    weight_key = str(getattr(inner, "weighted_by_key", "num-examples"))
    array_key = str(getattr(inner, "arrayrecord_key", "arrays"))
    if weights and not sum(weights) <= 1e300:
        top = max(weights)  # Flower divides by the sum: keep it finite (1e308 weights)
        weights = [w / top for w in weights]
    replies = []
    for (delta, _, metrics, node), weight in zip(kept, weights, strict=True):
        reply = by_node[node]
        with np.errstate(over="ignore", invalid="ignore"):
            model = [(np.asarray(c, np.float64) + d).astype(np.asarray(c).dtype, copy=False)
                     for c, d in zip(current, delta, strict=True)]
        # Flower's aggregate_metricrecords adds whatever it is given: finite scalars only
        clean: dict[str, Any] = {k: v for k, v in metrics.items()
                                 if isinstance(v, int | float) and not isinstance(v, bool)
                                 and math.isfinite(v)}
        clean[weight_key] = float(weight)
        replies.append(as_reply(reply, RecordDict({array_key: arrays_to_record(model, keys),
                                                   "metrics": MetricRecord(clean)})))
    if not replies:
        return None, None
    result: tuple[ArrayRecord | None, MetricRecord | None] = inner.aggregate_train(
        server_round, replies)
    return result


class StrategyWrapper(FedaggStrategy):
    """Base of the wrappers: everything not about training is the inner strategy's.

    Parameters
    ----------
    inner : Strategy
        Any Flower Message-API strategy.
    """

    def __init__(self, inner: Strategy) -> None:
        if not isinstance(inner, Strategy):
            raise ConfigError(explain("inner", type(inner).__name__,
                                      "must be a Flower Message-API strategy "
                                      "(flwr.serverapp.strategy.Strategy)",
                                      "pass e.g. strategies.FedAvg() or "
                                      "flwr.serverapp.strategy.FedAdam()"))
        self.inner = inner
        self.round_log = RoundLog()
        self.last_rejected: dict[str, str] = {}

    # -- delegated -----------------------------------------------------------------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Federated evaluation, as the inner strategy does it."""
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        """Evaluation metrics, as the inner strategy aggregates them."""
        return self.inner.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        """Log this wrapper, then the inner strategy's summary."""
        _log.info("%s around %s", type(self).__name__, type(self.inner).__name__)
        self.inner.summary()

    @property
    def last_accepted(self) -> list[int] | None:
        """Partition ids the inner strategy aggregated in the last round, if it says."""
        value = getattr(self.inner, "last_accepted", None)
        return list(value) if value is not None else None

    @property
    def last_site_metrics(self) -> dict[str, dict[str, float]]:
        """Per-site metrics of the last round, if the inner strategy keeps them."""
        return dict(getattr(self.inner, "last_site_metrics", {}) or {})

    def state_dict(self) -> dict[str, Any]:
        """The inner strategy's state (for checkpoints), if it has one."""
        fn = getattr(self.inner, "state_dict", None)
        return {"inner": fn()} if callable(fn) else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        fn = getattr(self.inner, "load_state_dict", None)
        if callable(fn):
            fn(state.get("inner", state))  # fedagg 0.1 kept the inner's

    def _new_round(self) -> None:
        self.round_log = RoundLog()
        self.last_rejected = {}
