"""FedAvg weighted by examples, with checks before aggregation and an optional server optimizer.

McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from Decentralized
Data" (Algorithm 1); server optimizers from Reddi et al. 2021, "Adaptive Federated Optimization".

A drop-in for Flower's :class:`flwr.serverapp.strategy.FedAvg`: same constructor defaults
(``fraction_train = fraction_evaluate = 1.0``, ``min_train_nodes = min_evaluate_nodes =
min_available_nodes = 2``, ``"num-examples"``, ``"arrays"``, ``"config"``), same messages, and
the same aggregate (tests/strategies/test_fedavg.py). What it adds, each documented in
docs/plugins.md:

* every reply is checked on its own (record layout, weight, ``partition-id`` and round echo
  as finite scalars of the right type and range, shapes, finite values, optional norm bound);
  a bad reply is excluded with the reason (:attr:`last_rejected`) instead of failing the round;
* round-level guards (:class:`fedagg.aggregate.UpdateGuards`): weights capped at
  ``max_weight_ratio`` x the round's median, updates with a delta norm above
  ``norm_outlier_factor`` x the round's median refused, and the new model committed only when
  it is finite and within ``max_model_change`` of the old one (the server optimizer's state is
  rolled back otherwise);
* a float reply of another precision (float64 for a float32 model) is cast to the model's
  dtype, as Flower's arithmetic would; ``strict_dtypes=True`` refuses it instead;
* fewer valid replies than ``min_sites`` leaves the global model unchanged;
* replies are aggregated as they come (streamed): each is checked, folded into an exact
  integer accumulator and dropped, so the server holds ~3 models whatever the number of sites,
  and the result is the same bits for every arrival order (fedagg.accumulate; the whole-round
  guards correct the few updates they refuse or cap exactly, docs/architecture/
  server-memory.md); ``shards=S`` splits the accumulator over S Ray actors (same bits);
* sampling is seeded (``seed`` and the round), so runs are reproducible; like Flower it waits
  until ``min_available_nodes`` nodes are connected;
* ``partition-id`` and ``server-round`` are not averaged as metrics; the old metric names
  ``train-loss`` / ``eval-loss`` / ``eval-acc`` are read as ``train_loss`` / ``eval_loss`` /
  ``eval_acc`` (aliases kept for one release);
* the aggregated delta can be applied with FedAvgM / FedAdam (``server_optimizer``).

The per-reply checks and the round-level guards are in :mod:`strategies.checks`, the metrics'
names and mean in :mod:`strategies.metrics` (names re-exported here).
"""

from __future__ import annotations

import gc
import logging
import math
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from fedagg.accumulate import WeightBuckets, grid_exponents
from fedagg.aggregate import (
    ServerOptimizer,
    UpdateGuards,
    model_change_problem,
    subtract,
)
from fedagg.config import RunConfig
from fedagg.errors import UpdateRejected
from strategies.base import FedaggStrategy
from strategies.checks import (
    MAX_PARTITION_ID,
    Update,
    check_metadata,
    guard_updates,
    guards_from_config,
    partition_of,
    validate_reply,
)
from strategies.metrics import METRIC_ALIASES, NOT_METRICS, _numbers, aggregate_metrics
from strategies.streaming import StreamRound, new_accumulator
from strategies.wire import arrays_to_record, npy_record, record_to_arrays

__all__ = ["MAX_PARTITION_ID", "METRIC_ALIASES", "NOT_METRICS", "FedAvg", "Update",
           "aggregate_metrics", "check_metadata", "guard_updates", "guards_from_config",
           "partition_of", "validate_reply"]

_log = logging.getLogger(__name__)


