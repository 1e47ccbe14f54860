"""The round guards over a round's listed, checked updates (for inner strategies that take replies).

:func:`guard_updates` applies the round-level guards of ``[strategy]``
(:func:`guards_from_config`, :class:`fedagg.aggregate.UpdateGuards`): weights not finite in
``(0, max_weight]`` refused, the norm-bomb guard (delta norms above ``norm_outlier_factor`` x the
round's median), weights capped at ``max_weight_ratio`` x their median. fedagg's FedAvg decides
the same on the stream of its updates (:class:`strategies.streaming.StreamRound`); a wrapper
applies these to the updates it hands a Flower strategy as replies, only when asked to
(docs/reliability.md).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedagg.aggregate import (
    MEDIAN_MIN_UPDATES,
    UpdateGuards,
    cap_weights,
    global_norm,
    norm_outliers,
    subtract,
)
from fedagg.config import RunConfig
from fedagg.errors import explain
from strategies.update import Update

__all__ = ["guard_updates", "guards_from_config"]

_log = logging.getLogger(__name__)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def guards_from_config(cfg: RunConfig) -> UpdateGuards:
    """The round-level guards of ``[strategy]`` (docs/reliability.md)."""
    s = cfg.strategy
    return UpdateGuards(max_weight=s.max_weight, max_weight_ratio=s.max_weight_ratio,
                        norm_outlier_factor=s.norm_outlier_factor,
                        max_model_change=s.max_model_change)


def guard_updates(updates: Sequence[Update], guards: UpdateGuards, current: Sequence[np.ndarray],
                  *, server_round: int, rejected: dict[str, str],
                  capped: dict[str, str] | None = None) -> list[Update]:
    """Apply the round-level guards to a round's checked updates (listed, for an inner strategy
    that takes replies); returns the kept ones, their weights capped.

    Updates with a weight that is not a finite number in ``(0, max_weight]`` are refused; with
    at least :data:`~fedagg.aggregate.MEDIAN_MIN_UPDATES` updates, those whose delta norm
    exceeds ``norm_outlier_factor`` x the median are refused (the norm-bomb guard), and the
    remaining weights are capped at ``max_weight_ratio`` x their median. Refusals are added to
    ``rejected`` (node id -> reason), caps to ``capped``; both are logged.
    """
    kept: list[Update] = []
    for u in updates:
        w = u.weight
        if not (_is_number(w) and math.isfinite(w) and w > 0) or (
                guards.max_weight is not None and w > guards.max_weight):
            rejected[u.key] = explain(f"{u.site}.weight", w,
                                      "must be a finite number in (0, strategy.max_weight]",
                                      "report the number of examples used for training")
            _log.warning("round %d: rejected update: %s", server_round, rejected[u.key])
            continue
        kept.append(u)
    if guards.norm_outlier_factor > 0 and len(kept) >= MEDIAN_MIN_UPDATES:
        norms = [global_norm([np.asarray(t) for t in u.tensors]) if u.kind == "delta"
                 else global_norm(subtract([np.asarray(t) for t in u.tensors], current))
                 for u in kept]
        out = set(norm_outliers(norms, guards.norm_outlier_factor))
        if out:
            median = float(np.median([n for n in norms if math.isfinite(n)] or [0.0]))
            for i in sorted(out):
                u = kept[i]
                rejected[u.key] = explain(
                    f"{u.site}.delta_norm", float(f"{norms[i]:.6g}"),
                    f"must be <= strategy.norm_outlier_factor x the round's median delta norm "
                    f"= {guards.norm_outlier_factor} x {median:.6g}",
                    "check the site (a norm bomb?), or raise / turn off (0) "
                    "strategy.norm_outlier_factor")
                _log.warning("round %d: rejected update: %s", server_round, rejected[u.key])
            kept = [u for i, u in enumerate(kept) if i not in out]
    weights, over = cap_weights([u.weight for u in kept], guards.max_weight_ratio)
    for i in over:
        u = kept[i]
        note = (f"{u.site}: weight {u.weight:.6g} capped to {weights[i]:.6g} "
                f"(strategy.max_weight_ratio = {guards.max_weight_ratio} x the round's median)")
        if capped is not None:
            capped[u.key] = note
        _log.warning("round %d: %s", server_round, note)
    return [u if w == u.weight else u.replace(weight=float(w))
            for u, w in zip(kept, weights, strict=True)]
