"""Fixed-point encoding of weighted updates into the ring ``Z_2^b`` (``b <= 32``).

A site with update ``x`` (clipped to ``[-clip, clip]``) and weight ``w`` encodes the vector
``[w_q * x, w_q]`` where ``w_q = round(w / weight_scale * 2^f) / 2^f`` is its weight in
``[0, 1]`` quantised to ``f`` fractional bits (``weight_scale`` is a public upper bound on a
site's weight). The values are scaled by ``2^f`` and rounded *stochastically* (unbiased: the
expected encoding is exact), then reduced mod ``2^b`` (two's complement). The server
recovers ``sum w_q x`` and ``sum w_q`` and divides, so FedAvg stays exact up to quantisation.

Two rules fix ``f`` and the ring width ``b``:

* **precision**: the worst-case absolute error of the decoded mean when every counted site has
  full weight is ``2^-f * (1 + clip)`` (:func:`error_bound`); ``f_p`` is the fewest fractional
  bits with ``2^-f * (1 + clip) <= precision`` (:func:`frac_bits_for_precision`);
* **headroom**: the sum of ``N`` encodings must not wrap, so
  ``N * (max(clip, 1) * 2^f + 1) <= 2^(b-1) - 1`` (:func:`fits`), i.e. ``b`` is about
  ``1 + f + ceil(log2(N * max(clip, 1)))`` bits.

:func:`resolve_encoding` applies them: with ``frac_bits`` and ``ring_bits`` both unset it takes
``f = f_p`` and the smallest ``b`` with headroom; when that ``b`` would exceed 32 it keeps
``b = 32`` and takes the most fractional bits that fit (the precision target is then missed,
and :func:`error_bound` reports the real bound). An explicit value is checked, and impossible
combinations are explained. Masked values travel bit-packed at ``b`` bits
(:mod:`fedagg.secagg.packing`).

The approach is the fixed-point encoding of Bonawitz et al. (CCS 2017, section 3) with the
unbiased stochastic rounding of Gupta et al., "Deep Learning with Limited Numerical
Precision", ICML 2015.
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np
from numpy.typing import NDArray

from fedagg.errors import AbortRound, ConfigError, UpdateRejected, explain

__all__ = [
    "DEFAULT_PRECISION",
    "MAX_FRAC_BITS",
    "MAX_RING_BITS",
    "MIN_FRAC_BITS",
    "MIN_RING_BITS",
    "RING_LIMIT",
    "decode_sum",
    "encode",
    "error_bound",
    "fits",
    "frac_bits_for_precision",
    "quantize_weight",
    "resolve_encoding",
    "resolve_frac_bits",
]

RING_LIMIT: Final = 2**31 - 1
"""Largest magnitude a (signed) sum may reach in ``Z_2^32`` without wrapping."""
MAX_FRAC_BITS: Final = 30
MIN_FRAC_BITS: Final = 8
MAX_RING_BITS: Final = 32
MIN_RING_BITS: Final = 8
DEFAULT_PRECISION: Final = 1e-6
"""Default target for the worst-case absolute error of the mean at full weight."""
_ENCODE_CHUNK: Final = 1 << 16
"""Values per chunk of :func:`encode` (two 512 KiB float64 scratch buffers)."""


def _limit(ring_bits: int) -> int:
    return (1 << (ring_bits - 1)) - 1


def fits(num_sites: int, clip: float, frac_bits: int, ring_bits: int = MAX_RING_BITS) -> bool:
    """Whether ``num_sites`` encodings at ``clip`` and ``frac_bits`` sum without wrapping."""
    return num_sites * (max(clip, 1.0) * 2.0**frac_bits + 1.0) <= _limit(ring_bits)


def frac_bits_for_precision(clip: float, precision: float) -> int:
    """Fewest ``f`` in ``[MIN_FRAC_BITS, MAX_FRAC_BITS]`` with ``2^-f * (1 + clip) <= precision``.

    ``MAX_FRAC_BITS`` when even that is not precise enough.
    """
    for f in range(MIN_FRAC_BITS, MAX_FRAC_BITS + 1):
        if 2.0**-f * (1.0 + clip) <= precision:
            return f
    return MAX_FRAC_BITS


def _best_frac(num_sites: int, clip: float, ring_bits: int) -> int | None:
    for f in range(MAX_FRAC_BITS, MIN_FRAC_BITS - 1, -1):
        if fits(num_sites, clip, f, ring_bits):
            return f
    return None


def _smallest_ring(num_sites: int, clip: float, frac_bits: int) -> int | None:
    for b in range(MIN_RING_BITS, MAX_RING_BITS + 1):
        if fits(num_sites, clip, frac_bits, b):
            return b
    return None


def resolve_encoding(
    num_sites: int,
    clip: float,
    frac_bits: int | None,
    ring_bits: int | None = None,
    precision: float = DEFAULT_PRECISION,
) -> tuple[int, int]:
    """``(frac_bits, ring_bits)`` for a round with ``num_sites`` sites.

    ``None`` means auto (see the module docstring): ``frac_bits=None`` with an explicit
    ``ring_bits`` takes the most fractional bits that fit that ring; ``ring_bits=None`` takes
    the smallest ring (at least :data:`MIN_RING_BITS`) with headroom for ``frac_bits``; both
    ``None`` first meet ``precision``, then shrink the ring.

    Raises
    ------
    ConfigError
        No value fits: the message names the parameter to change.
    """
    if frac_bits is not None and ring_bits is not None:
        if not fits(num_sites, clip, frac_bits, ring_bits):
            best = _best_frac(num_sites, clip, ring_bits)
            need = _smallest_ring(num_sites, clip, frac_bits)
            raise ConfigError(
                explain(
                    "secagg.frac_bits",
                    frac_bits,
                    f"{num_sites} sites * max(clip={clip}, 1) * 2^frac_bits must be < "
                    f"2^(ring_bits - 1) = 2^{ring_bits - 1} (headroom of the {ring_bits}-bit ring)",
                    (f"use frac_bits <= {best}" if best is not None else "lower secagg.clip")
                    + (f", ring_bits >= {need}" if need is not None else "")
                    + ", or leave either unset (auto)",
                )
            )
        return frac_bits, ring_bits
    if ring_bits is not None:
        f = _best_frac(num_sites, clip, ring_bits)
        if f is None:
            raise ConfigError(
                explain(
                    "secagg.ring_bits",
                    ring_bits,
                    f"with {num_sites} sites and clip={clip} even {MIN_FRAC_BITS} fractional "
                    f"bits overflow the {ring_bits}-bit ring (sites * max(clip, 1) * "
                    "2^frac_bits must be < 2^(ring_bits - 1))",
                    "raise secagg.ring_bits (at most 32), lower secagg.clip or the number of "
                    "sites per round",
                )
            )
        return f, ring_bits
    if frac_bits is not None:
        b = _smallest_ring(num_sites, clip, frac_bits)
        if b is None:
            best = _best_frac(num_sites, clip, MAX_RING_BITS)
            raise ConfigError(
                explain(
                    "secagg.frac_bits",
                    frac_bits,
                    f"{num_sites} sites * max(clip={clip}, 1) * 2^frac_bits must be < 2^31 "
                    "(headroom of the 32-bit ring)",
                    (f"use frac_bits <= {best}" if best is not None else "lower secagg.clip")
                    + ", lower secagg.clip, or leave frac_bits unset (auto)",
                )
            )
        return frac_bits, b
    f = frac_bits_for_precision(clip, precision)
    b = _smallest_ring(num_sites, clip, f)
    if b is not None:
        return f, b
    best = _best_frac(num_sites, clip, MAX_RING_BITS)
    if best is None:
        raise ConfigError(
            explain(
                "secagg.clip",
                clip,
                f"with {num_sites} sites even {MIN_FRAC_BITS} fractional bits overflow the "
                "32-bit ring (sites * max(clip, 1) * 2^frac_bits must be < 2^31)",
                "lower secagg.clip or the number of sites per round",
            )
        )
    return best, MAX_RING_BITS


def resolve_frac_bits(num_sites: int, clip: float, frac_bits: int | None) -> int:
    """The fractional bits for ``num_sites`` sites in the full 32-bit ring.

    ``None`` picks the largest value in ``[MIN_FRAC_BITS, MAX_FRAC_BITS]`` with headroom; an
    explicit value is checked (same as :func:`resolve_encoding` with ``ring_bits=32``).

    Raises
    ------
    ConfigError
        No value fits: the message names the parameter to change.
    """
    return resolve_encoding(num_sites, clip, frac_bits, MAX_RING_BITS)[0]


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

    The result is also the encoding mod ``2^b`` for any ring width ``b <= 32`` (its low ``b``
    bits): the caller masks in ``uint32`` and packs the low ``b`` bits.

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
    n = x.size
    out = np.empty(n + 1, np.uint32)
    # Chunk by chunk, in two cache-resident float64 scratch buffers (no D-sized temporaries):
    # clip, scale, add u ~ U[0, 1), floor. floor(s + u) is floor(s) + 1 with probability
    # frac(s): unbiased stochastic rounding in one pass (the probability is quantised to the
    # float64 ulp of s, at most 2^-27 of a unit here). The uniforms are drawn in order, so the
    # result equals the unchunked computation with the same generator.
    chunk = min(n, _ENCODE_CHUNK)
    scaled = np.empty(chunk, np.float64)
    noise = np.empty(chunk, np.float64)
    signed = out[:-1].view(np.int32)
    w = float(weight_q)
    for lo in range(0, n, _ENCODE_CHUNK):
        m = min(_ENCODE_CHUNK, n - lo)
        s, u = scaled[:m], noise[:m]
        np.clip(x[lo : lo + m], -clip, clip, out=s)
        s *= w
        rng.random(out=u)
        s += u
        np.floor(s, out=s)
        # |s| <= clip * 2^f + 1 < 2^31: exact; the int32 view is the value mod 2^32
        np.copyto(signed[lo : lo + m], s, casting="unsafe")
    out[-1] = np.uint32(weight_q)
    return out


def decode_sum(
    total: NDArray[np.uint32], frac_bits: int, ring_bits: int = MAX_RING_BITS
) -> tuple[NDArray[np.float64], float]:
    """Decode an unmasked sum into ``(sum w_q x, sum w_q)`` in weight-scale units.

    Only the low ``ring_bits`` bits of ``total`` are read (sign-extended from bit
    ``ring_bits - 1``); higher bits are ignored.

    Raises
    ------
    AbortRound
        The total weight is zero (nothing to average).
    """
    t = np.asarray(total, np.uint32)
    shift = np.uint32(MAX_RING_BITS - ring_bits)
    if shift:
        t = np.left_shift(t, shift).view(np.int32)
        np.right_shift(t, np.int32(shift), out=t)  # arithmetic: sign-extends from bit b - 1
    else:
        t = t.view(np.int32)
    # int32 -> float64 and the (exact, power-of-two) scaling in one pass
    signed = np.multiply(t, 2.0**-frac_bits, dtype=np.float64)
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
