"""Quantizers: re-encode the float32 values of a payload as float16, bfloat16 or int8.

Each quantizer is both a :class:`~fedagg.compression.base.Quantizer` (``quantize(payload)``,
used after a sparsifier in a :class:`~fedagg.compression.base.Chain`) and a
:class:`~fedagg.compression.base.Compressor` (``compress(tensors)``: dense, then quantize).
They keep the positions of the payload unchanged and only narrow the values. Wrap the
pipeline in :class:`~fedagg.compression.error_feedback.ErrorFeedback` to feed the rounding
error back into the next round.

References
----------
.. [Alistarh2017] D. Alistarh et al. "QSGD: Communication-Efficient SGD via Gradient
   Quantization and Encoding". NeurIPS 2017. Sec. 3.1 (stochastic rounding to levels,
   unbiased, variance bound Lemma 3.1).
.. [Seide2014] F. Seide et al. "1-Bit Stochastic Gradient Descent and its Application to
   Data-Parallel Distributed Training of Speech DNNs". Interspeech 2014 (quantization with
   error feedback).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.compression.base import Identity
from fedagg.compression.payload import (
    Payload,
    TensorPayload,
    WireDType,
    float32_to_bf16_bits,
)
from fedagg.errors import CodecError, ConfigError, explain

__all__ = ["BF16", "FP16", "Int8", "quantize_int8"]

_FP16_MAX = float(np.finfo(np.float16).max)


def _float_input(payload: Payload, who: str) -> None:
    for i, t in enumerate(payload.tensors):
        if t.dtype is not WireDType.FLOAT32:
            raise ConfigError(
                explain(
                    f"{who} input tensors[{i}].dtype",
                    t.dtype.name,
                    "a quantizer needs float32 values",
                    "put at most one quantizer in the pipeline, after the sparsifier",
                )
            )


class _QuantizerBase:
    reveals_indices = False

    def _one(self, t: TensorPayload, rng: np.random.Generator) -> TensorPayload:
        raise NotImplementedError

    def quantize(self, payload: Payload, *, rng: np.random.Generator) -> Payload:
        """Return ``payload`` with every tensor's values re-encoded (positions unchanged)."""
        _float_input(payload, type(self).__name__)
        return Payload(tuple(self._one(t, rng) for t in payload.tensors), payload.version)

    def compress(self, tensors: Sequence[NDArray[Any]], *, rng: np.random.Generator) -> Payload:
        """Dense compression: every value sent, quantized."""
        return self.quantize(Identity().compress(tensors, rng=rng), rng=rng)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FP16(_QuantizerBase):
    """IEEE float16 (round to nearest even). Values beyond +-65504 saturate to +-65504.

    Saturation (instead of inf) keeps the error-feedback residual finite.
    """

    def _one(self, t: TensorPayload, rng: np.random.Generator) -> TensorPayload:
        v = np.clip(t.values, -_FP16_MAX, _FP16_MAX).astype(np.float16)
        return replace(t, dtype=WireDType.FLOAT16, values=v)


class BF16(_QuantizerBase):
    """bfloat16 (8 exponent bits, 7 mantissa bits), round to nearest even.

    Values travel as ``uint16`` bit patterns (the upper half of the float32). Relative error
    is at most 2**-8; the range equals float32's.
    """

    def _one(self, t: TensorPayload, rng: np.random.Generator) -> TensorPayload:
        return replace(t, dtype=WireDType.BFLOAT16, values=float32_to_bf16_bits(t.values))


