"""Bit-packing of ``b``-bit ring elements into ``uint32`` words (the wire form of an upload).

With a ring ``Z_2^b`` (``b <= 32``, see :mod:`fedagg.secagg.fixed_point`) a masked entry needs
only ``b`` bits. A vector of ``n`` entries travels as ``b * ceil(n / 32)`` ``uint32`` words:

* the (zero-padded) vector is split into 32 contiguous *lanes* of ``L = ceil(n / 32)``
  entries (lane ``j`` holds entries ``j*L .. j*L + L - 1``);
* group ``g`` (``0 <= g < L``) is entry ``g`` of every lane: 32 values of ``b`` bits, i.e.
  ``32 * b`` bits = ``b`` words. Lane ``j`` occupies bits ``[j*b, (j+1)*b)`` of the group,
  little-endian across the group's words (bit ``o`` is bit ``o % 32`` of word ``o // 32``);
* the packed array is word-major: word ``w`` of every group, then word ``w + 1``, ... so
  ``packed[w*L + g]`` is word ``w`` of group ``g``.

Word-major lanes make every pack / unpack step a contiguous numpy shift / or over ``L``
values (about 3 operations per lane, no per-element Python), and let the server add an
upload into its running sum without materialising the unpacked vector
(:func:`add_unpacked`): the bits above ``b`` are left as garbage, which only affects bits
``>= b`` of the ``uint32`` sum (carries move upward), so the sum stays exact mod ``2^b``.

``b = 32`` is the identity (no padding, no copy).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from fedagg.errors import ProtocolError, explain

__all__ = ["add_unpacked", "pack", "packed_words", "unpack"]

_LANES = 32


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 32:
        raise ProtocolError(explain("ring bits", bits, "must be an int in [1, 32]", "-"))


def packed_words(n: int, bits: int) -> int:
    """Number of ``uint32`` words that carry ``n`` entries of ``bits`` bits."""
    _check_bits(bits)
    if n < 0:
        raise ProtocolError(explain("length", n, "must be >= 0", "-"))
    return n if bits == 32 else bits * -(-n // _LANES)


def _layout(bits: int) -> list[tuple[int, int, int]]:
    """Per lane: (word row, shift, bits in the next row, 0 if the lane fits in one word)."""
    out = []
    for j in range(_LANES):
        o = j * bits
        w, s = divmod(o, 32)
        out.append((w, s, max(s + bits - 32, 0)))
    return out


def pack(values: NDArray[np.uint32], bits: int) -> NDArray[np.uint32]:
    """Pack the low ``bits`` bits of each entry (higher bits are dropped, i.e. mod ``2^b``).

    Parameters
    ----------
    values : numpy.ndarray
        1-D ``uint32`` vector of ``n`` entries.
    bits : int
        Ring width ``b`` in ``[1, 32]``.

    Returns
    -------
    numpy.ndarray
        ``uint32`` words, :func:`packed_words` ``(n, bits)`` of them (``values`` itself when
        ``bits == 32``).
    """
    _check_bits(bits)
    v = np.asarray(values)
    if v.dtype != np.uint32 or v.ndim != 1:
        raise ProtocolError(explain("values", (str(v.dtype), v.ndim), "must be 1-D uint32", "-"))
    if bits == 32:
        return v
    n = v.shape[0]
    lanes = -(-n // _LANES)
    out = np.zeros(bits * lanes, np.uint32)
    if n == 0:
        return out
    src = np.zeros(_LANES * lanes, np.uint32)
    np.bitwise_and(v, np.uint32((1 << bits) - 1), out=src[:n])
    tmp = np.empty(lanes, np.uint32)
    rows = out.reshape(bits, lanes)
    for j, (w, s, spill) in enumerate(_layout(bits)):
        lane = src[j * lanes : (j + 1) * lanes]
        if s:
            np.left_shift(lane, np.uint32(s), out=tmp)
            np.bitwise_or(rows[w], tmp, out=rows[w])
        else:
            np.bitwise_or(rows[w], lane, out=rows[w])
        if spill:
            np.right_shift(lane, np.uint32(32 - s), out=tmp)
            np.bitwise_or(rows[w + 1], tmp, out=rows[w + 1])
    return out


def _check_packed(packed: NDArray[np.uint32], n: int, bits: int) -> NDArray[np.uint32]:
    p = np.asarray(packed)
    if p.dtype != np.uint32 or p.shape != (packed_words(n, bits),):
        raise ProtocolError(
            explain(
                "packed vector",
                (str(p.dtype), p.shape),
                f"must be {packed_words(n, bits)} uint32 words for {n} entries of {bits} bits",
                "resend",
            )
        )
    return p



def unpack(packed: NDArray[np.uint32], n: int, bits: int) -> NDArray[np.uint32]:
    """Inverse of :func:`pack`: ``n`` entries in ``[0, 2^bits)`` as a new ``uint32`` vector.

    Raises
    ------
    ProtocolError
        ``packed`` does not have the size :func:`packed_words` ``(n, bits)``.
    """
    _check_bits(bits)
    p = _check_packed(packed, n, bits)
    if bits == 32:
        return np.array(p, np.uint32)
    lanes = -(-n // _LANES)
    out = np.empty(_LANES * lanes, np.uint32)
    if n:
        _unpack_into(p.reshape(bits, lanes), out, bits, lanes, add=False)
        out &= np.uint32((1 << bits) - 1)
    return out[:n]


def add_unpacked(total: NDArray[np.uint32], packed: NDArray[np.uint32], bits: int) -> None:
    """In place: ``total += unpack(packed)`` modulo ``2^bits`` (bits above ``b``: garbage).

    ``total`` holds ``n`` entries. Only its low ``bits`` bits are meaningful afterwards; reduce
    with ``& (2^bits - 1)`` (or ignore the high bits) when the sum is complete.
    """
    _check_bits(bits)
    if total.dtype != np.uint32 or total.ndim != 1 or not total.flags.c_contiguous:
        raise ProtocolError(explain("total", str(total.dtype), "must be contiguous uint32", "-"))
    n = int(total.shape[0])
    p = _check_packed(packed, n, bits)
    if bits == 32:
        np.add(total, p, out=total)
        return
    lanes = -(-n // _LANES)
    if n:
        _unpack_into(p.reshape(bits, lanes), total, bits, lanes, add=True)


def _unpack_into(
    rows: NDArray[np.uint32], out: NDArray[np.uint32], bits: int, lanes: int, *, add: bool
) -> None:
    """Write (or add) lane ``j`` of ``rows`` into ``out[j*L : (j+1)*L]`` (unmasked high bits).

    ``out`` may be shorter than ``32 * L`` (the padding lanes are then skipped or truncated).
    """
    n = out.shape[0]
    tmp = np.empty(lanes, np.uint32)
    tmp2 = np.empty(lanes, np.uint32)
    for j, (w, s, spill) in enumerate(_layout(bits)):
        lo = j * lanes
        if lo >= n:
            break
        m = min(lanes, n - lo)
        dst = out[lo : lo + m]
        src = rows[w, :m]
        if spill:
            t, t2 = tmp[:m], tmp2[:m]
            np.right_shift(src, np.uint32(s), out=t)
            np.left_shift(rows[w + 1, :m], np.uint32(32 - s), out=t2)
            np.bitwise_or(t, t2, out=t)
            part = t
        elif s:
            part = tmp[:m]
            np.right_shift(src, np.uint32(s), out=part)
        else:
            part = src
        if add:
            np.add(dst, part, out=dst)
        else:
            np.copyto(dst, part)
