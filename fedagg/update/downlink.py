"""The global model on the way down: optional fp16 / bf16 encoding (``compression.down``).

The server keeps full-precision master weights; only what is sent changes, and sites take
their delta against the model *as sent* (decoded), so the server reconstructs it exactly.
bfloat16 travels as its uint16 bit pattern (Flower's ``ArrayRecord`` cannot carry bfloat16).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.compression import bf16_bits_to_float32, float32_to_bf16_bits
from fedagg.errors import ConfigError, ProtocolError, explain

__all__ = ["decode_down", "encode_down"]


def encode_down(arrays: Sequence[NDArray[Any]], down: str) -> tuple[list[NDArray[Any]], list[int]]:
    """Encode the float32 arrays of the global model for the downward message.

    ``fp16``: float16 (saturating at +-65504); ``bf16``: bfloat16 bit patterns as uint16.
    Arrays of other dtypes are sent unchanged.

    Returns
    -------
    (arrays, encoded)
        The arrays to send and the indices of the ones that were encoded.
    """
    if down == "none":
        return list(arrays), []
    if down not in ("fp16", "bf16"):
        raise ConfigError(explain("compression.down", down, "must be none, fp16 or bf16",
                                  "choose one of the listed codecs"))
    out: list[NDArray[Any]] = []
    encoded: list[int] = []
    for i, a in enumerate(arrays):
        if a.dtype != np.float32:
            out.append(a)
            continue
        if down == "fp16":
            out.append(np.clip(a, -65504.0, 65504.0).astype(np.float16))
        else:
            out.append(float32_to_bf16_bits(a).reshape(a.shape))
        encoded.append(i)
    return out, encoded


def decode_down(arrays: Sequence[NDArray[Any]], down: str,
                encoded: Sequence[int]) -> list[NDArray[Any]]:
    """Inverse of :func:`encode_down`: the encoded arrays back to float32 (exact widening).

    Raises
    ------
    ProtocolError
        An index out of range or an array that is not encoded as announced.
    """
    want = {"fp16": np.float16, "bf16": np.uint16}.get(down)
    out = list(arrays)
    for i in encoded:
        if want is None or not 0 <= i < len(out) or out[i].dtype != want:
            raise ProtocolError(explain(f"downward array {i}", getattr(out[i], "dtype", None)
                                        if 0 <= i < len(out) else "missing",
                                        f"must be {down}-encoded as the instruction says",
                                        "server and site must run the same fedagg version"))
        a = out[i]
        out[i] = (a.astype(np.float32) if down == "fp16"
                  else bf16_bits_to_float32(a).reshape(a.shape))
    return out
