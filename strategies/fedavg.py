"""FedAvg weighted by examples, with checks before aggregation and an optional server optimizer.

McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from Decentralized
Data" (Algorithm 1); server optimizers from Reddi et al. 2021, "Adaptive Federated Optimization".

A drop-in for Flower's :class:`flwr.serverapp.strategy.FedAvg`: same constructor defaults
(``fraction_train = fraction_evaluate = 1.0``, ``min_train_nodes = min_evaluate_nodes =
min_available_nodes = 2``, ``"num-examples"``, ``"arrays"``, ``"config"``), same messages, and
the same aggregate (tests/strategies/test_fedavg.py). What it adds, each documented in
docs/plugins.md:

* every reply is checked on its own (record layout, weight, shapes, finite values, optional
  norm bound, round echo); a bad reply is excluded with the reason (:attr:`last_rejected`)
  instead of failing the round;
* a float reply of another precision (float64 for a float32 model) is cast to the model's
  dtype, as Flower's arithmetic would; ``strict_dtypes=True`` refuses it instead;
* fewer valid replies than ``min_sites`` leaves the global model unchanged;
* accumulation is in float64, in a deterministic order (by the site's ``partition-id``);
* sampling is seeded (``seed`` and the round), so runs are reproducible; like Flower it waits
  until ``min_available_nodes`` nodes are connected;
* ``partition-id`` and ``server-round`` are not averaged as metrics; the old metric names
  ``train-loss`` / ``eval-loss`` / ``eval-acc`` are read as ``train_loss`` / ``eval_loss`` /
  ``eval_acc`` (aliases kept for one release);
* the aggregated delta can be applied with FedAvgM / FedAdam (``server_optimizer``).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from fedagg.aggregate import ServerOptimizer, cast_update, check_update, subtract, weighted_mean
from fedagg.config import RunConfig
from fedagg.errors import UpdateRejected, explain
from strategies.base import FedaggStrategy
from strategies.wire import arrays_to_record, record_to_arrays

__all__ = ["METRIC_ALIASES", "NOT_METRICS", "FedAvg", "Update", "aggregate_metrics",
           "partition_of", "validate_reply"]

_log = logging.getLogger(__name__)

NOT_METRICS = ("partition-id", "server-round")
"""Reply metrics that identify the reply rather than measure training; never averaged."""
METRIC_ALIASES = {"train-loss": "train_loss", "eval-loss": "eval_loss", "eval-acc": "eval_acc"}
"""Old metric names (fedagg 0.1) and the names of Flower's examples they map to."""

Update = tuple[list[np.ndarray], float, dict[str, Any], int]
"""``(arrays, weight, metrics, node id)``: a checked site update (its delta, or its whole
model) handed between wrappers and :meth:`FedAvg.aggregate_updates` without Flower records."""


def _numbers(metrics: Any) -> dict[str, float]:
    """The finite scalar entries of a site's metrics (per-site metrics for metrics.json)."""
    out: dict[str, float] = {}
    for k, v in dict(metrics).items():
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out[METRIC_ALIASES.get(str(k), str(k))] = float(v)
    return out


def partition_of(metrics: Any) -> int:
    """The ``partition-id`` a site reported (-1 when absent or not a finite number)."""
    value = dict(metrics).get("partition-id", -1)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return -1
    return int(value)


def aggregate_metrics(metrics: Sequence[dict[str, Any]], weights: Sequence[float]
                      ) -> MetricRecord:
    """Weighted mean of the sites' scalar metrics (identifiers and the weight left out).

    A key that is not a finite scalar at every site that sent it is dropped for the round
    (one site's list or NaN never breaks the others' mean).
    """
    total = float(sum(weights))
    acc: dict[str, float] = {}
    seen: dict[str, float] = {}
    bad: set[str] = set()
    for m, w in zip(metrics, weights, strict=True):
        for key, value in dict(m).items():
            k = METRIC_ALIASES.get(key, key)
            if k in NOT_METRICS or k == "num-examples":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value):
                bad.add(k)
                continue
            acc[k] = acc.get(k, 0.0) + float(value) * w
            seen[k] = seen.get(k, 0.0) + w
    out = MetricRecord()
    for k, v in acc.items():
        if k not in bad and seen[k] > 0 and total > 0:
            out[k] = v / seen[k]
    return out


