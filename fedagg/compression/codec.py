"""Versioned wire format for :class:`~fedagg.compression.payload.Payload`.

All integers are little-endian. A message is a header followed by one record per tensor and
nothing else (trailing bytes are an error)::

    offset  size  field
    0       4     magic b"FAGC"
    4       1     version (1)
    5       1     flags (0; reserved)
    6       4     n_tensors (u32)
    -- per tensor --
    +0      1     dtype code        1 float32, 2 float16, 3 bfloat16 (u16 bits), 4 int8
    +1      1     index code        0 dense, 1/2/3/4 delta-encoded u8/u16/u32/u64,
                                    5 shared support (no index bytes)
    +2      1     ndim (<= 32)
    +3      1     reserved (0)
    +4      4     chunk_size (u32; >= 1 for int8, else 0)
    +8      8     nnz (u64): number of values
    +16     8*ndim shape (u64 each)
            w*nnz indices, delta-encoded: d[0] = i[0], d[j] = i[j] - i[j-1] (>= 1)
            s*nnz values (s = 4, 2, 2, 1 by dtype)
            4*ceil(nnz/chunk_size) scales (float32, int8 only)

Indices use the smallest unsigned type that holds the largest delta (an empty index list uses
u8), so a payload has exactly one encoding; the decoder refuses a wider index type than that
(no fedagg encoder ever wrote one: this is the format's own rule, enforced, not a new
version). The decoder checks every count against the bytes actually present *before*
allocating, and every index, scale and field before building the payload; anything malformed
raises :class:`~fedagg.errors.CodecError` (never another exception), and so does every use
of a decoded payload (:meth:`Payload.to_dense` included): a shape is refused when the product
of its non-zero dimensions exceeds ``max_elements``, zero-size shapes such as ``(0, 2**63)``
included.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.compression.payload import (
    FORMAT_VERSION,
    Payload,
    TensorPayload,
    WireDType,
    check_shape,
    nonzero_extent,
)
from fedagg.errors import CodecError, explain

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "MAGIC",
    "decode",
    "dense_nbytes",
    "encode",
    "encoded_size",
]

MAGIC = b"FAGC"
DEFAULT_MAX_ELEMENTS = 2**31
"""Largest total number of tensor elements :func:`decode` accepts by default (8 GiB float32
once densified). Raise it with ``decode(data, max_elements=...)`` for larger models."""

MAX_NDIM = 32
_HEADER = struct.Struct("<4sBBI")
_TENSOR = struct.Struct("<BBBBIQ")
INDEX_DENSE = 0
INDEX_SHARED = 5
_INDEX_DTYPES: dict[int, str] = {1: "<u1", 2: "<u2", 3: "<u4", 4: "<u8"}
_VALUE_DTYPES: dict[WireDType, str] = {
    WireDType.FLOAT32: "<f4",
    WireDType.FLOAT16: "<f2",
    WireDType.BFLOAT16: "<u2",
    WireDType.INT8: "i1",
}


def _err(field: str, value: object, rule: str, fix: str = "reject this message") -> CodecError:
    return CodecError(explain(field, value, rule, fix))


def _index_code(deltas: NDArray[np.integer[Any]]) -> int:
    top = int(deltas.max()) if deltas.size else 0
    for code, limit in ((1, 0xFF), (2, 0xFFFF), (3, 0xFFFFFFFF)):
        if top <= limit:
            return code
    return 4


def _deltas(idx: NDArray[np.int64]) -> NDArray[np.int64]:
    if idx.size == 0:
        return idx
    return np.concatenate([idx[:1], np.diff(idx)])


def _n_chunks(t: TensorPayload) -> int:
    return -(-t.nnz // t.chunk_size) if t.dtype is WireDType.INT8 else 0


def _index_plan(t: TensorPayload) -> tuple[int, NDArray[np.int64] | None]:
    if t.implicit_indices:
        return INDEX_SHARED, None
    if t.indices is None:
        return INDEX_DENSE, None
    d = _deltas(t.indices)
    return _index_code(d), d


def encode(payload: Payload) -> bytes:
    """Serialize a payload (validated first).

    Parameters
    ----------
    payload : Payload

    Returns
    -------
    bytes

    Raises
    ------
    CodecError
        If the payload breaks an invariant (see :meth:`Payload.validate`).
    """
    if not isinstance(payload, Payload):
        raise _err("payload", type(payload).__name__, "must be a Payload", "pass a Payload")
    payload.validate()
    out = [_HEADER.pack(MAGIC, payload.version, 0, len(payload.tensors))]
    for t in payload.tensors:
        code, deltas = _index_plan(t)
        out.append(_TENSOR.pack(int(t.dtype), code, len(t.shape), 0, t.chunk_size, t.nnz))
        out.append(struct.pack(f"<{len(t.shape)}Q", *t.shape))
        if deltas is not None:
            out.append(deltas.astype(_INDEX_DTYPES[code]).tobytes())
        out.append(t.values.astype(_VALUE_DTYPES[t.dtype]).tobytes())
        if t.scales is not None:
            out.append(t.scales.astype("<f4").tobytes())
    return b"".join(out)


def encoded_size(payload: Payload) -> int:
    """Exact length in bytes of :func:`encode(payload) <encode>`, without encoding."""
    n = _HEADER.size
    for t in payload.tensors:
        code, _ = _index_plan(t)
        width = int(_INDEX_DTYPES[code][-1]) if code in _INDEX_DTYPES else 0
        n += _TENSOR.size + 8 * len(t.shape)
        n += t.nnz * (width + t.dtype.itemsize) + 4 * _n_chunks(t)
    return n


def dense_nbytes(tensors: Any) -> int:
    """Bytes of the uncompressed float32 update (sum of ``4 * size``), the ratio baseline.

    ``tensors`` may be arrays or shapes (tuples of ints).
    """
    total = 0
    for t in tensors:
        shape = t if isinstance(t, tuple) else np.shape(t)
        total += 4 * int(np.prod(shape, dtype=np.int64))
    return total


def _buffer(data: object) -> memoryview:
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise _err("data", data.dtype, "an array must be 1-D uint8", "pass bytes")
        return memoryview(np.ascontiguousarray(data).tobytes())
    if not isinstance(data, bytes | bytearray | memoryview):
        raise _err("data", type(data).__name__, "must be bytes", "pass the encoded bytes")
    try:
        return memoryview(data).cast("B")
    except (TypeError, ValueError) as exc:
        raise _err(
            "data", type(data).__name__, "must be a contiguous byte buffer", "pass bytes"
        ) from exc


def decode(data: bytes, *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> Payload:
    """Parse and validate an encoded payload.

    Parameters
    ----------
    data : bytes
        The message (``bytes``, ``bytearray``, ``memoryview`` or a 1-D ``uint8`` array).
    max_elements : int
        Largest total element count (sum over tensors of the product of the shape) accepted,
        bounding what :meth:`Payload.to_dense` may allocate.

    Returns
    -------
    Payload
        Arrays are fresh copies (the payload does not reference ``data``). Shared-support
        tensors have ``indices=None``; attach the support with ``Payload.with_support``.

    Raises
    ------
    CodecError
        On any malformed input: bad magic / version / flags / codes, truncated or trailing
        data, counts inconsistent with the byte length, a shape over ``max_elements`` (the
        product of its non-zero dimensions, so a zero-size shape such as ``(0, 2**63)`` is
        refused too),
        duplicate or out-of-range indices, non-finite or negative scales.
    """
    buf = _buffer(data)
    size = len(buf)
    if size < _HEADER.size:
        raise _err("data", f"{size} bytes", f"shorter than the {_HEADER.size}-byte header")
    magic, version, flags, n_tensors = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise _err("magic", bytes(magic), f"must be {MAGIC!r}", "this is not a fedagg payload")
    if version != FORMAT_VERSION:
        raise _err(
            "version", version, f"this fedagg reads version {FORMAT_VERSION}", "upgrade fedagg"
        )
    if flags != 0:
        raise _err("flags", flags, "must be 0 in version 1")
    pos = _HEADER.size
    if n_tensors * _TENSOR.size > size - pos:
        raise _err("n_tensors", n_tensors, f"cannot fit in the {size - pos} remaining bytes")
    budget = int(max_elements)
    tensors: list[TensorPayload] = []
    for i in range(n_tensors):
        t, pos, budget = _decode_tensor(buf, pos, i, budget, max_elements)
        tensors.append(t)
    if pos != size:
        raise _err("data", f"{size - pos} trailing bytes", "message must end after the last tensor")
    return Payload(tuple(tensors), version)


def _decode_tensor(
    buf: memoryview, pos: int, i: int, budget: int, max_elements: int
) -> tuple[TensorPayload, int, int]:
    size = len(buf)
    f = f"tensors[{i}]"
    if size - pos < _TENSOR.size:
        raise _err(f, f"{size - pos} bytes", f"truncated tensor header ({_TENSOR.size} needed)")
    dcode, icode, ndim, reserved, chunk, nnz = _TENSOR.unpack_from(buf, pos)
    pos += _TENSOR.size
    try:
        dtype = WireDType(dcode)
    except ValueError:
        raise _err(f + ".dtype", dcode, "unknown dtype code (1-4)") from None
    if icode not in _INDEX_DTYPES and icode not in (INDEX_DENSE, INDEX_SHARED):
        raise _err(f + ".index_code", icode, "unknown index code (0-5)")
    if ndim > MAX_NDIM:
        raise _err(f + ".ndim", ndim, f"must be <= {MAX_NDIM}")
    if reserved != 0:
        raise _err(f + ".reserved", reserved, "must be 0")
    if size - pos < 8 * ndim:
        raise _err(f + ".shape", ndim, "truncated shape")
    shape = struct.unpack_from(f"<{ndim}Q", buf, pos)
    pos += 8 * ndim
    extent = nonzero_extent(shape)
    if extent > max_elements:
        raise _err(
            f + ".shape",
            shape,
            f"the product of the non-zero dimensions must be <= max_elements={max_elements}, "
            "zero-size shapes included (a zero-size tensor with a huge dimension is no tensor "
            "of any model)",
            "reject, or decode with a larger max_elements for a model this size",
        )
    check_shape(shape, f + ".shape")  # also where max_elements is set above NumPy's limit
    numel = 1
    for d in shape:
        numel *= d
    if numel > budget:
        raise _err(
            f + ".shape",
            shape,
            f"total elements exceed max_elements={max_elements}",
            "reject, or decode with a larger max_elements for a model this size",
        )
    budget -= numel
    if dtype is WireDType.INT8:
        if chunk < 1:
            raise _err(f + ".chunk_size", chunk, "int8 needs chunk_size >= 1")
        n_chunks = -(-nnz // chunk)
    else:
        if chunk != 0:
            raise _err(f + ".chunk_size", chunk, f"must be 0 for {dtype.name}")
        n_chunks = 0
    if icode == INDEX_DENSE and nnz != numel:
        raise _err(f + ".nnz", nnz, f"a dense tensor must carry numel={numel} values")
    if nnz > numel:
        raise _err(f + ".nnz", nnz, f"more values than elements ({numel})")
    width = int(_INDEX_DTYPES[icode][-1]) if icode in _INDEX_DTYPES else 0
    need = nnz * (width + dtype.itemsize) + 4 * n_chunks
    if need > size - pos:
        raise _err(f, f"{size - pos} bytes left", f"nnz={nnz} needs {need} bytes (truncated)")
    indices: NDArray[np.int64] | None = None
    if width:
        deltas = np.frombuffer(buf, dtype=_INDEX_DTYPES[icode], count=nnz, offset=pos)
        narrowest = _index_code(deltas)
        if icode != narrowest:
            raise _err(f + ".index_code", icode,
                       f"must be the narrowest index type that holds the largest delta "
                       f"(code {narrowest}): every payload has exactly one encoding")
        pos += width * nnz
        indices = _undelta(deltas.astype(np.uint64), numel, f)
    values = np.frombuffer(buf, dtype=_VALUE_DTYPES[dtype], count=nnz, offset=pos)
    values = values.astype(dtype.numpy_dtype)  # native byte order, owned copy
    pos += dtype.itemsize * nnz
    scales: NDArray[np.float32] | None = None
    if dtype is WireDType.INT8:
        raw = np.frombuffer(buf, dtype="<f4", count=n_chunks, offset=pos)
        pos += 4 * n_chunks
        scales = raw.astype(np.float32)
        if not bool(np.all(np.isfinite(scales))) or bool(np.any(scales < 0)):
            raise _err(f + ".scales", "NaN/inf/negative", "scales must be finite and >= 0")
    t = TensorPayload(
        shape=tuple(int(d) for d in shape),
        dtype=dtype,
        values=values,
        indices=indices,
        scales=scales,
        chunk_size=int(chunk),
        implicit_indices=icode == INDEX_SHARED,
    )
    return t, pos, budget


def _undelta(deltas: NDArray[np.uint64], numel: int, f: str) -> NDArray[np.int64]:
    if deltas.size == 0:
        return np.empty(0, dtype=np.int64)
    if bool(np.any(deltas >= np.uint64(numel))):
        raise _err(f + ".indices", "delta >= numel", f"index out of range [0, {numel})")
    if deltas.size > 1 and bool(np.any(deltas[1:] == 0)):
        raise _err(f + ".indices", "zero delta", "duplicate index")
    idx = np.cumsum(deltas, dtype=np.uint64)
    if (deltas.size > 1 and not bool(np.all(idx[1:] > idx[:-1]))) or int(idx[-1]) >= numel:
        raise _err(f + ".indices", int(idx[-1]), f"index out of range [0, {numel})")
    return idx.astype(np.int64)
