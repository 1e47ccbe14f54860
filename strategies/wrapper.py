"""What fedagg's wrapper strategies share: delegation to ``inner``, and updates handed to it.

:class:`Compressed` and :class:`SecureAggregation` take ANY Flower Message-API strategy as
``inner`` (fedagg's FedAvg, a plugin, ``flwr.serverapp.strategy.FedAdam``, one of Flower's
differential-privacy wrappers...), as Flower's own differential-privacy wrappers do. They
change what travels; the inner strategy still samples the sites (its ``configure_train`` builds
the messages, with its own config keys) and decides the aggregate. Decoded updates
(:class:`strategies.update.Update`) reach the inner strategy

* through the engine seam :class:`UpdateConsumer` (``aggregate_updates``: fedagg's FedAvg and
  its subclasses that do not override ``aggregate_train``), without Flower records, sparse
  tensors as they are;
* otherwise as ordinary train replies (the array record = the model the site's update implies,
  one MetricRecord with the weight), which is what every Flower strategy understands: a robust
  strategy (FedTrimmedAvg, Krum, FedMedian) gets exactly the replies Flower would give it.

Secure aggregation can only hand over *one* update, the weighted mean of the round, so it
accepts only inner strategies whose aggregate is a weighted mean (:func:`is_linear`).

A wrapper is transparent for what it does not add: an attribute it does not have is the inner
strategy's (``wrapper.current_arrays``, ``wrapper.server_learning_rate``), read and written.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp import strategy as flwr_strategy
from flwr.serverapp.strategy import Strategy

from fedagg.aggregate import UpdateGuards
from fedagg.errors import ConfigError, ProtocolError, explain
from strategies.base import FedaggStrategy
from strategies.guards import guard_updates
from strategies.update import RoundReport, Update
from strategies.wire import arrays_to_record

__all__ = ["FLOWER_WRAPPERS", "NO_GUARDS", "StrategyWrapper", "UpdateConsumer", "inner_aggregate",
           "is_linear", "model_record_key", "model_replies", "streams_updates", "wrapped"]

_log = logging.getLogger(__name__)

NO_GUARDS = UpdateGuards(max_weight_ratio=0.0, norm_outlier_factor=0.0)
"""The round guards of a wrapper built by hand: none that can change an honest result."""

_FLOWER_LINEAR = tuple(getattr(flwr_strategy, n) for n in (
    "FedAvg", "FedAvgM", "FedProx", "FedOpt", "FedAdam", "FedYogi", "FedAdagrad")
    if hasattr(flwr_strategy, n))
_FLOWER_PASS_THROUGH = tuple(getattr(flwr_strategy, n) for n in (
    "DifferentialPrivacyClientSideFixedClipping",) if hasattr(flwr_strategy, n))


FLOWER_WRAPPERS = tuple(getattr(flwr_strategy, n) for n in (
    "DifferentialPrivacyServerSideFixedClipping", "DifferentialPrivacyClientSideFixedClipping",
    "DifferentialPrivacyServerSideAdaptiveClipping", "DifferentialPrivacyClientSideAdaptiveClipping")
    if hasattr(flwr_strategy, n))
"""Flower's wrapper strategies: each keeps the strategy it wraps in ``.strategy``."""


def wrapped(strategy: Strategy) -> Strategy | None:
    """The strategy ``strategy`` wraps (fedagg's wrappers and Flower's), or None."""
    if isinstance(strategy, StrategyWrapper):
        return strategy.inner
    if isinstance(strategy, FLOWER_WRAPPERS):
        inner: Strategy = strategy.strategy
        return inner
    return None


@runtime_checkable
class UpdateConsumer(Protocol):
    """What fedagg needs of an inner strategy to hand it decoded updates directly."""

    report: RoundReport

    def aggregate_updates(self, server_round: int, updates: Iterable[Update], *,
                          deltas: bool = True, sites: int | None = None
                          ) -> tuple[ArrayRecord | None, MetricRecord | None]: ...


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


def streams_updates(inner: Strategy) -> bool:
    """Whether ``inner`` takes decoded updates directly (:class:`UpdateConsumer`, its
    ``aggregate_updates`` not bypassed by a subclass's own ``aggregate_train``)."""
    return isinstance(inner, UpdateConsumer) and not _overridden_after(
        type(inner), "aggregate_updates", "aggregate_train")


def record_keys(inner: Strategy) -> tuple[str, str, str]:
    """``(weighted_by_key, arrayrecord_key, configrecord_key)`` of ``inner`` (Flower's FedAvg
    family declares them; Flower's defaults otherwise)."""
    if isinstance(inner, flwr_strategy.FedAvg):
        return inner.weighted_by_key, inner.arrayrecord_key, inner.configrecord_key
    if isinstance(inner, StrategyWrapper):
        return record_keys(inner.inner)
    return "num-examples", "arrays", "config"


