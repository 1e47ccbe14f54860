"""The sites' metrics of a round: which are averaged, under which names, and their weighted mean.

``partition-id`` and ``server-round`` identify a reply and are never averaged
(:data:`NOT_METRICS`); the old metric names of fedagg 0.1 are read as the names of Flower's
examples (:data:`METRIC_ALIASES`). :func:`aggregate_metrics` is the weighted mean of the
finite scalar metrics, a key that is not a finite scalar at every site that sent it being
left out of the round's mean. Used by :class:`strategies.fedavg.FedAvg` and the wrappers;
every name is importable from :mod:`strategies.fedavg` as well.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from flwr.app import MetricRecord

__all__ = ["METRIC_ALIASES", "NOT_METRICS", "aggregate_metrics"]

NOT_METRICS = ("partition-id", "server-round")
"""Reply metrics that identify the reply rather than measure training; never averaged."""
METRIC_ALIASES = {"train-loss": "train_loss", "eval-loss": "eval_loss", "eval-acc": "eval_acc"}
"""Old metric names (fedagg 0.1) and the names of Flower's examples they map to."""


def _numbers(metrics: Any) -> dict[str, float]:
    """The finite scalar entries of a site's metrics (per-site metrics for metrics.json)."""
    out: dict[str, float] = {}
    for k, v in dict(metrics).items():
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out[METRIC_ALIASES.get(str(k), str(k))] = float(v)
    return out


def aggregate_metrics(metrics: Sequence[dict[str, Any]], weights: Sequence[float]
                      ) -> MetricRecord:
    """Weighted mean of the sites' scalar metrics (identifiers and the weight left out).

    A key that is not a finite scalar at every site that sent it is dropped for the round
    (one site's list or NaN never breaks the others' mean).
    """
    top = max((float(w) for w in weights), default=0.0)
    if not (math.isfinite(top) and top > 0):
        return MetricRecord()
    # scaled by a power of two (exact: the same bits as unscaled weights), so that weights up
    # to ~1e308 do not overflow the sums
    shift = -math.frexp(top)[1]
    weights = [math.ldexp(float(w), shift) for w in weights]
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
        if k not in bad and seen[k] > 0 and total > 0 and math.isfinite(v / seen[k]):
            out[k] = v / seen[k]
    return out
