"""Flower records <-> numpy arrays and config dicts (part of the wire adapter).

Also measures the size of a message as Flower really ships it: since Flower 1.13 a message is a
tree of content-addressed objects (records, arrays, 5 MiB array chunks), each serialized with
``deflate()``; the bytes on the wire are the sum over the distinct objects of the tree
(:func:`message_nbytes`, computed without serialising or hashing the arrays' data).
"""

from __future__ import annotations

import functools
import io
import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
from flwr.common.serde_utils import error_to_proto, metadata_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=E0611
from flwr.supercore.constant import HEAD_BODY_DIVIDER, HEAD_VALUE_DIVIDER
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    no_object_id_recompute,
)
from numpy.lib import format as npformat

from fedagg.config import flatten, unflatten
from fedagg.errors import UpdateRejected, explain
from fedagg.npy import npy_header

__all__ = [
    "arrays_to_record",
    "config_to_record",
    "deflated_nbytes",
    "message_nbytes",
    "messages_nbytes",
    "npy_record",
    "numpy_array",
    "record_to_arrays",
    "record_to_config",
    "reply_metrics",
    "safe_numpy",
]


def message_nbytes(message: Message) -> int:
    """Serialized size of ``message`` in bytes (all distinct objects of its tree).

    The sum of ``len(obj.deflate())`` over the distinct objects of Flower's object tree
    (:func:`deflated_nbytes`), computed without serialising or hashing the arrays' data: an
    object's deflated form is a header (its type, the 64-character ids of its distinct children,
    its body's length) and a body, so its length follows from the body and the number of
    distinct children. Objects are told apart by content, as Flower's content hashes tell them
    apart (identical chunks, arrays or records count once). A record type it does not know is
    measured by :func:`deflated_nbytes`.
    """
    return messages_nbytes([message])


def messages_nbytes(messages: Iterable[Message]) -> int:
    """The sum of :func:`message_nbytes` over ``messages`` (each counted whole, as each node
    receives all of its message), measuring content they share once."""
    sizes = _Sizes()
    total = 0
    for message in messages:
        try:
            total += sizes.message(message)
        except _Unknown:
            total += deflated_nbytes(message)
    return total


def deflated_nbytes(message: Message) -> int:
    """:func:`message_nbytes` by Flower's own serialisation (every object deflated and hashed:
    the reference, ~100x slower for a model)."""
    with no_object_id_recompute():
        return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


class _Unknown(Exception):
    """A record type the size model does not cover."""


_ID = 64  # an object id: a SHA-256 in hex
_DIV = len(HEAD_BODY_DIVIDER)
_REF = "0" * _ID  # stands for any object id in a JSON body (all have the same length)


def _head(kind: str, children: int, body: int) -> int:
    """Length of an object's header and divider: ``kind<sp>id,id,...<sp>body length``."""
    ids = children * _ID + max(children - 1, 0)
    return len(kind) + 2 * len(HEAD_VALUE_DIVIDER) + ids + len(str(body)) + _DIV


@functools.lru_cache(maxsize=1024)
def _refs_size(kind: str, names: tuple[str, ...], distinct: int) -> int:
    """A record whose body is the JSON map name -> child id (ArrayRecord, RecordDict)."""
    body = len(json.dumps(dict.fromkeys(names, _REF)).encode("utf-8"))
    return _head(kind, distinct, body) + body


@functools.lru_cache(maxsize=1024)
def _array_size(dtype: str, shape: tuple[int, ...], stype: str, seq: tuple[int, ...]) -> int:
    """An Array: its body is the JSON of its metadata and its chunks' positions."""
    distinct = list(dict.fromkeys(seq))
    body = len(json.dumps({"dtype": dtype, "shape": shape, "stype": stype,
                           "arraychunk_ids": [distinct.index(c) for c in seq]}).encode("utf-8"))
    return _head("Array", len(distinct), body) + body


# The protobuf body of a ConfigRecord / MetricRecord (flwr.proto.recorddict_pb2), sized by the
# wire format's rules instead of serialised: each item is ``key`` (field 1, string) and
# ``value`` (field 2, a ``*RecordValue`` whose oneof picks the type: double 1, sint64 2,
# uint64 3, bool 4, string 5, bytes 6, lists 21-26, packed where numeric). The type of a value
# is the first of Flower's allowed types it is an instance of (lists: all items), as
# ``flwr.common.serde_utils._record_value_to_proto`` chooses it.
_ALLOWED: dict[str, tuple[type, ...]] = {"ConfigRecord": (bool, int, float, str, bytes),
                                         "MetricRecord": (float, int)}
