"""FedAvg weighted by examples, with checks before aggregation and an optional server optimizer.

McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from Decentralized
Data" (Algorithm 1); server optimizers from Reddi et al. 2021, "Adaptive Federated Optimization".

Compared with Flower's own :class:`flwr.serverapp.strategy.FedAvg` (whose plain aggregate this
one equals, see tests/strategies/test_fedavg.py):

* every reply is checked on its own (count, shapes, dtypes, finite values, weight, optional
  norm bound); a bad reply is excluded and logged with the reason instead of failing the round;
* fewer valid replies than ``min_sites`` leaves the global model unchanged;
* accumulation is in float64, in a deterministic order (by the site's ``partition-id``);
* sampling is seeded (``seed`` and round), so runs are reproducible;
* the aggregated delta can be applied with FedAvgM / FedAdam (``server_optimizer``).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from fedagg.aggregate import ServerOptimizer, check_update, subtract, weighted_mean
from fedagg.config import RunConfig
from fedagg.errors import UpdateRejected, explain
from strategies._records import arrays_to_record, record_to_arrays
from strategies.base import FedaggStrategy

__all__ = ["FedAvg", "partition_of", "validate_reply"]

_log = logging.getLogger(__name__)


def _numbers(metrics: MetricRecord) -> dict[str, float]:
    """The scalar entries of a site's MetricRecord (per-site metrics for metrics.json)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def partition_of(metrics: MetricRecord) -> int:
    """The ``partition-id`` a site reported (-1 when absent or not a number)."""
    value = metrics.get("partition-id", -1)
    return int(value) if isinstance(value, (int, float)) else -1


def validate_reply(reply: Message, keys: list[str], reference: list[np.ndarray], *,
                   weight_key: str = "num-examples", max_norm: float | None = None,
                   server_round: int | None = None) -> tuple[list[np.ndarray], float, MetricRecord]:
    """Check one train reply; return ``(arrays, weight, metrics)`` or raise UpdateRejected."""
    site = f"node {reply.metadata.src_node_id}"
    if reply.has_error():
        raise UpdateRejected(f"{site} replied with an error: {reply.error.reason}")
    content = reply.content
    arecs = list(content.array_records.values())
    mrecs = list(content.metric_records.values())
    if len(arecs) != 1:
        raise UpdateRejected(explain(f"{site}.array_records", len(arecs), "must hold exactly one ArrayRecord",
                                     "reply with the trained model in one ArrayRecord"))
    if len(mrecs) != 1 or weight_key not in mrecs[0]:
        raise UpdateRejected(explain(f"{site}.metrics", sorted(mrecs[0].keys()) if mrecs else [],
                                     f"must hold one MetricRecord with {weight_key!r}",
                                     f"add {weight_key!r} (number of training examples) to the metrics"))
    weight = mrecs[0][weight_key]
    if isinstance(weight, list) or not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
        raise UpdateRejected(explain(f"{site}.metrics.{weight_key}", weight, "must be a finite number > 0",
                                     "report the number of examples used for training"))
    try:
        rkeys, arrays = record_to_arrays(arecs[0], copy=False)
    except Exception as exc:  # malformed array bytes
        raise UpdateRejected(f"{site}.arrays could not be decoded: {exc}") from None
    if rkeys != keys:
        raise UpdateRejected(explain(f"{site}.arrays.keys", rkeys[:5], f"must equal the global model's keys {keys[:5]}...",
                                     "send the model of the same architecture"))
    check_update(arrays, reference, max_norm=max_norm, site=site)
    echoed = mrecs[0].get("server-round")
    if server_round is not None and echoed is not None and echoed != server_round:
        raise UpdateRejected(explain(f"{site}.metrics.server-round", echoed,
                                     f"must be the current round {server_round}",
                                     "stale reply from an earlier round: it is never aggregated"))
    return arrays, float(weight), mrecs[0]


