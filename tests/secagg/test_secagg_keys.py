"""X25519 (RFC 7748 vector), HKDF domain separation (RFC 5869 by hand) and share encryption."""

from __future__ import annotations

import hashlib
import hmac
import pickle
import struct

import pytest

from fedagg.errors import ProtocolError, VerificationError
from fedagg.secagg import keys
from fedagg.secagg.keys import SecretKey, ShareKind

# RFC 7748 section 6.1
ALICE_SK = bytes.fromhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
ALICE_PK = bytes.fromhex("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
BOB_SK = bytes.fromhex("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb")
BOB_PK = bytes.fromhex("de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f")
SHARED = bytes.fromhex("4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742")


def naive_hkdf(ikm: bytes, info: bytes, length: int = 32) -> bytes:
    """RFC 5869 sections 2.2-2.3 with the default (all-zero) salt."""
    prk = hmac.new(bytes(32), ikm, hashlib.sha256).digest()
    out, block, i = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
        i += 1
    return out[:length]


def ctx(run_id: bytes, kind: int, epoch: int, counter: int, a: int, b: int) -> bytes:
    return (
        struct.pack(">H", len(run_id)) + run_id + struct.pack(">BQQQQ", kind, epoch, counter, a, b)
    )


def test_x25519_rfc7748_vector() -> None:
    alice, bob = SecretKey(ALICE_SK), SecretKey(BOB_SK)
    assert alice.public_bytes() == ALICE_PK and bob.public_bytes() == BOB_PK
    assert alice.exchange(BOB_PK) == bob.exchange(ALICE_PK) == SHARED


def test_small_order_public_key_is_rejected_opaquely() -> None:
    with pytest.raises(VerificationError, match=r"^verification failed$"):
        SecretKey(ALICE_SK).exchange(bytes(32))
    with pytest.raises(ProtocolError):
        SecretKey(ALICE_SK).exchange(b"short")


def test_secret_key_redacts_repr_and_refuses_pickle() -> None:
    key = SecretKey(ALICE_SK)
    assert repr(key) == str(key) == "SecretKey(<redacted>)"
    with pytest.raises(TypeError):
        pickle.dumps(key)
    with pytest.raises(ProtocolError) as err:
        SecretKey(ALICE_SK[:31])
    assert ALICE_SK[:8].hex() not in str(err.value)


def test_hkdf_derivations_match_rfc5869_with_documented_info() -> None:
    ikm = bytes(range(32))
    bind = keys.round_binding(b"model digest")
    assert bind == hashlib.sha256(b"fedagg/secagg/v3/round-binding\x00model digest").digest()
    got = keys.pairwise_mask_key(ikm, run_id=b"run", epoch=1, round_number=2, a=5, b=3,
                                 binding=bind)
    info = b"fedagg/secagg/v3/pairwise-mask\x00" + ctx(b"run", 0, 1, 2, 3, 5) + bind
    assert got == naive_hkdf(ikm, info)
    other = keys.pairwise_mask_key(ikm, run_id=b"run", epoch=1, round_number=2, a=5, b=3,
                                   binding=keys.round_binding(b"another model"))
    assert other != got  # another model, other masks
    got = keys.self_mask_key(ikm, run_id=b"run", epoch=1, round_number=2, site=3)
    assert got == naive_hkdf(ikm, b"fedagg/secagg/v1/self-mask\x00" + ctx(b"run", 0, 1, 2, 3, 3))


def test_hkdf_golden_values() -> None:
    pair = keys.pairwise_mask_key(bytes(32), run_id=b"run", epoch=1, round_number=2, a=3, b=5,
                                  binding=keys.NO_BINDING)
    assert pair.hex() == "10b4b298ed51a06a264baf73ef766ee699031cefdaabb0412be579b7b2cd16a5"
    own = keys.self_mask_key(bytes(32), run_id=b"run", epoch=1, round_number=2, site=3)
    assert own.hex() == "95ed668c93c6b9b0a72e482edbc789ac1186bc66a1360650aacac6ebe6d4fbc4"


def test_domain_separation_every_context_field_matters() -> None:
    ikm = b"\x07" * 32
    base = dict(run_id=b"r", epoch=1, round_number=1, a=1, b=2, binding=keys.NO_BINDING)
    ref = keys.pairwise_mask_key(ikm, **base)  # type: ignore[arg-type]
    assert keys.pairwise_mask_key(ikm, **{**base, "a": 2, "b": 1}) == ref  # type: ignore[arg-type]
    variants = [
        {**base, "run_id": b"s"},
        {**base, "epoch": 2},
        {**base, "round_number": 2},
        {**base, "a": 0},
        {**base, "binding": keys.round_binding(b"another model")},
    ]
    outs = {keys.pairwise_mask_key(ikm, **v) for v in variants}  # type: ignore[arg-type]
    assert ref not in outs and len(outs) == len(variants)
    assert keys.self_mask_key(ikm, run_id=b"r", epoch=1, round_number=1, site=1) != ref


def _enc(plain: bytes, **over: object) -> bytes:
    args: dict[str, object] = dict(
        run_id=b"run", epoch=1, kind=ShareKind.SELF_MASK_SEED, counter=4, src=1, dst=2
    )
    args.update(over)
    return keys.encrypt_share(
        SecretKey(ALICE_SK),
        BOB_PK,
        plain,
        random_bytes=lambda n: b"\x01" * n,
        **args,  # type: ignore[arg-type]
    )


def _dec(blob: bytes, **over: object) -> bytes:
    args: dict[str, object] = dict(
        run_id=b"run", epoch=1, kind=ShareKind.SELF_MASK_SEED, counter=4, src=1, dst=2
    )
    args.update(over)
    return keys.decrypt_share(SecretKey(BOB_SK), ALICE_PK, blob, **args)  # type: ignore[arg-type]


def test_share_encryption_round_trip() -> None:
    blob = _enc(b"share-bytes")
    assert len(blob) == len(b"share-bytes") + keys.CIPHERTEXT_OVERHEAD
    assert _dec(blob) == b"share-bytes"


@pytest.mark.parametrize("position", [0, 5, 11, 12, 20, -1])
def test_tampered_ciphertext_is_rejected_opaquely(position: int) -> None:
    blob = bytearray(_enc(b"share-bytes"))
    blob[position] ^= 0x01
    with pytest.raises(VerificationError) as err:
        _dec(bytes(blob))
    assert str(err.value) == "verification failed"


@pytest.mark.parametrize(
    "field, value",
    [
        ("run_id", b"other"),
        ("epoch", 2),
        ("counter", 5),
        ("src", 3),
        ("dst", 3),
        ("kind", ShareKind.MASK_KEY),
    ],
)
def test_ciphertext_is_bound_to_its_context(field: str, value: object) -> None:
    with pytest.raises(VerificationError, match=r"^verification failed$"):
        _dec(_enc(b"share-bytes"), **{field: value})


def test_truncated_ciphertext_is_rejected() -> None:
    with pytest.raises(VerificationError):
        _dec(b"\x00" * 10)
