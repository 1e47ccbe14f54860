"""Median-relative guards for asynchronous buffers, decided on arrival against a sliding window.

A synchronous round sees its updates side by side, so the round guards
(:class:`fedagg.aggregate.UpdateGuards`) can refuse an update whose delta L2 norm is above
``norm_outlier_factor`` x the round's median norm (a *norm bomb*) and cap a weight above
``max_weight_ratio`` x the round's median weight. A FedBuff buffer is folded as its updates
arrive, and the median over its ``K`` updates is not known until it is full — by then the
bomb is already in the running sum. :class:`GuardWindow` therefore keeps the scalars
``(delta norm, weight)`` of recent **accepted** updates (no arrays), **one per site**: the
latest accepted update of each of the last ``W`` sites that had one accepted. It judges every
arriving update, before it is folded, exactly as the synchronous guard judges a round made of
the window's updates of the *other* sites and the arriving one (a synchronous round, too,
holds one update per site):

* refused (:class:`~fedagg.errors.UpdateRejected`, field, value, rule, fix) when
  :func:`fedagg.aggregate.norm_outliers` flags it, i.e. its norm is above
  ``norm_outlier_factor`` x the median of that round's norms, or not finite;
* its weight capped by :func:`fedagg.aggregate.cap_weights` at ``max_weight_ratio`` x the
  median of that round's weights.

One site is one value of the round however many updates it sends: its own earlier update is
left out when it is judged, and its accepted update replaces its earlier one in the window
(becoming the newest) instead of pushing another site's out. So a site that answers 50 times
as fast as the others cannot fill the window with its own values and walk the median up one
accepted update at a time (a *ratchet*); it moves the median by one order statistic at most,
as a single value does. The rules act once the round has
:data:`~fedagg.aggregate.MEDIAN_MIN_UPDATES` updates (the arriving one and two other sites'),
as a synchronous round must (before that only a non-finite norm is refused); a factor or
ratio of 0 turns each rule off. Refused updates never enter the window; an accepted one
enters with the weight it was folded with (after the cap). A secure cohort's sum (``node =
-1``) stands for no single site: each cohort is a value of its own. The decisions are a
deterministic function of the arrival order, and the window is plain data
(:meth:`GuardWindow.state_dict`), part of the asynchronous server state's checkpoint.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedagg.aggregate import MEDIAN_MIN_UPDATES, cap_weights, norm_outliers
from fedagg.errors import ConfigError, UpdateRejected, explain

__all__ = ["DEFAULT_GUARD_WINDOW", "GuardWindow", "Verdict"]

DEFAULT_GUARD_WINDOW = 20
"""Sites whose latest accepted update the guards compare against (``asynchronous.guard_window``):
two of FedBuff's default buffers (``K = 10``), so the median follows the shrinking delta norms
of a converging model within a few versions, while a single site is one value of up to 21
(it would need more than half of them, i.e. other sites, to move the median)."""

NO_SITE = -1
"""The node of a window entry that stands for no single site (a secure cohort's sum)."""


@dataclass(frozen=True)
class Verdict:
    """What the guards decided for one accepted update.

    Attributes
    ----------
    norm : float
        Its delta L2 norm.
    weight : float
        The weight to fold it with (``reported`` or the cap).
    reported : float
        The weight it reported.
    median_weight : float
        The median weight the cap was taken from (0.0 when no cap applied).
    node : int
        The site it came from (:data:`NO_SITE` for a secure cohort's sum).
    """

    norm: float
    weight: float
    reported: float
    median_weight: float = 0.0
    node: int = NO_SITE

    @property
    def capped(self) -> bool:
        """Whether the weight was lowered."""
        return self.weight < self.reported


class GuardWindow:
    """The scalars of the latest accepted update of the last ``size`` sites, and the decisions
    taken from them.

    Parameters
    ----------
    size : int
        ``W``: entries remembered, one per site (at least :data:`MEDIAN_MIN_UPDATES`).
    norm_outlier_factor : float
        Refuse a norm above this multiple of the median (0: off; else > 1).
    max_weight_ratio : float
        Cap a weight at this multiple of the median (0: off; else > 1).

    Raises
    ------
    ConfigError
        A window smaller than :data:`MEDIAN_MIN_UPDATES` (the guards could never act), or a
        factor / ratio that is negative, not finite, or in ``(0, 1]``.
    """

    def __init__(self, size: int = DEFAULT_GUARD_WINDOW, *, norm_outlier_factor: float = 10.0,
                 max_weight_ratio: float = 10.0) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < MEDIAN_MIN_UPDATES:
            raise ConfigError(explain(
                "asynchronous.guard_window", size,
                f"must be a whole number >= {MEDIAN_MIN_UPDATES} (the median-relative guards "
                f"need {MEDIAN_MIN_UPDATES} accepted updates to compare against)",
                f"use e.g. {DEFAULT_GUARD_WINDOW}; turn the guards off with "
                "strategy.norm_outlier_factor = 0 and strategy.max_weight_ratio = 0"))
        for name, value in (("strategy.norm_outlier_factor", norm_outlier_factor),
                            ("strategy.max_weight_ratio", max_weight_ratio)):
            if not (isinstance(value, int | float) and math.isfinite(value)) or value < 0 \
                    or 0 < value <= 1:
                raise ConfigError(explain(name, value, "must be 0 (off) or a finite number > 1",
                                          "use e.g. 10"))
        self.size = size
        self.norm_outlier_factor = float(norm_outlier_factor)
        self.max_weight_ratio = float(max_weight_ratio)
        self._entries: deque[tuple[int, float, float]] = deque(maxlen=size)  # node, norm, weight

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nodes(self) -> list[int]:
        """The window's sites, oldest first (:data:`NO_SITE` for a cohort's sum)."""
        return [n for n, _, _ in self._entries]

    @property
    def weights(self) -> list[float]:
        """The weights the window's updates were folded with, oldest first."""
        return [w for _, _, w in self._entries]

    def _others(self, node: int) -> list[tuple[int, float, float]]:
        return [e for e in self._entries if node == NO_SITE or e[0] != node]

    def judge(self, norm: float, weight: float, *, site: str, cap: bool = True,
              node: int = NO_SITE) -> Verdict:
        """Judge one arriving update (nothing is remembered: :meth:`accept` it once folded).

        Parameters
        ----------
        norm : float
            Its delta L2 norm (:func:`fedagg.accumulate.delta_norm`).
        weight : float
            Its reported weight (examples).
        site : str
            Who sent it, for the message (``"node 12"``, ``"cohort 3"``).
        cap : bool
            Whether the weight cap applies (not for a secure cohort's sum).
        node : int
            The site's node id: its own entry in the window is not part of the round it is
            judged in (:data:`NO_SITE`: a cohort's sum, judged against every entry).

        Raises
        ------
        UpdateRejected
            A norm bomb (or a non-finite norm), named with the round's median.
        """
        others = self._others(int(node))
        norms = [*(n for _, n, _ in others), float(norm)]
        if len(norms) - 1 in norm_outliers(norms, self.norm_outlier_factor):
            finite = [n for n in norms if math.isfinite(n)]
            median = float(np.median(finite)) if finite else 0.0
            active = self.norm_outlier_factor > 0 and len(norms) >= MEDIAN_MIN_UPDATES
            rule = (f"must be <= strategy.norm_outlier_factor x the median delta norm of the "
                    f"latest accepted updates of {len(others)} other site(s) and this one = "
                    f"{self.norm_outlier_factor:g} x {median:.6g}") if active \
                else "must be finite"
            raise UpdateRejected(explain(
                f"{site}.delta_norm", float(f"{norm:.6g}"), rule,
                "the update is refused and never reaches the model; check the site (a norm "
                "bomb?), or raise / turn off (0) strategy.norm_outlier_factor"))
        if not cap:
            return Verdict(float(norm), float(weight), float(weight), node=int(node))
        weights, over = cap_weights([*(w for _, _, w in others), float(weight)],
                                    self.max_weight_ratio)
        if len(weights) - 1 in over:
            cap_value = float(weights[-1])
            return Verdict(float(norm), cap_value, float(weight),
                           cap_value / self.max_weight_ratio, node=int(node))
        return Verdict(float(norm), float(weight), float(weight), node=int(node))

    def accept(self, verdict: Verdict) -> None:
        """Remember a folded update's norm and (capped) weight as its site's newest entry (its
        earlier one leaves); the oldest entry leaves a full window."""
        if verdict.node != NO_SITE:
            kept = [e for e in self._entries if e[0] != verdict.node]
            if len(kept) != len(self._entries):
                self._entries.clear()
                self._entries.extend(kept)
        self._entries.append((int(verdict.node), verdict.norm, verdict.weight))

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the window's sites, norms and weights, oldest first."""
        return {"size": self.size, "nodes": self.nodes,
                "norms": [n for _, n, _ in self._entries], "weights": self.weights}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` output (``None``: an empty window, an older checkpoint;
        one without ``nodes`` loads its entries as standing for no single site).

        A window saved with another size keeps its newest ``size`` entries.

        Raises
        ------
        ConfigError
            Lists of different lengths, values that are not finite numbers >= 0, or nodes
            that are not ids (>= -1) with each site at most once.
        """
        self._entries.clear()
        if not state:
            return
        norms, weights = list(state.get("norms", [])), list(state.get("weights", []))
        nodes = list(state.get("nodes", [NO_SITE] * len(norms)))
        sites = [n for n in nodes if n != NO_SITE]
        ok = len(norms) == len(weights) == len(nodes) and all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            and v >= 0 for v in norms + weights) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= NO_SITE for n in nodes) \
            and len(set(sites)) == len(sites)
        if not ok:
            raise ConfigError(explain("asynchronous state.guard_window",
                                      f"{len(nodes)} nodes, {len(norms)} norms, "
                                      f"{len(weights)} weights",
                                      "must be three lists of one length: node ids (each site "
                                      "once) and finite numbers >= 0",
                                      "resume from an intact checkpoint"))
        self._entries.extend((int(n), float(v), float(w))
                             for n, v, w in zip(nodes, norms, weights, strict=True))
