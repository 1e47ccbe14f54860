"""Golden vectors for the mask PRG: ChaCha20 keystream of RFC 8439 (sections 2.3.2, 2.4.2, A.1)."""

from __future__ import annotations

import numpy as np
import pytest

from fedagg.errors import ProtocolError
from fedagg.secagg.prg import MAX_WORDS, keystream, mask_words

# RFC 8439 appendix A.1, test vectors #1 (counter 0) and #2 (counter 1): zero key, zero nonce.
A1_TV1 = bytes.fromhex(
    "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
    "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"
)
A1_TV2 = bytes.fromhex(
    "9f07e7be5551387a98ba977c732d080dcb0f29a048e3656912c6533e32ee7aed"
    "29b721769ce64e43d57133b074d839d531ed1f28510afb45ace10a1f4b794d6f"
)
# RFC 8439 section 2.3.2: key 00..1f, nonce 000000090000004a00000000, counter 1.
S232_BLOCK = bytes.fromhex(
    "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
    "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e"
)
# RFC 8439 section 2.4.2: encryption of the "sunscreen" plaintext, counter 1.
S242_PLAINTEXT = (
    b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for "
    b"the future, sunscreen would be it."
)
S242_CIPHERTEXT = bytes.fromhex(
    "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b"
    "f91b65c5524733ab8f593dabcd62b3571639d624e65152ab8f530c359f0861d8"
    "07ca0dbf500d6a6156a38e088a22b65e52bc514d16ccf806818ce91ab7793736"
    "5af90bbf74a35be6b40b8eedf2785e42874d"
)
KEY_00_1F = bytes(range(32))


def test_rfc8439_a1_keystream_vectors() -> None:
    assert keystream(bytes(32), 64) == A1_TV1
    assert keystream(bytes(32), 64, counter=1) == A1_TV2
    assert keystream(bytes(32), 128) == A1_TV1 + A1_TV2  # counter increments across blocks


def test_rfc8439_block_function_vector() -> None:
    nonce = bytes.fromhex("000000090000004a00000000")
    assert keystream(KEY_00_1F, 64, counter=1, nonce=nonce) == S232_BLOCK


def test_rfc8439_encryption_vector() -> None:
    nonce = bytes.fromhex("000000000000004a00000000")
    stream = keystream(KEY_00_1F, len(S242_PLAINTEXT), counter=1, nonce=nonce)
    ct = bytes(a ^ b for a, b in zip(S242_PLAINTEXT, stream, strict=True))
    assert ct == S242_CIPHERTEXT


def test_mask_words_are_little_endian_keystream_words() -> None:
    words = mask_words(bytes(32), 16)
    assert words.dtype == np.uint32 and words.shape == (16,)
    assert int(words[0]) == int.from_bytes(A1_TV1[:4], "little") == 0xADE0B876
    assert words.tobytes() == A1_TV1  # on little-endian hosts the bytes are the stream


def test_mask_words_deterministic_and_key_dependent() -> None:
    a = mask_words(b"\x01" * 32, 1000)
    assert np.array_equal(a, mask_words(b"\x01" * 32, 1000))
    assert np.array_equal(a[:10], mask_words(b"\x01" * 32, 10))  # prefix-stable
    b = mask_words(b"\x01" * 31 + b"\x02", 1000)  # last key byte matters (full 256-bit key)
    assert not np.array_equal(a, b)


def test_mask_words_rejects_bad_lengths() -> None:
    with pytest.raises(ProtocolError):
        mask_words(bytes(32), -1)
    with pytest.raises(ProtocolError):
        mask_words(bytes(32), MAX_WORDS + 1)
    with pytest.raises(ProtocolError):
        keystream(bytes(31), 4)
