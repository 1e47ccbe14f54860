"""The sites' metrics of a round: fedagg's weighted mean of them, in Flower's function form.

:func:`site_metrics_mean` has the signature of Flower's ``train_metrics_aggr_fn`` /
``evaluate_metrics_aggr_fn`` (``(list[RecordDict], weight key) -> MetricRecord``) and computes
what Flower's default (``aggregate_metricrecords``) computes -- the weighted mean of every
metric, lists element by element, the weight itself left out -- with three differences that
suit a run where sites cannot be trusted to agree:

* ``partition-id`` and ``server-round`` identify a reply and are never averaged
  (:data:`NOT_METRICS`);
* a key that is not finite at every site that sent it, or a list whose length differs from
  one site to another, is left out of the round's mean (one site's NaN or odd list never
  breaks the others' mean; Flower's would be NaN or raise);
* the old metric names of fedagg 0.1 are read as the names of Flower's examples
  (:data:`METRIC_ALIASES`).

fedagg's run config uses it for both (:meth:`strategies.FedAvg.from_config`); a FedAvg built
by hand uses Flower's default unless given it.
"""

from __future__ import annotations

import math
from typing import Any

from flwr.app import MetricRecord, RecordDict

__all__ = ["METRIC_ALIASES", "NOT_METRICS", "site_metrics_mean"]

NOT_METRICS = ("partition-id", "server-round")
"""Reply metrics that identify the reply rather than measure training; never averaged."""
METRIC_ALIASES = {"train-loss": "train_loss", "eval-loss": "eval_loss", "eval-acc": "eval_acc"}
"""Old metric names (fedagg 0.1) and the names of Flower's examples they map to."""


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def site_metrics_mean(contents: list[RecordDict], weight_key: str) -> MetricRecord:
    """Weighted mean of the replies' metrics (identifiers, the weight and broken keys left out).

    Parameters
    ----------
    contents : list of RecordDict
        The accepted replies' contents (each with one MetricRecord holding ``weight_key``).
    weight_key : str
        The weight's name.
    """
    records = [next(iter(c.metric_records.values()), MetricRecord()) for c in contents]
    weights = [float(w) if _finite(w := r.get(weight_key)) else 0.0  # type: ignore[arg-type]
               for r in records]
    top = max(weights, default=0.0)
    if not (math.isfinite(top) and top > 0):
        return MetricRecord()
    # scaled by a power of two (exact: the same bits as unscaled weights), so that weights up
    # to ~1e308 do not overflow the sums
    shift = -math.frexp(top)[1]
    weights = [math.ldexp(w, shift) for w in weights]
    acc: dict[str, Any] = {}
    seen: dict[str, float] = {}
    bad: set[str] = set()
    for rec, w in zip(records, weights, strict=True):
        for key, value in rec.items():
            k = METRIC_ALIASES.get(key, key)
            if k in NOT_METRICS or key == weight_key or k in bad:
                continue
            if isinstance(value, list):
                if not value or not all(_finite(v) for v in value) or (
                        k in acc and (not isinstance(acc[k], list) or len(acc[k]) != len(value))):
                    bad.add(k)
                    continue
                acc[k] = [a + float(v) * w for a, v in zip(acc.get(k, [0.0] * len(value)),
                                                           value, strict=True)]
            elif _finite(value) and not isinstance(acc.get(k), list):
                acc[k] = acc.get(k, 0.0) + float(value) * w
            else:
                bad.add(k)
                continue
            seen[k] = seen.get(k, 0.0) + w
    out = MetricRecord()
    for k, v in acc.items():
        if k in bad or not seen[k] > 0:
            continue
        mean = [x / seen[k] for x in v] if isinstance(v, list) else v / seen[k]
        if all(math.isfinite(x) for x in (mean if isinstance(mean, list) else [mean])):
            out[k] = mean
    return out