class FedAvg(FedaggStrategy, FlowerFedAvg):
    """Federated Averaging weighted by ``num-examples`` (McMahan et al. 2017).

    Parameters
    ----------
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes
        As in Flower's FedAvg.
    min_sites : int
        Fewer valid replies than this leaves the model unchanged for the round.
    server_optimizer : {"none", "sgd", "momentum", "adam"}
        How the aggregated delta is applied (FedOpt, Reddi et al. 2021).
    server_lr, server_momentum : float
        Server learning rate and momentum / beta1.
    max_update_norm : float, optional
        Reject site updates whose delta has a larger L2 norm.
    seed : int
        Seed of the per-round site sampling.
    """

    def __init__(self, *, fraction_train: float = 1.0, fraction_evaluate: float = 0.0,
                 min_train_nodes: int = 1, min_evaluate_nodes: int = 1, min_available_nodes: int = 1,
                 min_sites: int = 1, server_optimizer: str = "none", server_lr: float = 1.0,
                 server_momentum: float = 0.9, max_update_norm: float | None = None, seed: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate,
                         min_train_nodes=min_train_nodes, min_evaluate_nodes=min_evaluate_nodes,
                         min_available_nodes=min_available_nodes, **kwargs)
        self.min_sites = min_sites
        self.max_update_norm = max_update_norm
        self.seed = seed
        self.optimizer = ServerOptimizer(server_optimizer, lr=server_lr, beta1=server_momentum)
        self.last_rejected: dict[str, str] = {}
        self.retries = 0
        self.last_accepted: list[int] = []
        self.last_site_metrics: dict[str, dict[str, float]] = {}
        self._global: tuple[list[str], list[np.ndarray]] | None = None

    @classmethod
    def from_config(cls, options: Any, cfg: RunConfig) -> FedAvg:
        """Build from a validated run config."""
        s = cfg.strategy
        strategy = cls(fraction_train=cfg.run.fraction_train, min_sites=cfg.run.min_sites,
                   server_optimizer=s.server_optimizer, server_lr=s.server_lr,
                   server_momentum=s.server_momentum, max_update_norm=s.max_update_norm,
                   seed=cfg.run.seed)
        strategy.retries = cfg.run.retries
        return strategy

    @property
    def current_global(self) -> tuple[list[str], list[np.ndarray]]:
        """Keys and arrays of the global model sent in the current round."""
        if self._global is None:
            raise RuntimeError("no round configured yet")
        return self._global

    # -- sampling ----------------------------------------------------------------------------
    def sample(self, grid: Grid, server_round: int, fraction: float, minimum: int) -> list[int]:
        """Seeded sample of connected node ids for ``server_round``."""
        nodes = sorted(grid.get_node_ids())
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
        nodes = self.sample(grid, server_round, self.fraction_evaluate, self.min_evaluate_nodes)
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, nodes, MessageType.EVALUATE)

    # -- aggregation -------------------------------------------------------------------------
    def accept(self, replies: Iterable[Message], server_round: int | None = None
               ) -> list[tuple[list[np.ndarray], float, MetricRecord, Message]]:
        """Validate every reply; keep the good ones in a deterministic order, log the others."""
        if self._global is None:
            raise RuntimeError("aggregate_train called before configure_train")
        keys, reference = self._global
        self.last_rejected = {}
        good = []
        for reply in replies:
            try:
                arrays, weight, metrics = validate_reply(reply, keys, reference,
                                                         weight_key=self.weighted_by_key,
                                                         max_norm=self.max_update_norm,
                                                         server_round=server_round)
            except UpdateRejected as exc:
                self.last_rejected[str(reply.metadata.src_node_id)] = str(exc)
                _log.warning("rejected update: %s", exc)
                continue
            good.append((arrays, weight, metrics, reply))
        good.sort(key=lambda g: (g[2].get("partition-id", -1), g[3].metadata.src_node_id))
        self.last_accepted = [partition_of(g[2]) for g in good]
        self.last_site_metrics = {str(partition_of(g[2])): _numbers(g[2]) for g in good}
        return good

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Weighted mean of the valid replies, applied through the server optimizer."""
        good = self.accept(replies, server_round)
        if len(good) < self.min_sites:
            _log.warning("round %d: %d valid updates < min_sites=%d; global model unchanged",
                         server_round, len(good), self.min_sites)
            return None, None
        assert self._global is not None
        keys, current = self._global
        mean = weighted_mean([g[0] for g in good], [g[1] for g in good])
        if self.optimizer.kind == "none":
            new = mean  # plain FedAvg: the new model is the weighted mean itself
        else:
            new = self.optimizer.step(current, subtract(mean, current))
        metrics = aggregate_metricrecords([g[3].content for g in good], self.weighted_by_key)
        return arrays_to_record(new, keys), metrics

    def state_dict(self) -> dict[str, Any]:
        """Server-optimizer state, for checkpoints."""
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.optimizer.load_state_dict(state["optimizer"])
