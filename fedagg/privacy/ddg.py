"""The distributed discrete Gaussian mechanism of one round: site encoder, server decoder.

Kairouz, Liu, Steinke (ICML 2021, Algorithm 1 and Sec. 4) make secure aggregation
differentially private without a trusted party: each site adds a share of integer noise to
its integer-encoded update, secure aggregation reveals only the sum modulo ``2^b``, and the
sum of the shares is noise enough for differential privacy. One round here, with parameters
:class:`DdgParams` (``c``, ``gamma``, ``beta``, ``sigma_site``, ``b``, ``n``, ``n_min``,
``d``):

Site (:class:`DdgEncoder`)

1. **clip** the flattened update ``x`` to L2 norm ``c`` (``x * min(1, c / ||x||)``): the
   sensitivity of the sum to one site;
2. **scale** by ``1 / gamma`` (``gamma`` is the grid step in model units);
3. **rotate** with the round's public randomized Hadamard transform
   (:class:`fedagg.privacy.rotation.HadamardRotation`; pads to ``d_pad``, a power of two), so
   every coordinate carries about ``||x|| / sqrt(d_pad)`` and the modular sum rarely wraps;
4. **round** each coordinate randomly up or down, unbiased, again until the squared norm is
   at most ``Delta_2^2`` (:func:`fedagg.privacy.rounding.conditional_round`): the integer
   vector's norm is bounded with certainty, which the privacy analysis needs;
5. **add noise** ``N_Z(0, sigma_site^2)`` per coordinate
   (:func:`fedagg.privacy.discrete_gaussian.sample_discrete_gaussian`), with
   ``sigma_site^2 = sigma^2 / n_min``: any ``n_min`` surviving sites' shares carry the target
   ``sigma^2`` together, and each additional survivor only adds noise;
6. **reduce** modulo ``2^b`` into ``uint32`` (two's complement in the ring ``Z_2^b``), the
   input of secure aggregation's masking (``RingMasker.mask_encoded``).

Server (:class:`DdgDecoder`), given the unmasked ring sum of the ``k`` survivors: map it to
the centred integers ``[-2^(b-1), 2^(b-1))``, multiply by ``gamma``, invert the rotation,
drop the padding; the sum's estimate is unbiased (up to the clipping and the conditioning of
the rounding) and the mean is ``sum / k``, unweighted: under differential privacy every site
contributes a vector of norm at most ``c``, and example counts are not used.

What the guarantee covers. The sum of ``n_min`` shares is the mechanism of KLS 2021,
Theorem 1 (accounted by :mod:`fedagg.privacy.accounting`); more survivors add independent
noise (post-processing), so the guarantee holds for every round with ``k >= n_min``
survivors; :meth:`DdgDecoder.decode` refuses ``k < n_min`` (the secure aggregation threshold
must be at least ``n_min``). It protects one site's update (add or remove one site's
contribution) against a server that sees only the sum. A site's own noise is known to that
site: if up to ``t`` sites collude with the server, size ``n_min`` as the honest survivors
(``n_min = survivors - t``). The ring wrap does not weaken privacy (decoding is
post-processing of the sum); it only costs accuracy.

Modular wrap. The ring holds the coordinates of the sum in ``[-2^(b-1), 2^(b-1))``. Each
rotated coordinate of the sum of ``k <= n`` clipped updates is sub-Gaussian with variance
proxy ``(n c / gamma)^2 / d_pad`` (flattening, independent of the data as long as the round's
seed is), the noise adds ``n sigma_site^2`` (the discrete Gaussian is ``sigma^2``-sub-Gaussian,
CKS 2020 Sec. 2), and rounding moves each site's coordinate by less than 1. So, with
``V = (n c / gamma)^2 / d_pad + n sigma_site^2``, the probability that any coordinate wraps is at
most ``2 d_pad exp(-(2^(b-1) - n)^2 / (2 V))`` (union bound over the coordinates):
:attr:`DdgParams.overflow_probability`, the quantity :mod:`fedagg.privacy.calibrate` keeps
small (KLS 2021, Sec. 4.3, modular clipping). A wrapped coordinate is a valid ring element,
so the server cannot tell it from a large one; it decodes to its value minus ``2^b`` (before
the inverse rotation spreads the error over all coordinates). :attr:`DecodedSum.peak` (the
largest centred magnitude as a fraction of ``2^(b-1)``) near 1 is the sign to look for. An
update crafted against a known rotation (one coordinate holding all of its norm) can make the
sum wrap: that is an integrity attack of a site, outside what this mechanism protects.

References
----------
.. [KLS2021] P. Kairouz, Z. Liu, T. Steinke. "The Distributed Discrete Gaussian Mechanism for
   Federated Learning with Secure Aggregation". ICML 2021 (Algorithm 1; Sec. 4.1 rounding,
   4.2 flattening, 4.3 modular clipping; Theorem 1).
.. [CKS2020] C. Canonne, G. Kamath, T. Steinke. "The Discrete Gaussian for Differential
   Privacy". NeurIPS 2020.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import ArrayLike, NDArray

from fedagg.errors import AbortRound, ConfigError, ProtocolError, explain
from fedagg.privacy.discrete_gaussian import sample_discrete_gaussian
from fedagg.privacy.rotation import HadamardRotation, next_power_of_two
from fedagg.privacy.rounding import (
    DEFAULT_MAX_TRIES,
    conditional_round,
    rounded_l1_bound,
    rounded_l2_bound,
)
from fedagg.secagg.fixed_point import MAX_RING_BITS, MIN_RING_BITS

__all__ = [
    "DEFAULT_BETA",
    "MAX_OVERFLOW_PROBABILITY",
    "DdgDecoder",
    "DdgEncoder",
    "DdgParams",
    "DecodedSum",
    "SiteEncoding",
    "clip_to_norm",
    "overflow_bound",
]

log = logging.getLogger(__name__)

DEFAULT_BETA: Final = math.exp(-0.5)
"""KLS 2021's conditional-rounding parameter: ``sqrt(2 ln(1/beta)) = 1``."""
MAX_OVERFLOW_PROBABILITY: Final = 1e-3
"""Largest per-round wrap bound :class:`DdgParams` accepts (calibration aims far lower)."""
_MAX_DIM: Final = 1 << 30
_INT64_NORM_LIMIT: Final = 2.0**62


