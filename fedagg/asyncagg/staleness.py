"""Staleness weights: how much an update trained from an older model version still counts.

An update that a site computed from model version ``tau`` and that the server folds while the
global model is at version ``t`` has staleness ``s = t - tau >= 0``. Its delta is scaled by a
weight ``w(s)`` in ``(0, 1]`` before it enters the buffer:

``constant``
    ``w(s) = 1`` (FedBuff without down-weighting).
``polynomial``
    ``w(s) = (1 + s) ** -a`` (Xie et al. 2019, "Asynchronous Federated Optimization",
    section 5.2; FedBuff, Nguyen et al. 2022, section 5 uses ``a = 0.5``, i.e.
    ``1 / sqrt(1 + s)``).
``hinge``
    ``w(s) = 1`` for ``s <= b``, else ``1 / (a * (s - b) + 1)`` (Xie et al. 2019,
    section 5.2).

All three equal 1 at ``s = 0``, so with no staleness the buffer is the plain (weighted) mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from fedagg.errors import ConfigError, explain

__all__ = ["STALENESS_KINDS", "StalenessKind", "StalenessWeight"]

StalenessKind = Literal["constant", "polynomial", "hinge"]
STALENESS_KINDS: tuple[str, ...] = ("constant", "polynomial", "hinge")


@dataclass(frozen=True)
class StalenessWeight:
    """``w(s)`` for integer staleness ``s >= 0`` (see the module docstring).

    Parameters
    ----------
    kind : {"constant", "polynomial", "hinge"}
        The family.
    a : float
        Exponent (``polynomial``) or slope after the knee (``hinge``); ``>= 0``.
    b : int
        Knee of ``hinge``: updates at most ``b`` versions old keep weight 1; ``>= 0``.

    Raises
    ------
    ConfigError
        Unknown kind, negative or non-finite ``a``, negative ``b``.

    Examples
    --------
    >>> StalenessWeight("polynomial", a=0.5)(3)
    0.5
    >>> StalenessWeight("hinge", a=1.0, b=2)(4)
    0.3333333333333333
    """

    kind: str = "polynomial"
    a: float = 0.5
    b: int = 4

    def __post_init__(self) -> None:
        if self.kind not in STALENESS_KINDS:
            raise ConfigError(explain("asynchronous.staleness", self.kind,
                                      "must be one of " + ", ".join(STALENESS_KINDS),
                                      "choose one of the listed staleness weights"))
        if not (isinstance(self.a, int | float) and math.isfinite(self.a) and self.a >= 0):
            raise ConfigError(explain("asynchronous.staleness_a", self.a,
                                      "must be a finite number >= 0",
                                      "use e.g. 0.5 (FedBuff's 1/sqrt(1+s))"))
        if isinstance(self.b, bool) or not isinstance(self.b, int) or self.b < 0:
            raise ConfigError(explain("asynchronous.staleness_b", self.b,
                                      "must be a whole number >= 0",
                                      "use e.g. 4 (updates up to 4 versions old keep weight 1)"))

    def __call__(self, staleness: int) -> float:
        """The weight of an update ``staleness`` versions old.

        Raises
        ------
        ConfigError
            Negative staleness (an update from a version the server has not made yet).
        """
        s = int(staleness)
        if s < 0:
            raise ConfigError(explain("staleness", s, "must be >= 0",
                                      "an update cannot come from a future model version"))
        if self.kind == "constant":
            return 1.0
        if self.kind == "polynomial":
            return float((1.0 + s) ** -float(self.a))
        if s <= self.b:
            return 1.0
        return 1.0 / (float(self.a) * (s - self.b) + 1.0)
