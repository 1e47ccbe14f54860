"""Key agreement, key derivation and share encryption for secure aggregation.

Three primitives, each behind a small function so the protocol code never touches raw
``cryptography`` objects:

* **X25519** key agreement (RFC 7748) through :class:`SecretKey`.
* **HKDF-SHA256** (RFC 5869) with a versioned domain-separation tag per use (pairwise mask,
  self mask, share encryption, neighbour graph). The ``info`` string is
  ``tag || 0x00 || context`` where ``context`` binds the run, the membership epoch, the round
  (or key generation) and the ordered pair of sites, so no two uses ever share a key.
* **ChaCha20-Poly1305** (RFC 8439, section 2.8) authenticated encryption of Shamir shares that
  the server relays between sites. The associated data repeats the full context, and a wrong
  key, nonce, tag or context fails with an opaque :class:`~fedagg.errors.VerificationError`.

The construction follows Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving
Machine Learning", CCS 2017, section 4 (key agreement ``KA``, authenticated encryption ``AE``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from enum import IntEnum
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedagg.errors import ProtocolError, VerificationError, explain

__all__ = [
    "CIPHERTEXT_OVERHEAD",
    "KEY_BYTES",
    "NONCE_BYTES",
    "NO_BINDING",
    "TAG_ADVERTISED_KEYS",
    "TAG_DROP_PROOF",
    "TAG_GRAPH",
    "TAG_PAIRWISE_MASK",
    "TAG_ROUND_BINDING",
    "TAG_SEED_COMMITMENT",
    "TAG_SELF_MASK",
    "TAG_SHARE_ENCRYPTION",
    "RandomBytes",
    "SecretKey",
    "ShareKind",
    "check_public_key",
    "commit_seed",
    "context",
    "decrypt_share",
    "derive_key",
    "drop_proof",
    "encrypt_share",
    "is_canonical_public_key",
    "pairwise_mask_key",
    "round_binding",
    "self_mask_key",
    "split_keys",
]

RandomBytes = Callable[[int], bytes]
"""A source of random bytes: ``random_bytes(n)`` returns ``n`` bytes (``os.urandom`` at the edge)."""

KEY_BYTES: Final = 32
NONCE_BYTES: Final = 12
_AEAD_TAG_BYTES: Final = 16
CIPHERTEXT_OVERHEAD: Final = NONCE_BYTES + _AEAD_TAG_BYTES

# Versioned domain-separation tags (RFC 5869 section 3.2: "info" binds a key to its use).
TAG_PAIRWISE_MASK: Final = b"fedagg/secagg/v3/pairwise-mask"  # v3: bound to the round's model
TAG_SELF_MASK: Final = b"fedagg/secagg/v1/self-mask"
TAG_SHARE_ENCRYPTION: Final = b"fedagg/secagg/v1/share-encryption"
TAG_GRAPH: Final = b"fedagg/secagg/v2/neighbour-graph"
TAG_ADVERTISED_KEYS: Final = b"fedagg/secagg/v2/advertised-keys"
TAG_SEED_COMMITMENT: Final = b"fedagg/secagg/v1/seed-commitment"
TAG_DROP_PROOF: Final = b"fedagg/secagg/v2/drop-proof"
TAG_ROUND_BINDING: Final = b"fedagg/secagg/v3/round-binding"
_AAD_PREFIX: Final = b"fedagg/secagg/v1/share-aad"


class ShareKind(IntEnum):
    """What a Shamir share is a share of (bound into the encryption key and the AAD)."""

    SELF_MASK_SEED = 1
    """The per-round self-mask seed ``b_i``."""
    MASK_KEY = 2
    """A site's X25519 mask-agreement secret key ``s_i`` of one key generation."""


