"""The checks of one train reply, and the round-level guards over a round's checked updates.

* :func:`validate_reply` — one reply on its own: record layout, weight, ``partition-id`` and
  round echo (:func:`check_metadata`: finite scalars of the right type and range), array
  bytes, tensor names, shapes and dtypes, finite values, the optional norm bound; a bad reply
  raises :class:`~fedagg.errors.UpdateRejected`, naming the field, the value, the rule and
  the fix, and is left out of the round, never failing it;
* :func:`guard_updates` — the round-level guards of ``[strategy]``
  (:func:`guards_from_config`, :class:`fedagg.aggregate.UpdateGuards`): weights not finite in
  ``(0, max_weight]`` refused, the norm-bomb guard (delta norms above ``norm_outlier_factor``
  x the round's median), weights capped at ``max_weight_ratio`` x their median.

Used by :class:`strategies.fedavg.FedAvg`, the compressed strategy and the wrappers
(docs/reliability.md); every name is importable from :mod:`strategies.fedavg` as well, and
the warnings keep the logger name ``strategies.fedavg``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.app import Message, MetricRecord

from fedagg.aggregate import (
    MEDIAN_MIN_UPDATES,
    UpdateGuards,
    cap_weights,
    cast_update,
    check_update,
    global_norm,
    norm_outliers,
    subtract,
)
from fedagg.config import RunConfig
from fedagg.errors import UpdateRejected, explain
from strategies.wire import record_to_arrays

__all__ = ["MAX_PARTITION_ID", "Update", "check_metadata", "guard_updates",
           "guards_from_config", "partition_of", "validate_reply"]

_log = logging.getLogger("strategies.fedavg")  # the name these warnings had before the split

Update = tuple[list[np.ndarray], float, dict[str, Any], int]
"""``(arrays, weight, metrics, node id)``: a checked site update (its delta, or its whole
model) handed between wrappers and :meth:`FedAvg.aggregate_updates` without Flower records."""


MAX_PARTITION_ID = 2**31 - 1
"""Largest ``partition-id`` a reply may carry (larger ones, like non-integers, are refused)."""


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_metadata(site: str, metrics: Any, *, weight_key: str = "num-examples",
                   server_round: int | None = None, max_weight: float | None = None) -> float:
    """Type- and range-check the identifiers and the weight of one reply; returns the weight.

    The weight (``weight_key``) must be a finite number > 0 (and <= ``max_weight``); a
    ``server-round`` echo must be the integer ``server_round``; a ``partition-id`` must be an
    integer in ``[0, 2^31)``. Lists, booleans, NaN or Inf in any of them refuse the reply, never
    the round (other metrics are only averaged, see :func:`aggregate_metrics`).

    Raises
    ------
    UpdateRejected
        Naming the field, the value, the rule and the fix.
    """
    weight: Any = metrics.get(weight_key) if hasattr(metrics, "get") else None
    if not (_is_number(weight) and math.isfinite(weight) and weight > 0):
        raise UpdateRejected(explain(f"{site}.metrics.{weight_key}", weight,
                                     "must be a finite number > 0",
                                     "report the number of examples used for training"))
    if max_weight is not None and weight > max_weight:
        raise UpdateRejected(explain(f"{site}.metrics.{weight_key}", weight,
                                     f"must be <= strategy.max_weight = {max_weight}",
                                     "report the real number of examples, or raise "
                                     "strategy.max_weight"))
    if "server-round" in metrics:
        echoed: Any = metrics["server-round"]
        ok = _is_number(echoed) and math.isfinite(echoed) and float(echoed).is_integer()
        if not ok or (server_round is not None and int(echoed) != server_round):
            raise UpdateRejected(explain(
                f"{site}.metrics.server-round", echoed,
                f"must be the current round {server_round}" if server_round is not None
                else "must be an integer",
                "stale reply from an earlier round: it is never aggregated"))
    if "partition-id" in metrics:
        pid: Any = metrics["partition-id"]
        if not (_is_number(pid) and math.isfinite(pid) and float(pid).is_integer()
                and 0 <= pid <= MAX_PARTITION_ID):
            raise UpdateRejected(explain(f"{site}.metrics.partition-id", pid,
                                         f"must be an integer in [0, {MAX_PARTITION_ID}]",
                                         "report the site's partition id (or leave it out)"))
    return float(weight)


def guards_from_config(cfg: RunConfig) -> UpdateGuards:
    """The round-level guards of ``[strategy]`` (docs/reliability.md)."""
    s = cfg.strategy
    return UpdateGuards(max_weight=s.max_weight, max_weight_ratio=s.max_weight_ratio,
                        norm_outlier_factor=s.norm_outlier_factor,
                        max_model_change=s.max_model_change)


def guard_updates(updates: Sequence[Update], guards: UpdateGuards, current: Sequence[np.ndarray],
                  *, deltas: bool, server_round: int, rejected: dict[str, str],
                  capped: dict[str, str] | None = None) -> tuple[list[Update], list[float]]:
    """Apply the round-level guards to checked updates; returns the kept ones and their weights.

    Updates with a weight that is not a finite number in ``(0, max_weight]`` are refused (a
    wrapper or plugin may hand over anything); with at least
    :data:`~fedagg.aggregate.MEDIAN_MIN_UPDATES` updates, those whose delta norm exceeds
    ``norm_outlier_factor`` x the median are refused (the norm-bomb guard), and the remaining
    weights are capped at ``max_weight_ratio`` x their median. Refusals are added to
    ``rejected`` (node id -> reason), caps to ``capped``; both are logged.
    """
    kept: list[Update] = []
    for u in updates:
        node = str(u[3])
        w = u[1]
        if not (_is_number(w) and math.isfinite(w) and w > 0) or (
                guards.max_weight is not None and w > guards.max_weight):
            rejected[node] = explain(f"node {node}.weight", w,
                                     "must be a finite number in (0, strategy.max_weight]",
                                     "report the number of examples used for training")
            _log.warning("round %d: rejected update: %s", server_round, rejected[node])
            continue
        kept.append(u)
    if guards.norm_outlier_factor > 0 and len(kept) >= MEDIAN_MIN_UPDATES:
        norms = [global_norm(u[0]) if deltas else global_norm(subtract(u[0], current))
                 for u in kept]
        out = set(norm_outliers(norms, guards.norm_outlier_factor))
        if out:
            median = float(np.median([n for n in norms if math.isfinite(n)] or [0.0]))
            for i in sorted(out):
                node = str(kept[i][3])
                rejected[node] = explain(
                    f"node {node}.delta_norm", float(f"{norms[i]:.6g}"),
                    f"must be <= strategy.norm_outlier_factor x the round's median delta norm "
                    f"= {guards.norm_outlier_factor} x {median:.6g}",
                    "check the site (a norm bomb?), or raise / turn off (0) "
                    "strategy.norm_outlier_factor")
                _log.warning("round %d: rejected update: %s", server_round, rejected[node])
            kept = [u for i, u in enumerate(kept) if i not in out]
    weights, over = cap_weights([u[1] for u in kept], guards.max_weight_ratio)
    for i in over:
        node = str(kept[i][3])
        note = (f"node {node}: weight {kept[i][1]:.6g} capped to {weights[i]:.6g} "
                f"(strategy.max_weight_ratio = {guards.max_weight_ratio} x the round's median)")
        if capped is not None:
            capped[node] = note
        _log.warning("round %d: %s", server_round, note)
    return kept, [float(w) for w in weights]


def partition_of(metrics: Any) -> int:
    """The ``partition-id`` a site reported (-1 when absent or not a finite number)."""
    value = dict(metrics).get("partition-id", -1)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return -1
    return int(value)


def validate_reply(reply: Message, keys: list[str], reference: list[np.ndarray], *,
                   weight_key: str = "num-examples", max_norm: float | None = None,
                   server_round: int | None = None, strict_dtypes: bool = False,
                   max_weight: float | None = None, check_finite: bool = True
                   ) -> tuple[list[np.ndarray], float, MetricRecord]:
    """Check one train reply; return ``(arrays, weight, metrics)`` or raise UpdateRejected.

    ``check_finite=False`` leaves the NaN / Inf check to the consumer: only for one that
    folds the arrays into an accumulator that refuses them itself (``checks_finite``).
    """
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
    weight = check_metadata(site, mrecs[0], weight_key=weight_key, server_round=server_round,
                            max_weight=max_weight)
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
    check_update(arrays, reference, max_norm=max_norm, site=site, check_finite=check_finite)
    return arrays, weight, mrecs[0]
