"""The compressed-update payload: what a site sends and what the server decodes.

A :class:`Payload` holds one :class:`TensorPayload` per model tensor. Each tensor is either

* **dense**: ``indices is None`` and ``values`` holds every element (row-major order);
* **sparse, explicit indices**: ``indices`` holds the sorted, unique flat positions of the
  ``values`` (TopK, random-k). The indices travel on the wire, so the receiver learns them;
* **sparse, shared support**: ``implicit_indices=True``; the positions come from public
  information that every party can recompute (:mod:`fedagg.compression.support`), so they are
  *not* sent. A decoded payload of this kind has ``indices=None`` until the receiver attaches
  the support with :meth:`Payload.with_support`.

Values are stored in their wire dtype (:class:`WireDType`): float32, float16, bfloat16 (as
``uint16`` bit patterns) or int8 with one float32 scale per chunk of ``chunk_size`` values.
:meth:`Payload.to_dense` turns any complete payload back into float32 arrays.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.errors import CodecError, explain

__all__ = [
    "FORMAT_VERSION",
    "Payload",
    "TensorPayload",
    "WireDType",
    "bf16_bits_to_float32",
    "check_shape",
    "float32_to_bf16_bits",
    "nonzero_extent",
    "split_flat_support",
]

FORMAT_VERSION = 1
"""Version of the payload / wire format produced by this release."""


class WireDType(enum.IntEnum):
    """Dtype code of the values of one tensor, as written on the wire (one byte)."""

    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3  #: stored as ``uint16`` bit patterns (upper half of a float32)
    INT8 = 4  #: signed int8 with one float32 scale per chunk

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """NumPy dtype of the ``values`` array for this wire dtype."""
        return np.dtype(_NUMPY_DTYPES[self])

    @property
    def itemsize(self) -> int:
        """Bytes per value on the wire."""
        return self.numpy_dtype.itemsize


_NUMPY_DTYPES: dict[WireDType, type[np.generic]] = {
    WireDType.FLOAT32: np.float32,
    WireDType.FLOAT16: np.float16,
    WireDType.BFLOAT16: np.uint16,
    WireDType.INT8: np.int8,
}


def float32_to_bf16_bits(x: NDArray[Any]) -> NDArray[np.uint16]:
    """Round float32 values to bfloat16 (round to nearest, ties to even); return bit patterns.

    NaN stays NaN (quiet, sign kept); values that round past the largest bfloat16 become
    +-inf, exactly as IEEE round-to-nearest-even prescribes.

    Parameters
    ----------
    x : ndarray
        Values; converted to float32 first.

    Returns
    -------
    ndarray of uint16
        The upper 16 bits of the rounded float32 values.
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = (bits + (np.uint32(0x7FFF) + lsb)) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = np.isnan(bits.view(np.float32))
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def bf16_bits_to_float32(bits: NDArray[Any]) -> NDArray[np.float32]:
    """Widen bfloat16 bit patterns (``uint16``) to float32 (exact)."""
    wide = np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)
    return wide.view(np.float32)


def split_flat_support(support: NDArray[np.int64], sizes: Sequence[int]) -> list[NDArray[np.int64]]:
    """Split sorted flat indices over concatenated tensors into per-tensor local indices.

    Parameters
    ----------
    support : ndarray of int64
        Sorted, unique indices into the concatenation of tensors of ``sizes`` elements.
    sizes : sequence of int
        Number of elements of each tensor, in order.

    Returns
    -------
    list of ndarray of int64
        For each tensor, the indices that fall into it, relative to its first element.
    """
    offsets = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))]).astype(np.int64)
    cuts = np.searchsorted(support, offsets)
    return [
        (support[cuts[i] : cuts[i + 1]] - offsets[i]).astype(np.int64) for i in range(len(sizes))
    ]


def _bad(field_name: str, value: object, rule: str, fix: str) -> CodecError:
    return CodecError(explain(field_name, value, rule, fix))


_MAX_ARRAY_BYTES = int(np.iinfo(np.intp).max)


def nonzero_extent(shape: Sequence[int]) -> int:
    """Product of the non-zero dimensions of ``shape`` (1 for an empty shape).

    NumPy bounds this product, not the element count, when it builds an array of ``shape``:
    ``(0, 2**63)`` has no element but cannot be an ndarray.
    """
    n = 1
    for d in shape:
        if int(d):
            n *= int(d)
    return n


def check_shape(shape: Sequence[int], field_name: str = "shape") -> None:
    """Refuse a shape whose float32 dense tensor NumPy cannot represent, with CodecError.

    Parameters
    ----------
    shape : sequence of int
        Non-negative dimensions.
    field_name : str
        Name for the message.

    Raises
    ------
    CodecError
        If ``4 *`` :func:`nonzero_extent` ``(shape)`` exceeds the largest ndarray (``2**63 - 1``
        bytes on 64-bit platforms), zero-size shapes included.
    """
    if 4 * nonzero_extent(shape) > _MAX_ARRAY_BYTES:
        raise _bad(
            field_name,
            tuple(shape)[:8],
            f"the product of the non-zero dimensions times 4 bytes must be <= "
            f"{_MAX_ARRAY_BYTES} (the largest ndarray), zero-size shapes included",
            "reject this payload: no model tensor has such a shape",
        )