def validate_reply(reply: Message, keys: list[str], reference: list[np.ndarray], *,
                   weight_key: str = "num-examples", max_norm: float | None = None,
                   server_round: int | None = None, strict_dtypes: bool = False
                   ) -> tuple[list[np.ndarray], float, MetricRecord]:
    """Check one train reply; return ``(arrays, weight, metrics)`` or raise UpdateRejected."""
    site = f"node {reply.metadata.src_node_id}"
    if reply.has_error():
        raise UpdateRejected(f"{site} replied with an error: {reply.error.reason}")
    content = reply.content
    arecs = list(content.array_records.values())
    mrecs = list(content.metric_records.values())
    if len(arecs) != 1:
        raise UpdateRejected(explain(f"{site}.array_records", len(arecs),
                                     "must hold exactly one ArrayRecord",
                                     "reply with the trained model in one ArrayRecord"))
    if len(mrecs) != 1 or weight_key not in mrecs[0]:
        raise UpdateRejected(explain(f"{site}.metrics", sorted(mrecs[0].keys()) if mrecs else [],
                                     f"must hold one MetricRecord with {weight_key!r}",
                                     f"add {weight_key!r} (number of training examples) to the "
                                     "metrics"))
    weight = mrecs[0][weight_key]
    if isinstance(weight, bool) or not (isinstance(weight, int | float) and math.isfinite(weight)
                                        and weight > 0):
        raise UpdateRejected(explain(f"{site}.metrics.{weight_key}", weight,
                                     "must be a finite number > 0",
                                     "report the number of examples used for training"))
    echoed = mrecs[0].get("server-round")
    if server_round is not None and echoed is not None and echoed != server_round:
        raise UpdateRejected(explain(f"{site}.metrics.server-round", echoed,
                                     f"must be the current round {server_round}",
                                     "stale reply from an earlier round: it is never aggregated"))
    try:
        rkeys, arrays = record_to_arrays(arecs[0], copy=False)
    except UpdateRejected:
        raise
    except Exception as exc:  # malformed array bytes
        raise UpdateRejected(f"{site}.arrays could not be decoded: {exc}") from None
    if rkeys != keys:
        raise UpdateRejected(explain(f"{site}.arrays.keys", rkeys[:5],
                                     f"must equal the global model's keys {keys[:5]}...",
                                     "send the model of the same architecture"))
    arrays = cast_update(arrays, reference, strict=strict_dtypes, site=site)
    check_update(arrays, reference, max_norm=max_norm, site=site)
    return arrays, float(weight), mrecs[0]


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
    strict_dtypes : bool
        Refuse replies whose float dtype differs from the model's (default: cast them).
    seed : int
        Seed of the per-round site sampling.
    wait_timeout : float, optional
        Longest wait for ``min_available_nodes`` nodes (None: as long as it takes, like
        Flower).
    """

    aggregates_linearly: ClassVar[bool] = True

    def __init__(self, fraction_train: float = 1.0, fraction_evaluate: float = 1.0,
                 min_train_nodes: int = 2, min_evaluate_nodes: int = 2,
                 min_available_nodes: int = 2, weighted_by_key: str = "num-examples",
                 arrayrecord_key: str = "arrays", configrecord_key: str = "config", *,
                 min_sites: int = 1, server_optimizer: str = "none", server_lr: float = 1.0,
                 server_momentum: float = 0.9, max_update_norm: float | None = None,
                 strict_dtypes: bool = False, seed: int = 0,
                 wait_timeout: float | None = None, **kwargs: Any) -> None:
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
        self.strict_dtypes = strict_dtypes
        self.seed = seed
        self.wait_timeout = wait_timeout
        self.optimizer = ServerOptimizer(server_optimizer, lr=server_lr, beta1=server_momentum)
        self.last_rejected: dict[str, str] = {}
        self.last_accepted: list[int] = []
        self.last_site_metrics: dict[str, dict[str, float]] = {}
        self._global: tuple[list[str], list[np.ndarray]] | None = None

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
                   wait_timeout=cfg.run.wait_for_sites)

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
        self._global = record_to_arrays(arrays)
        if self.fraction_train == 0.0:
            return []
        config["server-round"] = server_round
        nodes = self.sample(grid, server_round, self.fraction_train, self.min_train_nodes)
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
        if self._global is None:
            raise RuntimeError("aggregate_train called before configure_train")
        keys, reference = self._global
        self.last_rejected = {}
        good: list[Update] = []
        for reply in replies:
            try:
                arrays, weight, metrics = validate_reply(
                    reply, keys, reference, weight_key=self.weighted_by_key,
                    max_norm=self.max_update_norm, server_round=server_round,
                    strict_dtypes=self.strict_dtypes)
            except UpdateRejected as exc:
                self.last_rejected[str(reply.metadata.src_node_id)] = str(exc)
                _log.warning("rejected update: %s", exc)
                continue
            good.append((arrays, weight, dict(metrics), reply.metadata.src_node_id))
        return good

    def aggregate_updates(self, server_round: int, updates: Iterable[Update], *,
                          deltas: bool = True, sites: int | None = None
                          ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Weighted mean of checked updates, applied through the server optimizer.

        The entry point for wrappers that decode updates themselves (compressed, secure): no
        Flower records in between. ``deltas=False``: the updates are whole models (plain
        replies); with ``server_optimizer = "none"`` the new model is then their weighted
        mean itself, exactly as Flower computes it. ``sites``: how many sites the updates
        stand for (secure aggregation hands over one aggregate), for the ``min_sites`` check.
        """
        if self._global is None:
            raise RuntimeError("aggregate_updates called before configure_train")
        good = sorted(updates, key=lambda g: (partition_of(g[2]), g[3]))
        self.last_accepted = [partition_of(g[2]) for g in good]
        self.last_site_metrics = {str(partition_of(g[2])): _numbers(g[2]) for g in good}
        count = len(good) if sites is None else int(sites)
        if count < self.min_sites or not good:
            _log.warning("round %d: %d valid updates < min_sites=%d; global model unchanged",
                         server_round, count, self.min_sites)
            return None, None
        keys, current = self._global
        mean = weighted_mean([g[0] for g in good], [g[1] for g in good])
        if deltas:
            new = self.optimizer.step(current, mean)
        elif self.optimizer.kind == "none":
            new = mean
        else:
            new = self.optimizer.step(current, subtract(mean, current))
        metrics = aggregate_metrics([g[2] for g in good], [g[1] for g in good])
        return arrays_to_record(new, keys), metrics

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Weighted mean of the valid replies, applied through the server optimizer."""
        return self.aggregate_updates(server_round, self.accept(replies, server_round),
                                      deltas=False)

    def state_dict(self) -> dict[str, Any]:
        """Server-optimizer state, for checkpoints."""
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.optimizer.load_state_dict(state["optimizer"])
