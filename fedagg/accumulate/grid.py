"""What an accumulator sums, and the fixed-point grid of each tensor.

A tensor of an update is a dense array or :class:`Sparse` (values at strictly increasing flat
positions); :class:`TensorSpec` is one accumulated tensor (shape, dtype of the mean, grid
exponent). The grid is fixed *before* the round from public data, the global model
(:func:`grid_exponents`: ``precision_bits`` below the power of two above each tensor's largest
magnitude, :func:`max_abs`), so it is the same on every shard and for every arrival order
(:mod:`fedagg.accumulate.exact` explains the scheme and its error bound). Every name here is
importable from :mod:`fedagg.accumulate.exact` and :mod:`fedagg.accumulate` as well.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from fedagg.errors import ConfigError, explain

__all__ = [
    "BLOCK",
    "DEFAULT_PRECISION_BITS",
    "Sparse",
    "TensorSpec",
    "TensorUpdate",
    "grid_exponents",
    "max_abs",
]

BLOCK = 1 << 16
"""Elements processed at a time: the fold's temporaries are two blocks of 8 bytes (1 MiB)."""

DEFAULT_PRECISION_BITS = 32
"""Grid bits below each tensor's scale (:func:`grid_exponents`)."""


class Sparse(NamedTuple):
    """A sparse tensor update: ``values`` at the flat positions ``indices``.

    ``indices`` must be strictly increasing and within the tensor (what the codec checks
    before building a payload, :class:`fedagg.compression.payload.TensorPayload`); the other
    elements are zero.
    """

    indices: npt.NDArray[np.int64]
    values: npt.NDArray[Any]


TensorUpdate = npt.NDArray[Any] | Sparse
"""One tensor of an update: a dense array of the tensor's shape, or :class:`Sparse`."""


@dataclass(frozen=True)
class TensorSpec:
    """One accumulated tensor: its shape, the dtype of its mean and its grid exponent.

    Parameters
    ----------
    shape : tuple of int
        Shape of the tensor (a shard's piece is 1-D, see :mod:`fedagg.accumulate.layout`).
    dtype : str
        NumPy dtype name of the mean (the global model's tensor dtype).
    exponent : int
        The grid is ``2**exponent``: each product ``w * x`` is rounded to a multiple of it.
        Integer tensors use 0 (exact for integer weights).
    """

    shape: tuple[int, ...]
    dtype: str
    exponent: int

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


def max_abs(a: npt.NDArray[Any], *, block: int = BLOCK) -> float:
    """``max |a|`` without a full-size temporary (0.0 for an empty array; NaN propagates)."""
    flat = np.asarray(a).reshape(-1)
    best = 0.0
    for s in range(0, flat.size, block):
        b = flat[s:s + block]
        hi, lo = float(np.max(b)), float(np.min(b))
        if math.isnan(hi) or math.isnan(lo):
            return math.nan
        best = max(best, hi, -lo)
    return best


def grid_exponents(
    reference: Sequence[npt.NDArray[Any]], *, precision_bits: int = DEFAULT_PRECISION_BITS
) -> list[int]:
    """Grid exponents of the tensors of a model, from public data fixed before the round.

    Parameters
    ----------
    reference : sequence of ndarray
        The global model of the round (what every site received): the same on every shard and
        for every arrival order, so the grid is too.
    precision_bits : int
        Grid bits below each float tensor's scale, 8..60. The scale is the power of two above
        the tensor's largest magnitude; an all-zero tensor (biases at initialisation) takes the
        model's largest, and an all-zero model 1.0.

    Returns
    -------
    list of int
        ``exponent`` per tensor for :class:`TensorSpec` (0 for integer tensors).

    Raises
    ------
    ConfigError
        ``precision_bits`` out of range, or a tensor that is neither float nor integer.
    """
    if (isinstance(precision_bits, bool) or not isinstance(precision_bits, int | np.integer)
            or not 8 <= int(precision_bits) <= 60):
        raise ConfigError(explain("precision_bits", precision_bits, "must be an int in 8..60",
                                  "use the default 32 (or up to 60 for float64 models)"))
    scales: list[float | None] = []
    for j, r in enumerate(reference):
        dt = np.asarray(r).dtype
        if np.issubdtype(dt, np.integer):
            scales.append(None)
        elif np.issubdtype(dt, np.floating):
            m = max_abs(np.asarray(r))
            scales.append(m if math.isfinite(m) else 0.0)
        else:
            raise ConfigError(explain(f"reference[{j}].dtype", str(dt),
                                      "must be a float or integer dtype",
                                      "accumulate numeric tensors only"))
    top = max((s for s in scales if s is not None), default=0.0)
    out = []
    for s in scales:
        if s is None:
            out.append(0)
            continue
        scale = s if s > 0 else (top if top > 0 else 1.0)
        out.append(math.frexp(scale)[1] - int(precision_bits))  # 2**e > scale >= 2**(e-1)
    return out
