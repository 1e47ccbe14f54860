"""Median-relative guards for asynchronous buffers, decided on arrival against a sliding window.

A synchronous round sees its updates side by side, so the round guards
(:class:`fedagg.aggregate.UpdateGuards`) can refuse an update whose delta L2 norm is above
``norm_outlier_factor`` x the round's median norm (a *norm bomb*) and cap a weight above
``max_weight_ratio`` x the round's median weight. A FedBuff buffer is folded as its updates
arrive, and the median over its ``K`` updates is not known until it is full — by then the
bomb is already in the running sum. :class:`GuardWindow` therefore keeps the scalars
``(delta norm, weight)`` of the last ``W`` **accepted** updates (no arrays) and judges every
arriving update, before it is folded, exactly as the synchronous guard judges a round made of
those ``W`` updates and the arriving one:

* refused (:class:`~fedagg.errors.UpdateRejected`, field, value, rule, fix) when
  :func:`fedagg.aggregate.norm_outliers` flags it, i.e. its norm is above
  ``norm_outlier_factor`` x the median of the ``W + 1`` norms, or not finite;
* its weight capped by :func:`fedagg.aggregate.cap_weights` at ``max_weight_ratio`` x the
  median of the ``W + 1`` weights.

The arriving update is one of the ``W + 1`` values the median is taken over, as a bomb is part
of its own synchronous round; being a single value it moves the median by one order statistic
at most. The median-relative rules act once the window holds
:data:`~fedagg.aggregate.MEDIAN_MIN_UPDATES` accepted updates (before that only a non-finite
norm is refused); a factor or ratio of 0 turns each rule off. Refused updates never enter the
window; an accepted one enters with the weight it was folded with (after the cap). The
decisions are a deterministic function of the arrival order, and the window is plain data
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
"""Accepted updates whose scalars the guards compare against (``asynchronous.guard_window``):
two of FedBuff's default buffers (``K = 10``), so the median follows the shrinking delta norms
of a converging model within a few versions, while a single site would have to send more than
half of the last 20 accepted updates to move it."""


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
    """

    norm: float
    weight: float
    reported: float
    median_weight: float = 0.0

    @property
    def capped(self) -> bool:
        """Whether the weight was lowered."""
        return self.weight < self.reported


class GuardWindow:
    """The scalars of the last ``size`` accepted updates and the decisions taken from them.

    Parameters
    ----------
    size : int
        ``W``: accepted updates remembered (at least :data:`MEDIAN_MIN_UPDATES`).
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
        self._norms: deque[float] = deque(maxlen=size)
        self._weights: deque[float] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self._norms)

    @property
    def active(self) -> bool:
        """Whether the window holds enough accepted updates for the median-relative rules."""
        return len(self._norms) >= MEDIAN_MIN_UPDATES

    def judge(self, norm: float, weight: float, *, site: str, cap: bool = True) -> Verdict:
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

        Raises
        ------
        UpdateRejected
            A norm bomb (or a non-finite norm), named with the window's median.
        """
        norms = [*self._norms, float(norm)] if self.active else [float(norm)]
        if len(norms) - 1 in norm_outliers(norms, self.norm_outlier_factor):
            finite = [n for n in norms if math.isfinite(n)]
            median = float(np.median(finite)) if finite else 0.0
            rule = (f"must be <= strategy.norm_outlier_factor x the median delta norm of the "
                    f"last {len(norms) - 1} accepted updates and this one = "
                    f"{self.norm_outlier_factor:g} x {median:.6g}") if self.active \
                else "must be finite"
            raise UpdateRejected(explain(
                f"{site}.delta_norm", float(f"{norm:.6g}"), rule,
                "the update is refused and never reaches the model; check the site (a norm "
                "bomb?), or raise / turn off (0) strategy.norm_outlier_factor"))
        if not cap or not self.active:
            return Verdict(float(norm), float(weight), float(weight))
        weights, over = cap_weights([*self._weights, float(weight)], self.max_weight_ratio)
        if len(weights) - 1 in over:
            cap_value = float(weights[-1])
            return Verdict(float(norm), cap_value, float(weight),
                           cap_value / self.max_weight_ratio)
        return Verdict(float(norm), float(weight), float(weight))

    def accept(self, verdict: Verdict) -> None:
        """Remember a folded update's norm and (capped) weight; the oldest one leaves."""
        self._norms.append(verdict.norm)
        self._weights.append(verdict.weight)

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the window's norms and weights, oldest first."""
        return {"size": self.size, "norms": list(self._norms), "weights": list(self._weights)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict` output (``None``: an empty window, an older checkpoint).

        A window saved with another size keeps its newest ``size`` entries.

        Raises
        ------
        ConfigError
            Lists of different lengths or values that are not finite numbers >= 0.
        """
        self._norms.clear()
        self._weights.clear()
        if not state:
            return
        norms, weights = list(state.get("norms", [])), list(state.get("weights", []))
        ok = len(norms) == len(weights) and all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            and v >= 0 for v in norms + weights)
        if not ok:
            raise ConfigError(explain("asynchronous state.guard_window",
                                      f"{len(norms)} norms, {len(weights)} weights",
                                      "must be two lists of finite numbers >= 0 of one length",
                                      "resume from an intact checkpoint"))
        self._norms.extend(float(v) for v in norms)
        self._weights.extend(float(v) for v in weights)
