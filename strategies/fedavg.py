"""FedAvg weighted by examples: Flower's FedAvg, with fedagg's exact streamed engine behind it.

McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from Decentralized
Data" (Algorithm 1); server optimizers from Reddi et al. 2021, "Adaptive Federated Optimization".

A drop-in for Flower's :class:`flwr.serverapp.strategy.FedAvg`: the same constructor (same
defaults, ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn`` included), the same messages,
the same ``aggregate_train`` -- Flower's own method, not a copy, so Flower's privacy accountant
and anything else that checks for it accepts this class -- and the same result for every
honest input (within ~1e-10 of each tensor's scale, tests/strategies/test_fedavg_dropin.py).

Where fedagg's work happens. Flower's ``aggregate_train`` asks ``_check_and_log_replies``
which replies to average; fedagg answers there:

* every reply is decoded and checked on its own (:class:`strategies.codec.PlainCodec`:
  record layout, weight, ``partition-id`` / round echo, shapes, dtypes, finite values,
  optional norm bound); a bad reply is left out with the reason
  (:attr:`report`.``refused``), never reaching the model -- with ``isolate_replies=False``
  (the default, as Flower) replies whose record names differ raise
  ``InconsistentMessageReplies`` as Flower does, with ``True`` (fedagg's runs) they are
  refused one by one;
* configured for the round (``configure_train``), the replies are folded as they come into
  an exact integer accumulator (:mod:`fedagg.accumulate`: ~3 models of memory whatever the
  number of sites, the same bits for every arrival order) with the opt-in round guards, the
  server optimizer applied, and the new model committed only when finite and within
  ``max_model_change``; Flower's averaging is handed that result as the one reply to average
  (the mean of one model is the model). Called alone (Flower's tests, a strategy used
  without ``configure_train``), Flower averages the checked replies itself.

The engine has a second, direct entry: :meth:`aggregate_updates` takes checked
:class:`~strategies.update.Update` s from any iterable -- fedagg's round loop, the compressed
and secure wrappers and the asynchronous buffer hand updates over that way, without Flower
records in between.

Protections that can change an honest result are off by default and named: the weight cap
(``max_weight_ratio``: weights above that multiple of the round's median are capped; real
federations mix one large hospital with several small sites), the norm-bomb guard
(``norm_outlier_factor``), ``max_update_norm``, ``max_weight``, ``max_model_change``, the
bounds on the sites' metrics (``metric_limits``). ``fedagg simulate``'s run config turns the
first two and the metric bounds on (``[strategy]``, docs/reliability.md).

The same weight cap applies to federated evaluation: an evaluate reply's weight above
``max_weight_ratio`` x the median of the evaluation's weights is capped (with fewer than three
evaluation replies, the median is taken together with the last training round's weights), and
the cap is named in :attr:`eval_report`.

Records are credited by the node id the transport authenticates: :attr:`report`'s
``site_metrics`` is keyed by node id, a site's ``partition-id`` is only a label in it, and a
label two nodes claim in the same round is withheld from both (``accepted`` -1, the reason in
``metrics_dropped``).
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from fedagg.accumulate import WeightBuckets, grid_exponents
from fedagg.aggregate import (
    MEDIAN_MIN_UPDATES,
    ServerOptimizer,
    UpdateGuards,
    cap_weights,
    model_change_problem,
    subtract,
)
from fedagg.config import RunConfig
from fedagg.errors import ConfigError, UpdateRejected, explain
from strategies.base import FedaggStrategy
from strategies.codec import Consistency, PlainCodec, check_metadata
from strategies.metrics import MetricLimits, site_metrics_mean
from strategies.streaming import StreamRound, new_accumulator
from strategies.update import RoundReport, Update, node_of, numbers, partition_of
from strategies.wire import arrays_to_record, npy_record, record_to_arrays

__all__ = ["FedAvg"]

_log = logging.getLogger(__name__)

MetricsFn = Callable[[list[RecordDict], str], MetricRecord]


class FedAvg(FedaggStrategy, FlowerFedAvg):
    """Federated Averaging weighted by ``num-examples`` (McMahan et al. 2017).

    Parameters
    ----------
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes
        As in Flower's FedAvg (same defaults).
    weighted_by_key, arrayrecord_key, configrecord_key
        As in Flower's FedAvg.
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : callable, optional
        As in Flower's FedAvg: ``(list[RecordDict], weight key) -> MetricRecord`` over the
        accepted replies (default Flower's weighted mean, lists included; fedagg's run config
        passes :func:`strategies.metrics.site_metrics_mean`, which leaves identifiers out).
    min_sites : int
        Fewer accepted updates than this leaves the model unchanged for the round.
    server_optimizer : {"none", "sgd", "momentum", "adam"}
        How the aggregated delta is applied (FedOpt, Reddi et al. 2021).
    server_lr, server_momentum : float
        Server learning rate and momentum / beta1.
    max_update_norm : float, optional
        Refuse site updates whose delta has a larger L2 norm.
    max_weight : float, optional
        Refuse updates with a larger weight.
    max_weight_ratio, norm_outlier_factor : float
        The median-relative round guards (:class:`fedagg.aggregate.UpdateGuards`); 0 (the
        default): off.
    max_model_change : float, optional
        Commit a new model only within this L2 distance of the old one.
    isolate_replies : bool
        Refuse replies whose record names differ from the others one by one instead of
        raising Flower's ``InconsistentMessageReplies`` for the round.
    strict_dtypes : bool
        Refuse replies whose float dtype differs from the model's (default: cast them).
    seed : int
        Seed of the per-round site sampling.
    wait_timeout : float, optional
        Longest wait for ``min_available_nodes`` nodes (None: as long as it takes, like
        Flower).
    shards : int
        ``0`` / ``1``: aggregate in this process; ``S >= 2``: on S Ray actors, each holding
        1/S of the accumulator (:class:`strategies.sharded.ShardedAccumulator`; same bits).
    stream_retain : int
        Fewest updates kept per criterion (largest norms, largest weights) so that the round
        guards can correct the streamed sum exactly; a round needing more corrections is
        refused.
    hostile_fraction : float
        Share of a round's updates the round guards may refuse or cap without the round
        failing: a configured round keeps ``max(stream_retain, ceil(hostile_fraction x
        messages sent))`` updates per criterion.
    metric_limits : MetricLimits, optional
        Bounds on each reply's metrics (keys, key length, list length) before they reach the
        records and the metrics functions; keys over them are dropped, named in
        :attr:`report`'s ``metrics_dropped`` (default: none, as Flower).
    """

    aggregates_linearly: ClassVar[bool] = True
    # aggregate_train / aggregate_evaluate are Flower's own methods (not overridden, found
    # through the MRO): they ask _check_and_log_replies what to average.

    def __init__(self, fraction_train: float = 1.0, fraction_evaluate: float = 1.0,
                 min_train_nodes: int = 2, min_evaluate_nodes: int = 2,
                 min_available_nodes: int = 2, weighted_by_key: str = "num-examples",
                 arrayrecord_key: str = "arrays", configrecord_key: str = "config",
                 train_metrics_aggr_fn: MetricsFn | None = None,
                 evaluate_metrics_aggr_fn: MetricsFn | None = None, *,
                 min_sites: int = 1, server_optimizer: str = "none", server_lr: float = 1.0,
                 server_momentum: float = 0.9, max_update_norm: float | None = None,
                 strict_dtypes: bool = False, seed: int = 0,
                 wait_timeout: float | None = None, max_weight: float | None = None,
                 max_weight_ratio: float = 0.0, norm_outlier_factor: float = 0.0,
                 max_model_change: float | None = None, isolate_replies: bool = False,
                 shards: int = 0, stream_retain: int = 2, hostile_fraction: float = 0.25,
                 metric_limits: MetricLimits | None = None) -> None:
        self._result: tuple[list[Update], MetricRecord] | None = None
        # Flower logs a warning for a 0 fraction at every construction; fedagg's run config
        # defaults to fraction_evaluate = 0 (centralized evaluation), so set it quietly.
        super().__init__(fraction_train=fraction_train or 1.0,
                         fraction_evaluate=fraction_evaluate or 1.0,
                         min_train_nodes=min_train_nodes, min_evaluate_nodes=min_evaluate_nodes,
                         min_available_nodes=min_available_nodes, weighted_by_key=weighted_by_key,
                         arrayrecord_key=arrayrecord_key, configrecord_key=configrecord_key,
                         train_metrics_aggr_fn=train_metrics_aggr_fn,
                         evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn)
        self.fraction_train, self.fraction_evaluate = fraction_train, fraction_evaluate
        if fraction_evaluate == 0.0:
            self.min_evaluate_nodes = 0
        if fraction_train == 0.0:
            self.min_train_nodes = 0
        self.min_sites = min_sites
        self.max_update_norm = max_update_norm
        self.guards = UpdateGuards(max_weight=max_weight, max_weight_ratio=max_weight_ratio,
                                   norm_outlier_factor=norm_outlier_factor,
                                   max_model_change=max_model_change)
        self.isolate_replies = isolate_replies
        self.strict_dtypes = strict_dtypes
        self.seed = seed
        self.wait_timeout = wait_timeout
        self.optimizer = ServerOptimizer(server_optimizer, lr=server_lr, beta1=server_momentum)
        self.report = RoundReport()
        self.eval_report = RoundReport()
        self._global: tuple[list[str], list[np.ndarray]] | None = None
        self._grid: tuple[list[np.ndarray], list[int]] | None = None
        self.precompute_grid = True
        """Derive the accumulator's grid in configure_train (while the sites train); off for
        an instance that only builds messages and checks replies (the asynchronous loop's
        per-dispatch strategies): it would be a wasted pass over the model."""
        self._round: int | None = None
        self._sent: int | None = None
        """Train messages of the configured round: at most that many updates come back (the
        streamed guards keep aside fewer updates with it)."""
        self.shards = int(shards)
        self.stream_retain = int(stream_retain)
        self.hostile_fraction = float(hostile_fraction)
        self.metric_limits = (metric_limits if metric_limits is not None
                              else MetricLimits(weight_key=weighted_by_key))
        self.last_train_weights: list[float] = []
        """The per-site weights of the last committed round (the evaluation cap's reference
        when an evaluation has too few replies for a median of its own; empty when the round
        was one aggregate, as under secure aggregation). A loop that commits updates
        elsewhere (the asynchronous buffer) may set it."""
        self._sharded: Any = None  # the Ray actors, kept from round to round

    @classmethod
    def from_config(cls, options: Any, cfg: RunConfig) -> FedAvg:
        """Build from a validated run config (``[run]`` and ``[strategy]``): fedagg's
        protections as configured, replies isolated, identifiers left out of the metrics."""
        s = cfg.strategy
        mean = functools.partial(site_metrics_mean, max_keys=s.max_metric_keys)
        return cls(fraction_train=cfg.run.fraction_train,
                   fraction_evaluate=cfg.run.fraction_evaluate, min_train_nodes=1,
                   min_evaluate_nodes=1, min_available_nodes=cfg.run.min_sites,
                   train_metrics_aggr_fn=mean, evaluate_metrics_aggr_fn=mean,
                   min_sites=cfg.run.min_sites, server_optimizer=s.server_optimizer,
                   server_lr=s.server_lr, server_momentum=s.server_momentum,
                   max_update_norm=s.max_update_norm, seed=cfg.run.seed,
                   wait_timeout=cfg.run.wait_for_sites, max_weight=s.max_weight,
                   max_weight_ratio=s.max_weight_ratio,
                   norm_outlier_factor=s.norm_outlier_factor,
                   max_model_change=s.max_model_change, isolate_replies=True,
                   shards=s.shards, stream_retain=s.stream_retain,
                   hostile_fraction=s.hostile_fraction,
                   metric_limits=MetricLimits(max_keys=s.max_metric_keys,
                                              max_key_length=s.max_metric_key_length,
                                              max_list_length=s.max_metric_list_length))

    # -- Flower's metrics functions ----------------------------------------------------------
    @property
    def train_metrics_aggr_fn(self) -> MetricsFn:
        """Aggregates the accepted replies' metrics (Flower's attribute; settable).

        Flower's ``aggregate_train`` calls it with the replies to average; when fedagg's
        engine has already averaged the round (the one reply handed over is its result), it
        returns the metrics the user's function computed over the round's accepted replies.
        """
        return self._metrics_of_round

    @train_metrics_aggr_fn.setter
    def train_metrics_aggr_fn(self, fn: MetricsFn) -> None:
        self._train_metrics_fn = fn

    def _metrics_of_round(self, contents: list[RecordDict], weight_key: str) -> MetricRecord:
        result, self._result = self._result, None
        if result is not None:
            return result[1]
        return self._train_metrics_fn(contents, weight_key)

    # -- sampling ----------------------------------------------------------------------------
    @property
    def current_global(self) -> tuple[list[str], list[np.ndarray]]:
        """Keys and arrays of the global model sent in the current round."""
        if self._global is None:
            raise RuntimeError("no round configured yet")
        return self._global

    def sample(self, grid: Grid, server_round: int, fraction: float, minimum: int) -> list[int]:
        """Seeded sample of connected node ids, after waiting for ``min_available_nodes``."""
        deadline = None if self.wait_timeout is None else time.monotonic() + self.wait_timeout
        want = max(self.min_available_nodes, minimum)
        while True:
            nodes = sorted(grid.get_node_ids())
            if len(nodes) >= want or (deadline is not None and time.monotonic() >= deadline):
                break
            _log.info("waiting for nodes to connect: %d connected (minimum required: %d)",
                      len(nodes), want)
            time.sleep(1.0)
        k = min(len(nodes), max(int(len(nodes) * fraction), minimum))
        return sorted(random.Random(f"{self.seed}-{server_round}").sample(nodes, k))

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Sample sites and send them the global model and the round config."""
        self.report = RoundReport()
        self._result = None
        self._round = server_round
        # read-only views on the record the caller holds anyway: no second copy of the model
        self._global = record_to_arrays(arrays, copy=False)
        # the accumulator's grid depends only on the model sent: derived now, while the sites
        # train, not after the last reply came (a pass over the model, ~10 ms per 10M values)
        self._grid = ((self._global[1], grid_exponents(self._global[1]))
                      if self.precompute_grid and self.shards <= 1
                      and self.fraction_train != 0.0 else None)
        if self.fraction_train == 0.0:
            return []
        config["server-round"] = server_round
        nodes = self.sample(grid, server_round, self.fraction_train, self.min_train_nodes)
        self._sent = len(nodes)  # at most this many updates come back
        self.report.sampled = len(nodes)
        _log.info("round %d: sampled %d sites", server_round, len(nodes))
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, nodes, MessageType.TRAIN)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Federated evaluation on a seeded sample (none when fraction_evaluate is 0)."""
        self.eval_report = RoundReport()
        if self.fraction_evaluate == 0.0:
            return []
        config["server-round"] = server_round
        nodes = self.sample(grid, server_round + 1_000_003, self.fraction_evaluate,
                            self.min_evaluate_nodes)
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, nodes, MessageType.EVALUATE)

    # -- what Flower's aggregate_train / aggregate_evaluate average -----------------------------
    def codec(self, *, check_finite: bool = True) -> PlainCodec:
        """The round's per-reply checks (against the configured model, if any)."""
        keys, ref = self._global if self._global is not None else (None, None)
        return PlainCodec(keys=keys, reference=ref, weight_key=self.weighted_by_key,
                          server_round=self._round if self._global is not None else None,
                          max_norm=self.max_update_norm if ref is not None else None,
                          max_weight=self.guards.max_weight, strict_dtypes=self.strict_dtypes,
                          check_finite=check_finite)

    def decoded(self, replies: Iterable[Message], *, check_finite: bool = True,
                arrays: bool = True, report: RoundReport | None = None) -> Iterator[Update]:
        """The checked updates of ``replies``, one at a time; refusals go to ``report``
        (default :attr:`report`).

        Error replies are counted in ``report.errors``; a reply that fails Flower's
        consistency rules raises ``InconsistentMessageReplies`` (or, with
        ``isolate_replies``, is refused); a reply that fails fedagg's checks is refused.
        """
        report = report if report is not None else self.report
        codec = self.codec(check_finite=check_finite)
        consistency = Consistency(self.weighted_by_key, arrays=arrays)
        i = 0  # not enumerate(): its cached result tuple would keep the last reply alive
        for reply in replies:  # while the next one is being received
            i += 1
            node = node_of(reply)
            who = str(node) if node is not None else f"reply {i}"
            if reply.has_error():
                report.errors[who] = reply.error.reason or "error reply"
                _log.warning("error reply from %s: %s", who, reply.error.reason)
                continue
            report.replies += 1
            if not self.isolate_replies:  # Flower's rules for the round's replies together
                consistency.check(reply)
            try:
                update = codec.decode(reply) if arrays else self._evaluation(reply, codec)
            except UpdateRejected as exc:
                report.refuse(who, str(exc))
                continue
            finally:
                del reply
            yield update
            del update
            gc_young()

    def accept(self, replies: Iterable[Message]) -> list[Update]:
        """fedagg's per-reply checks over a round's replies: the accepted updates (their
        models as read-only views), the refused ones named in :attr:`report` (a plugin's
        ``aggregate_train`` starts here, docs/plugins.md)."""
        return list(self.decoded(replies))

    def _evaluation(self, reply: Message, codec: PlainCodec) -> Update:
        metrics = next(iter(reply.content.metric_records.values()))
        weight = check_metadata(f"node {node_of(reply)}", metrics,
                                weight_key=self.weighted_by_key, max_weight=codec.max_weight)
        return Update((), weight, dict(metrics), node_of(reply), reply=reply)

    def _check_and_log_replies(self, replies: Iterable[Message], is_train: bool,
                               validate: bool = True) -> tuple[list[Message], list[Message]]:
        """The replies Flower's ``aggregate_train`` / ``aggregate_evaluate`` average.

        Training, configured for the round: fedagg's engine folds the checked replies as they
        come and the round's result is the one reply returned (its weight 1.0; the metrics the
        metrics function computed over the accepted replies come with it); an empty list when
        nothing may be committed (the reasons in :attr:`report`). Otherwise: the checked
        replies themselves.
        """
        if not is_train:
            ups = list(self.decoded(replies, arrays=False, report=self.eval_report))
            weights = self._capped_weights(ups, self.eval_report, pool=self.last_train_weights)
            bounded = [self._bounded(u, self.eval_report) for u in ups]
            return [_with_weight(u, w, self.weighted_by_key, metrics=m) for u, w, m in
                    zip(ups, weights, bounded, strict=True)], []
        if self._global is None:  # aggregate_train called alone: Flower averages the checked
            if self.optimizer.kind != "none":
                raise ConfigError(explain(
                    "FedAvg.aggregate_train", "called before configure_train",
                    f"server_optimizer = {self.optimizer.kind!r} steps from the global model, "
                    "which configure_train records", "call configure_train for the round first"))
            ups = list(self.decoded(replies))
            weights = self._capped_weights(ups, self.report)
            self.report.accepted = [_partition(u) for u in ups]
            return [_with_weight(u, w, self.weighted_by_key) for u, w in
                    zip(ups, weights, strict=True)], []
        record, metrics = self._engine(replies)
        if record is None:
            return [], []
        self._result = ([], metrics if metrics is not None else MetricRecord())
        content = RecordDict({self.arrayrecord_key: record,
                              "metrics": MetricRecord({self.weighted_by_key: 1.0})})
        return [Message(content=content, dst_node_id=0, message_type=MessageType.TRAIN)], []

    def aggregate_stream(self, server_round: int, replies: Iterable[Message]
                         ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """fedagg's round loop: the replies folded into the engine as they come (configured
        for the round; otherwise as ``aggregate_train``)."""
        if self._global is None or self._round != server_round or \
                type(self).aggregate_train is not FedAvg.aggregate_train:
            return self.aggregate_train(server_round, replies)
        return self._engine(replies)

    def _engine(self, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The configured round's replies, checked and folded (:meth:`aggregate_updates`)."""
        server_round = self._round if self._round is not None else 0
        # in this process the fold itself refuses NaN / Inf (one read of each reply, not two);
        # the Ray shards, and a subclass's own accumulator, get replies checked first
        folds_checked = (self.shards <= 1 and type(self)._accumulator is FedAvg._accumulator)
        return self.aggregate_updates(
            server_round, self.decoded(replies, check_finite=not folds_checked), deltas=False)

    def _capped_weights(self, updates: Sequence[Update], report: RoundReport, *,
                        pool: Sequence[float] = ()) -> list[float]:
        """The weights of a list-averaged round, capped by ``max_weight_ratio`` (noted).

        With fewer than :data:`~fedagg.aggregate.MEDIAN_MIN_UPDATES` updates, the median is
        taken over their weights together with ``pool`` (an evaluation: the last training
        round's weights), which only serve as the reference.
        """
        own = [u.weight for u in updates]
        pooled = len(own) < MEDIAN_MIN_UPDATES and len(own) + len(pool) >= MEDIAN_MIN_UPDATES
        weights, over = cap_weights([*own, *pool] if pooled else own,
                                    self.guards.max_weight_ratio)
        weights = weights[:len(own)]
        of = ("the median of these weights and the last training round's" if pooled
              else "the median")
        for i in over:
            if i >= len(own):
                continue
            u = updates[i]
            report.capped[u.key] = (
                f"{u.site}: weight {u.weight:.6g} capped to {weights[i]:.6g} "
                f"(strategy.max_weight_ratio = {self.guards.max_weight_ratio} x {of})")
        return [float(w) for w in weights]

    def _bounded(self, update: Update, report: RoundReport) -> dict[str, Any]:
        """``update``'s metrics within :attr:`metric_limits` (what was dropped noted)."""
        metrics, note = self.metric_limits.bound(update.site, update.metrics)
        if note:
            report.metrics_dropped[update.key] = note
            _log.warning("%s", note)
        return metrics

    def _credit(self, updates: Sequence[Update], report: RoundReport) -> list[dict[str, Any]]:
        """The accepted updates' metrics (bounded), credited by node id into ``report``.

        ``site_metrics`` is keyed by the node id the transport authenticates; the
        ``partition-id`` a site reports stays a label in it (``accepted`` lists the labels),
        and a label claimed by more than one node of the round is withheld from all of them.
        """
        bounded = [self._bounded(u, report) for u in updates]
        claims: dict[int, list[int]] = {}
        for i, m in enumerate(bounded):
            if (label := partition_of(m)) >= 0:
                claims.setdefault(label, []).append(i)
        for label, idx in claims.items():
            if len(idx) < 2:
                continue
            names = ", ".join(updates[i].site for i in idx[:4])
            for i in idx:
                bounded[i] = {k: v for k, v in bounded[i].items() if k != "partition-id"}
                u = updates[i]
                note = (f"{u.site}: partition-id {label} withheld: claimed by {len(idx)} nodes "
                        f"of this round ({names}); a partition id is a label, the records "
                        "are keyed by node id")
                old = report.metrics_dropped.get(u.key)
                report.metrics_dropped[u.key] = f"{old}; {note}" if old else note
                _log.warning("%s", note)
        report.accepted = [partition_of(m) for m in bounded]
        report.site_metrics = {u.key if u.node is not None else f"?{i}": numbers(m)
                               for i, (u, m) in enumerate(zip(updates, bounded, strict=True))}
        return bounded

    # -- the engine ------------------------------------------------------------------------------
    def _accumulator(self, current: Sequence[np.ndarray]) -> WeightBuckets:
        """The round's accumulator: in this process, or the Ray actors (kept across rounds)."""
        grid = self._grid[1] if self._grid is not None and self._grid[0] is current else None
        acc = new_accumulator(current, shards=self.shards, sharded=self._sharded,
                              exponents=grid)
        if self.shards > 1:
            self._sharded = acc.first
        return acc

    def aggregate_updates(self, server_round: int, updates: Iterable[Update], *,
                          deltas: bool = True, sites: int | None = None
                          ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Weighted mean of checked updates, applied through the server optimizer.

        ``updates`` is consumed once, each update folded as it comes (never listed; its
        tensors may be :class:`fedagg.accumulate.Sparse`); the round guards decide on the
        stream (:class:`strategies.streaming.StreamRound`), and the new model is committed
        only if :func:`fedagg.aggregate.model_change_problem` finds nothing (else the
        optimizer's state is rolled back and ``None`` returned, the reason in
        :attr:`report` under ``"server"``).

        The entry point for wrappers and loops that decode updates themselves (compressed,
        secure, asynchronous): no Flower records in between. ``deltas=False``: the updates are
        whole models (plain replies); with ``server_optimizer = "none"`` the new model is then
        their weighted mean itself, as Flower computes it (within the accumulator's bound,
        ~1e-10 of each tensor's scale). ``sites``: how many sites the updates stand for
        (secure aggregation hands over one aggregate), for the ``min_sites`` check.
        """
        if self._global is None:
            raise RuntimeError("aggregate_updates called before configure_train")
        keys, current = self._global
        report = self.report
        acc = self._accumulator(current)
        expected = self._sent if self._round == server_round else None
        stream = StreamRound(acc, self.guards, current, deltas=deltas, server_round=server_round,
                             retain=self.retain_for(expected), expected=expected)
        for update in updates:  # any iterable, consumed once: each update folded, then dropped
            stream.add(update)
            del update
        kept, capped_weights, problem = stream.close()
        for who, why in stream.rejected.items():
            report.refused.setdefault(who, why)
        report.capped.update(stream.capped)
        order = sorted(range(len(kept)), key=lambda i: (_partition(kept[i]), kept[i].key))
        good = [kept[i] for i in order]
        weights = [capped_weights[i] for i in order]
        if sites is None:  # the sites' own updates: each credited to its node
            site_metrics = self._credit(good, report)
        else:  # one aggregate standing for several sites (secure, sketches): no site's record
            site_metrics = [dict(u.metrics) for u in good]  # the server's own, not a site's
            report.accepted = [_partition(u) for u in good]
        count = len(good) if sites is None else int(sites)
        if problem:
            report.refuse("server", problem, log=False)
            _log.error("%s", problem)
            return None, None
        if count < self.min_sites or not good:
            _log.warning("round %d: %d valid updates < min_sites=%d; global model unchanged",
                         server_round, count, self.min_sites)
            return None, None
        record = None
        if not deltas and self.optimizer.kind == "none" and acc.buckets == 1:
            # the mean written straight into the new model's record (no second copy of it)
            if hasattr(acc.first, "mean_record"):  # sharded: joined from the shards' pieces
                record = acc.first.mean_record(keys)
            elif hasattr(acc.first, "mean_npy"):
                record = npy_record(keys, acc.first.mean_npy())
        mean = record_to_arrays(record, copy=False)[1] if record is not None else acc.mean()
        del acc, stream  # the accumulator goes before the new model is built
        snap = self.optimizer.snapshot()
        if deltas:
            new = self.optimizer.step(current, mean)
        elif self.optimizer.kind == "none":
            new = mean
        else:
            new = self.optimizer.step(current, subtract(mean, current))
        problem = model_change_problem(new, current, max_change=self.guards.max_model_change)
        if problem:
            self.optimizer.restore(snap)  # a refused model leaves no trace in the momentum
            report.refuse("server", f"round {server_round}: the aggregated model was not "
                          f"committed (global model unchanged): {problem}", log=False)
            _log.error("%s", report.refused["server"])
            return None, None
        self.last_train_weights = [float(w) for w in weights] if sites is None else []
        metrics = self._train_metrics_fn(
            [RecordDict({"metrics": MetricRecord({**_metric_values(m),
                                                  self.weighted_by_key: float(w)})})
             for m, w in zip(site_metrics, weights, strict=True)], self.weighted_by_key)
        if record is not None and new is mean:
            return record, metrics
        return arrays_to_record(new, keys), metrics

    def retain_for(self, expected: int | None) -> int:
        """Updates a streamed round keeps per criterion: ``stream_retain``, and with the
        number of updates the round can have, at least ``hostile_fraction`` of them."""
        if expected is None:
            return self.stream_retain
        return max(self.stream_retain, math.ceil(self.hostile_fraction * max(int(expected), 0)))

    def state_dict(self) -> dict[str, Any]:
        """Server-optimizer state, for checkpoints."""
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.optimizer.load_state_dict(state["optimizer"])


def gc_young() -> None:
    """Collect the young generations: Flower's typed record views (``content.array_records``)
    hold a bound method of themselves, a reference cycle that keeps a used reply's bytes alive
    until the cyclic GC runs, which large byte buffers do not trigger (microseconds)."""
    gc.collect(1)


def _partition(update: Update) -> int:
    return partition_of(update.metrics)


def _metric_values(metrics: Any) -> dict[str, Any]:
    """What a MetricRecord can hold of a site's metrics (numbers and lists of numbers)."""
    out: dict[str, Any] = {}
    for k, v in dict(metrics).items():
        if isinstance(v, bool):
            continue
        if isinstance(v, int | float) or (isinstance(v, list) and all(
                isinstance(x, int | float) and not isinstance(x, bool) for x in v)):
            out[str(k)] = v
    return out


def _with_weight(update: Update, weight: float, key: str, *,
                 metrics: dict[str, Any] | None = None) -> Message:
    """``update``'s reply, its weight replaced by ``weight`` when a guard capped it (and its
    metrics by ``metrics``, the bounded ones, when they differ)."""
    reply = update.reply
    assert reply is not None
    same = metrics is None or len(metrics) == len(update.metrics)
    if weight == update.weight and same:
        return reply
    content = RecordDict(dict(reply.content.items()))
    mkey = next(iter(content.metric_records.keys()))
    kept = dict(content.metric_records[mkey]) if same else _metric_values(metrics)
    content[mkey] = MetricRecord({**kept, key: float(weight)})
    out: Message = Message(content=content, metadata=reply.metadata)  # type: ignore[call-overload]
    return out

