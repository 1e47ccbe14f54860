"""npy bytes built in place: the form in which a Flower ``Array`` carries a NumPy array.

A result that goes into a message (the round's new model) can be written straight into the
``bytes`` object the message will hold, instead of into an array that is then copied into
one (:func:`writable_bytes`, :func:`npy_header`).
"""

from __future__ import annotations

import ctypes
import functools
import io
from collections.abc import Callable
from typing import cast

import numpy as np
import numpy.typing as npt
from numpy.lib import format as npformat

__all__ = ["Filled", "npy_header", "writable_bytes"]


@functools.lru_cache(maxsize=128)
def npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    """The npy (version 1.0) header ``np.save`` writes for a C-ordered array."""
    buf = io.BytesIO()
    npformat.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False,
                                          "shape": tuple(shape)})
    return buf.getvalue()


class Filled:
    """A ``bytes`` object being filled: :meth:`result` hands it over once written."""

    def __init__(self, obj: bytes | bytearray) -> None:
        self._obj = obj

    def result(self) -> bytes:
        obj, self._obj = self._obj, b""
        return obj if isinstance(obj, bytes) else bytes(obj)  # bytearray fallback: one copy


def writable_bytes(n: int) -> tuple[Filled, npt.NDArray[np.uint8]]:
    """A new ``bytes`` object of ``n`` bytes and a writable uint8 view to fill it with.

    CPython's documented way to build a bytes object in place is
    ``PyBytes_FromStringAndSize(NULL, n)`` ("the contents are uninitialized") and writing
    its buffer before anyone else sees the object; here through ``ctypes.pythonapi``. The
    object is handed out only by :meth:`Filled.result`, after the caller dropped the view.
    Elsewhere (no ``pythonapi``) a bytearray is filled and copied once.
    """
    make = _from_string_and_size()
    if make is None or n <= 0:
        ba = bytearray(max(n, 0))
        return Filled(ba), np.frombuffer(ba, np.uint8)
    obj: bytes = make(None, n)
    address = ctypes.cast(ctypes.c_char_p(obj), ctypes.c_void_p).value
    assert address is not None
    view = np.frombuffer(memoryview((ctypes.c_char * n).from_address(address)).cast("B"),
                         np.uint8)
    return Filled(obj), view


@functools.cache
def _from_string_and_size() -> Callable[[None, int], bytes] | None:
    """``PyBytes_FromStringAndSize`` with its own prototype (None outside CPython)."""
    api = getattr(ctypes, "pythonapi", None)
    if api is None:
        return None
    proto = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t)
    return cast(Callable[[None, int], bytes], proto(("PyBytes_FromStringAndSize", api)))
