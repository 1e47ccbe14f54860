"""Protocol messages: plain frozen dataclasses of ints, bytes and numpy arrays.

Every message converts to and from a flat ``dict[str, int | bytes | numpy.ndarray]`` with
:meth:`to_dict` / :meth:`from_dict`, so a transport adapter (Flower records) only has to copy
values: ints and bytes go into a ConfigRecord, arrays into an ArrayRecord. Only a masked
vector of more than :data:`INLINE_BYTES` is an array; every other list is one ``bytes`` value
of fixed-size little-endian records (wire version 3): id lists 4 bytes per id (``uint32``), key
generations 8 (``uint64``), share rows ``4 x NUM_LIMBS`` (``uint32`` limbs), a small masked
vector 4 per word (``uint32``), ciphertexts :data:`CIPHERTEXT_BYTES` each, in the order of the
matching id list. (Version 2 sent id lists and share rows as arrays, each costing ~0.45 kB of
array framing per message: with a sparse masked vector, ~3 kB of a site's ~7 kB of fixed
per-round bytes.)

Every message checks the type and range of every field, and that each list field has one
entry per id of its id list, when it is built (by ``from_dict``, at parse time, or by the
constructor) and raises :class:`~fedagg.errors.ProtocolError` on anything unexpected. A
receiver therefore drops that one message, and so only its sender, never the round.
``repr`` shows only ids, counts and sizes, never shares or key material.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Final, TypeVar

import numpy as np
from numpy.typing import NDArray

from fedagg.errors import ProtocolError, explain
from fedagg.secagg.graph import ADVERTISED_KEY_BYTES
from fedagg.secagg.keys import CIPHERTEXT_OVERHEAD, KEY_BYTES
from fedagg.secagg.shamir import NUM_LIMBS, PRIME, SHARE_BYTES

__all__ = [
    "CIPHERTEXT_BYTES",
    "INLINE_BYTES",
    "MAX_COUNTER",
    "MAX_DIM",
    "MAX_SITE",
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

PROTOCOL_VERSION: Final = 4
"""Wire version: 2 added ``ShareKeysRequest.roster_public`` and the key-mixed graph seed; 3 sends
id lists, key generations, share rows and masked vectors up to :data:`INLINE_BYTES` as ``bytes``
of little-endian records, not arrays."""
CIPHERTEXT_BYTES: Final = SHARE_BYTES + CIPHERTEXT_OVERHEAD
"""Size of one encrypted share: 12-byte nonce, 40-byte share, 16-byte tag."""
MAX_SITE: Final = PRIME - 2
"""Largest site id (Shamir evaluation point ``id + 1 < p``)."""
MAX_COUNTER: Final = 2**63 - 1
"""Largest epoch, round or key generation (fits ``int64`` and the 64-bit HKDF context)."""
MAX_DIM: Final = 2**40
"""Largest vector length a round may announce."""
INLINE_BYTES: Final = 65_536
"""A masked vector up to this many bytes travels as ``bytes`` (inline in the transport's
ConfigRecord); a larger one as a ``uint32`` array (Flower chunks arrays at 5 MiB)."""

MessageDict = dict[str, "int | bytes | NDArray[Any]"]
Ids = tuple[int, ...]
M = TypeVar("M", bound="Message")

# Field kinds. Every value a peer sends is checked for its type and range when a message is
# built, whether by ``from_dict`` (parse time) or by the constructor, and a violation raises
# ProtocolError, so a receiver can drop the one bad message (and its sender) and go on.
#   "int"     counter (epoch, round, generation) in [0, MAX_COUNTER]
#   "site"    site id in [0, MAX_SITE]
#   "dim"     vector length in [1, MAX_DIM]
#   "run_id"  1..256 bytes
#   "key"     one 32-byte public key;   "digest" 32 bytes (SHA-256)
#   "keys"    32-byte public keys, one per entry of the id list named in COUNTS
#   "cts"     CIPHERTEXT_BYTES-byte ciphertexts, one per entry of the matching id list
#   "roster_keys" ADVERTISED_KEY_BYTES per roster site (may be empty: not sent)
#   "ids"     distinct site ids (bytes of uint32 LE on the wire; a tuple / int array in process)
#   "gens"    key generations in [0, MAX_COUNTER] (bytes of uint64 LE on the wire)
#   "u32"     1-D uint32 array (the masked vector: bytes of uint32 LE up to INLINE_BYTES, else
#             the one array on the wire)
#   "shares"  2-D uint32 array, NUM_LIMBS columns, entries < p (bytes of uint32 LE rows on the wire)
_INT_KINDS: Final = {"int": (0, MAX_COUNTER), "site": (0, MAX_SITE), "dim": (1, MAX_DIM)}
_FIXED_BYTES: Final = {"key": KEY_BYTES, "digest": 32}
_UNIT_BYTES: Final = {"keys": KEY_BYTES, "cts": CIPHERTEXT_BYTES}
_BYTES_KINDS: Final = {"run_id", "key", "digest", "keys", "cts", "roster_keys"}
_ID_KINDS: Final = {"ids", "gens"}


def split_blob(blob: bytes, count: int, field: str = "ciphertexts") -> list[bytes]:
    """Split ``blob`` into ``count`` records of :data:`CIPHERTEXT_BYTES`."""
    if len(blob) != count * CIPHERTEXT_BYTES:
        raise ProtocolError(
            explain(field, len(blob), f"must be {count} x {CIPHERTEXT_BYTES} bytes", "resend")
        )
    return [blob[i * CIPHERTEXT_BYTES : (i + 1) * CIPHERTEXT_BYTES] for i in range(count)]


_WIRE_DTYPE: Final[dict[str, np.dtype[Any]]] = {
    "ids": np.dtype("<u4"), "gens": np.dtype("<u8"), "shares": np.dtype("<u4"),
    "u32": np.dtype("<u4")}
"""Little-endian record type of each list kind that travels as ``bytes`` (wire version 3)."""


def _from_wire(value: bytes | bytearray, kind: str, field: str) -> NDArray[Any]:
    """Decode one list field sent as bytes (a whole number of records, nothing allocated first)."""
    dtype = _WIRE_DTYPE[kind]
    unit = dtype.itemsize * (NUM_LIMBS if kind == "shares" else 1)
    if len(value) % unit:
        raise ProtocolError(explain(field, f"{len(value)} bytes", f"must be a whole number of "
                                    f"{unit}-byte records", "resend"))
    arr: NDArray[Any] = np.frombuffer(value, dtype=dtype)  # read-only (a masked vector is read once)
    if kind == "shares":
        return arr.reshape(-1, NUM_LIMBS).astype(np.uint32)
    return arr.astype(dtype.newbyteorder("="), copy=False)


def _to_wire(value: object, kind: str) -> bytes:
    """Encode one list field as bytes of little-endian records (see :data:`_WIRE_DTYPE`)."""
    data: bytes = np.ascontiguousarray(np.asarray(value).reshape(-1), _WIRE_DTYPE[kind]).tobytes()
    return data


def _int_list(value: object, field: str, lo: int, hi: int) -> Ids:
    if isinstance(value, tuple) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        out = value  # already plain ints (a message built in process)
    else:
        arr = np.asarray(value) if isinstance(value, (np.ndarray, tuple, list)) else None
        if (
            arr is None
            or arr.ndim != 1
            or (arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)))
        ):
            raise ProtocolError(
                explain(field, type(value).__name__, "must be a 1-D int array", "-")
            )
        out = tuple(int(v) for v in arr)
    if any(not lo <= v <= hi for v in out):
        raise ProtocolError(explain(field, "out of range", f"entries must be in [{lo}, {hi}]", "-"))
    return out


def _convert(value: object, kind: str, field: str) -> object:
    """Type- and range-check one field value (see the field kinds above)."""
    if kind in _INT_KINDS:
        lo, hi = _INT_KINDS[kind]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ProtocolError(explain(field, type(value).__name__, "must be an int", "-"))
        if not lo <= int(value) <= hi:
            raise ProtocolError(explain(field, int(value), f"must be in [{lo}, {hi}]", "-"))
        return int(value)
    if kind in _BYTES_KINDS:
        if not isinstance(value, (bytes, bytearray)):
            raise ProtocolError(explain(field, type(value).__name__, "must be bytes", "-"))
        data = bytes(value)
        size = _FIXED_BYTES.get(kind)
        if size is not None and len(data) != size:
            raise ProtocolError(explain(field, len(data), f"must be {size} bytes", "-"))
        if kind == "run_id" and not 1 <= len(data) <= 256:
            raise ProtocolError(explain(field, len(data), "must be 1..256 bytes", "-"))
        return data
    if kind in _WIRE_DTYPE and isinstance(value, (bytes, bytearray)):
        value = _from_wire(value, kind, field)
    if kind == "ids":
        ids = _int_list(value, field, 0, MAX_SITE)
        if len(set(ids)) != len(ids):
            raise ProtocolError(explain(field, "duplicate id", "ids must be distinct", "-"))
        return ids
    if kind == "gens":
        return _int_list(value, field, 0, MAX_COUNTER)
    if not isinstance(value, np.ndarray) or value.dtype != np.uint32:
        raise ProtocolError(explain(field, type(value).__name__, "must be a uint32 array", "-"))
    ndim = 1 if kind == "u32" else 2
    if value.ndim != ndim or (ndim == 2 and value.shape[1] != NUM_LIMBS):
        raise ProtocolError(explain(field, value.shape, f"must be {ndim}-D", "-"))
    if kind == "shares" and value.size and int(value.max()) >= PRIME:
        raise ProtocolError(
            explain(field, "limb >= p", f"share limbs must be field elements (< {PRIME})", "-")
        )
    return value


class Message:
    """Base class: validation, flat-dict conversion and a redacted ``repr``.

    Subclasses are frozen dataclasses. ``FIELDS`` names each field's kind; ``COUNTS`` ties a
    list-valued field to the id list it belongs to (same number of entries; ``unit`` bytes per
    entry for bytes fields); ``OPTIONAL`` fields have a default and may be missing from a dict
    (added in a later wire version). Validation runs in ``__post_init__``, so a message that
    exists is well formed.
    """

    TYPE: ClassVar[int]
    FIELDS: ClassVar[tuple[tuple[str, str], ...]]
    COUNTS: ClassVar[tuple[tuple[str, str], ...]] = ()
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field, kind in self.FIELDS:
            value = _convert(getattr(self, field), kind, f"{name}.{field}")
            object.__setattr__(self, field, value)
        for ids_field, other in self.COUNTS:
            count = len(getattr(self, ids_field))
            value = getattr(self, other)
            unit = _UNIT_BYTES.get(dict(self.FIELDS)[other], 0)
            if (len(value) != count * unit) if unit else (len(value) != count):
                raise ProtocolError(
                    explain(
                        f"{name}.{other}",
                        len(value),
                        f"must hold one entry per {ids_field} ({count})",
                        "-",
                    )
                )

    def to_dict(self) -> MessageDict:
        """Flat ``str -> int | bytes | ndarray`` dict (see the module docstring)."""
        out: MessageDict = {"secagg_version": PROTOCOL_VERSION, "secagg_type": self.TYPE}
        for name, kind in self.FIELDS:
            value = getattr(self, name)
            if kind in _WIRE_DTYPE and (kind != "u32" or value.nbytes <= INLINE_BYTES):
                value = _to_wire(value, kind)
            out[name] = value
        return out

    @classmethod
    def from_dict(cls: type[M], data: MessageDict) -> M:
        """Validate and rebuild a message; raises ProtocolError on any mismatch."""
        if not isinstance(data, dict):
            raise ProtocolError(explain("message", type(data).__name__, "must be a dict", "-"))
        expected = {"secagg_version", "secagg_type"} | {n for n, _ in cls.FIELDS}
        keys = set(data)
        if not expected - cls.OPTIONAL <= keys <= expected:
            odd = sorted(str(k) for k in keys ^ expected if k not in cls.OPTIONAL)
            raise ProtocolError(explain(cls.__name__, odd, "unexpected/missing keys", "-"))
        version = _convert(data["secagg_version"], "int", f"{cls.__name__}.secagg_version")
        kind = _convert(data["secagg_type"], "int", f"{cls.__name__}.secagg_type")
        if version != PROTOCOL_VERSION or kind != cls.TYPE:
            raise ProtocolError(
                explain(
                    cls.__name__,
                    (version, kind),
                    f"expected version {PROTOCOL_VERSION}, type {cls.TYPE}",
                    "upgrade both sides / route the message to the right handler",
                )
            )
        kwargs = {n: data[n] for n, _ in cls.FIELDS if n in data}
        try:
            return cls(**kwargs)
        except TypeError as err:  # unreachable: the key set was checked above
            raise ProtocolError(explain(cls.__name__, "fields", str(err), "-")) from None

    def __repr__(self) -> str:
        parts = []
        for name, kind in self.FIELDS:
            value = getattr(self, name)
            if kind in _INT_KINDS:
                parts.append(f"{name}={value}")
            elif kind in _ID_KINDS:
                parts.append(
                    f"{name}={list(value)}" if len(value) <= 16 else f"{name}=<{len(value)} ids>"
                )
            elif kind in _BYTES_KINDS:
                parts.append(f"{name}=<{len(value)} bytes>")
            else:
                parts.append(f"{name}=<array {tuple(value.shape)}>")
        return f"{type(self).__name__}({', '.join(parts)})"


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class KeyAdvertiseRequest(Message):
    """Setup exchange 1, server -> every site: start membership epoch ``epoch``."""

    TYPE = 1
    FIELDS = (
        ("run_id", "run_id"),
        ("epoch", "int"),
        ("roster", "ids"),
        ("params_digest", "digest"),
    )
    run_id: bytes
    epoch: int
    roster: Ids
    params_digest: bytes


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class KeyAdvertise(Message):
    """Site -> server: public keys ``c`` (share encryption) and ``s`` (masks, generation 0)."""

    TYPE = 2
    FIELDS = (("site", "site"), ("epoch", "int"), ("c_public", "key"), ("s_public", "key"))
    site: int
    epoch: int
    c_public: bytes
    s_public: bytes


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ShareKeysRequest(Message):
    """Setup exchange 2, server -> site: the advertised roster, its keys and the neighbours.

    ``roster_public`` (wire version 2) holds every roster site's advertised ``c || s`` public
    keys in roster order. The site hashes them into the graph seed and checks its neighbours,
    its own keys and ``neighbour_c_public`` against them (see :mod:`fedagg.secagg.graph`).
    """

    TYPE = 3
    FIELDS = (
        ("epoch", "int"),
        ("roster", "ids"),
        ("neighbours", "ids"),
        ("neighbour_c_public", "keys"),
        ("roster_public", "roster_keys"),
    )
    COUNTS = (("neighbours", "neighbour_c_public"),)
    OPTIONAL = frozenset({"roster_public"})
    epoch: int
    roster: Ids
    neighbours: Ids
    neighbour_c_public: bytes
    roster_public: bytes = b""

    def __post_init__(self) -> None:
        super().__post_init__()
        size = len(self.roster) * ADVERTISED_KEY_BYTES
        if self.roster_public and len(self.roster_public) != size:
            raise ProtocolError(
                explain(
                    "ShareKeysRequest.roster_public",
                    len(self.roster_public),
                    f"must be {len(self.roster)} x {ADVERTISED_KEY_BYTES} bytes (c || s per site)",
                    "-",
                )
            )


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ShareKeys(Message):
    """Site -> server: encrypted shares of its generation-``gen`` mask key, one per neighbour."""

    TYPE = 4
    FIELDS = (
        ("site", "site"),
        ("epoch", "int"),
        ("gen", "int"),
        ("recipients", "ids"),
        ("ciphertexts", "cts"),
    )
    COUNTS = (("recipients", "ciphertexts"),)
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
        ("dim", "dim"),
        ("gen", "int"),
        ("neighbours", "ids"),
        ("neighbour_gens", "gens"),
        ("neighbour_s_public", "keys"),
        ("binding", "digest"),
    )
    COUNTS = (("neighbours", "neighbour_gens"), ("neighbours", "neighbour_s_public"))
    epoch: int
    round: int
    participants: Ids
    dim: int
    gen: int
    neighbours: Ids
    neighbour_gens: Ids
    neighbour_s_public: bytes
    binding: bytes
    """What the round's masks are bound to (32 bytes): the digest of the model every
    participant was sent (:func:`fedagg.secagg.keys.round_binding`). A site derives its
    pairwise masks from the binding of the model *it* received, so members holding different
    models have masks that do not cancel; the round's canary then fails."""


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class MaskedUpload(Message):
    """Participant -> server: masked vector, encrypted self-mask-seed shares, next mask key."""

    TYPE = 6
    FIELDS = (
        ("site", "site"),
        ("epoch", "int"),
        ("round", "int"),
        ("masked", "u32"),
        ("b_commitment", "digest"),
        ("b_recipients", "ids"),
        ("b_ciphertexts", "cts"),
        ("next_gen", "int"),
        ("next_s_public", "key"),
        ("next_recipients", "ids"),
        ("next_ciphertexts", "cts"),
    )
    COUNTS = (("b_recipients", "b_ciphertexts"), ("next_recipients", "next_ciphertexts"))
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
        ("b_ciphertexts", "cts"),
        ("s_senders", "ids"),
        ("s_gens", "gens"),
        ("s_ciphertexts", "cts"),
    )
    COUNTS = (
        ("b_senders", "b_ciphertexts"),
        ("s_senders", "s_gens"),
        ("s_senders", "s_ciphertexts"),
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
    """Site -> server: decrypted shares (rows of ``NUM_LIMBS`` field elements, x = site + 1).

    ``b_owners`` / ``s_owners`` are the requested senders in request order, less any whose
    relayed ciphertext did not decrypt to a valid share for this site: a bad ciphertext costs
    only its sender's share, never the whole response.
    """

    TYPE = 8
    FIELDS = (
        ("site", "site"),
        ("epoch", "int"),
        ("round", "int"),
        ("b_owners", "ids"),
        ("b_shares", "shares"),
        ("s_owners", "ids"),
        ("s_shares", "shares"),
    )
    COUNTS = (("b_owners", "b_shares"), ("s_owners", "s_shares"))
    site: int
    epoch: int
    round: int
    b_owners: Ids
    b_shares: NDArray[np.uint32]
    s_owners: Ids
    s_shares: NDArray[np.uint32]