class FedAvg(FedaggStrategy, FlowerFedAvg):
    """Federated Averaging weighted by ``num-examples`` (McMahan et al. 2017).

    Parameters
    ----------
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes
        As in Flower's FedAvg (same defaults).
    weighted_by_key, arrayrecord_key, configrecord_key
        As in Flower's FedAvg.
    min_sites : int
        Fewer valid replies than this leaves the model unchanged for the round.
    server_optimizer : {"none", "sgd", "momentum", "adam"}
        How the aggregated delta is applied (FedOpt, Reddi et al. 2021).
    server_lr, server_momentum : float
        Server learning rate and momentum / beta1.
    max_update_norm : float, optional
        Reject site updates whose delta has a larger L2 norm.
    max_weight, max_weight_ratio, norm_outlier_factor, max_model_change
        The round-level guards (:class:`fedagg.aggregate.UpdateGuards`; defaults: no absolute
        weight bound, weights capped at 10 x the round's median, updates above 10 x the
        median delta norm refused, no bound on the model's change beyond finiteness).
    strict_dtypes : bool
        Refuse replies whose float dtype differs from the model's (default: cast them).
    seed : int
        Seed of the per-round site sampling.
    wait_timeout : float, optional
        Longest wait for ``min_available_nodes`` nodes (None: as long as it takes, like
        Flower).
    shards : int
        ``0`` / ``1``: aggregate in this process; ``S >= 2``: on S Ray actors, each holding
        1/S of the accumulator (:class:`server.sharded.ShardedAccumulator`; same bits).
    stream_retain : int
        Updates kept per criterion (largest norms, largest weights) so that the round guards
        can correct the streamed sum exactly; a round needing more corrections is refused.
    """

    aggregates_linearly: ClassVar[bool] = True

    def __init__(self, fraction_train: float = 1.0, fraction_evaluate: float = 1.0,
                 min_train_nodes: int = 2, min_evaluate_nodes: int = 2,
                 min_available_nodes: int = 2, weighted_by_key: str = "num-examples",
                 arrayrecord_key: str = "arrays", configrecord_key: str = "config", *,
                 min_sites: int = 1, server_optimizer: str = "none", server_lr: float = 1.0,
                 server_momentum: float = 0.9, max_update_norm: float | None = None,
                 strict_dtypes: bool = False, seed: int = 0,
                 wait_timeout: float | None = None, max_weight: float | None = None,
                 max_weight_ratio: float = 10.0, norm_outlier_factor: float = 10.0,
                 max_model_change: float | None = None, shards: int = 0,
                 stream_retain: int = 2, **kwargs: Any) -> None:
        # Flower logs a warning for a 0 fraction at every construction; fedagg's run config
        # defaults to fraction_evaluate = 0 (centralized evaluation), so set it quietly.
        super().__init__(fraction_train=fraction_train or 1.0,
                         fraction_evaluate=fraction_evaluate or 1.0,
                         min_train_nodes=min_train_nodes, min_evaluate_nodes=min_evaluate_nodes,
                         min_available_nodes=min_available_nodes, weighted_by_key=weighted_by_key,
                         arrayrecord_key=arrayrecord_key, configrecord_key=configrecord_key,
                         **kwargs)
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
        self.strict_dtypes = strict_dtypes
        self.seed = seed
        self.wait_timeout = wait_timeout
        self.optimizer = ServerOptimizer(server_optimizer, lr=server_lr, beta1=server_momentum)
        self.last_rejected: dict[str, str] = {}
        self.last_guarded: dict[str, str] = {}
        """Refusals of the round-level guards in the last :meth:`aggregate_updates` (node id or
        ``"server"`` -> reason); wrappers that call it directly report them."""
        self.last_capped: dict[str, str] = {}
        self.last_accepted: list[int] = []
        self.last_site_metrics: dict[str, dict[str, float]] = {}
        self._global: tuple[list[str], list[np.ndarray]] | None = None
        self._grid: tuple[list[np.ndarray], list[int]] | None = None
        self.precompute_grid = True
        """Derive the accumulator's grid in configure_train (while the sites train); off for
        an instance that only builds messages and checks replies (the asynchronous loop's
        per-dispatch strategies): it would be a wasted pass over the model."""
        self._sent: tuple[int, int] | None = None
        """``(round, train messages)`` of the last configure_train: at most that many updates
        come back (the streamed guards keep aside fewer updates with it)."""
        self.shards = int(shards)
        self.stream_retain = int(stream_retain)
        self._sharded: Any = None  # the Ray actors, kept from round to round

    @classmethod
    def from_config(cls, options: Any, cfg: RunConfig) -> FedAvg:
        """Build from a validated run config (``[run]`` and ``[strategy]``)."""
        s = cfg.strategy
        return cls(fraction_train=cfg.run.fraction_train,
                   fraction_evaluate=cfg.run.fraction_evaluate, min_train_nodes=1,
                   min_evaluate_nodes=1, min_available_nodes=cfg.run.min_sites,
                   min_sites=cfg.run.min_sites, server_optimizer=s.server_optimizer,
                   server_lr=s.server_lr, server_momentum=s.server_momentum,
                   max_update_norm=s.max_update_norm, seed=cfg.run.seed,
                   wait_timeout=cfg.run.wait_for_sites, max_weight=s.max_weight,
                   max_weight_ratio=s.max_weight_ratio,
                   norm_outlier_factor=s.norm_outlier_factor,
                   max_model_change=s.max_model_change, shards=s.shards,
                   stream_retain=s.stream_retain)

    @property
    def current_global(self) -> tuple[list[str], list[np.ndarray]]:
        """Keys and arrays of the global model sent in the current round."""
        if self._global is None:
            raise RuntimeError("no round configured yet")
        return self._global

    # -- sampling ----------------------------------------------------------------------------
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
        self._sent = (server_round, len(nodes))  # at most this many updates come back
        _log.info("round %d: sampled %d sites", server_round, len(nodes))
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, nodes, MessageType.TRAIN)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Federated evaluation on a seeded sample (none when fraction_evaluate is 0)."""
        if self.fraction_evaluate == 0.0:
            return []
        config["server-round"] = server_round
        nodes = self.sample(grid, server_round + 1_000_003, self.fraction_evaluate,
                            self.min_evaluate_nodes)
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, nodes, MessageType.EVALUATE)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        """Weighted mean of the sites' evaluation metrics (bad replies left out, named)."""
        ms, ws = [], []
        for r in replies:
            if r.has_error():
                _log.warning("round %d: evaluation error from node %d: %s", server_round,
                             r.metadata.src_node_id, r.error.reason)
                continue
            mrecs = list(r.content.metric_records.values())
            w = mrecs[0].get(self.weighted_by_key) if len(mrecs) == 1 else None
            if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) \
                    or w <= 0:
                _log.warning("round %d: evaluation reply of node %d has no valid %s",
                             server_round, r.metadata.src_node_id, self.weighted_by_key)
                continue
            ms.append(dict(mrecs[0]))
            ws.append(float(w))
        return aggregate_metrics(ms, ws) if ms else None

    # -- aggregation -------------------------------------------------------------------------
    def accept(self, replies: Iterable[Message], server_round: int | None = None) -> list[Update]:
        """Validate every reply; the good ones (their models), bad ones named."""
        return list(self.accepted(replies, server_round))

    def accepted(self, replies: Iterable[Message], server_round: int | None = None, *,
                 check_finite: bool = True) -> Iterator[Update]:
        """:meth:`accept` one reply at a time: each good update is yielded, then released.

        Nothing of a reply is kept once the consumer has dropped its update (the arrays are
        read-only views on the reply's bytes): the streamed :meth:`aggregate_train`.
        ``check_finite=False`` leaves NaN / Inf to the consumer (only for one that folds
        every update into an accumulator with ``checks_finite``).
        """
        if self._global is None:
            raise RuntimeError("aggregate_train called before configure_train")
        keys, reference = self._global
        self.last_rejected = {}
        for reply in replies:
            node = reply.metadata.src_node_id
            try:
                arrays, weight, metrics = validate_reply(
                    reply, keys, reference, weight_key=self.weighted_by_key,
                    max_norm=self.max_update_norm, server_round=server_round,
                    strict_dtypes=self.strict_dtypes, max_weight=self.guards.max_weight,
                    check_finite=check_finite)
            except UpdateRejected as exc:
                self.last_rejected[str(node)] = str(exc)
                _log.warning("rejected update: %s", exc)
                continue
            finally:
                del reply
            yield arrays, weight, dict(metrics), node
            del arrays
            # Flower's typed record views (content.array_records) are self-referencing: the
            # reply's bytes would wait for a cyclic GC; the young generations are microseconds
            gc.collect(1)

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
        tensors may be :class:`fedagg.accumulate.Sparse`); the round-level guards take
        :func:`guard_updates`' decisions on the stream (:class:`strategies.streaming.
        StreamRound`), and the new model is committed only if
        :func:`fedagg.aggregate.model_change_problem` finds nothing (else the optimizer's state
        is rolled back and ``None`` returned, the reason in :attr:`last_guarded` under
        ``"server"``).

        The entry point for wrappers that decode updates themselves (compressed, secure): no
        Flower records in between. ``deltas=False``: the updates are whole models (plain
        replies); with ``server_optimizer = "none"`` the new model is then their weighted
        mean itself, as Flower computes it (within the accumulator's bound, ~1e-10 of each
        tensor's scale). ``sites``: how many sites the updates
        stand for (secure aggregation hands over one aggregate), for the ``min_sites`` check.
        """
        if self._global is None:
            raise RuntimeError("aggregate_updates called before configure_train")
        keys, current = self._global
        self.last_guarded, self.last_capped = {}, {}
        acc = self._accumulator(current)
        sent = self._sent
        stream = StreamRound(acc, self.guards, current, deltas=deltas, server_round=server_round,
                             retain=self.stream_retain,
                             expected=sent[1] if sent and sent[0] == server_round else None)
        for update in updates:  # any iterable, consumed once: each update folded, then dropped
            stream.add(update)
            del update
        kept, capped_weights, problem = stream.close()
        self.last_guarded.update(stream.rejected)
        self.last_capped.update(stream.capped)
        order = sorted(range(len(kept)), key=lambda i: (partition_of(kept[i][1]), kept[i][2]))
        good = [kept[i] for i in order]
        weights = [capped_weights[i] for i in order]
        self.last_accepted = [partition_of(m) for _, m, _ in good]
        self.last_site_metrics = {str(partition_of(m)): _numbers(m) for _, m, _ in good}
        count = len(good) if sites is None else int(sites)
        if problem:
            self.last_guarded["server"] = problem
            self.last_rejected.update(self.last_guarded)
            _log.error("%s", problem)
            return None, None
        if count < self.min_sites or not good:
            self.last_rejected.update(self.last_guarded)
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
            self.last_guarded["server"] = (f"round {server_round}: the aggregated model was not "
                                           f"committed (global model unchanged): {problem}")
            self.last_rejected.update(self.last_guarded)
            _log.error("%s", self.last_guarded["server"])
            return None, None
        self.last_rejected.update(self.last_guarded)
        metrics = aggregate_metrics([m for _, m, _ in good], weights)
        if record is not None and new is mean:
            return record, metrics
        return arrays_to_record(new, keys), metrics

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Weighted mean of the valid replies, applied through the server optimizer.

        ``replies`` may be any iterable (a generator of replies as they arrive): it is never
        listed; each reply is checked, folded and released before the next. In this
        process the fold itself refuses NaN / Inf (one read of each reply, not two); the Ray
        shards, and a subclass that consumes the updates itself, get replies checked first.
        """
        cls = type(self)
        folds_checked = (self.shards <= 1 and cls.aggregate_updates is FedAvg.aggregate_updates
                         and cls._accumulator is FedAvg._accumulator)
        return self.aggregate_updates(
            server_round, self.accepted(replies, server_round, check_finite=not folds_checked),
            deltas=False)

    def state_dict(self) -> dict[str, Any]:
        """Server-optimizer state, for checkpoints."""
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.optimizer.load_state_dict(state["optimizer"])
