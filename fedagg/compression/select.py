"""Selection primitives of the sparsifiers: how many entries a ratio keeps, and which ``k``
entries are the largest (exactly, ties to the lowest index).

Used by TopK (:mod:`fedagg.compression.topk`), the aggregate's TopK support
(:mod:`fedagg.compression.support`), the sketch's heavy hitters
(:mod:`fedagg.compression.sketch`) and the vote tables (:mod:`fedagg.compression.vote_tables`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = ["k_from_ratio", "topk_indices"]


def k_from_ratio(ratio: float, n: int) -> int:
    """Number of entries kept for ``ratio`` of ``n``: ``ceil(ratio * n)`` clipped to [0, n].

    A tiny tolerance keeps ``0.3 * 10`` at 3 despite floating-point error.
    """
    return max(0, min(n, math.ceil(ratio * n - 1e-9)))


def topk_indices(values: NDArray[Any], k: int) -> NDArray[np.int64]:
    """Exact indices of the ``k`` largest ``|values|``, sorted ascending.

    Ties at the threshold are broken towards the lowest index, so the result is a pure
    function of the input (no dependence on the selection algorithm). Runs in O(n) via
    :func:`numpy.partition`. NaN counts as larger than any number.

    Parameters
    ----------
    values : ndarray
        1-D values.
    k : int
        How many to keep, ``0 <= k <= len(values)``.

    Returns
    -------
    ndarray of int64
    """
    n = int(values.shape[0])
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    if k >= n:
        return np.arange(n, dtype=np.int64)
    mag = np.abs(values)
    thr = np.partition(mag, n - k)[n - k]
    if np.isnan(thr):
        above = np.flatnonzero(np.isnan(mag))
        return np.sort(above[:k]).astype(np.int64)
    greater = np.flatnonzero((mag > thr) | np.isnan(mag))
    need = k - greater.shape[0]
    ties = np.flatnonzero(mag == thr)[:need]
    return np.sort(np.concatenate([greater, ties])).astype(np.int64)