class SecretKey:
    """An X25519 secret key whose ``repr`` never shows key material.

    Parameters
    ----------
    raw : bytes
        32 secret bytes (RFC 7748 section 5; clamping happens inside X25519).
    """

    __slots__ = ("_key", "_shared")

    def __init__(self, raw: bytes) -> None:
        if not isinstance(raw, bytes) or len(raw) != KEY_BYTES:
            raise ProtocolError(
                explain("secret_key", "<redacted>", "must be 32 bytes", "pass a 32-byte key")
            )
        self._key = X25519PrivateKey.from_private_bytes(raw)
        self._shared: dict[bytes, bytes] = {}  # peer public -> X25519 output, this object only

    @classmethod
    def generate(cls, random_bytes: RandomBytes) -> SecretKey:
        """Make a new key from ``random_bytes(32)``."""
        return cls(bytes(random_bytes(KEY_BYTES)))

    def public_bytes(self) -> bytes:
        """The 32-byte X25519 public key."""
        return self._key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    def secret_bytes(self) -> bytes:
        """The 32 raw secret bytes (for ``state_dict`` and Shamir sharing only)."""
        return self._key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    def exchange(self, peer_public: bytes) -> bytes:
        """X25519 shared secret with ``peer_public`` (RFC 7748 section 6.1).

        Raises
        ------
        ProtocolError
            If ``peer_public`` is not 32 bytes.
        VerificationError
            If ``peer_public`` is not canonically encoded, or the shared secret is all zero (a
            small-order public key).
        """
        _check_key_bytes(peer_public)
        shared = self._shared.get(peer_public)
        if shared is None:
            # Memoised for the life of this object (a site encrypts the self-mask shares and
            # the next key's shares to the same neighbours in one round): no more secret than
            # the private key kept next to it, and never serialised, logged or shown.
            try:
                shared = self._key.exchange(X25519PublicKey.from_public_bytes(peer_public))
            except ValueError:  # all-zero output: a small-order point
                raise VerificationError() from None
            self._shared[bytes(peer_public)] = shared
        return shared

    def __repr__(self) -> str:
        return "SecretKey(<redacted>)"

    def __str__(self) -> str:
        return repr(self)

    def __reduce__(self) -> str | tuple[object, ...]:
        raise TypeError("SecretKey cannot be pickled; use secret_bytes() explicitly")


_FIELD_PRIME: Final = 2**255 - 19
# A fixed, public scalar (clamped by X25519 to a multiple of the cofactor 8 with bit 254 set):
# X25519(scalar, u) is all zero exactly when u has small order on the curve or its twist, so
# one exchange with it rejects every low-order point (Bernstein, "Curve25519", 2006, section 3;
# the list in RFC 7748 section 7 and in libsodium's blocklist is a subset).
_PROBE: Final = X25519PrivateKey.from_private_bytes(
    hashlib.sha256(b"fedagg/secagg/v1/low-order-probe").digest()
)


def is_canonical_public_key(public: bytes) -> bool:
    """Whether ``public`` is the unique encoding of its u-coordinate (top bit clear, u < p).

    RFC 7748 section 5 lets a receiver accept non-canonical encodings (it masks the top bit and
    reduces mod p); fedagg refuses them so that every key has exactly one byte string, which the
    neighbour-graph seed hashes.
    """
    return len(public) == KEY_BYTES and int.from_bytes(public, "little") < _FIELD_PRIME


def split_keys(blob: bytes, count: int, field: str) -> list[bytes]:
    """``count`` public keys of :data:`KEY_BYTES` each from ``blob`` (ProtocolError naming
    ``field`` when its length is not exactly that)."""
    if len(blob) != count * KEY_BYTES:
        raise ProtocolError(explain(field, len(blob), f"must be {count} x 32 bytes", "resend"))
    return [blob[i * KEY_BYTES : (i + 1) * KEY_BYTES] for i in range(count)]