@dataclass(frozen=True, eq=False)
class TensorPayload:
    """The compressed form of one tensor.

    Parameters
    ----------
    shape : tuple of int
        Shape of the original tensor.
    dtype : WireDType
        Wire dtype of ``values``.
    values : ndarray
        1-D array of the sent values in ``dtype.numpy_dtype`` (``nnz`` entries).
    indices : ndarray of int64 or None
        Sorted, unique flat (row-major) positions of ``values``; ``None`` for a dense tensor
        or for a decoded shared-support tensor.
    scales : ndarray of float32 or None
        One non-negative finite scale per chunk of ``chunk_size`` values (int8 only).
    chunk_size : int
        Values per scale (int8 only, >= 1); 0 for the other dtypes.
    implicit_indices : bool
        ``True`` when the positions come from a shared public support and are not sent.
    """

    shape: tuple[int, ...]
    dtype: WireDType
    values: NDArray[Any]
    indices: NDArray[np.int64] | None = None
    scales: NDArray[np.float32] | None = None
    chunk_size: int = 0
    implicit_indices: bool = False

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def nnz(self) -> int:
        """Number of values sent."""
        return int(self.values.shape[0])

    @property
    def is_dense(self) -> bool:
        """``True`` when every element is sent and no positions are needed."""
        return self.indices is None and not self.implicit_indices

    def float_values(self) -> NDArray[np.float32]:
        """The sent values dequantized to float32 (1-D, ``nnz`` entries)."""
        if self.dtype is WireDType.FLOAT32:
            return np.asarray(self.values, dtype=np.float32)
        if self.dtype is WireDType.FLOAT16:
            return np.asarray(self.values, dtype=np.float16).astype(np.float32)
        if self.dtype is WireDType.BFLOAT16:
            return bf16_bits_to_float32(self.values)
        if self.scales is None or self.chunk_size < 1:
            raise _bad(
                "scales", None, "an int8 tensor needs scales and chunk_size >= 1", "re-encode"
            )
        rep = np.repeat(self.scales.astype(np.float32), self.chunk_size)[: self.nnz]
        return (self.values.astype(np.float32) * rep).astype(np.float32)

    def to_dense(self) -> NDArray[np.float32]:
        """Decode to a float32 array of :attr:`shape` (zeros where nothing was sent).

        Raises
        ------
        CodecError
            If the shape cannot be an ndarray (see :func:`check_shape`), the values do not
            fill it, or a shared-support tensor has no support attached.
        """
        check_shape(self.shape)
        vals = self.float_values()
        try:
            if self.is_dense:
                return vals.reshape(self.shape).copy()
            if self.indices is None:
                raise _bad(
                    "indices",
                    None,
                    "a shared-support tensor carries no indices on the wire",
                    "attach the public support first with Payload.with_support(support)",
                )
            out = np.zeros(self.numel, dtype=np.float32)
            out[self.indices] = vals
            return out.reshape(self.shape)
        except (ValueError, IndexError) as exc:  # an unvalidated, hand-built payload
            raise _bad(
                "values",
                f"{self.nnz} values for shape {self.shape[:8]}",
                f"must fill the shape ({exc})",
                "call validate() on a payload built by hand",
            ) from None

    def validate(self) -> None:
        """Check every invariant; raise :class:`~fedagg.errors.CodecError` on the first break."""
        if not isinstance(self.dtype, WireDType):
            raise _bad("dtype", self.dtype, "must be a WireDType", "use WireDType.FLOAT32 etc.")
        if any((not isinstance(d, int | np.integer)) or int(d) < 0 for d in self.shape):
            raise _bad("shape", self.shape, "dimensions must be non-negative ints", "fix shape")
        check_shape(self.shape)
        v = self.values
        if not isinstance(v, np.ndarray) or v.ndim != 1 or v.dtype != self.dtype.numpy_dtype:
            raise _bad(
                "values",
                getattr(v, "dtype", type(v)),
                f"must be a 1-D {self.dtype.numpy_dtype} array for dtype {self.dtype.name}",
                "convert the values to the wire dtype",
            )
        numel, nnz = self.numel, self.nnz
        if self.is_dense and nnz != numel:
            raise _bad("values", nnz, f"a dense tensor must carry numel={numel} values", "fix")
        if nnz > numel:
            raise _bad("values", nnz, f"more values than elements ({numel})", "fix indices")
        if self.indices is not None:
            _check_indices(self.indices, nnz, numel)
        if self.dtype is WireDType.INT8:
            if self.chunk_size < 1:
                raise _bad("chunk_size", self.chunk_size, "int8 needs chunk_size >= 1", "fix")
            n_chunks = -(-nnz // self.chunk_size)
            s = self.scales
            if s is None or s.ndim != 1 or s.dtype != np.float32 or s.shape[0] != n_chunks:
                raise _bad(
                    "scales",
                    None if s is None else s.shape,
                    f"int8 needs {n_chunks} float32 scales (ceil(nnz / chunk_size))",
                    "re-quantize the tensor",
                )
            if not bool(np.all(np.isfinite(s))) or bool(np.any(s < 0)):
                raise _bad("scales", "non-finite or negative", "scales must be finite, >= 0", "fix")
        else:
            if self.scales is not None or self.chunk_size != 0:
                raise _bad(
                    "scales",
                    self.chunk_size,
                    "only int8 tensors carry scales and a chunk size",
                    "drop scales / set chunk_size=0",
                )


def _check_indices(indices: NDArray[Any], nnz: int, numel: int) -> None:
    if not isinstance(indices, np.ndarray) or indices.ndim != 1 or indices.dtype != np.int64:
        raise _bad("indices", getattr(indices, "dtype", None), "must be 1-D int64", "convert")
    if indices.shape[0] != nnz:
        raise _bad("indices", indices.shape[0], f"count must equal nnz={nnz}", "fix")
    if nnz == 0:
        return
    if int(indices[0]) < 0 or int(indices[-1]) >= numel:
        raise _bad("indices", "out of range", f"must lie in [0, {numel})", "fix")
    if nnz > 1 and not bool(np.all(np.diff(indices) > 0)):
        raise _bad("indices", "unsorted or duplicate", "must be strictly increasing", "fix")


@dataclass(frozen=True, eq=False)
class Payload:
    """A compressed model update: one :class:`TensorPayload` per tensor.

    Parameters
    ----------
    tensors : tuple of TensorPayload
        Per-tensor payloads, in model order.
    version : int
        Format version (:data:`FORMAT_VERSION`).
    """

    tensors: tuple[TensorPayload, ...]
    version: int = field(default=FORMAT_VERSION)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(self.tensors))

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the original tensors."""
        return [t.shape for t in self.tensors]

    @property
    def nnz(self) -> int:
        """Total number of values sent."""
        return sum(t.nnz for t in self.tensors)

    @property
    def numel(self) -> int:
        """Total number of elements of the original tensors."""
        return sum(t.numel for t in self.tensors)

    def to_dense(self) -> list[NDArray[np.float32]]:
        """Decode every tensor to float32 (zeros where nothing was sent)."""
        return [t.to_dense() for t in self.tensors]

    def validate(self) -> None:
        """Check every invariant of every tensor; raise :class:`~fedagg.errors.CodecError`."""
        if self.version != FORMAT_VERSION:
            raise _bad("version", self.version, f"must be {FORMAT_VERSION}", "re-encode")
        for t in self.tensors:
            t.validate()

    def with_support(self, support: NDArray[Any] | Sequence[int]) -> Payload:
        """Attach a shared flat support to the shared-support tensors (receiver side).

        Parameters
        ----------
        support : array of int
            Sorted, unique indices into the concatenation of *all* tensors (the same array
            the sites used, recomputed from public information).

        Returns
        -------
        Payload
            A copy whose shared-support tensors carry their indices.

        Raises
        ------
        CodecError
            If the support does not fit the payload (count per tensor differs from ``nnz``,
            out of range, unsorted or duplicate).
        """
        sup = np.asarray(support, dtype=np.int64).ravel()
        numel = self.numel
        _check_indices(sup, sup.shape[0], numel)
        parts = split_flat_support(sup, [t.numel for t in self.tensors])
        out: list[TensorPayload] = []
        for i, (t, idx) in enumerate(zip(self.tensors, parts, strict=True)):
            if not t.implicit_indices:
                out.append(t)
                continue
            if idx.shape[0] != t.nnz:
                raise _bad(
                    f"tensors[{i}].support",
                    idx.shape[0],
                    f"the shared support puts {idx.shape[0]} indices in a tensor that "
                    f"carries {t.nnz} values",
                    "recompute the support with the same (seed, round, k) as the sites",
                )
            out.append(replace(t, indices=idx))
        return Payload(tuple(out), self.version)

    def equals(self, other: Payload) -> bool:
        """Exact structural and bitwise equality (NaN-safe), for tests and checks."""
        if self.version != other.version or len(self) != len(other):
            return False
        for a, b in zip(self.tensors, other.tensors, strict=True):
            if (
                tuple(a.shape) != tuple(b.shape)
                or a.dtype != b.dtype
                or a.chunk_size != b.chunk_size
                or a.implicit_indices != b.implicit_indices
            ):
                return False
            for x, y in ((a.values, b.values), (a.indices, b.indices), (a.scales, b.scales)):
                if (x is None) != (y is None):
                    return False
                if (
                    x is not None
                    and y is not None
                    and (x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes())
                ):
                    return False
        return True


def dense_float32(tensors: Sequence[NDArray[Any]]) -> list[NDArray[np.float32]]:
    """Convert input tensors to float32 arrays (no copy when already float32)."""
    return [np.asarray(t, dtype=np.float32) for t in tensors]
