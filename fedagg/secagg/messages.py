"""Protocol messages: plain frozen dataclasses of ints, bytes and numpy arrays.

Every message converts to and from a flat ``dict[str, int | bytes | numpy.ndarray]`` with
:meth:`to_dict` / :meth:`from_dict`, so a transport adapter (Flower records) only has to copy
values: ints and bytes go into a ConfigRecord, arrays into an ArrayRecord. ``from_dict``
validates every key and type and raises :class:`~fedagg.errors.ProtocolError` on anything
unexpected. Id lists travel as ``int64`` arrays, ciphertext lists as one ``bytes`` value of
fixed-size records (:data:`CIPHERTEXT_BYTES` each, in the order of the matching id list).
``repr`` shows only ids, counts and sizes, never shares or key material.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Final, TypeVar

import numpy as np
from numpy.typing import NDArray

from fedagg.errors import ProtocolError, explain
from fedagg.secagg.keys import CIPHERTEXT_OVERHEAD
from fedagg.secagg.shamir import NUM_LIMBS, SHARE_BYTES

__all__ = [
    "CIPHERTEXT_BYTES",
    "PROTOCOL_VERSION",
    "KeyAdvertise",
    "KeyAdvertiseRequest",
    "MaskedUpload",
    "Message",
    "MessageDict",
    "RoundRequest",
    "ShareKeys",
    "ShareKeysRequest",
    "UnmaskRequest",
    "UnmaskResponse",
    "split_blob",
]

PROTOCOL_VERSION: Final = 1
CIPHERTEXT_BYTES: Final = SHARE_BYTES + CIPHERTEXT_OVERHEAD
"""Size of one encrypted share: 12-byte nonce, 40-byte share, 16-byte tag."""

MessageDict = dict[str, "int | bytes | NDArray[Any]"]
Ids = tuple[int, ...]
M = TypeVar("M", bound="Message")

# field kinds: "int", "bytes", "ids" (tuple of ints <-> int64 array), "u32" (1-D uint32),
# "shares" (2-D uint32, NUM_LIMBS columns)


def split_blob(blob: bytes, count: int, field: str = "ciphertexts") -> list[bytes]:
    """Split ``blob`` into ``count`` records of :data:`CIPHERTEXT_BYTES`."""
    if len(blob) != count * CIPHERTEXT_BYTES:
        raise ProtocolError(
            explain(field, len(blob), f"must be {count} x {CIPHERTEXT_BYTES} bytes", "resend")
        )
    return [blob[i * CIPHERTEXT_BYTES : (i + 1) * CIPHERTEXT_BYTES] for i in range(count)]


def _ids(value: object, field: str) -> Ids:
    arr = np.asarray(value) if isinstance(value, (np.ndarray, tuple, list)) else None
    if arr is None or arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ProtocolError(explain(field, type(value).__name__, "must be a 1-D int array", "-"))
    out = tuple(int(v) for v in arr)
    if any(v < 0 for v in out):
        raise ProtocolError(explain(field, "negative id", "ids must be >= 0", "-"))
    return out


class Message:
    """Base class: flat-dict conversion and a redacted ``repr``."""

    TYPE: ClassVar[int]
    FIELDS: ClassVar[tuple[tuple[str, str], ...]]

    def to_dict(self) -> MessageDict:
        """Flat ``str -> int | bytes | ndarray`` dict (see the module docstring)."""
        out: MessageDict = {"secagg_version": PROTOCOL_VERSION, "secagg_type": self.TYPE}
        for name, kind in self.FIELDS:
            value = getattr(self, name)
            out[name] = np.asarray(value, dtype=np.int64) if kind == "ids" else value
        return out

    @classmethod
    def from_dict(cls: type[M], data: MessageDict) -> M:
        """Validate and rebuild a message; raises ProtocolError on any mismatch."""
        if not isinstance(data, dict):
            raise ProtocolError(explain("message", type(data).__name__, "must be a dict", "-"))
        expected = {"secagg_version", "secagg_type"} | {n for n, _ in cls.FIELDS}
        if set(data) != expected:
            raise ProtocolError(
                explain(cls.__name__, sorted(set(data) ^ expected), "unexpected/missing keys", "-")
            )
        if data["secagg_version"] != PROTOCOL_VERSION or data["secagg_type"] != cls.TYPE:
            raise ProtocolError(
                explain(
                    cls.__name__,
                    (data["secagg_version"], data["secagg_type"]),
                    f"expected version {PROTOCOL_VERSION}, type {cls.TYPE}",
                    "upgrade both sides / route the message to the right handler",
                )
            )
        kwargs: dict[str, object] = {}
        for name, kind in cls.FIELDS:
            kwargs[name] = _convert(data[name], kind, f"{cls.__name__}.{name}")
        return cls(**kwargs)

    def __repr__(self) -> str:
        parts = []
        for name, kind in self.FIELDS:
            value = getattr(self, name)
            if kind == "int":
                parts.append(f"{name}={value}")
            elif kind == "ids":
                parts.append(
                    f"{name}={list(value)}" if len(value) <= 16 else f"{name}=<{len(value)} ids>"
                )
            elif kind == "bytes":
                parts.append(f"{name}=<{len(value)} bytes>")
            else:
                parts.append(f"{name}=<array {tuple(value.shape)}>")
        return f"{type(self).__name__}({', '.join(parts)})"


def _convert(value: object, kind: str, field: str) -> object:
    if kind == "int":
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ProtocolError(explain(field, type(value).__name__, "must be an int", "-"))
        return int(value)
    if kind == "bytes":
        if not isinstance(value, (bytes, bytearray)):
            raise ProtocolError(explain(field, type(value).__name__, "must be bytes", "-"))
        return bytes(value)
    if kind == "ids":
        return _ids(value, field)
    if not isinstance(value, np.ndarray) or value.dtype != np.uint32:
        raise ProtocolError(explain(field, type(value).__name__, "must be a uint32 array", "-"))
    ndim = 1 if kind == "u32" else 2
    if value.ndim != ndim or (ndim == 2 and value.shape[1] != NUM_LIMBS):
        raise ProtocolError(explain(field, value.shape, f"must be {ndim}-D", "-"))
    return value


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class KeyAdvertiseRequest(Message):
    """Setup exchange 1, server -> every site: start membership epoch ``epoch``."""

    TYPE = 1
    FIELDS = (("run_id", "bytes"), ("epoch", "int"), ("roster", "ids"), ("params_digest", "bytes"))
    run_id: bytes
    epoch: int
    roster: Ids
    params_digest: bytes


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class KeyAdvertise(Message):
    """Site -> server: public keys ``c`` (share encryption) and ``s`` (masks, generation 0)."""

    TYPE = 2
    FIELDS = (("site", "int"), ("epoch", "int"), ("c_public", "bytes"), ("s_public", "bytes"))
    site: int
    epoch: int
    c_public: bytes
    s_public: bytes


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ShareKeysRequest(Message):
    """Setup exchange 2, server -> site: the advertised roster and its neighbours' ``c`` keys."""

    TYPE = 3
    FIELDS = (
        ("epoch", "int"),
        ("roster", "ids"),
        ("neighbours", "ids"),
        ("neighbour_c_public", "bytes"),
    )
    epoch: int
    roster: Ids
    neighbours: Ids
    neighbour_c_public: bytes


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ShareKeys(Message):
    """Site -> server: encrypted shares of its generation-``gen`` mask key, one per neighbour."""

    TYPE = 4
    FIELDS = (
        ("site", "int"),
        ("epoch", "int"),
        ("gen", "int"),
        ("recipients", "ids"),
        ("ciphertexts", "bytes"),
    )
    site: int
    epoch: int
    gen: int
    recipients: Ids
    ciphertexts: bytes


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class RoundRequest(Message):
    """Round exchange 1, server -> participant (rides with the train instruction)."""

    TYPE = 5
    FIELDS = (
        ("epoch", "int"),
        ("round", "int"),
        ("participants", "ids"),
        ("dim", "int"),
        ("gen", "int"),
        ("neighbours", "ids"),
        ("neighbour_gens", "ids"),
        ("neighbour_s_public", "bytes"),
    )
    epoch: int
    round: int
    participants: Ids
    dim: int
    gen: int
    neighbours: Ids
    neighbour_gens: Ids
    neighbour_s_public: bytes


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class MaskedUpload(Message):
    """Participant -> server: masked vector, encrypted self-mask-seed shares, next mask key."""

    TYPE = 6
    FIELDS = (
        ("site", "int"),
        ("epoch", "int"),
        ("round", "int"),
        ("masked", "u32"),
        ("b_commitment", "bytes"),
        ("b_recipients", "ids"),
        ("b_ciphertexts", "bytes"),
        ("next_gen", "int"),
        ("next_s_public", "bytes"),
        ("next_recipients", "ids"),
        ("next_ciphertexts", "bytes"),
    )
    site: int
    epoch: int
    round: int
    masked: NDArray[np.uint32]
    b_commitment: bytes
    b_recipients: Ids
    b_ciphertexts: bytes
    next_gen: int
    next_s_public: bytes
    next_recipients: Ids
    next_ciphertexts: bytes


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class UnmaskRequest(Message):
    """Round exchange 2, server -> each site that uploaded: relayed encrypted shares.

    ``b_senders`` survived (reveal their self-mask seed share); ``s_senders`` dropped before
    uploading (reveal the share of their mask key of generation ``s_gens``).
    """

    TYPE = 7
    FIELDS = (
        ("epoch", "int"),
        ("round", "int"),
        ("b_senders", "ids"),
        ("b_ciphertexts", "bytes"),
        ("s_senders", "ids"),
        ("s_gens", "ids"),
        ("s_ciphertexts", "bytes"),
    )
    epoch: int
    round: int
    b_senders: Ids
    b_ciphertexts: bytes
    s_senders: Ids
    s_gens: Ids
    s_ciphertexts: bytes


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class UnmaskResponse(Message):
    """Site -> server: decrypted shares (rows of ``NUM_LIMBS`` field elements, x = site + 1)."""

    TYPE = 8
    FIELDS = (
        ("site", "int"),
        ("epoch", "int"),
        ("round", "int"),
        ("b_owners", "ids"),
        ("b_shares", "shares"),
        ("s_owners", "ids"),
        ("s_shares", "shares"),
    )
    site: int
    epoch: int
    round: int
    b_owners: Ids
    b_shares: NDArray[np.uint32]
    s_owners: Ids
    s_shares: NDArray[np.uint32]