def _whole(field: str, value: object, low: int, high: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not (
            low <= int(value) <= high):
        raise ConfigError(explain(field, value, f"must be a whole number in [{low}, {high}]",
                                  fix))
    return int(value)


def _real(field: str, value: object, rule: str, ok: Callable[[float], bool], fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating) or not (
            math.isfinite(float(value)) and ok(float(value))):
        raise ConfigError(explain(field, value, rule, fix))


def overflow_bound(*, num_sites: int, clip: float, gamma: float, sigma_site: float,
                   ring_bits: int, padded_dim: int) -> float:
    """``min(1, 2 d_pad exp(-(2^(b-1) - n)^2 / (2 V)))`` with
    ``V = (n c / gamma)^2 / d_pad + n sigma_site^2``: a bound on the probability that any
    coordinate of the sum of at most ``n`` sites leaves ``[-2^(b-1), 2^(b-1))`` (module
    docstring, "Modular wrap")."""
    margin = float((1 << (ring_bits - 1)) - num_sites)
    if margin <= 0:
        return 1.0
    n = float(num_sites)
    var = (n * clip / gamma) ** 2 / padded_dim + n * sigma_site ** 2
    if var == 0.0:
        return 0.0
    log_p = math.log(2.0 * padded_dim) - margin * margin / (2.0 * var)
    return 1.0 if log_p >= 0 else math.exp(log_p)


def clip_to_norm(x: NDArray[np.float64], clip: float) -> tuple[float, bool]:
    """Scale ``x`` in place to L2 norm ``clip`` if it is longer: ``x * min(1, clip / ||x||)``.

    Returns ``(norm before clipping, whether it was clipped)``.

    Raises
    ------
    ConfigError
        ``x`` holds a NaN or an infinity.
    """
    norm = float(np.linalg.norm(x))
    if not math.isfinite(norm):
        raise ConfigError(explain("update", "non-finite", "must hold finite values only",
                                  "fix the training step (a NaN or an infinity)"))
    clipped = norm > clip
    if clipped:
        x *= clip / norm
    return norm, clipped


@dataclass(frozen=True)
class DdgParams:
    """The parameters of one distributed discrete Gaussian round (KLS 2021, Algorithm 1).

    Grid units: the integer grid after scaling by ``1 / gamma``; ``sigma_site`` is in those
    units (noise std in model units is ``gamma * sigma_site``).

    Parameters
    ----------
    clip : float
        L2 clipping norm ``c`` of a site's update (model units), ``> 0``.
    gamma : float
        Grid step ``gamma`` (model units per integer), ``> 0``.
    sigma_site : float
        Each site's discrete Gaussian parameter ``sigma / sqrt(n_min)`` (grid units);
        ``0`` disables the noise (no privacy), otherwise ``>= 0.5`` (KLS 2021, Theorem 1).
    ring_bits : int
        Ring width ``b`` of secure aggregation (bits per coordinate on the wire), in
        ``[MIN_RING_BITS, MAX_RING_BITS]`` = ``[8, 32]``.
    num_sites : int
        ``n``: sites in the round (at most ``n`` shares are summed), ``>= 1``.
    min_sites : int
        ``n_min``: survivors the noise is sized for, ``1 <= n_min <= n``.
    dim : int
        ``d``: length of the flattened update, in ``[1, 2^30]``.
    beta : float
        Conditional-rounding parameter in ``[0, 1)`` (:mod:`fedagg.privacy.rounding`;
        ``0`` = plain rounding with the worst-case bound ``c / gamma + sqrt(d_pad)``).
    max_tries : int
        Rounding tries before the round-toward-zero fallback, ``>= 1``.

    Raises
    ------
    ConfigError
        A field out of range (the message names it), or a ring too small for the sum:
        :attr:`overflow_probability` above :data:`MAX_OVERFLOW_PROBABILITY`.
    """

    clip: float
    gamma: float
    sigma_site: float
    ring_bits: int
    num_sites: int
    min_sites: int
    dim: int
    beta: float = DEFAULT_BETA
    max_tries: int = DEFAULT_MAX_TRIES

    def __post_init__(self) -> None:
        _real("privacy.clip", self.clip, "must be a finite number > 0", lambda v: v > 0,
              "use the L2 norm bound of one site's update, e.g. 1.0")
        _real("privacy.gamma", self.gamma, "must be a finite number > 0", lambda v: v > 0,
              "let fedagg.privacy.calibrate_ddg choose it")
        _real("privacy.sigma_site", self.sigma_site, "must be 0 (no noise) or in [0.5, 2^40]",
              lambda v: v == 0.0 or 0.5 <= v <= 2.0**40,
              "let fedagg.privacy.calibrate_ddg choose it (KLS 2021 Theorem 1 needs >= 0.5)")
        _whole("privacy.ring_bits", self.ring_bits, MIN_RING_BITS, MAX_RING_BITS,
               "use the secure aggregation round's ring width")
        _whole("privacy.num_sites", self.num_sites, 1, 1 << 20,
               "pass the number of sites in the round")
        _whole("privacy.min_sites", self.min_sites, 1, int(self.num_sites),
               f"use 1 <= min_sites <= num_sites = {self.num_sites} (at most the secure "
               "aggregation threshold's number of survivors)")
        _whole("privacy.dim", self.dim, 1, _MAX_DIM, "pass the flattened update's size")
        _real("privacy.beta", self.beta, "must be in [0, 1)", lambda v: 0.0 <= v < 1.0,
              "use exp(-0.5) (KLS 2021) or 0 for unconditional rounding")
        _whole("privacy.max_tries", self.max_tries, 1, 1 << 20, "use e.g. 1000")
        if (self.clip / self.gamma + math.sqrt(self.padded_dim)) ** 2 >= _INT64_NORM_LIMIT:
            raise ConfigError(explain(
                "privacy.gamma", self.gamma,
                f"clip / gamma = {self.clip / self.gamma:.3g} grid units is beyond any ring "
                "(squared norms must stay below 2^62)",
                "raise gamma (fedagg.privacy.calibrate_ddg chooses it for the ring)"))
        p = self.overflow_probability
        if p > MAX_OVERFLOW_PROBABILITY:
            raise ConfigError(explain(
                "privacy.ring_bits", self.ring_bits,
                f"the {self.ring_bits}-bit ring is too small for the sum of {self.num_sites} "
                f"sites at gamma = {self.gamma:.4g}, sigma_site = {self.sigma_site:.4g}: it "
                f"wraps with probability up to {p:.3g} per round (limit "
                f"{MAX_OVERFLOW_PROBABILITY})",
                "raise ring_bits or gamma, or let fedagg.privacy.calibrate_ddg choose gamma "
                "and sigma for this ring"))

    @property
    def padded_dim(self) -> int:
        """``d_pad``: the next power of two of ``dim`` (length of the ring vector)."""
        return next_power_of_two(self.dim)

    @property
    def modulus(self) -> int:
        """``2^b``."""
        return 1 << int(self.ring_bits)

    @property
    def noise_shares(self) -> int:
        """Shares the privacy analysis counts on: ``n_min``."""
        return int(self.min_sites)

    @property
    def sigma(self) -> float:
        """The target std of the summed noise of ``n_min`` shares (grid units)."""
        return math.sqrt(self.min_sites) * float(self.sigma_site)

    @property
    def l2_bound(self) -> float:
        """``Delta_2``: the L2 norm bound of a site's rounded vector (grid units)."""
        return rounded_l2_bound(self.clip / self.gamma, float(self.beta), self.padded_dim)

    @property
    def l1_bound(self) -> float:
        """``Delta_1 = min(sqrt(d_pad) Delta_2, Delta_2^2)`` (grid units)."""
        return rounded_l1_bound(self.l2_bound, self.padded_dim)

    @property
    def bound_sq(self) -> int:
        """``floor(Delta_2^2)``: the squared norm the rounding accepts (exact integer)."""
        return math.floor(self.l2_bound ** 2)

    @property
    def overflow_probability(self) -> float:
        """Upper bound on the probability that the sum of ``<= n`` sites wraps in one round
        (:func:`overflow_bound`)."""
        return overflow_bound(num_sites=int(self.num_sites), clip=float(self.clip),
                              gamma=float(self.gamma), sigma_site=float(self.sigma_site),
                              ring_bits=int(self.ring_bits), padded_dim=self.padded_dim)

    def mean_noise_std(self, survivors: int) -> float:
        """Std of the noise on each coordinate of the decoded mean with ``survivors`` sites,
        in model units: ``gamma * sqrt(survivors) * sigma_site / survivors`` (the rounding
        adds at most ``gamma / (2 sqrt(survivors))`` more; the discrete Gaussian's variance
        is at most ``sigma_site^2``, equal to it within ``1e-6`` for ``sigma_site >= 1``)."""
        k = float(survivors)
        return float(self.gamma) * math.sqrt(k) * float(self.sigma_site) / k


@dataclass(frozen=True)
class SiteEncoding:
    """What one site's encoder produced.

    ``ring`` goes to secure aggregation; the rest is for the site's own logs. It depends on
    the private update, so it must not be sent to the server (the clipping bit of every site
    would leak a little about its data, the norm far more).

    Attributes
    ----------
    ring : numpy.ndarray
        ``uint32`` vector of ``padded_dim`` ring elements in ``[0, 2^b)``.
    norm : float
        L2 norm of the update before clipping.
    clipped : bool
        Whether the update was scaled down to norm ``clip``.
    tries : int
        Randomized roundings drawn.
    fallback : bool
        Whether the rounding fell back to rounding toward zero (:mod:`fedagg.privacy.rounding`).
    """

    ring: NDArray[np.uint32]
    norm: float
    clipped: bool
    tries: int
    fallback: bool


@dataclass(frozen=True)
class DecodedSum:
    """The server's view of one round after decoding.

    Attributes
    ----------
    sum : numpy.ndarray
        float64 estimate of the sum of the survivors' clipped updates (``dim`` values), noised.
    survivors : int
        ``k``: sites whose shares are in the sum.
    peak : float
        Largest centred magnitude of the ring sum as a fraction of ``2^(b-1)``; close to 1
        means a coordinate may have wrapped (module docstring).
    """

    sum: NDArray[np.float64]
    survivors: int
    peak: float

    @property
    def mean(self) -> NDArray[np.float64]:
        """``sum / survivors``: the unweighted mean of the clipped updates, noised."""
        out: NDArray[np.float64] = self.sum / float(self.survivors)
        return out


class DdgEncoder:
    """A site's side of the distributed discrete Gaussian (steps 1-6 of the module docstring).

    Parameters
    ----------
    params : DdgParams
        The round's parameters (the same at every site and at the server).

    Examples
    --------
    >>> p = DdgParams(clip=1.0, gamma=1e-3, sigma_site=0.0, ring_bits=16, num_sites=2,
    ...               min_sites=2, dim=3)
    >>> enc = DdgEncoder(p).encode([0.3, 0.0, -0.4], seed=b"r1", rng=np.random.default_rng(0))
    >>> enc.ring.dtype, enc.ring.shape, enc.clipped
    (dtype('uint32'), (4,), False)
    """

    def __init__(self, params: DdgParams) -> None:
        self.params = params

    def encode(self, update: ArrayLike, *, seed: bytes,
               rng: np.random.Generator) -> SiteEncoding:
        """Clip, scale, rotate, round, noise and reduce one site's update.

        Parameters
        ----------
        update : array_like
            The site's update, ``dim`` values (any shape; flattened in C order).
        seed : bytes
            The round's public rotation seed (the server decodes with the same seed).
        rng : numpy.random.Generator
            The site's private randomness (rounding and noise); never shared.

        Returns
        -------
        SiteEncoding

        Raises
        ------
        ConfigError
            ``update`` does not have ``dim`` values, or holds a NaN or an infinity.
        """
        p = self.params
        x = np.array(update, dtype=np.float64, copy=True).reshape(-1)
        if x.size != p.dim:
            raise ConfigError(explain("update", x.size, f"must have {p.dim} values "
                                      "(privacy.dim)", "pass the flattened update of the "
                                      "round's model, or build DdgParams for its size"))
        norm, clipped = clip_to_norm(x, float(p.clip))
        x /= p.gamma
        y = HadamardRotation(p.dim, seed).forward(x)
        del x
        rounded = conditional_round(y, p.bound_sq, rng, max_tries=p.max_tries)
        del y
        if rounded.fallback:
            log.warning("conditional rounding reached %d tries; rounded toward zero "
                        "(privacy bound kept, this update slightly biased)", p.max_tries)
        z = rounded.values
        if p.sigma_site > 0:
            z += sample_discrete_gaussian(float(p.sigma_site), z.size, rng)
        np.bitwise_and(z, p.modulus - 1, out=z)
        ring: NDArray[np.uint32] = z.astype(np.uint32)
        return SiteEncoding(ring, norm, clipped, rounded.tries, rounded.fallback)


class DdgDecoder:
    """The server's side: the unmasked ring sum back to a float sum (module docstring).

    Parameters
    ----------
    params : DdgParams
        The round's parameters.
    """

    def __init__(self, params: DdgParams) -> None:
        self.params = params

    def decode(self, ring_sum: ArrayLike, *, survivors: int, seed: bytes) -> DecodedSum:
        """Centre, rescale, rotate back and unpad the sum of ``survivors`` sites' rings.

        Parameters
        ----------
        ring_sum : array_like
            The unmasked sum modulo ``2^b``: ``padded_dim`` integers in ``[0, 2^b)``.
        survivors : int
            ``k``: sites whose encodings are in the sum, ``n_min <= k <= n``.
        seed : bytes
            The round's public rotation seed.

        Returns
        -------
        DecodedSum

        Raises
        ------
        AbortRound
            ``survivors < min_sites``: the sum carries less noise than the privacy
            accounting assumes; it must not be used.
        ProtocolError
            ``survivors > num_sites``, or ``ring_sum`` of the wrong length, type or range.
        """
        p = self.params
        if isinstance(survivors, bool) or not isinstance(survivors, int | np.integer):
            raise ProtocolError(explain("survivors", survivors, "must be a whole number",
                                        "pass the number of sites in the sum"))
        k = int(survivors)
        if k < p.min_sites:
            raise AbortRound(explain(
                "survivors", k, f"the noise is sized for at least min_sites = {p.min_sites} "
                "survivors; fewer leave the sum less private than accounted",
                "discard this sum and set the secure aggregation threshold to at least "
                "privacy.min_sites"))
        if k > p.num_sites:
            raise ProtocolError(explain("survivors", k, f"must be <= num_sites = "
                                        f"{p.num_sites}", "build DdgParams for the round's "
                                        "number of sites"))
        s = np.asarray(ring_sum)
        if s.shape != (p.padded_dim,) or s.dtype.kind not in "ui":
            raise ProtocolError(explain("ring sum", (s.shape, str(s.dtype)),
                                        f"must be {p.padded_dim} integers", "pass the unmasked "
                                        "sum without the weight slot"))
        v = s.astype(np.int64)
        if v.size and (int(v.min()) < 0 or int(v.max()) >= p.modulus):
            raise ProtocolError(explain("ring sum", (int(v.min()), int(v.max())),
                                        f"values must lie in [0, 2^{p.ring_bits})",
                                        "reduce the sum modulo 2^ring_bits"))
        half = p.modulus >> 1
        v[v >= half] -= p.modulus
        peak = float(np.abs(v).max()) / half if v.size else 0.0
        y = v.astype(np.float64)
        del v
        y *= p.gamma
        total = HadamardRotation(p.dim, seed).inverse(y)
        return DecodedSum(total, k, peak)
