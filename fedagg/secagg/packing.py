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

import math
from collections.abc import Iterator

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


def _classes(bits: int) -> tuple[int, list[tuple[int, int, int, int]]]:
    """Lanes grouped by bit offset: ``(q, [(j, w, s, spill) for the first p lanes])``.

    Lane ``j`` starts at bit ``j * bits`` of its group: word row ``w``, shift ``s``; ``spill``
    is 1 when it continues into row ``w + 1``. With ``g = gcd(bits, 32)`` the pattern repeats
    every ``p = 32 / g`` lanes, ``q = bits / g`` rows further on: lanes ``j, j + p, j + 2p,
    ...`` share ``s`` and use rows ``w, w + q, w + 2q, ...``, so one strided 2-D numpy
    operation handles all of them (``p`` classes instead of 32 lanes).
    """
    g = math.gcd(bits, 32)
    p, q = 32 // g, bits // g
    out = []
    for j in range(p):
        w, s = divmod(j * bits, 32)
        out.append((j, w, s, int(s + bits > 32)))
    return q, out


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
    mask = np.uint32((1 << bits) - 1)
    rows = out.reshape(bits, lanes)
    full = n // lanes  # lanes with all L entries present; lane `full` may be partial
    q, classes = _classes(bits)
    tmp = np.empty((2, (full + len(classes) - 1) // len(classes), lanes), np.uint32)
    for lane_src, step, (_, w, s, spill) in _lane_views(v, full, lanes, q, classes):
        k, m = lane_src.shape
        low, t = tmp[0, :k, :m], tmp[1, :k, :m]
        np.bitwise_and(lane_src, mask, out=low)  # mod 2^b, in a small scratch (no D-sized copy)
        dst = _rows(rows, w, step, k, m)
        if s:
            np.left_shift(low, np.uint32(s), out=t)
            np.bitwise_or(dst, t, out=dst)
        else:
            np.bitwise_or(dst, low, out=dst)
        if spill:
            dst = _rows(rows, w + 1, step, k, m)
            np.right_shift(low, np.uint32(32 - s), out=t)
            np.bitwise_or(dst, t, out=dst)
    return out


def _rows(
    rows: NDArray[np.uint32], start: int, step: int, k: int, m: int
) -> NDArray[np.uint32]:
    """Rows ``start, start + step, ...`` (``k`` of them), first ``m`` columns: a strided view."""
    return rows[start : start + step * (k - 1) + 1 : step, :m]


def _lane_views(
    vec: NDArray[np.uint32],
    full: int,
    lanes: int,
    q: int,
    classes: list[tuple[int, int, int, int]],
) -> Iterator[tuple[NDArray[np.uint32], int, tuple[int, int, int, int]]]:
    """Per lane class: (its lanes of ``vec`` as a ``(k, m)`` view, row step, layout).

    The complete lanes of a class come as one strided ``(k, L)`` view whose rows in the packed
    array are ``q`` apart; the partial last lane (``vec`` shorter than ``32 * L``) comes as a
    ``(1, m)`` view of its own.
    """
    p = len(classes)
    bits = q * 32 // p
    body = vec[: full * lanes].reshape(full, lanes)
    for c in classes:
        if c[0] < full:
            yield body[c[0] :: p], q, c
    lo = full * lanes
    if lo < vec.shape[0] and full < _LANES:
        w, s = divmod(full * bits, 32)
        yield vec[lo:].reshape(1, -1), 1, (full, w, s, int(s + bits > 32))


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
    The two parts of a lane that spills into the next row do not overlap, so they are added
    rather than or-ed (bits above ``b`` are garbage either way); lanes are handled a class at
    a time (:func:`_classes`), as strided 2-D views.
    """
    n = out.shape[0]
    full = min(n // lanes, _LANES)
    q, classes = _classes(bits)
    tmp = np.empty(((full + len(classes) - 1) // len(classes) or 1, lanes), np.uint32)
    for dst, step, (_, w, s, spill) in _lane_views(out, full, lanes, q, classes):
        k, m = dst.shape
        t = tmp[:k, :m]
        src = _rows(rows, w, step, k, m)
        if add:
            if s:
                np.right_shift(src, np.uint32(s), out=t)
                np.add(dst, t, out=dst)
            else:
                np.add(dst, src, out=dst)
        elif s:
            np.right_shift(src, np.uint32(s), out=dst)
        else:
            np.copyto(dst, src)
        if spill:
            np.left_shift(_rows(rows, w + 1, step, k, m), np.uint32(32 - s), out=t)
            np.add(dst, t, out=dst)
