"""Weights of any size: one accumulator per 32-bit range of weights, combined at the end.

An :class:`~fedagg.accumulate.Accumulator` takes a weight ``w`` as the factor of an exact
integer sum on a grid, so its range bounds ``w * x`` (``< 2**92`` grid units per fold). Real
weights are numbers of examples, far below ``2**32``; a hostile or broken site may report
``1e308``. :class:`WeightBuckets` folds an update of weight ``w`` into bucket
``b = (exponent of |w| - 1) // 32`` with the weight scaled by ``2**(-32 b)`` (exact: a power of
two), so every bucket sees weights below ``2**32``. Buckets are made when first needed; with
real weights there is only bucket 0 and the result is that accumulator's, bit for bit. With
several (only weights of 2**32 and more make a second one), the mean is
``sum_b 2**(32 b) W_b m_b / sum_b 2**(32 b) W_b`` from each bucket's mean ``m_b`` (rounded to
the tensor's dtype) and weight, in float64 with the scales taken relative to the largest
bucket (no overflow for weights up to ~1e308), in bucket order: still a function of the
multiset of updates only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from fedagg.accumulate.grid import TensorUpdate
from fedagg.errors import ConfigError, explain

__all__ = ["BUCKET_BITS", "WeightBuckets"]

BUCKET_BITS = 32
"""Each bucket holds the weights of one 32-bit range of magnitudes."""


class _Sums(Protocol):
    def fold(self, update: Sequence[TensorUpdate], weight: float) -> None: ...

    def mean(self) -> list[npt.NDArray[Any]]: ...

    @property
    def count(self) -> int: ...

    @property
    def total_weight(self) -> float: ...


def _bucket(weight: float) -> int:
    w = abs(float(weight))
    if not math.isfinite(w) or w == 0.0:
        raise ConfigError(explain("weight", weight, "must be a finite non-zero number",
                                  "pass the site's number of examples"))
    return max(0, (math.frexp(w)[1] - 1) // BUCKET_BITS)


class WeightBuckets:
    """The accumulator interface over one accumulator per range of weights.

    Parameters
    ----------
    first : accumulator
        Bucket 0 (weights below 2**32): every real round uses only this one.
    make : callable
        Makes the accumulator of a further bucket (same model and grid).
    dtypes : sequence of str
        The mean's dtypes (for combined buckets).
    """

    def __init__(self, first: _Sums, make: Callable[[], _Sums], dtypes: Sequence[str]) -> None:
        self.first = first
        self._make = make
        self._dtypes = list(dtypes)
        self._buckets: dict[int, _Sums] = {0: first}

    @property
    def buckets(self) -> int:
        """Number of buckets in use."""
        return len(self._buckets)

    @property
    def count(self) -> int:
        """Folds so far (a fold with a negative weight counts -1)."""
        return sum(b.count for b in self._buckets.values())

    @property
    def total_weight(self) -> float:
        """The sum of the weights (inf when it exceeds float64)."""
        total = 0.0
        for b, acc in sorted(self._buckets.items()):
            try:
                total += math.ldexp(acc.total_weight, BUCKET_BITS * b)
            except OverflowError:
                return math.inf
        return total

    @property
    def fuses_norm(self) -> bool:
        """Whether :meth:`fold` can return the delta norm from its own pass (in-process
        accumulators; not the Ray shards)."""
        return bool(getattr(self.first, "fuses_norm", False))

    @property
    def checks_finite(self) -> bool:
        """Whether :meth:`fold` refuses a non-finite update itself, folding nothing of it
        (:class:`fedagg.errors.NonFiniteUpdate`; in-process accumulators)."""
        return bool(getattr(self.first, "checks_finite", False))

    def fold(self, update: Sequence[TensorUpdate], weight: float, **norm: Any) -> float | None:
        """Fold ``weight * update`` into its weight's bucket (see the module docstring);
        ``norm=True, reference=...`` also returns the delta norm (:attr:`fuses_norm`)."""
        b = _bucket(weight)
        acc = self._buckets.get(b)
        if acc is None:
            acc = self._buckets[b] = self._make()
        scaled = math.ldexp(float(weight), -BUCKET_BITS * b)
        if norm:
            return acc.fold(update, scaled, **norm)  # type: ignore[func-returns-value]
        acc.fold(update, scaled)
        return None

    def mean(self) -> list[npt.NDArray[Any]]:
        """The weighted mean (bucket 0's own when it is the only bucket)."""
        live = {b: a for b, a in self._buckets.items() if a.count != 0}
        if len(live) <= 1:
            return (next(iter(live.values())) if live else self.first).mean()
        top = max(live)
        total = 0.0
        sums: list[npt.NDArray[np.float64]] | None = None
        for b in sorted(live):
            acc = live[b]
            scale = math.ldexp(1.0, BUCKET_BITS * (b - top))
            total += acc.total_weight * scale
            part = [np.asarray(m, np.float64) * (acc.total_weight * scale)
                    for m in acc.mean()]  # sum_b = mean_b * W_b, relative to the top bucket
            sums = part if sums is None else [s + p for s, p in zip(sums, part, strict=True)]
        assert sums is not None
        if not total > 0:
            raise ConfigError(explain("weights", total, "must sum to a positive number",
                                      "fold at least one update"))
        with np.errstate(over="ignore", invalid="ignore"):
            return [(s / total).astype(d) for s, d in zip(sums, self._dtypes, strict=True)]
