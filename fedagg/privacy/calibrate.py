"""Choose the grid step ``gamma`` and the noise ``sigma`` of the distributed discrete Gaussian.

Given the clip ``c``, the dimension ``d``, the sites ``n`` and the survivors ``n_min`` the
noise is sized for, the ring width ``b``, the budget ``(epsilon, delta)`` and the number of
participations ``T``, :func:`calibrate_ddg` returns the :class:`DdgParams` that

(a) keep the per-round wrap bound :attr:`DdgParams.overflow_probability` (the sub-Gaussian
    bound on the rotated, rounded, noised sum of ``n`` sites, :mod:`fedagg.privacy.ddg`) at or
    below ``overflow_probability``, and
(b) spend at most ``epsilon`` at ``delta`` after ``T`` participations, by the ledger of
    :mod:`fedagg.privacy.accounting` (KLS 2021 Theorem 1, dp-accounting's RDP accountant),

with the least noise on the decoded mean. For a fixed ``gamma`` the smallest feasible
``sigma`` is found by bisection (epsilon decreases with ``sigma``). The noise in model units,
``gamma sigma``, grows with ``gamma`` (the rounding inflates the sensitivity ``Delta_2`` by
about ``gamma^2 d / 4``), while the wrap bound falls with it (the same norm takes fewer grid
steps); so the best ``gamma`` is the smallest one with an acceptable wrap bound, found by
bisection on ``log gamma``. This is KLS 2021's trade-off (Sec. 4.3 and 5: bits, noise and
rounding), solved with a rigorous tail bound where their experiments use ``k`` standard
deviations of a Gaussian approximation.

References
----------
.. [KLS2021] P. Kairouz, Z. Liu, T. Steinke. "The Distributed Discrete Gaussian Mechanism for
   Federated Learning with Secure Aggregation". ICML 2021 (Sec. 4.3 modular clipping, Sec. 5
   choice of the scale and the noise).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import numpy as np

from fedagg.errors import ConfigError, explain
from fedagg.privacy.accounting import PrivacyLedger, ddg_charge, ddg_round_charge
from fedagg.privacy.ddg import DEFAULT_BETA, MAX_OVERFLOW_PROBABILITY, DdgParams, overflow_bound
from fedagg.privacy.rotation import next_power_of_two
from fedagg.privacy.rounding import DEFAULT_MAX_TRIES, rounded_l1_bound, rounded_l2_bound
from fedagg.secagg.fixed_point import MAX_RING_BITS

__all__ = ["DEFAULT_OVERFLOW_PROBABILITY", "DdgCalibration", "calibrate_ddg"]

DEFAULT_OVERFLOW_PROBABILITY: Final = 1e-6
"""Default per-round bound on the probability that the sum wraps (any coordinate)."""
_MIN_SIGMA: Final = 0.5
_REL_TOL: Final = 1e-6


@dataclass(frozen=True)
class DdgCalibration:
    """The result of :func:`calibrate_ddg`.

    Attributes
    ----------
    params : DdgParams
        The round's parameters (clip, gamma, sigma_site, ring, sites, dimension).
    epsilon : float
        Epsilon after :attr:`participations` rounds at :attr:`delta` (``<=`` the target).
    delta : float
        The run's delta.
    participations : int
        Rounds each site takes part in.
    overflow_probability : float
        Per-round bound on the probability that the sum wraps.
    """

    params: DdgParams
    epsilon: float
    delta: float
    participations: int
    overflow_probability: float

    @property
    def bits_per_coordinate(self) -> int:
        """Bits each coordinate takes on the wire: the ring width (``padded_dim`` of them)."""
        return int(self.params.ring_bits)

    @property
    def noise_multiplier(self) -> float:
        """Std of the noise of ``n_min`` shares over the clip, ``sqrt(n_min) sigma_site gamma
        / c``: comparable with the ``z`` of central DP (noise ``z c`` on the sum)."""
        p = self.params
        return p.sigma * float(p.gamma) / float(p.clip)

    @property
    def sensitivity_inflation(self) -> float:
        """``Delta_2 gamma / c``: how much rounding grows the sensitivity (``>= 1``)."""
        p = self.params
        return p.l2_bound * float(p.gamma) / float(p.clip)

    def mean_noise_std(self, survivors: int | None = None) -> float:
        """Noise std per coordinate of the decoded mean (model units), by default with all
        ``num_sites`` surviving (:meth:`DdgParams.mean_noise_std`)."""
        k = int(self.params.num_sites) if survivors is None else int(survivors)
        return self.params.mean_noise_std(k)


def _real_positive(field: str, value: object, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating) or not (
            math.isfinite(float(value)) and float(value) > 0):
        raise ConfigError(explain(field, value, "must be a finite number > 0", fix))
    return float(value)


def _bisect_log(feasible: Callable[[float], bool], lo: float, hi: float) -> float:
    """``hi`` shrunk towards the boundary: ``feasible(hi)`` holds, ``feasible(lo)`` not."""
    while hi / lo > 1.0 + _REL_TOL:
        mid = math.sqrt(lo * hi)
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


def calibrate_ddg(*, clip: float, dim: int, num_sites: int, min_sites: int, ring_bits: int,
                  epsilon: float, delta: float, participations: int,
                  beta: float = DEFAULT_BETA,
                  overflow_probability: float = DEFAULT_OVERFLOW_PROBABILITY,
                  max_tries: int = DEFAULT_MAX_TRIES) -> DdgCalibration:
    """Choose ``gamma`` and ``sigma_site`` for a budget and a ring (module docstring).

    Parameters
    ----------
    clip : float
        L2 clip ``c`` of a site's update (model units).
    dim : int
        Length ``d`` of the flattened update.
    num_sites, min_sites : int
        ``n`` sites per round, ``n_min`` survivors the noise is sized for.
    ring_bits : int
        Ring width ``b`` of secure aggregation.
    epsilon, delta : float
        The budget after ``participations`` rounds.
    participations : int
        Rounds each site takes part in (``rounds`` when every site is in every round).
    beta : float
        Conditional-rounding parameter (:mod:`fedagg.privacy.rounding`).
    overflow_probability : float
        Target per-round bound on a wrap, in ``(0, MAX_OVERFLOW_PROBABILITY]``.
    max_tries : int
        Rounding tries before the fallback.

    Returns
    -------
    DdgCalibration

    Raises
    ------
    ConfigError
        An argument out of range (named), or a ring too small for any ``gamma``: the message
        gives the smallest ``ring_bits`` that works.

    Examples
    --------
    >>> cal = calibrate_ddg(clip=1.0, dim=1000, num_sites=10, min_sites=8, ring_bits=16,
    ...                     epsilon=4.0, delta=1e-5, participations=50)
    >>> cal.epsilon <= 4.0, cal.overflow_probability <= 1e-6, cal.bits_per_coordinate
    (True, True, 16)
    """
    c = _real_positive("privacy.clip", clip, "use the L2 norm bound of one site's update")
    eps = _real_positive("privacy.epsilon", epsilon, "use e.g. 2, 4 or 8")
    target_p = _real_positive("privacy.overflow_probability", overflow_probability,
                              f"use a value <= {MAX_OVERFLOW_PROBABILITY}, e.g. 1e-6")
    if target_p > MAX_OVERFLOW_PROBABILITY:
        raise ConfigError(explain("privacy.overflow_probability", overflow_probability,
                                  f"must be <= {MAX_OVERFLOW_PROBABILITY}", "use e.g. 1e-6"))
    # Every field DdgParams holds is checked (and named) by building it at a harmless point.
    DdgParams(clip=c, gamma=c, sigma_site=0.0, ring_bits=ring_bits, num_sites=num_sites,
              min_sites=min_sites, dim=dim, beta=beta, max_tries=max_tries)
    PrivacyLedger(delta)
    if isinstance(participations, bool) or not isinstance(participations, int) or (
            participations < 1):
        raise ConfigError(explain("privacy.participations", participations,
                                  "must be a whole number >= 1",
                                  "pass the rounds each site takes part in"))
    n, m, b = int(num_sites), int(min_sites), int(ring_bits)
    d_pad = next_power_of_two(int(dim))

    def epsilon_of(gamma: float, sigma: float) -> float:
        l2 = rounded_l2_bound(c / gamma, float(beta), d_pad)
        charge = ddg_charge(l2_bound=l2, l1_bound=rounded_l1_bound(l2, d_pad),
                            sigma_site=sigma, shares=m, dim=d_pad)
        ledger = PrivacyLedger(delta)
        ledger.record(charge, participations)
        return ledger.epsilon()

    def sigma_for(gamma: float) -> float:
        if epsilon_of(gamma, _MIN_SIGMA) <= eps:
            return _MIN_SIGMA
        hi = 2 * _MIN_SIGMA
        while epsilon_of(gamma, hi) > eps:
            hi *= 2.0
        return _bisect_log(lambda s: epsilon_of(gamma, s) <= eps, hi / 2.0, hi)

    def wraps_rarely(gamma: float) -> bool:
        return overflow_bound(num_sites=n, clip=c, gamma=gamma, sigma_site=sigma_for(gamma),
                              ring_bits=b, padded_dim=d_pad) <= target_p

    hi = c / float(1 << (b - 1))
    limit = c * 2.0**40
    while not wraps_rarely(hi):
        hi *= 2.0
        if hi > limit:
            raise ConfigError(explain(
                "privacy.ring_bits", ring_bits,
                f"no grid step fits the sum of {n} sites of dimension {dim} at epsilon = "
                f"{eps} in a {b}-bit ring with wrap probability <= {target_p}",
                _more_bits_hint(b, c, dim, n, m, eps, delta, participations, beta, target_p)))
    lo = hi / 2.0
    floor = c * 2.0**-60
    while wraps_rarely(lo) and lo > floor:
        hi, lo = lo, lo / 2.0
    gamma = _bisect_log(wraps_rarely, lo, hi)
    sigma = sigma_for(gamma)
    params = DdgParams(clip=c, gamma=gamma, sigma_site=sigma, ring_bits=b, num_sites=n,
                       min_sites=m, dim=int(dim), beta=float(beta), max_tries=int(max_tries))
    ledger = PrivacyLedger(delta)
    ledger.record(ddg_round_charge(params), participations)
    return DdgCalibration(params, ledger.epsilon(), float(delta), int(participations),
                          params.overflow_probability)


def _more_bits_hint(b: int, c: float, dim: int, n: int, m: int, eps: float, delta: float,
                    participations: int, beta: float, target_p: float) -> str:
    for more in range(b + 1, MAX_RING_BITS + 1):
        try:
            calibrate_ddg(clip=c, dim=dim, num_sites=n, min_sites=m, ring_bits=more,
                          epsilon=eps, delta=delta, participations=participations, beta=beta,
                          overflow_probability=target_p)
        except ConfigError:
            continue
        return f"use ring_bits >= {more}, fewer sites per round, or a larger epsilon"
    return "use fewer sites per round or a larger epsilon (even 32 bits do not fit)"
