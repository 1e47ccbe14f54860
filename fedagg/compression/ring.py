"""Ring forms of sketch tables and vote counters: what secure aggregation masks.

Secure aggregation sums vectors of ``Z_2^b`` (``b <= 32``) elements, carried as ``uint32``
and bit-packed at ``b`` bits (:mod:`fedagg.secagg.packing`). This module turns the integer
tables of :mod:`fedagg.compression.sketch` and :mod:`fedagg.compression.vote` into such
vectors and back:

* :func:`to_ring` / :func:`from_ring`: signed integers in two's complement, low ``b`` bits;
* :func:`encode_table` / :func:`decode_table_sum`: the **exact** sketch path. The update is
  quantised exactly as :func:`fedagg.secagg.fixed_point.encode` does, sketched *in
  integers* and reduced mod ``2^32``, so the masked modular sum of the sites' vectors is
  exactly the integer sketch of their summed fixed-point updates (with the summed weight);
* :func:`pack_counters` / :func:`unpack_counters`: several small non-negative counters
  (``field_bits`` each) in one ring element, so a vote can ride in the same masked vector as
  the values at the values' ring width. Sums never carry across fields while every summed
  counter stays below ``2^field_bits`` (a summed Bloom counter is at most the number of
  sites), so the packed sum unpacks to the sum of the counters;
* :func:`ring_nbytes`: bytes of ``n`` ring elements on the wire.

``fedagg.secagg.fixed_point`` / ``packing`` are imported inside the functions that need them:
the secagg package pulls in its protocol (and cryptography), which plaintext users of the
sketches should not pay for at import time.

References
----------
.. [Bonawitz2017] K. Bonawitz et al. "Practical Secure Aggregation for Privacy-Preserving
   Machine Learning". CCS 2017 (inputs in ``Z_R``, fixed-point encoding, Sec. 3).
.. [Rothchild2020] D. Rothchild et al. "FetchSGD: Communication-Efficient Federated Learning
   with Sketching". ICML 2020 (sketches are linear, so they can be summed, Sec. 3).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from fedagg.compression.sketch import CountSketch, check_int, flatten
from fedagg.errors import CodecError, ConfigError, explain

__all__ = [
    "counters_per_element",
    "decode_table_sum",
    "encode_table",
    "from_ring",
    "pack_counters",
    "ring_nbytes",
    "to_ring",
    "unpack_counters",
]

_RING_BITS: Final = 32


def _check_bits(ring_bits: int) -> int:
    return check_int("ring_bits", ring_bits, 1, _RING_BITS, "e.g. 32 (secagg.ring_bits)")


def to_ring(table: NDArray[Any], ring_bits: int = _RING_BITS) -> NDArray[np.uint32]:
    """Integer counters as ``uint32`` ring elements: two's complement, low ``ring_bits`` kept."""
    _check_bits(ring_bits)
    t = np.asarray(table)
    if not np.issubdtype(t.dtype, np.integer):
        raise ConfigError(explain("table", str(t.dtype), "must be integers", "sketch_int()"))
    mask = np.int64((1 << ring_bits) - 1)
    return (t.astype(np.int64).ravel() & mask).astype(np.uint32)


def from_ring(total: NDArray[Any], ring_bits: int = _RING_BITS) -> NDArray[np.int64]:
    """Inverse of :func:`to_ring` on a (summed) vector: sign-extend from bit ``ring_bits - 1``."""
    _check_bits(ring_bits)
    t = np.asarray(total)
    if t.dtype != np.uint32:
        raise CodecError(explain("ring vector", str(t.dtype), "must be uint32", "-"))
    low = t.astype(np.int64) & np.int64((1 << ring_bits) - 1)
    half = np.int64(1 << (ring_bits - 1))
    return np.where(low >= half, low - (half << 1), low)


def encode_table(
    values: NDArray[Any] | Sequence[NDArray[Any]],
    sketch: CountSketch,
    *,
    weight_q: int,
    frac_bits: int,
    clip: float,
    table_clip: float,
    rng: np.random.Generator,
) -> tuple[NDArray[np.uint32], int]:
    """Site side, exact path: the ring vector ``[S_int(q), w_q]`` ready to be masked.

    ``q`` is the fixed-point encoding of ``w_q * clip(values)`` with stochastic rounding,
    bit for bit what :func:`fedagg.secagg.fixed_point.encode` produces with the same ``rng``.
    The integer sketch of ``q`` is clipped to ``+-floor(table_clip * 2^frac_bits)`` so that
    ``fixed_point.fits(num_sites, table_clip, frac_bits, ring_bits)`` (choose the encoding
    with ``fixed_point.resolve_encoding(num_sites, table_clip, ...)``) guarantees the sum
    does not wrap. With no counter clipped, the sites' modular sum is exactly the integer
    sketch of their summed ``q`` (see the module docstring).

    Returns
    -------
    (numpy.ndarray, int)
        ``uint32`` vector of ``rows * cols + 1`` entries (mask in ``uint32``, pack the low
        ``b`` bits), and the number of clipped counters (0 in the exact case; a metric).
    """
    from fedagg.secagg import fixed_point

    flat = flatten(values)
    if flat.shape[0] != sketch.dim:
        raise ConfigError(explain("update size", flat.shape[0], f"must be {sketch.dim}", "-"))
    if not (isinstance(table_clip, int | float) and np.isfinite(table_clip) and table_clip > 0):
        raise ConfigError(explain("table_clip", table_clip, "must be finite and > 0", "e.g. 1.0"))
    vec = fixed_point.encode(flat, int(weight_q), frac_bits=frac_bits, clip=clip, rng=rng)
    q = vec[:-1].view(np.int32)
    table = sketch.sketch_int(q)
    bound = int(np.floor(table_clip * 2.0**frac_bits))
    clipped = int(np.count_nonzero(np.abs(table) > bound))
    if clipped:
        np.clip(table, -bound, bound, out=table)
    out = np.empty(sketch.size + 1, dtype=np.uint32)
    out[:-1] = to_ring(table)
    out[-1] = vec[-1]
    return out, clipped