def quantize_int8(
    values: NDArray[Any],
    chunk_size: int,
    *,
    stochastic: bool,
    rng: np.random.Generator | None = None,
) -> tuple[NDArray[np.int8], NDArray[np.float32]]:
    """Quantize 1-D values to int8 with one scale per chunk of ``chunk_size`` values.

    ``scale = max|v| / 127`` per chunk, rounded up to a float32 (one ulp up where rounding
    to nearest went below), ``q = v / scale`` rounded and clipped to [-127, 127].

    * deterministic (round half to even): ``|v - q * scale| <= scale / 2``;
    * stochastic: ``q = floor(v / scale + u)``, ``u ~ U[0, 1)``, so ``E[q * scale] = v`` and
      ``|v - q * scale| < scale`` ([Alistarh2017]_ Sec. 3.1 with 255 levels per chunk).

    Parameters
    ----------
    values : ndarray
        1-D finite values.
    chunk_size : int
        Values per scale, >= 1.
    stochastic : bool
        Stochastic rounding (needs ``rng``) instead of round-half-to-even.
    rng : numpy.random.Generator, optional
        Source of the uniforms for stochastic rounding.

    Returns
    -------
    (ndarray of int8, ndarray of float32)
        The quantized values and ``ceil(len(values) / chunk_size)`` scales.

    Raises
    ------
    CodecError
        If a value is NaN or infinite (it has no int8 encoding).
    """
    v = np.asarray(values, dtype=np.float32)
    n = int(v.shape[0])
    n_chunks = -(-n // chunk_size)
    if n == 0:
        return np.empty(0, dtype=np.int8), np.empty(0, dtype=np.float32)
    if not bool(np.all(np.isfinite(v))):
        raise CodecError(
            explain("values", "NaN/inf", "int8 can only encode finite values", "check the update")
        )
    padded = np.zeros(n_chunks * chunk_size, dtype=np.float64)
    padded[:n] = v
    chunks = padded.reshape(n_chunks, chunk_size)
    amax = np.max(np.abs(chunks), axis=1)
    scales = (amax / 127.0).astype(np.float32)
    # float32 rounding (coarse for subnormals) may push the scale below amax / 127; step it
    # up one ulp so that |v / scale| <= 127 and the error bounds hold exactly.
    low = scales.astype(np.float64) * 127.0 < amax
    scales[low] = np.nextafter(scales[low], np.float32(np.inf))
    safe = np.where(scales > 0, scales.astype(np.float64), 1.0)
    x = chunks / safe[:, None]
    if stochastic:
        if rng is None:
            raise ConfigError(explain("rng", None, "stochastic rounding needs an rng", "pass rng"))
        q = np.floor(x + rng.random(x.shape))
    else:
        q = np.rint(x)
    q = np.clip(q, -127, 127).reshape(-1)[:n].astype(np.int8)
    return q, scales


class Int8(_QuantizerBase):
    """Signed int8 with a float32 scale per chunk of values; stochastic rounding by default.

    Parameters
    ----------
    chunk_size : int
        Values sharing one scale (default 256: 1.6 % scale overhead).
    stochastic : bool
        ``True`` (default): unbiased stochastic rounding with the ``rng`` given to
        :meth:`quantize` ([Alistarh2017]_); ``False``: round half to even.

    See Also
    --------
    quantize_int8 : the error bounds.
    """

    def __init__(self, chunk_size: int = 256, *, stochastic: bool = True) -> None:
        if (
            isinstance(chunk_size, bool)
            or not isinstance(chunk_size, int)
            or not (1 <= chunk_size <= 2**31 - 1)
        ):
            raise ConfigError(
                explain("Int8.chunk_size", chunk_size, "must be an int in [1, 2**31 - 1]", "256")
            )
        self.chunk_size = chunk_size
        self.stochastic = bool(stochastic)

    def _one(self, t: TensorPayload, rng: np.random.Generator) -> TensorPayload:
        q, scales = quantize_int8(t.values, self.chunk_size, stochastic=self.stochastic, rng=rng)
        return replace(t, dtype=WireDType.INT8, values=q, scales=scales, chunk_size=self.chunk_size)

    def __repr__(self) -> str:
        return f"Int8(chunk_size={self.chunk_size}, stochastic={self.stochastic})"
