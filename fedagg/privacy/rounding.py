"""Conditional randomized rounding to the integer grid, with a hard bound on the norm.

Each coordinate ``x_j`` of the (scaled, rotated) site vector is rounded to ``floor(x_j) + 1``
with probability ``x_j - floor(x_j)`` and to ``floor(x_j)`` otherwise, so the rounding is
unbiased. Rounding can grow the L2 norm, and the privacy analysis needs a bound on the norm
of what a site actually adds to the sum. Kairouz, Liu, Steinke (ICML 2021, Sec. 4.1 and
their proposition on conditional rounding) round again until

``||round(x)||_2^2 <= Delta_2^2 = min( ||x||^2 + d/4 + sqrt(2 ln(1/beta)) (||x|| + sqrt(d)/2),
                                      (||x|| + sqrt(d))^2 )``

for a norm bound ``||x|| <= c`` (all in grid units): one unconditional rounding meets the
first bound with probability at least ``1 - beta``, and the second always holds, because
every coordinate moves by less than 1. So the expected number of tries is at most
``1 / (1 - beta)`` (``beta = exp(-0.5)``, KLS's choice: at most 2.6 tries, in practice one).

fedagg caps the tries (:data:`DEFAULT_MAX_TRIES`). When the cap is reached, which has
probability at most ``beta^max_tries`` (``< 1e-200`` with the defaults), the vector is rounded
*toward zero* instead: every coordinate's magnitude shrinks, so the norm is at most
``||x|| <= c <= Delta_2`` and the sensitivity bound of the privacy analysis still holds; the
only cost is a small bias of that one site in that one round, and the result says so
(:attr:`Rounded.fallback`). The bound is checked on exact integers (int64), not in floating
point.

References
----------
.. [KLS2021] P. Kairouz, Z. Liu, T. Steinke. "The Distributed Discrete Gaussian Mechanism for
   Federated Learning with Secure Aggregation". ICML 2021 (Sec. 4.1, conditional randomized
   rounding; the L2 and L1 bounds on the rounded vector).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "DEFAULT_MAX_TRIES",
    "Rounded",
    "conditional_round",
    "rounded_l1_bound",
    "rounded_l2_bound",
]

DEFAULT_MAX_TRIES: Final = 1000
"""Rounding tries before the round-toward-zero fallback."""
_CHUNK: Final = 1 << 20


def rounded_l2_bound(norm: float, beta: float, dim: int) -> float:
    """KLS 2021's bound ``Delta_2`` on the L2 norm of a conditionally rounded vector.

    Parameters
    ----------
    norm : float
        Bound on the L2 norm of the vector before rounding, in grid units (``c / gamma``).
    beta : float
        Failure probability of one unconditional rounding, in ``[0, 1)``; ``0`` means no
        conditioning (the deterministic bound ``norm + sqrt(dim)``).
    dim : int
        Number of coordinates rounded (the padded dimension).
    """
    hard = norm + math.sqrt(dim)
    if beta == 0.0:
        return hard
    soft_sq = norm * norm + 0.25 * dim + math.sqrt(2.0 * math.log(1.0 / beta)) * (
        norm + 0.5 * math.sqrt(dim))
    return min(hard, math.sqrt(soft_sq))


def rounded_l1_bound(l2_bound: float, dim: int) -> float:
    """Bound on the L1 norm of an integer vector of L2 norm ``<= l2_bound`` in ``Z^dim``:
    ``min(sqrt(dim) l2, l2^2)`` (Cauchy–Schwarz; and ``|v_j| <= v_j^2`` on integers)."""
    return l2_bound * min(math.sqrt(dim), l2_bound)


@dataclass(frozen=True)
class Rounded:
    """The rounded vector and how it was obtained.

    Attributes
    ----------
    values : numpy.ndarray
        int64 grid point with ``||values||_2^2 <= bound_sq``.
    tries : int
        Randomized roundings drawn (``1`` in the common case).
    fallback : bool
        Whether every try failed and the vector was rounded toward zero instead.
    """

    values: NDArray[np.int64]
    tries: int
    fallback: bool


def _sum_squares(v: NDArray[np.int64]) -> int:
    total = 0
    for start in range(0, v.size, _CHUNK):
        part = v[start:start + _CHUNK]
        total += int(np.dot(part, part))
    return total


def conditional_round(x: NDArray[np.float64], bound_sq: int, rng: np.random.Generator, *,
                      max_tries: int = DEFAULT_MAX_TRIES) -> Rounded:
    """Randomly round ``x`` to integers until the squared norm is ``<= bound_sq``.

    Parameters
    ----------
    x : numpy.ndarray
        float64 vector in grid units, with ``||x||_2^2 <= bound_sq`` (the caller clips).
    bound_sq : int
        ``floor(Delta_2^2)``: the largest squared norm accepted (exact integer comparison).
    rng : numpy.random.Generator
        The site's private randomness.
    max_tries : int
        Tries before the round-toward-zero fallback (module docstring).

    Returns
    -------
    Rounded
    """
    floor = np.floor(x)
    frac = x - floor
    base = floor.astype(np.int64)
    for tries in range(1, max_tries + 1):
        up = rng.random(x.size) < frac
        values = base + up
        if _sum_squares(values) <= bound_sq:
            return Rounded(values, tries, False)
    return Rounded(np.trunc(x).astype(np.int64), max_tries, True)