def check_public_key(public: object, field: str = "public_key") -> bytes:
    """Return ``public`` if it is a usable X25519 public key, else raise :class:`ProtocolError`.

    Usable means 32 bytes, canonically encoded (:func:`is_canonical_public_key`) and not of
    small order: a low-order key (RFC 7748 section 7) makes every shared secret with it all zero
    (or one of eight values), so a site announcing one would knock out the neighbours that use
    it. The check costs one X25519 with a fixed public scalar. The message only says that the
    key is invalid (nothing about the key is secret).
    """
    if not isinstance(public, bytes) or len(public) != KEY_BYTES:
        shown = len(public) if isinstance(public, bytes) else type(public).__name__
        raise ProtocolError(
            explain(field, shown, "must be a 32-byte X25519 public key", "send the raw key")
        )
    if not is_canonical_public_key(public):
        raise ProtocolError(
            explain(field, "non-canonical", "must be a canonical X25519 key (u < 2^255 - 19)",
                    "send the key as produced by X25519")
        )
    try:
        _PROBE.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:  # all-zero output: a small-order point
        raise ProtocolError(
            explain(field, "low order", "must not be a small-order X25519 point",
                    "generate the key with X25519")
        ) from None
    return public


def _check_key_bytes(public: object) -> bytes:
    """Length and encoding check of a peer key before an exchange (the exchange itself
    detects a small-order key through its all-zero output)."""
    if not isinstance(public, bytes) or len(public) != KEY_BYTES:
        shown = len(public) if isinstance(public, bytes) else type(public).__name__
        raise ProtocolError(
            explain("public_key", shown, "must be a 32-byte X25519 public key", "send the raw key")
        )
    if not is_canonical_public_key(public):
        raise VerificationError()
    return public


def context(
    *, run_id: bytes, epoch: int, counter: int, first: int, second: int, kind: int = 0
) -> bytes:
    """Injective encoding of the public context a derived key is bound to.

    ``len(run_id) (u16) || run_id || kind (u8) || epoch || counter || first || second``
    (unsigned 64-bit big-endian integers).
    """
    for name, value in (
        ("epoch", epoch),
        ("counter", counter),
        ("first", first),
        ("second", second),
    ):
        if not 0 <= value < 2**64:
            raise ProtocolError(explain(name, value, "must be in [0, 2**64)", "use a smaller id"))
    if len(run_id) >= 2**16:
        raise ProtocolError(explain("run_id", len(run_id), "must be < 65536 bytes", "shorten it"))
    return (
        struct.pack(">H", len(run_id))
        + run_id
        + struct.pack(">BQQQQ", kind, epoch, counter, first, second)
    )


def derive_key(ikm: bytes, tag: bytes, info_context: bytes, length: int = KEY_BYTES) -> bytes:
    """HKDF-SHA256 (RFC 5869) of ``ikm`` with ``info = tag || 0x00 || info_context``."""
    return HKDF(
        algorithm=hashes.SHA256(), length=length, salt=None, info=tag + b"\x00" + info_context
    ).derive(ikm)


def pairwise_mask_key(
    shared: bytes, *, run_id: bytes, epoch: int, round_number: int, a: int, b: int,
    binding: bytes
) -> bytes:
    """Round key of the pairwise mask between sites ``a`` and ``b`` (symmetric in a, b), bound
    to the round's ``binding`` (:func:`round_binding`: the model both were sent)."""
    if len(binding) != 32:
        raise ProtocolError(explain("binding", len(binding), "must be 32 bytes",
                                    "use round_binding"))
    lo, hi = min(a, b), max(a, b)
    ctx = context(run_id=run_id, epoch=epoch, counter=round_number, first=lo, second=hi)
    return derive_key(shared, TAG_PAIRWISE_MASK, ctx + binding)


NO_BINDING: Final = bytes(32)
"""The binding of a round that names no model (the Flower-free API's default)."""


def round_binding(model_digest: bytes) -> bytes:
    """The 32-byte binding of a round whose participants were all sent the model with
    ``model_digest`` (e.g. :func:`strategies.wire.model_digest`)."""
    return hashlib.sha256(TAG_ROUND_BINDING + b"\x00" + model_digest).digest()


