"""Mask expansion: a ChaCha20 keystream over the full 32-byte key, read as uint32 words.

A mask key (itself an HKDF output bound to round and pair, see :mod:`fedagg.secagg.keys`)
seeds ChaCha20 (RFC 8439, section 2.4) with a zero 96-bit nonce and block counter 0; the
keystream bytes are read as little-endian ``uint32`` words, i.e. uniform elements of
``Z_2^32``. Every key is used for exactly one mask, so the fixed nonce never repeats under a key.

This replaces Flower's 32-bit-folded Mersenne Twister seed with a PRG whose security rests on
the whole 256-bit key (Bonawitz et al., CCS 2017, section 3: "PRG").
"""

from __future__ import annotations

from typing import Final

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from numpy.typing import NDArray

from fedagg.errors import ProtocolError, explain

__all__ = ["BLOCK_WORDS", "CHUNK_WORDS", "MAX_WORDS", "MaskStream", "check_length", "keystream",
           "mask_words"]

_BLOCK_BYTES: Final = 64
BLOCK_WORDS: Final = _BLOCK_BYTES // 4
"""``uint32`` words per ChaCha20 block (the granularity of :class:`MaskStream`'s ``start``)."""
MAX_WORDS: Final = (2**32 * _BLOCK_BYTES) // 4
"""Most words one key can produce before the 32-bit block counter wraps (RFC 8439 2.4)."""
CHUNK_WORDS: Final = 1 << 16
"""Words per keystream chunk of :class:`MaskStream` (256 KiB: stays in the L2 cache)."""
_ZEROS: Final = bytes(4 * CHUNK_WORDS)  # the "plaintext" of every chunk, allocated once


def check_length(length: int) -> None:
    """ProtocolError unless ``length`` words fit one key's keystream (:data:`MAX_WORDS`)."""
    if not 0 <= length <= MAX_WORDS:
        raise ProtocolError(
            explain("mask length", length, f"must be in [0, {MAX_WORDS}]", "split the vector")
        )


class MaskStream:
    """The keystream of one mask key, read chunk by chunk into a caller's buffer.

    Same words as :func:`mask_words` (ChaCha20, zero nonce, counter 0, little-endian
    ``uint32``), without materialising the whole mask: :meth:`next_into` writes the next
    ``m <= CHUNK_WORDS`` words into ``out`` (no allocation), so a masking loop can add the
    chunk while it is still in cache.

    ``start`` (a multiple of :data:`BLOCK_WORDS`) starts the stream at word ``start`` of the
    keystream (ChaCha20's block counter set to ``start / 16``), so disjoint ranges of one mask
    can be expanded independently (in parallel) and give the same words as one pass.
    """

    __slots__ = ("_enc",)

    def __init__(self, key: bytes, *, start: int = 0) -> None:
        if len(key) != 32:
            raise ProtocolError(explain("chacha20 key", len(key), "must be 32 bytes", "fix"))
        if start % BLOCK_WORDS or not 0 <= start < MAX_WORDS:
            raise ProtocolError(
                explain("start", start, f"must be a multiple of {BLOCK_WORDS} in [0, {MAX_WORDS})",
                        "start at a block boundary")
            )
        nonce = (start // BLOCK_WORDS).to_bytes(4, "little") + bytes(12)  # counter || nonce
        self._enc = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()

    def next_into(self, out: NDArray[np.uint32]) -> None:
        """Fill ``out`` (contiguous ``uint32``, at most :data:`CHUNK_WORDS`) with the next words."""
        m = out.shape[0]
        if m > CHUNK_WORDS or out.dtype != np.uint32 or not out.flags.c_contiguous:
            raise ProtocolError(explain("chunk", (m, str(out.dtype)),
                                        f"must be contiguous uint32 of <= {CHUNK_WORDS}", "-"))
        self._enc.update_into(memoryview(_ZEROS)[: 4 * m], out.view(np.uint8).data)


def keystream(key: bytes, nbytes: int, *, counter: int = 0, nonce: bytes = bytes(12)) -> bytes:
    """Raw ChaCha20 keystream (RFC 8439 section 2.4).

    Parameters
    ----------
    key : bytes
        32-byte key.
    nbytes : int
        Number of keystream bytes.
    counter : int
        Initial 32-bit block counter.
    nonce : bytes
        96-bit nonce.
    """
    if len(key) != 32 or len(nonce) != 12 or not 0 <= counter < 2**32:
        raise ProtocolError(
            explain("chacha20", (len(key), len(nonce), counter), "bad key/nonce/counter", "fix")
        )
    full_nonce = counter.to_bytes(4, "little") + nonce  # cryptography's 16-byte layout
    encryptor = Cipher(algorithms.ChaCha20(key, full_nonce), mode=None).encryptor()
    return encryptor.update(bytes(nbytes))


def mask_words(key: bytes, length: int) -> NDArray[np.uint32]:
    """``length`` pseudorandom ``uint32`` words from ``key`` (read-only array).

    Raises
    ------
    ProtocolError
        If ``length`` is negative or exceeds one key's keystream (:data:`MAX_WORDS`).
    """
    check_length(length)
    return np.frombuffer(keystream(key, 4 * length), dtype="<u4").astype(np.uint32, copy=False)
