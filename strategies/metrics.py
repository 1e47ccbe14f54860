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

Metrics are inputs too: :class:`MetricLimits` bounds what one reply's metrics may add to the
run's records -- how many keys, how long a key, how long a list -- and says which keys it left
out and why (fedagg's run config: ``strategy.max_metric_keys``, ``max_metric_key_length``,
``max_metric_list_length``). The identifiers and the weight are always kept; the reply itself
still counts. With ``max_keys``, :func:`site_metrics_mean` keeps the round's keys that the
most sites reported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flwr.app import MetricRecord, RecordDict

__all__ = ["METRIC_ALIASES", "NOT_METRICS", "MetricLimits", "site_metrics_mean"]

NOT_METRICS = ("partition-id", "server-round")
"""Reply metrics that identify the reply rather than measure training; never averaged."""
METRIC_ALIASES = {"train-loss": "train_loss", "eval-loss": "eval_loss", "eval-acc": "eval_acc"}
"""Old metric names (fedagg 0.1) and the names of Flower's examples they map to."""


@dataclass(frozen=True)
class MetricLimits:
    """How much of one reply's metrics the server keeps (the rest dropped, with the reason).

    Parameters
    ----------
    max_keys : int, optional
        Keys kept per reply, the identifiers (:data:`NOT_METRICS`) and the weight included;
        the others are kept in sorted order up to this count (None: all).
    max_key_length : int, optional
        Longest key kept, in characters (None: any).
    max_list_length : int, optional
        Longest list value kept, in elements (None: any).
    weight_key : str
        The weight's name (always kept).
    """

    max_keys: int | None = None
    max_key_length: int | None = None
    max_list_length: int | None = None
    weight_key: str = "num-examples"

    @property
    def active(self) -> bool:
        """Whether any bound is set."""
        return not (self.max_keys is None and self.max_key_length is None
                    and self.max_list_length is None)

    def bound(self, site: str, metrics: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
        """``metrics`` within the limits, and why keys were dropped ('' when none was).

        The weight and the identifiers are always kept. Keys longer than ``max_key_length``
        and lists longer than ``max_list_length`` are dropped first; of the remaining keys,
        the first ``max_keys`` in sorted order are kept (the identifiers and the weight
        count towards it).
        """
        if not self.active:
            return dict(metrics), ""
        keep = {self.weight_key, *NOT_METRICS}
        out: dict[str, Any] = {}
        long_keys: list[str] = []
        long_lists: list[str] = []
        for key in sorted(metrics, key=str):
            value = metrics[key]
            k = str(key)
            if k in keep:
                out[k] = value
            elif self.max_key_length is not None and len(k) > self.max_key_length:
                long_keys.append(k)
            elif (self.max_list_length is not None and isinstance(value, list)
                  and len(value) > self.max_list_length):
                long_lists.append(k)
            else:
                out[k] = value
        over: list[str] = []
        if self.max_keys is not None and len(out) > self.max_keys:
            others = [k for k in out if k not in keep]
            room = max(self.max_keys - (len(out) - len(others)), 0)
            over = others[room:]
            for k in over:
                del out[k]
        parts = []
        if over:
            parts.append(f"{len(over)} key(s) over strategy.max_metric_keys = {self.max_keys} "
                         f"(kept the first in sorted order; dropped e.g. {_names(over)})")
        if long_keys:
            parts.append(f"{len(long_keys)} key(s) longer than strategy.max_metric_key_length "
                         f"= {self.max_key_length} characters (e.g. {_names(long_keys)})")
        if long_lists:
            parts.append(f"{len(long_lists)} list(s) longer than strategy.max_metric_list_length"
                         f" = {self.max_list_length} elements ({_names(long_lists)})")
        if not parts:
            return out, ""
        return out, (f"{site}: {sum(map(len, (over, long_keys, long_lists)))} of its "
                     f"{len(metrics)} metric keys dropped, the reply still counts: "
                     + "; ".join(parts) + ". Fix: report fewer / shorter metrics, or raise the "
                     "bound")


def _names(keys: list[str], most: int = 3) -> str:
    shown = ", ".join(repr(k[:40] + ("..." if len(k) > 40 else "")) for k in keys[:most])
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def site_metrics_mean(contents: list[RecordDict], weight_key: str, *,
                      max_keys: int | None = None) -> MetricRecord:
    """Weighted mean of the replies' metrics (identifiers, the weight and broken keys left out).

    Parameters
    ----------
    contents : list of RecordDict
        The accepted replies' contents (each with one MetricRecord holding ``weight_key``).
    weight_key : str
        The weight's name.
    max_keys : int, optional
        Keep at most this many keys: those that the most sites reported (ties in sorted
        order), so that keys only one site sends cannot crowd out the ones every site sends.
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
    sites: dict[str, int] = {}
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
            sites[k] = sites.get(k, 0) + 1
    out = MetricRecord()
    names = {k for k in acc if k not in bad and seen[k] > 0}
    if max_keys is not None and len(names) > max_keys:
        names = set(sorted(sorted(names), key=lambda k: -sites[k])[:max(max_keys, 0)])
    for k in acc:
        if k not in names:
            continue
        v = acc[k]
        mean = [x / seen[k] for x in v] if isinstance(v, list) else v / seen[k]
        if all(math.isfinite(x) for x in (mean if isinstance(mean, list) else [mean])):
            out[k] = mean
    return out