def decode_table_sum(
    total: NDArray[Any],
    sketch: CountSketch,
    *,
    frac_bits: int,
    ring_bits: int = _RING_BITS,
) -> tuple[NDArray[np.float64], float]:
    """Server side, exact path: the unmasked sum of :func:`encode_table` vectors.

    Returns
    -------
    (numpy.ndarray, float)
        ``sum_i w_q,i * S(x_i)`` as a ``(rows, cols)`` float64 table (weight-scale units) and
        ``sum_i w_q,i``; divide the first by the second for the weighted-mean sketch.

    Raises
    ------
    CodecError
        ``total`` does not have ``rows * cols + 1`` entries.
    fedagg.errors.AbortRound
        The total weight is zero.
    """
    from fedagg.secagg import fixed_point

    t = np.asarray(total)
    if t.shape != (sketch.size + 1,):
        raise CodecError(
            explain("sketch sum", t.shape, f"must have rows * cols + 1 = {sketch.size + 1}", "-")
        )
    table, weight = fixed_point.decode_sum(t.astype(np.uint32), frac_bits, ring_bits)
    return table.reshape(sketch.shape), weight


def ring_nbytes(n: int, ring_bits: int) -> int:
    """Bytes of ``n`` masked ring elements bit-packed at ``ring_bits`` (the secure wire form)."""
    from fedagg.secagg import packing

    return 4 * packing.packed_words(n, _check_bits(ring_bits))


def counters_per_element(field_bits: int, ring_bits: int = _RING_BITS) -> int:
    """How many ``field_bits``-bit counters one ``ring_bits``-bit element carries."""
    check_int("field_bits", field_bits, 1, _check_bits(ring_bits), f"1..ring_bits={ring_bits}")
    return ring_bits // field_bits


def pack_counters(
    counters: NDArray[Any], field_bits: int, ring_bits: int = _RING_BITS
) -> NDArray[np.uint32]:
    """Pack non-negative counters, ``counters_per_element`` per ring element (field ``f`` of
    element ``e`` holds counter ``e * per + f`` at bits ``[f * field_bits, (f+1) * field_bits)``).

    Sum the packed vectors mod ``2^ring_bits`` (masked or not) and :func:`unpack_counters`
    gives the summed counters, provided every *summed* counter is below ``2^field_bits``
    (e.g. ``field_bits = vote_ring_bits(num_sites, k)``).

    Raises
    ------
    ConfigError
        Negative or non-integer counters, or one that does not fit its field.
    """
    per = counters_per_element(field_bits, ring_bits)
    c = np.asarray(counters).ravel()
    if c.size and not np.issubdtype(c.dtype, np.integer):
        raise ConfigError(explain("counters", str(c.dtype), "must be integers", "-"))
    c = c.astype(np.int64)
    if c.size and (int(c.min()) < 0 or int(c.max()) >= 1 << field_bits):
        raise ConfigError(
            explain(
                "counters",
                (int(c.min()), int(c.max())),
                f"must be in [0, 2^{field_bits})",
                "raise field_bits",
            )
        )
    n_el = -(-c.shape[0] // per)
    padded = np.zeros(n_el * per, dtype=np.uint64)
    padded[: c.shape[0]] = c.astype(np.uint64)
    shifts = (np.arange(per, dtype=np.uint64) * np.uint64(field_bits))[None, :]
    words = np.bitwise_or.reduce(padded.reshape(n_el, per) << shifts, axis=1) if n_el else padded
    return words.astype(np.uint32)


def unpack_counters(
    total: NDArray[Any], n: int, field_bits: int, ring_bits: int = _RING_BITS
) -> NDArray[np.int64]:
    """Inverse of :func:`pack_counters` on a (summed) vector: ``n`` counters, int64.

    Raises
    ------
    CodecError
        ``total`` is not ``uint32`` or has the wrong number of elements.
    """
    per = counters_per_element(field_bits, ring_bits)
    t = np.asarray(total)
    n_el = -(-int(n) // per)
    if t.dtype != np.uint32 or t.shape != (n_el,):
        raise CodecError(
            explain("packed counters", (str(t.dtype), t.shape), f"must be {n_el} uint32", "-")
        )
    low = t.astype(np.uint64) & np.uint64((1 << ring_bits) - 1)
    shifts = (np.arange(per, dtype=np.uint64) * np.uint64(field_bits))[None, :]
    fields = (low[:, None] >> shifts) & np.uint64((1 << field_bits) - 1)
    return fields.ravel()[: int(n)].astype(np.int64)