def self_mask_key(seed: bytes, *, run_id: bytes, epoch: int, round_number: int, site: int) -> bytes:
    """Round key of the self mask of ``site`` from its 32-byte per-round seed ``b_i``."""
    ctx = context(run_id=run_id, epoch=epoch, counter=round_number, first=site, second=site)
    return derive_key(seed, TAG_SELF_MASK, ctx)


def commit_seed(seed: bytes, *, run_id: bytes, epoch: int, round_number: int, site: int) -> bytes:
    """SHA-256 commitment to a self-mask seed (hiding: the seed has 256 random bits).

    Lets the server check a reconstructed seed, so a wrong share cannot silently corrupt
    the aggregate.
    """
    ctx = context(run_id=run_id, epoch=epoch, counter=round_number, first=site, second=site)
    return hashlib.sha256(TAG_SEED_COMMITMENT + b"\x00" + ctx + seed).digest()


def drop_proof(secret: bytes, *, run_id: bytes, epoch: int, site: int, gen: int) -> bytes:
    """Proof that the server rebuilt ``site``'s mask key of generation ``gen``: HKDF of the key.

    Only a holder of the key computes it: the site itself, and the server once it rebuilt the
    key from ``t`` mask-key shares, i.e. once it declared the site dropped. Then no honest
    neighbour also revealed a share of the site's self-mask seed of that round (a site reveals
    one kind of share per neighbour), so with ``t > k / 2`` that round's upload of the site is
    never unmasked. fedagg's asynchronous loop sends the proof to a site it asks to carry such
    an update into a later cohort (:mod:`clients.carry`); one-way, so it reveals nothing of
    the key to anyone who does not hold it.
    """
    ctx = context(run_id=run_id, epoch=epoch, counter=gen, first=site, second=site)
    return derive_key(secret, TAG_DROP_PROOF, ctx)


def _share_context(
    run_id: bytes, epoch: int, kind: ShareKind, counter: int, src: int, dst: int
) -> bytes:
    return context(
        run_id=run_id, epoch=epoch, counter=counter, first=src, second=dst, kind=int(kind)
    )


def encrypt_share(
    own_secret: SecretKey,
    peer_public: bytes,
    plaintext: bytes,
    *,
    run_id: bytes,
    epoch: int,
    kind: ShareKind,
    counter: int,
    src: int,
    dst: int,
    random_bytes: RandomBytes,
) -> bytes:
    """Encrypt one share from ``src`` to ``dst`` (ChaCha20-Poly1305, RFC 8439 section 2.8).

    The key is HKDF(X25519(c_src, c_dst)) bound to (run, epoch, kind, counter, src, dst), so
    every message has its own key; the 12-byte nonce is random on top of that. Returns
    ``nonce || ciphertext || tag``.
    """
    ctx = _share_context(run_id, epoch, kind, counter, src, dst)
    key = derive_key(own_secret.exchange(peer_public), TAG_SHARE_ENCRYPTION, ctx)
    nonce = bytes(random_bytes(NONCE_BYTES))
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, _AAD_PREFIX + ctx)


def decrypt_share(
    own_secret: SecretKey,
    peer_public: bytes,
    blob: bytes,
    *,
    run_id: bytes,
    epoch: int,
    kind: ShareKind,
    counter: int,
    src: int,
    dst: int,
) -> bytes:
    """Inverse of :func:`encrypt_share`; any mismatch raises an opaque VerificationError."""
    if not isinstance(blob, bytes) or len(blob) < CIPHERTEXT_OVERHEAD:
        raise VerificationError()
    ctx = _share_context(run_id, epoch, kind, counter, src, dst)
    key = derive_key(own_secret.exchange(peer_public), TAG_SHARE_ENCRYPTION, ctx)
    try:
        return ChaCha20Poly1305(key).decrypt(
            blob[:NONCE_BYTES], blob[NONCE_BYTES:], _AAD_PREFIX + ctx
        )
    except InvalidTag:
        raise VerificationError() from None
