"""Double masking of encoded updates in ``Z_2^32`` (Bonawitz et al., CCS 2017, section 4).

A site ``i`` uploads ``y_i = x_i + PRG(B_i) + sum_{j in N(i)} sign(i, j) * PRG(K_ij)`` with
``sign(i, j) = +1`` if ``i < j`` else ``-1``; ``B_i`` is the round key of its self mask and
``K_ij`` the round key of the pairwise mask (both HKDF outputs, see
:mod:`fedagg.secagg.keys`). Pairwise masks cancel in the sum over sites that uploaded; the
server removes the self masks of those sites and the pairwise masks they share with sites
that dropped before uploading. ``uint32`` arithmetic wraps, which is exactly mod ``2^32``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable

import numpy as np
from numpy.typing import NDArray

from fedagg.secagg.prg import CHUNK_WORDS, MaskStream, check_length
from fedagg.secagg.threads import resolve_threads, run_all

__all__ = ["CANARY_BITS", "add_masks", "canary_slots", "pairwise_sign"]

CANARY_BITS = 64
"""Bits of the round's canary: a site appends :func:`canary_slots` zeros after its vector;
pairwise masks that do not cancel (members whose masks are bound to different models, see
:attr:`fedagg.secagg.messages.RoundRequest.binding`) leave them uniformly random, so an
unmasked sum whose canary is not zero is refused (false acceptance ``2**-64``)."""


def canary_slots(ring_bits: int) -> int:
    """Zero slots a site appends in a ring of ``ring_bits`` bits (at least :data:`CANARY_BITS`
    bits in all)."""
    return -(-CANARY_BITS // ring_bits)


def pairwise_sign(site: int, other: int) -> int:
    """``+1`` if ``site < other`` else ``-1``: the sign ``site`` gives the pair's mask."""
    return 1 if site < other else -1


def add_masks(
    vector: NDArray[np.uint32],
    signed_keys: Iterable[tuple[int, bytes]],
    *,
    threads: int | None = 1,
) -> None:
    """In place: ``vector += sign * PRG(key)`` mod ``2^32`` for each ``(sign, key)``.

    The masks are never materialised: the vector is walked in chunks of
    :data:`~fedagg.secagg.prg.CHUNK_WORDS`; for each chunk, every key's keystream continues
    into one preallocated (cache-resident) scratch buffer and is added or subtracted in place,
    with ``uint32`` wraparound. Same result as adding the full :func:`mask_words` of each key.

    With ``threads > 1`` (``None`` / ``0``: automatic, see :mod:`fedagg.secagg.threads`) the
    vector is cut into that many contiguous, chunk-aligned ranges, each expanded by its own
    thread with keystreams started at the range (ChaCha20 block counter); the result is
    bit-identical to the serial pass.
    """
    if vector.dtype != np.uint32 or vector.ndim != 1 or not vector.flags.c_contiguous:
        raise ValueError("add_masks needs a contiguous 1-D uint32 vector")
    n = int(vector.shape[0])
    check_length(n)
    keys = list(signed_keys)
    if not keys or n == 0:
        return
    chunks = -(-n // CHUNK_WORDS)
    t = min(resolve_threads(threads), chunks)
    bounds = [min(n, (chunks * r // t) * CHUNK_WORDS) for r in range(t + 1)]
    run_all(
        [
            functools.partial(_add_range, vector, keys, lo, hi)
            for lo, hi in itertools.pairwise(bounds)
        ],
        t,
    )


def _add_range(
    vector: NDArray[np.uint32], keys: list[tuple[int, bytes]], lo: int, hi: int
) -> None:
    """``vector[lo:hi] += sign * PRG(key)[lo:hi]`` for every key (``lo``: chunk-aligned)."""
    streams = [(sign, MaskStream(key, start=lo)) for sign, key in keys]
    scratch = np.empty(min(hi - lo, CHUNK_WORDS), np.uint32)
    for start in range(lo, hi, CHUNK_WORDS):
        view = vector[start : min(start + CHUNK_WORDS, hi)]
        words = scratch[: view.shape[0]]
        for sign, stream in streams:
            stream.next_into(words)
            if sign > 0:
                np.add(view, words, out=view)
            else:
                np.subtract(view, words, out=view)