_INT64_MAX, _UINT64_MAX = (1 << 63) - 1, (1 << 64) - 1


def _varint(v: int) -> int:
    """Bytes of ``v >= 0`` as a protobuf varint."""
    return max(1, -(-v.bit_length() // 7))


def _zigzag(v: int) -> int:
    if not -(1 << 63) <= v <= _INT64_MAX:
        raise _Unknown("int64 range")
    return 2 * v if v >= 0 else -2 * v - 1


def _delimited(n: int) -> int:
    """A length-delimited field of ``n`` bytes after its one-byte tag."""
    return 1 + _varint(n) + n


def _scalar(t: type, v: Any) -> tuple[Any, int]:
    """``(token, size)`` of one value of allowed type ``t`` as a oneof field (one-byte tag)."""
    if t is bool:
        return ("b", bool(v)), 2
    if t is int:
        if v > _INT64_MAX:
            if v > _UINT64_MAX:
                raise _Unknown("uint64 range")
            return ("u", int(v)), 1 + _varint(v)
        return ("i", int(v)), 1 + _varint(_zigzag(v))
    if t is float:
        return ("f", struct.pack("<d", v)), 9
    data = v.encode("utf-8") if t is str else bytes(v)
    return (t.__name__[0], data), _delimited(len(data))


def _listed(t: type, vals: list[Any]) -> tuple[Any, int]:
    """``(token, size of the list message)`` of a list of allowed type ``t``."""
    if t is str or t is bytes:
        parts = [_scalar(t, v) for v in vals]
        return tuple(p[0] for p in parts), sum(p[1] for p in parts)
    if t is float:
        token: Any = struct.pack(f"<{len(vals)}d", *vals)
        packed = 8 * len(vals)
    elif t is bool:
        token, packed = tuple(bool(v) for v in vals), len(vals)
    elif any(v > _INT64_MAX for v in vals):  # UintList
        if any(v < 0 or v > _UINT64_MAX for v in vals):
            raise _Unknown("uint64 range")
        token, packed = ("u", *map(int, vals)), sum(_varint(v) for v in vals)
    else:
        token, packed = tuple(map(int, vals)), sum(_varint(_zigzag(v)) for v in vals)
    return token, _delimited(packed) if vals else 0


def _value(v: Any, allowed: tuple[type, ...]) -> tuple[Any, int]:
    """``(token, size)`` of a ``*RecordValue`` message."""
    for t in allowed:
        if isinstance(v, t):
            return _scalar(t, v)
        if isinstance(v, list) and all(isinstance(x, t) for x in v):
            token, size = _listed(t, v)
            return ("L", t.__name__, token), 2 + _varint(size) + size  # fields 21-26: 2 tag bytes
    raise _Unknown(type(v).__name__)


def _values_size(rec: Any, allowed: tuple[type, ...]) -> tuple[Any, int]:
    """``(token, body size)`` of a ConfigRecord / MetricRecord (its items in order)."""
    tokens, body = [], 0
    for key, v in rec.items():
        token, vsize = _value(v, allowed)
        k = key.encode("utf-8")
        item = (_delimited(len(k)) if k else 0) + _delimited(vsize)
        body += _delimited(item)
        tokens.append((k, token))
    return tuple(tokens), body


class _Sizes:
    """Deflated sizes of the distinct objects of messages' trees, keyed by content.

    ``_trees`` remembers, per record object met in this call, its token and the sizes of its
    distinct objects (the messages of one exchange share their content)."""

    def __init__(self) -> None:
        self._trees: dict[int, tuple[Any, dict[Any, int]]] = {}
        self._chunks: dict[tuple[Any, ...], list[tuple[memoryview, Any]]] = {}
        self._keep: list[Any] = []  # the objects ``_trees`` is keyed by stay alive meanwhile

    def message(self, message: Message) -> int:
        """Size of ``message`` with everything it carries."""
        children, tree = 0, {}
        if message.has_content():
            tree = self._tree(message.content)[1]
            children = 1
        meta = metadata_to_proto(message.metadata)
        meta.message_id = ""  # as Message.deflate: the id is not part of the content
        body = len(ProtoMessage(
            metadata=meta, content=None,
            error=error_to_proto(message.error) if message.has_error() else None,
        ).SerializeToString(deterministic=True))
        return sum(tree.values()) + _head("Message", children, body) + body

    def _tree(self, obj: Any) -> tuple[Any, dict[Any, int]]:
        """``(token, {token: size} of obj and its descendants)`` of a record or array."""
        hit = self._trees.get(id(obj))
        if hit is not None:
            return hit
        if isinstance(obj, RecordDict | ArrayRecord):
            kind = "RecordDict" if isinstance(obj, RecordDict) else "ArrayRecord"
            tree: dict[Any, int] = {}
            tokens = []
            for name, child in obj.items():
                token, sub = self._tree(child)
                tree.update(sub)
                tokens.append((name, token))
            me: Any = (kind, tuple(tokens))
            tree[me] = _refs_size(kind, tuple(n for n, _ in tokens), len({t for _, t in tokens}))
        elif type(obj) in (ConfigRecord, MetricRecord):  # no children: a protobuf body
            kind = type(obj).__name__
            token, body = _values_size(obj, _ALLOWED[kind])
            me, tree = (kind, token), {}
            tree[me] = _head(kind, 0, body) + body
        elif type(obj) is Array:
            data = memoryview(obj.data)
            step = FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
            tree = {}
            seq = tuple(self._chunk(data[i:i + step], tree) for i in range(0, len(data), step))
            me = ("Array", obj.dtype, tuple(obj.shape), obj.stype, seq)
            tree[me] = _array_size(obj.dtype, tuple(obj.shape), obj.stype, seq)
        else:
            raise _Unknown(type(obj).__name__)
        self._trees[id(obj)] = (me, tree)
        self._keep.append(obj)
        return me, tree

    def _chunk(self, view: memoryview, tree: dict[Any, int]) -> Any:
        """The token of a chunk: chunks with the same bytes get the same token."""
        n = len(view)
        key = (n, bytes(view[:32]), bytes(view[n // 2:n // 2 + 32]), bytes(view[-32:]))
        same = self._chunks.setdefault(key, [])
        # rare: chunks that agree on those bytes (zeros, repeats) are compared whole
        token = next((t for other, t in same if bytes(other) == bytes(view)), None)
        if token is None:
            token = ("ArrayChunk", key, len(same))
            same.append((view, token))
        tree[token] = _head("ArrayChunk", 0, n) + n
        return token


def arrays_to_record(arrays: Sequence[np.ndarray], keys: Sequence[str] | None = None) -> ArrayRecord:
    """List of numpy arrays -> ArrayRecord (keys ``"0"``, ``"1"``, ... unless given)."""
    names = list(keys) if keys is not None else [str(i) for i in range(len(arrays))]
    return ArrayRecord({k: numpy_array(a) for k, a in zip(names, arrays, strict=True)})


def safe_numpy(array: Array, *, name: str = "array", max_elements: int = 2**31,
               copy: bool = True) -> np.ndarray:
    """Decode a Flower ``Array`` (npy bytes) after checking its header against its length.

    ``Array.numpy()`` trusts the npy header and allocates what it claims before reading, so a
    hostile reply could ask for terabytes; this validates the header (numeric dtype, shape,
    byte count equal to the data actually present) before allocating anything.

    Raises
    ------
    UpdateRejected
        Not numpy-serialized, bad header, object / structured dtype, or a length mismatch.
    """
    if array.stype != "numpy.ndarray":
        raise UpdateRejected(explain(name, array.stype, "must be numpy-serialized",
                                     "send numpy arrays in the ArrayRecord"))
    data = array.data
    try:
        shape, fortran, dtype, offset = _npy_header(data)
    except (ValueError, OSError, SyntaxError, TypeError) as exc:
        raise UpdateRejected(explain(name, f"{len(data)} bytes", f"is not a valid npy array ({exc})",
                                     "send arrays serialized by Flower's ArrayRecord")) from None
    if dtype.kind not in "biuf" or dtype.hasobject or dtype.fields is not None:
        raise UpdateRejected(explain(f"{name}.dtype", str(dtype), "must be a plain numeric dtype",
                                     "send float or integer arrays"))
    count = 1
    for dim in shape:
        count *= int(dim)
    if count > max_elements:
        raise UpdateRejected(explain(f"{name}.shape", tuple(shape), f"claims more than {max_elements} elements",
                                     "send arrays of the model's shapes"))
    body = len(data) - offset
    if body != count * dtype.itemsize:
        raise UpdateRejected(explain(name, f"{body} data bytes", f"header says {count * dtype.itemsize}",
                                     "the array is truncated or padded; resend it"))
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    out = flat.reshape(shape, order="F" if fortran else "C")
    return np.array(out, copy=True) if copy else out  # without copy: a read-only view


_NPY_V1 = b"\x93NUMPY\x01\x00"
_CACHED_HEADER_BYTES = 256


def _npy_header(data: bytes) -> tuple[tuple[int, ...], bool, np.dtype[Any], int]:
    """``(shape, fortran, dtype, data offset)`` of npy bytes (headers of v1 files cached)."""
    if data[:8] == _NPY_V1 and len(data) >= 10:
        end = 10 + int.from_bytes(data[8:10], "little")
        if end <= _CACHED_HEADER_BYTES and len(data) >= end:
            return _parse_header(bytes(data[:end]))
    return _parse_header.__wrapped__(data)


@functools.lru_cache(maxsize=128)
def _parse_header(data: bytes) -> tuple[tuple[int, ...], bool, np.dtype[Any], int]:
    """Parse the npy header at the start of ``data`` with numpy's reader.

    Cached for short headers (:func:`_npy_header`): the same few shapes come back in every
    message, and numpy's reader evaluates the header dict with ``ast.literal_eval``.
    """
    buf = io.BytesIO(data)
    version = npformat.read_magic(buf)
    if version == (1, 0):
        shape, fortran, dtype = npformat.read_array_header_1_0(buf)
    elif version == (2, 0):
        shape, fortran, dtype = npformat.read_array_header_2_0(buf)
    else:
        raise ValueError(f"unsupported npy version {version}")
    return tuple(int(d) for d in shape), bool(fortran), dtype, buf.tell()


def numpy_array(array: np.ndarray) -> Array:
    """A Flower ``Array`` of ``array`` (npy bytes as ``np.save`` writes them), with one copy.

    ``Array(ndarray)`` goes through ``np.save`` into a growing ``BytesIO`` and copies its
    contents out again; this joins a cached header and the array's buffer instead.
    """
    a = np.asarray(array)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    if a.dtype.hasobject or a.dtype.fields is not None:
        return Array(a)
    header = _npy_header_bytes(a.dtype.str, a.shape)
    data = b"".join((header, a.data.cast("B") if a.size else b""))
    return Array(dtype=str(a.dtype), shape=tuple(int(d) for d in a.shape), stype="numpy.ndarray",
                 data=data)


_npy_header_bytes = npy_header


def npy_record(keys: Sequence[str], arrays: Sequence[tuple[str, tuple[int, ...], bytes]]
               ) -> ArrayRecord:
    """An ArrayRecord of ready npy bytes: ``(dtype, shape, data)`` per key, not copied
    (:meth:`fedagg.accumulate.Accumulator.mean_npy` writes a round's mean that way)."""
    if len(keys) != len(arrays):
        raise ValueError(f"{len(keys)} keys for {len(arrays)} arrays")
    return ArrayRecord({k: Array(dtype=dt, shape=tuple(int(d) for d in shape),
                                 stype="numpy.ndarray", data=data)
                        for k, (dt, shape, data) in zip(keys, arrays, strict=True)})


def record_to_arrays(record: ArrayRecord, *, copy: bool = True) -> tuple[list[str], list[np.ndarray]]:
    """ArrayRecord -> (keys, numpy arrays) in record order (headers checked before allocation).

    With ``copy=False`` the arrays are read-only views on the record's bytes (server-side
    aggregation reads them once; nothing is copied).
    """
    keys = list(record.keys())
    return keys, [safe_numpy(record[k], name=f"arrays[{k!r}]", copy=copy) for k in keys]


def config_to_record(nested: Mapping[str, Any], **extra: Any) -> ConfigRecord:
    """Nested config dict -> flat ``ConfigRecord`` with dotted keys (None values are dropped)."""
    flat = {k: v for k, v in flatten(nested).items() if v is not None and not isinstance(v, dict)}
    flat.update({k: v for k, v in extra.items() if v is not None})
    return ConfigRecord(flat)


def record_to_config(record: ConfigRecord | Mapping[str, Any]) -> dict[str, Any]:
    """Flat dotted ``ConfigRecord`` -> nested dict (keys without a dot are kept at the top)."""
    return unflatten({k: v for k, v in dict(record).items()})


def reply_metrics(message: Message) -> MetricRecord | None:
    """The first MetricRecord of a reply, or None."""
    recs = list(message.content.metric_records.values())
    return recs[0] if recs else None