def model_replies(updates: Iterable[Update], current: list[np.ndarray], keys: list[str],
                   inner: Strategy) -> Iterator[Message]:
    """The train reply each update implies: its model (``current + delta``) and its weight,
    the site's other metrics as it sent them, the reply's own metadata."""
    weight_key, array_key, _ = record_keys(inner)
    for u in updates:
        if u.kind == "delta":
            with np.errstate(over="ignore", invalid="ignore"):
                model = [(np.asarray(c, np.float64) + np.asarray(d)).astype(
                    np.asarray(c).dtype, copy=False) for c, d in zip(current, u.tensors,
                                                                     strict=True)]
        else:
            model = [np.asarray(t) for t in u.tensors]
        metrics = MetricRecord({**_record_values(u.metrics), weight_key: float(u.weight)})
        content = RecordDict({array_key: arrays_to_record(model, keys), "metrics": metrics})
        if u.reply is not None:
            yield Message(content=content, metadata=u.reply.metadata)  # type: ignore[call-overload]
        else:
            yield Message(content=content, dst_node_id=0, message_type="train")


def _record_values(metrics: Any) -> dict[str, Any]:
    """What a MetricRecord holds of a site's metrics (numbers and lists of numbers)."""
    out: dict[str, Any] = {}
    for k, v in dict(metrics).items():
        if isinstance(v, bool):
            continue
        if isinstance(v, int | float) or (isinstance(v, list) and all(
                isinstance(x, int | float) and not isinstance(x, bool) for x in v)):
            out[str(k)] = v
    return out


def inner_aggregate(inner: Strategy, server_round: int, updates: Iterable[Update],
                    keys: list[str], current: list[np.ndarray], report: RoundReport, *,
                    sites: int | None = None, guards: UpdateGuards = NO_GUARDS
                    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """Hand checked updates to ``inner``: directly, or as the train replies they imply.

    An iterator is streamed to an :class:`UpdateConsumer` one update at a time, never
    listed, and the consumer's own report (its guards' refusals, the accepted sites) merged
    into ``report``. Any other strategy gets the list of replies the updates imply, after
    ``guards`` (default none: Flower's strategies get exactly the replies Flower would give
    them); ``current`` is the global model deltas are taken against (full precision).
    """
    if streams_updates(inner):
        consumer: Any = inner
        consumer.report = RoundReport()
        out: tuple[ArrayRecord | None, MetricRecord | None] = consumer.aggregate_updates(
            server_round, updates, **({"sites": sites} if sites is not None else {}))
        report.merge(consumer.report)
        return out
    listed = list(updates)  # a Flower strategy gets replies: all of them, as Flower does
    if guards.norm_outlier_factor > 0 or guards.max_weight_ratio > 0 or \
            guards.max_weight is not None:
        listed = guard_updates(listed, guards, current, server_round=server_round,
                               rejected=report.refused, capped=report.capped)
    if not listed:
        return None, None
    replies = list(model_replies(listed, current, keys, inner))
    result: tuple[ArrayRecord | None, MetricRecord | None] = inner.aggregate_train(
        server_round, replies)
    if isinstance(inner, FedaggStrategy):
        report.merge(inner.report)
    return result


def _declared(cls: type) -> set[str]:
    """The attribute names the classes of ``cls``'s MRO declare (annotations)."""
    return {name for c in cls.__mro__ for name in vars(c).get("__annotations__", {})}


class StrategyWrapper(FedaggStrategy):
    """Base of the wrappers: everything not about training is the inner strategy's.

    Parameters
    ----------
    inner : Strategy
        Any Flower Message-API strategy.
    """

    inner: Strategy
    report: RoundReport

    def __init__(self, inner: Strategy) -> None:
        if not isinstance(inner, Strategy):
            raise ConfigError(explain("inner", type(inner).__name__,
                                      "must be a Flower Message-API strategy "
                                      "(flwr.serverapp.strategy.Strategy)",
                                      "pass e.g. strategies.FedAvg() or "
                                      "flwr.serverapp.strategy.FedAdam()"))
        object.__setattr__(self, "inner", inner)
        self.report = RoundReport()

    # -- transparency ------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """A data attribute the wrapper does not have is the inner strategy's (methods are
        not: what the wrapper does not override is Flower's or its own)."""
        inner = self.__dict__.get("inner")
        if name.startswith("__") or name == "inner" or inner is None:
            raise AttributeError(name)
        value = getattr(inner, name)
        if callable(value):
            raise AttributeError(f"{type(self).__name__} has no method {name!r}")
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        """Setting a data attribute the wrapper does not declare but the inner strategy has
        sets the inner strategy's (``wrapper.current_arrays = ...`` as on the strategy it
        wraps); a wrapper's own attributes are declared in its class body."""
        inner = self.__dict__.get("inner")
        if (inner is not None and name not in self.__dict__ and not hasattr(type(self), name)
                and name not in _declared(type(self)) and hasattr(inner, name)
                and not callable(getattr(inner, name))):
            setattr(inner, name, value)
        else:
            object.__setattr__(self, name, value)

    # -- delegated -----------------------------------------------------------------------------
    @property
    def eval_report(self) -> RoundReport:
        """The inner strategy's: federated evaluation is the inner strategy's."""
        inner = self.__dict__.get("inner")
        return inner.eval_report if isinstance(inner, FedaggStrategy) else RoundReport()

    @eval_report.setter
    def eval_report(self, report: RoundReport) -> None:
        inner = self.__dict__.get("inner")
        if isinstance(inner, FedaggStrategy):
            inner.eval_report = report

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
        self.report = RoundReport()
