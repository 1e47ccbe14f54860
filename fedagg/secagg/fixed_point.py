"""Fixed-point encoding of weighted updates into the ring ``Z_2^32``.

A site with update ``x`` (clipped to ``[-clip, clip]``) and weight ``w`` encodes the vector
``[w_q * x, w_q]`` where ``w_q = round(w / weight_scale * 2^f) / 2^f`` is its weight in
``[0, 1]`` quantised to ``f`` fractional bits (``weight_scale`` is a public upper bound on a
site's weight). The values are scaled by ``2^f`` and rounded *stochastically* (unbiased: the
expected encoding is exact), then reduced mod ``2^32`` (two's complement). The server
recovers ``sum w_q x`` and ``sum w_q`` and divides, so FedAvg stays exact up to quantisation.

Headroom: the sum of ``N`` encodings must not wrap, so ``N * (max(clip, 1) * 2^f + 1)`` must be
at most ``2^31 - 1``. :func:`resolve_frac_bits` picks the largest ``f`` that fits (or checks an
explicit one) and explains which parameter to change when nothing fits. The approach is the
fixed-point encoding of Bonawitz et al. (CCS 2017, section 3) with the unbiased stochastic
rounding of Gupta et al., "Deep Learning with Limited Numerical Precision", ICML 2015.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np
from numpy.typing import NDArray

from fedagg.errors import AbortRound, ConfigError, UpdateRejected, explain

__all__ = [
    "MAX_FRAC_BITS",
    "MIN_FRAC_BITS",
    "RING_LIMIT",
    "decode_sum",
    "encode",
    "error_bound",
    "fits",
    "quantize_weight",
    "resolve_frac_bits",
]

RING_LIMIT: Final = 2**31 - 1
"""Largest magnitude a (signed) sum may reach in ``Z_2^32`` without wrapping."""
MAX_FRAC_BITS: Final = 30
MIN_FRAC_BITS: Final = 8


def fits(num_sites: int, clip: float, frac_bits: int) -> bool:
    """Whether ``num_sites`` encodings at ``clip`` and ``frac_bits`` sum without wrapping."""
    return num_sites * (max(clip, 1.0) * 2.0**frac_bits + 1.0) <= RING_LIMIT


def resolve_frac_bits(num_sites: int, clip: float, frac_bits: int | None) -> int:
    """The fractional bits to use for ``num_sites`` sites.

    ``None`` picks the largest value in ``[MIN_FRAC_BITS, MAX_FRAC_BITS]`` with headroom; an
    explicit value is checked.

    Raises
    ------
    ConfigError
        No value fits: the message names the parameter to change.
    """
    if frac_bits is None:
        for f in range(MAX_FRAC_BITS, MIN_FRAC_BITS - 1, -1):
            if fits(num_sites, clip, f):
                return f
        raise ConfigError(
            explain(
                "secagg.clip",
                clip,
                f"with {num_sites} sites even {MIN_FRAC_BITS} fractional bits overflow the "
                "32-bit ring (sites * max(clip, 1) * 2^frac_bits must be < 2^31)",
                "lower secagg.clip or the number of sites per round",
            )
        )
    if not fits(num_sites, clip, frac_bits):
        best = math.floor(math.log2(max(RING_LIMIT / num_sites - 1, 1.0) / max(clip, 1.0)))
        raise ConfigError(
            explain(
                "secagg.frac_bits",
                frac_bits,
                f"{num_sites} sites * max(clip={clip}, 1) * 2^frac_bits must be < 2^31 "
                "(headroom of the 32-bit ring)",
                f"use frac_bits <= {best}, lower secagg.clip, or leave frac_bits unset (auto)",
            )
        )
    return frac_bits


def quantize_weight(weight: float, weight_scale: float, frac_bits: int) -> int:
    """``round(weight / weight_scale * 2^f)`` as an integer in ``[0, 2^f]``.

    Raises
    ------
    ConfigError
        ``weight`` is negative, not finite, or above the public ``weight_scale``.
    """
    if not math.isfinite(weight) or weight < 0:
        raise ConfigError(explain("weight", weight, "must be finite and >= 0", "pass examples"))
    if weight > weight_scale:
        raise ConfigError(
            explain(
                "secagg.weight_scale",
                weight_scale,
                f"a site weight ({weight}) exceeds the public weight bound",
                "set weight_scale to at least the largest number of examples per site",
            )
        )
    return round(weight / weight_scale * 2.0**frac_bits)


def encode(
    values: NDArray[np.floating],
    weight_q: int,
    *,
    frac_bits: int,
    clip: float,
    rng: np.random.Generator,
) -> NDArray[np.uint32]:
    """Encode ``[w_q * clip(values), w_q]`` into ``Z_2^32`` with stochastic rounding.

    Parameters
    ----------
    values : numpy.ndarray
        Flat float update.
    weight_q : int
        Quantised weight from :func:`quantize_weight`.
    frac_bits, clip : int, float
        Encoding parameters.
    rng : numpy.random.Generator
        Randomness of the stochastic rounding.

    Returns
    -------
    numpy.ndarray
        ``uint32`` vector of length ``values.size + 1``.
    """
    x = np.asarray(values).reshape(-1)
    if not bool(np.isfinite(x.sum(dtype=np.float64))) and not bool(np.isfinite(x).all()):
        raise UpdateRejected(explain("update", "non-finite", "must be finite", "fix training"))
    # In place on one float64 buffer: clip, scale, split into floor and fraction.
    scaled = np.clip(x, -clip, clip, out=np.empty(x.size, np.float64))
    scaled *= float(weight_q)
    low = np.floor(scaled)
    scaled -= low  # the fractional part, in [0, 1)
    up = rng.random(x.size) < scaled  # round up with probability = fraction (unbiased)
    out = np.empty(x.size + 1, np.uint32)
    body = out[:-1].view(np.int32)
    np.copyto(body, low, casting="unsafe")  # |low| <= clip * 2^f < 2^31: exact
    body += up  # two's complement: the int32 view is the value mod 2^32
    out[-1] = np.uint32(weight_q)
    return out


def decode_sum(total: NDArray[np.uint32], frac_bits: int) -> tuple[NDArray[np.float64], float]:
    """Decode an unmasked sum into ``(sum w_q x, sum w_q)`` in weight-scale units.

    Raises
    ------
    AbortRound
        The total weight is zero (nothing to average).
    """
    signed = np.asarray(total, np.uint32).view(np.int32).astype(np.float64) / 2.0**frac_bits
    total_weight = float(signed[-1])
    if total_weight <= 0:
        raise AbortRound("the counted sites have total weight 0; nothing to average")
    return signed[:-1], total_weight


def error_bound(num_counted: int, total_weight: float, clip: float, frac_bits: int) -> float:
    """Worst-case absolute error of the decoded weighted mean.

    ``num_counted * 2^-f * (1 + clip) / sum(w_q)``: stochastic rounding contributes less than
    one unit of ``2^-f`` per site to the numerator, weight rounding half a unit per site times
    at most ``2 * clip`` in the mean.
    """
    return num_counted * 2.0**-frac_bits * (1.0 + clip) / total_weight + 1e-12
