"""The results of an :class:`~fedagg.accumulate.Accumulator`: exact sums and the mean.

Methods of :class:`~fedagg.accumulate.exact.Accumulator` (assigned on the class there), kept
here so that each module holds one concept: the limbs are brought to their canonical form and
read block by block, one rounding per element (see :mod:`fedagg.accumulate.exact`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from fedagg.accumulate import native
from fedagg.errors import ConfigError, explain
from fedagg.npy import npy_header, writable_bytes

if TYPE_CHECKING:
    from fedagg.accumulate.exact import Accumulator

__all__ = ["MEAN_STEP", "mean", "mean_npy", "sum_f64", "sums"]

MEAN_STEP = 1 << 13
"""Elements per step of :func:`mean` (its one float64 buffer; the peak of a round's end is the
accumulator + the mean being written + this)."""

_LIMB = 31
"""A carry moves ``lo >> 31`` into the high limb, leaving ``0 <= lo < 2**31``."""


def sum_f64(self: Accumulator, j: int, out: npt.NDArray[np.float64], s: int) -> None:
    """The exact sum of tensor j's block at ``s``, rounded to float64 (canonical)."""
    lo = self._lo[j][s:s + out.size]
    hi = self._hi[j]
    if hi is None:
        out[...] = lo  # one int64: the exact value, rounded once
    else:
        np.multiply(hi[s:s + out.size], float(1 << _LIMB), out=out, dtype=np.float64,
                    casting="unsafe")
        out += lo  # canonical (0 <= lo < 2**31): one rounding while |hi| < 2**53
    out *= math.ldexp(1.0, self.specs[j].exponent)

def sums(self: Accumulator) -> list[npt.NDArray[np.float64]]:
    """The weighted sums ``sum_i w_i x_i`` per tensor, in float64 (full-size arrays)."""
    out = []
    for j, spec in enumerate(self.specs):
        if self._hi[j] is not None:
            self._normalize(j, force=True)
        a = np.empty(spec.size, np.float64)
        for s in range(0, spec.size, self.block):
            sum_f64(self, j, a[s:s + self.block], s)
        out.append(a.reshape(spec.shape))
    return out

def mean(self: Accumulator) -> list[npt.NDArray[Any]]:
    """The weighted mean ``sum_i w_i x_i / sum_i w_i`` per tensor, in each spec's dtype.

    Only the output arrays are allocated (plus one block of float64).

    Raises
    ------
    ConfigError
        Nothing was folded, or the weights do not sum to a positive number.
    """
    _check_total(self)
    out = []
    for j, spec in enumerate(self.specs):
        res = np.empty(spec.size, np.dtype(spec.dtype))
        _mean_into(self, j, res)
        out.append(res.reshape(spec.shape))
    return out


def mean_npy(self: Accumulator) -> list[tuple[str, tuple[int, ...], bytes]]:
    """:meth:`mean` as ``(dtype, shape, npy bytes)`` per tensor (what a Flower ``Array``
    carries).

    Each tensor's mean is written straight into the ``bytes`` object that will hold it (after
    its npy header): no array of the mean and no copy of it into a message. The same values
    as :meth:`mean`, bit for bit.

    Raises
    ------
    ConfigError
        Nothing was folded, or the weights do not sum to a positive number.
    """
    _check_total(self)
    out = []
    for j, spec in enumerate(self.specs):
        dt = np.dtype(spec.dtype)
        header = npy_header(dt.str, spec.shape)
        data, view = writable_bytes(len(header) + spec.size * dt.itemsize)
        view[:len(header)] = np.frombuffer(header, np.uint8)
        _mean_into(self, j, view[len(header):].view(dt))  # npy v1 headers keep it aligned
        del view
        out.append((str(dt), spec.shape, data.result()))
    return out


def _check_total(self: Accumulator) -> None:
    if self._weight <= 0:
        raise ConfigError(explain("weights", float(self._weight),
                                  "must sum to a positive number", "fold at least one update"))


def _mean_into(self: Accumulator, j: int, res: npt.NDArray[Any]) -> None:
    """Write tensor ``j``'s mean into ``res`` (flat, the spec's dtype)."""
    spec = self.specs[j]
    total = float(self._weight)
    if self._hi[j] is not None:
        self._normalize(j, force=True)
    dt = res.dtype
    if not self._native_off and native.mean_into(
            self._lo[j], self._hi[j], math.ldexp(1.0, spec.exponent), total, res):
        return  # one pass in C, the same bits
    step = min(self.block, MEAN_STEP)
    f = np.empty(min(spec.size, step), np.float64)  # 64 KiB: not the fold's block buffers
    for s in range(0, spec.size, step):
        n = min(step, spec.size - s)
        fb = f[:n]
        sum_f64(self, j, fb, s)
        fb /= total
        with np.errstate(over="ignore", invalid="ignore"):
            if np.issubdtype(dt, np.integer):
                np.trunc(fb, out=fb)
            res[s:s + n] = fb  # inf from a float overflow is caught by model checks
