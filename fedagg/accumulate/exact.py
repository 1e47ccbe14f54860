"""An order-independent streaming accumulator: exact integer sums on a fixed-point grid.

One site update at a time is folded into a running weighted sum ``sum_i w_i x_i``; nothing of
an update is kept after its fold. The result does not depend on the order in which updates
arrive, nor on how the model is cut into shards (:mod:`fedagg.accumulate.layout`): it is a
function of the *multiset* of ``(update, weight)`` pairs alone, bit for bit.

How
---
Each tensor ``t`` has a grid exponent ``g_t``, fixed *before* the round from public data
(:func:`grid_exponents`: ``precision_bits`` below the power of two above the largest
magnitude of the global model's tensor). A fold computes, per element,

1. the product ``p = w * x`` in float64. For an integer weight ``w < 2**29`` and a float32 /
   float16 / bfloat16 ``x`` it is exact (24 + 29 = 53 significand bits);
2. ``q = rint(p / 2**g_t)`` (round half to even): the one rounding of the whole scheme, a
   deterministic function of ``(w, x)`` alone, of at most ``2**(g_t - 1)``;
3. ``acc += q`` in int64 — integer addition, exact and associative.

``acc`` is one int64 per element (the 8 bytes of a dense float64 accumulator). Should the
partial sums of a tensor approach ``2**62`` (huge weights or values far above the grid's
scale), a second int64 limb is allocated for that tensor and carries move there exactly
(``acc = hi * 2**31 + lo``); the limbs are brought to one canonical form before any result is
read, so whether and when carries happened leaves no trace. Weights are summed exactly as
rationals (:class:`fractions.Fraction`). The mean is ``float64(acc) * 2**g_t / float64(W)``,
cast to the tensor's dtype.

Why not a float64 sum in arrival order (``weighted_mean``, Flower's FedAvg): float addition
is not associative, so two arrival orders give results that differ in the last bits, and an
aggregate split over shards would differ from the unsplit one. Compensated sums (Kahan 1965;
Neumaier 1974, "Rundungsfehleranalyse einiger Verfahren zur Summation endlicher Summen",
ZAMM 54) shrink the error but stay order-dependent; exact expansions (Shewchuk 1997,
"Adaptive Precision Floating-Point Arithmetic and Fast Robust Geometric Predicates", DCG 18)
and reproducible binned sums (Demmel & Nguyen 2015, "Parallel Reproducible Summation",
IEEE TC 64; ReproBLAS) are order-independent but need several words per element — 2-6x this
accumulator, more than one reply of the model. Buffering replies to sort them costs memory
that grows with the number of sites. A fixed grid keeps one word per element and makes every
sum exact; the price is a bounded absolute error, stated by :meth:`Accumulator.error_bound`:
``count * 2**(g_t - 1) / W`` per element of the mean, at most ``2**-(precision_bits + 1)``
times the tensor's scale when the weights are integers >= 1 (``count <= W``). With the default
32 bits that is ~1e-10 of the scale: below float32's own rounding (``2**-24`` relative) for
every element within ``2**-9`` of the scale, and an absolute ~1e-10 x scale below.

The same integers make corrections exact: folding an update again with ``-w`` removes it
without a trace (used to drop a reply that a whole-round check refuses after it was folded),
and :meth:`Accumulator.merge` adds two accumulators of disjoint sites exactly (tree or
parallel reductions).

The tensor types and the grid are in :mod:`fedagg.accumulate.grid`. The accumulator's results
(:meth:`Accumulator.mean`, :meth:`~Accumulator.mean_npy`, :meth:`~Accumulator.sums`: the limbs
brought to their canonical form and read block by block, one rounding per element) and its
plain-data state (:meth:`~Accumulator.state_dict`) are methods of the one class: they read the
limbs it writes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

from fedagg.accumulate import native
from fedagg.accumulate.grid import (
    BLOCK,
    DEFAULT_PRECISION_BITS,
    Sparse,
    TensorSpec,
    TensorUpdate,
    grid_exponents,
)
from fedagg.errors import ConfigError, NonFiniteUpdate, UpdateRejected, explain
from fedagg.npy import npy_header, writable_bytes

__all__ = ["MEAN_STEP", "Accumulator"]

MEAN_STEP = 1 << 13
"""Elements per step of :meth:`Accumulator.mean` (its one float64 buffer; the peak of a round's
end is the accumulator + the mean being written + this)."""
_LIMB = 31
"""A carry moves ``lo >> 31`` into the high limb, leaving ``0 <= lo < 2**31``."""
_STATE_VERSION = 1

_LO_MAX = 1 << 62
"""Partial sums of the low limb stay below this (int64 holds up to ``2**63 - 1``)."""
_Q_MAX = float(1 << 92)
"""Largest ``|q|`` of one fold that the two limbs take (``|q >> 31| < 2**61``)."""


def _check_weight(weight: float) -> float:
    if isinstance(weight, bool) or not isinstance(weight, int | float | np.integer | np.floating):
        raise ConfigError(explain("weight", weight, "must be a finite non-zero number",
                                  "pass the site's number of examples"))
    w = float(weight)
    if not math.isfinite(w) or w == 0.0:
        raise ConfigError(explain("weight", weight, "must be a finite non-zero number",
                                  "pass the site's number of examples (negative: remove a fold)"))
    return w


class Accumulator:
    """Running weighted sum of site updates, exact on a fixed grid, order-independent.

    Parameters
    ----------
    specs : sequence of TensorSpec
        The tensors (shape, dtype of the mean, grid exponent); see :meth:`for_model`.
    block : int
        Elements per step of a fold (temporaries: two blocks of 8 bytes).
    native : bool
        Fold with the native kernel when it is built and passed its self-check (default);
        ``False``: the NumPy path only (same results).

    Notes
    -----
    Memory: 8 bytes per element, plus 8 more for a tensor whose partial sums outgrow 2**62
    (the high limb), plus the two block buffers. See the module docstring for the scheme,
    its error bound and why it was chosen.
    """

    def __init__(self, specs: Sequence[TensorSpec], *, block: int = BLOCK,
                 native: bool = True) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ConfigError(explain("block", block, "must be an int >= 1",
                                      "use the default BLOCK"))
        self.specs = list(specs)
        for j, s in enumerate(self.specs):
            if not isinstance(s, TensorSpec) or not (
                    np.issubdtype(np.dtype(s.dtype), np.floating)
                    or np.issubdtype(np.dtype(s.dtype), np.integer)):
                raise ConfigError(explain(f"specs[{j}]", s, "must be a TensorSpec of a float "
                                          "or integer dtype", "build specs with for_model"))
            if not -1100 <= s.exponent <= 1100:
                raise ConfigError(explain(f"specs[{j}].exponent", s.exponent,
                                          "must be in -1100..1100",
                                          "derive it with grid_exponents"))
        self.block = block
        self._lo = [np.zeros(s.size, np.int64) for s in self.specs]
        self._hi: list[npt.NDArray[np.int64] | None] = [None for _ in self.specs]
        self._bound = [0 for _ in self.specs]  # upper bound of |lo| (python int)
        self._hbound = [0 for _ in self.specs]  # upper bound of |hi|
        self._folds_abs = 0
        self._weight = Fraction(0)
        self._count = 0
        self._fbuf = np.empty(0, np.float64)
        self._ibuf = np.empty(0, np.int64)
        self._native_off = not native  # the NumPy path only (tests, the kernel's self-check)

    @classmethod
    def for_model(cls, reference: Sequence[npt.NDArray[Any]], *,
                  precision_bits: int = DEFAULT_PRECISION_BITS, block: int = BLOCK,
                  exponents: Sequence[int] | None = None) -> Accumulator:
        """An accumulator for updates shaped like ``reference`` (grid from it, same dtypes).

        ``exponents``: ``grid_exponents(reference, precision_bits=precision_bits)`` when the
        caller computed it already (one per tensor).
        """
        exps = (grid_exponents(reference, precision_bits=precision_bits) if exponents is None
                else [int(e) for e in exponents])
        if len(exps) != len(reference):
            raise ConfigError(explain("exponents", len(exps),
                                      f"must hold one grid exponent per tensor ({len(reference)})",
                                      "pass grid_exponents(reference)"))
        return cls([TensorSpec(tuple(np.shape(r)), np.asarray(r).dtype.name, e)
                    for r, e in zip(reference, exps, strict=True)], block=block)

    # -- reading -----------------------------------------------------------------------------
    @property
    def count(self) -> int:
        """Folds so far (a fold with a negative weight counts -1)."""
        return self._count

    @property
    def total_weight(self) -> float:
        """The exact sum of the weights folded so far, rounded once to float64 (inf beyond)."""
        try:
            return float(self._weight)
        except OverflowError:
            return math.inf if self._weight > 0 else -math.inf

    @property
    def nbytes(self) -> int:
        """Bytes held by the accumulator's arrays (limbs and block buffers)."""
        return (sum(a.nbytes for a in self._lo) + sum(a.nbytes for a in self._hi if a is not None)
                + self._fbuf.nbytes + self._ibuf.nbytes)

    def error_bound(self) -> list[float]:
        """Per tensor, the largest absolute error of an element of :meth:`mean` from the grid.

        ``count_abs * 2**(exponent - 1) / |W|`` with ``count_abs`` the number of folds (each
        rounds once); the final cast to the tensor's dtype adds its own half ulp.
        """
        w = abs(float(self._weight))
        n = self._folds_abs
        return [math.ldexp(n, s.exponent - 1) / w if w > 0 else math.inf for s in self.specs]

    # -- folding -----------------------------------------------------------------------------
    fuses_norm = True
    """:meth:`fold` can return the update's delta norm from the same pass (``norm=True``)."""

    checks_finite = True
    """:meth:`fold` refuses a NaN or infinity (:class:`NonFiniteUpdate`) and folds nothing of
    that update: a caller that folds every update needs no finiteness pass of its own."""

    def fold(self, update: Sequence[TensorUpdate], weight: float, *, norm: bool = False,
             reference: Sequence[npt.NDArray[Any]] | None = None) -> float | None:
        """Add ``weight * update`` to the running sum; nothing of ``update`` is kept.

        Parameters
        ----------
        update : sequence of ndarray or Sparse
            One entry per tensor: a dense array of the tensor's shape (any float or integer
            dtype; a read-only view on the message bytes is fine) or :class:`Sparse`.
        weight : float
            The site's weight (number of examples); a negative weight removes an earlier fold
            of the same update exactly.
        norm, reference : bool, sequence of ndarray
            With ``norm``, also return ``delta_norm(update, reference)``
            (:func:`fedagg.accumulate.delta_norm`, up to its last bits), read in the same pass.

        Returns
        -------
        float or None
            The norm with ``norm=True``, else None.

        Raises
        ------
        ConfigError
            A weight that is not finite and non-zero; an update whose tensor count, shape or
            sparse indices do not match (nothing is folded then).
        NonFiniteUpdate
            A NaN or infinity in the update (an :class:`UpdateRejected`): nothing was folded.
        UpdateRejected
            A value beyond the accumulator's range (``|w x| >= 2**(exponent + 92)``): nothing
            was folded.
        """
        w = _check_weight(weight)
        if len(update) != len(self.specs):
            raise ConfigError(explain("update", f"{len(update)} tensors",
                                      f"must hold {len(self.specs)} tensors",
                                      "fold updates of the accumulator's model"))
        for j, (u, s) in enumerate(zip(update, self.specs, strict=True)):
            self._check_shape(j, u, s)
            if norm and reference is not None and isinstance(u, Sparse):
                raise ConfigError(explain(f"update[{j}]", "sparse", "a sparse tensor is a delta:"
                                          " pass no reference", "compute the norm of the delta"))
        total = 0.0
        for j, u in enumerate(update):
            mode = 0 if not norm else 1 if reference is None or isinstance(u, Sparse) else 2
            try:
                total += self._fold_tensor(j, u, w, None if mode < 2 else np.asarray(
                    reference[j]).reshape(-1), mode)  # type: ignore[index]
            except UpdateRejected:
                for k in range(j):  # a refused update leaves no trace: q(-w) = -q(w) exactly
                    u_k = update[k]
                    x_k = np.asarray(u_k.values if isinstance(u_k, Sparse) else u_k).reshape(-1)
                    idx_k = (np.asarray(u_k.indices, np.int64) if isinstance(u_k, Sparse)
                             else None)
                    self._fold_blocks(k, x_k, idx_k, -self._scale(k, w), x_k.size)
                raise
        self._weight += Fraction(w)
        self._count += 1 if w > 0 else -1
        self._folds_abs += 1
        return (math.sqrt(total) if total >= 0 else math.nan) if norm else None

    def merge(self, other: Accumulator) -> None:
        """Add another accumulator's sums and weights (exact: disjoint sites, any split)."""
        if [(s.shape, s.exponent) for s in other.specs] != [(s.shape, s.exponent)
                                                          for s in self.specs]:
            raise ConfigError(explain("other.specs", [s.shape for s in other.specs][:3],
                                      "must have the same shapes and grid exponents",
                                      "merge accumulators of the same model and round"))
        for j in range(len(self.specs)):
            if self._bound[j] + other._bound[j] >= _LO_MAX or other._hi[j] is not None:
                other._normalize(j, force=True)
                self._normalize(j, force=True)
            ohi = other._hi[j]
            if ohi is not None:
                self._grow_hi(j, other._hbound[j])
                self._hi_of(j)[:] += ohi
            np.add(self._lo[j], other._lo[j], out=self._lo[j])
            self._bound[j] += other._bound[j]
        self._weight += other._weight
        self._count += other._count
        self._folds_abs += other._folds_abs

    def _check_shape(self, j: int, u: TensorUpdate, s: TensorSpec) -> None:
        if isinstance(u, Sparse):
            idx = np.asarray(u.indices)
            vals = np.asarray(u.values)
            ok = (idx.ndim == 1 and vals.ndim == 1 and idx.shape == vals.shape
                  and np.issubdtype(idx.dtype, np.integer))
            if ok and idx.size:
                ok = (int(idx[0]) >= 0 and int(idx[-1]) < s.size
                      and (idx.size == 1 or bool(np.all(idx[1:] > idx[:-1]))))
            if not ok:
                raise ConfigError(explain(f"update[{j}]", "sparse indices",
                                          f"must be strictly increasing positions in "
                                          f"[0, {s.size}) with one value each",
                                          "decode the payload with the codec (it checks them)"))
        elif tuple(np.shape(u)) != s.shape:
            raise ConfigError(explain(f"update[{j}].shape", tuple(np.shape(u)),
                                      f"must equal {s.shape}", "fold updates of the same model"))

    def _buffers(self, n: int) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
        if self._fbuf.size < n:
            self._fbuf = np.empty(min(max(n, 1), self.block), np.float64)
            self._ibuf = np.empty(self._fbuf.size, np.int64)
        return self._fbuf[:n], self._ibuf[:n]

    def _scale(self, j: int, w: float) -> float:
        try:
            c = math.ldexp(w, -self.specs[j].exponent)
        except OverflowError:
            c = math.inf
        if not math.isfinite(c):
            raise UpdateRejected(explain(f"weight of tensor {j}", w,
                                         "is beyond the accumulator's range",
                                         "report the real number of examples"))
        return c

    def _quantize(self, j: int, x: npt.NDArray[Any], c: float,
                  f: npt.NDArray[np.float64]) -> float:
        """``f = rint(x * c)``; returns ``max |f|`` (range- and finiteness-checked)."""
        with np.errstate(over="ignore", invalid="ignore"):
            np.multiply(x, c, out=f, dtype=np.float64, casting="unsafe")
            np.rint(f, out=f)
        m = max(float(np.max(f)), -float(np.min(f))) if f.size else 0.0
        if not m < _Q_MAX:  # also NaN
            if not bool(np.isfinite(x).all()):
                raise NonFiniteUpdate(explain(
                    f"update[{j}]", f"{int(x.size - np.count_nonzero(np.isfinite(x)))} "
                    "non-finite values in a block", "must be finite (no NaN / Inf)",
                    "check the site's training (learning rate, data)"), j)
            raise UpdateRejected(explain(
                f"update[{j}]", "a value of magnitude >= 2**92 grid units" if math.isfinite(m)
                else "a non-finite value", f"must be finite and below 2**{92 + self.specs[j].exponent}"
                " x 1/weight (the accumulator's range for this tensor)",
                "check the site (a norm bomb?); such an update is refused by the norm checks"))
        return m

    def _add(self, j: int, f: npt.NDArray[np.float64], ib: npt.NDArray[np.int64], m: float,
             sl: slice | npt.NDArray[np.int64]) -> None:
        """``acc[sl] += f`` exactly (f integer-valued, ``|f| <= m``)."""
        lo = self._lo[j]
        if m < _LO_MAX:
            if self._bound[j] + int(m) >= _LO_MAX:
                self._normalize(j)
            ib[...] = f  # integer-valued float64 below 2**62: exact
            if isinstance(sl, slice):
                view = lo[sl]
                np.add(view, ib, out=view)
            else:
                lo[sl] += ib  # unique positions (checked)
            self._bound[j] += int(m)
            return
        # |q| >= 2**62: split q = qh * 2**31 + ql exactly (0 <= ql < 2**31)
        self._normalize(j, force=True)
        self._grow_hi(j, (int(m) >> _LIMB) + 1)
        hi = self._hi_of(j)
        qh = np.floor(f * (1.0 / (1 << _LIMB)))  # exact: power-of-two scaling, floor
        ql = f - qh * float(1 << _LIMB)  # exact: the low 31 bits
        ib[...] = qh
        hi[sl] += ib
        ib[...] = ql
        lo[sl] += ib
        self._bound[j] += 1 << _LIMB

    def _fold_tensor(self, j: int, u: TensorUpdate, w: float,
                     ref: npt.NDArray[Any] | None = None, norm: int = 0) -> float:
        """Fold tensor ``j`` block by block (the native kernel where it applies); a refused
        block undoes the blocks before it. Returns the sum of squares of ``x`` (``norm`` 1) or
        ``x - ref`` (2)."""
        c = self._scale(j, w)
        if isinstance(u, Sparse):
            idx: npt.NDArray[np.int64] | None = np.asarray(u.indices, np.int64)
            x = np.asarray(u.values).reshape(-1)
        else:
            idx, x = None, np.asarray(u).reshape(-1)
        ss, s = 0.0, 0
        while s < x.size:
            s, part = self._native(j, x, idx, c, s, ref, norm)
            ss += part
            if s >= x.size:
                break
            xb = x[s:s + self.block]
            f, ib = self._buffers(xb.size)
            try:  # a refusal is raised before block s changes anything
                m = self._quantize(j, xb, c, f)
                self._add(j, f, ib, m, slice(s, s + xb.size) if idx is None
                          else idx[s:s + self.block])
            except UpdateRejected:
                self._fold_blocks(j, x, idx, -c, s)
                raise
            if norm:
                d = (xb.astype(np.float64) if norm == 1 or ref is None
                     else np.subtract(xb, ref[s:s + xb.size], dtype=np.float64))
                ss += float(np.dot(d, d))
            s += xb.size
        return ss

    def _native(self, j: int, x: npt.NDArray[Any], idx: npt.NDArray[np.int64] | None,
                c: float, s: int, ref: npt.NDArray[Any] | None = None, norm: int = 0
                ) -> tuple[int, float]:
        """Fold ``x[s:]`` with the native kernel up to the first block it hands back."""
        if idx is not None or self._native_off:
            return s, 0.0
        lo, got = self._lo[j][:x.size], None  # no block buffers: the kernel needs none
        if s == 0 and x.size >= native.PARALLEL_MIN and native.threads() > 1:
            got = native.fold_f32_parallel(x, lo, c, self._bound[j], self.block, _LO_MAX, ref,
                                           norm, native.threads())
        if got is None:
            got = native.fold_f32(x, s, lo, c, self._bound[j], self.block, _LO_MAX, ref, norm)
        if got is None:
            return s, 0.0
        s, self._bound[j], part = got
        return s, part

    def _fold_blocks(self, j: int, x: npt.NDArray[Any], idx: npt.NDArray[np.int64] | None,
                     c: float, stop: int) -> None:
        """Fold the blocks of ``x`` before ``stop`` with scale ``c`` (the undo of a refusal)."""
        self._undoing = True  # the same magnitudes again: no range check can refuse them
        try:
            s = 0
            while s < stop:
                s = self._native(j, x[:stop], idx, c, s)[0]
                if s >= stop:
                    break
                xb = x[s:s + self.block]
                f, ib = self._buffers(xb.size)
                m = self._quantize(j, xb, c, f)
                self._add(j, f, ib, m, slice(s, s + xb.size) if idx is None
                          else idx[s:s + self.block])
                s += xb.size
        finally:
            self._undoing = False

    def _hi_of(self, j: int) -> npt.NDArray[np.int64]:
        hi = self._hi[j]
        if hi is None:
            hi = self._hi[j] = np.zeros(self.specs[j].size, np.int64)
        return hi

    def _grow_hi(self, j: int, by: int) -> None:
        """Account ``by`` more in ``|hi|``; refuse before the high limb could overflow."""
        if self._hbound[j] + by >= _LO_MAX and not self._undoing:
            raise UpdateRejected(explain(f"accumulated tensor {j}", "sums beyond 2**93 grid "
                                         "units", "are beyond the accumulator's range",
                                         "check the sites' weights and values (norm bombs?)"))
        self._hbound[j] += by

    def _normalize(self, j: int, *, force: bool = False) -> None:
        """Move carries into the high limb: ``0 <= lo < 2**31`` afterwards (exact).

        Without ``force`` a low limb that is already canonical (no high limb, bound below
        ``2**31``) is left alone.
        """
        if not force and self._bound[j] < (1 << _LIMB) and self._hi[j] is None:
            return
        if self._hi[j] is not None and self._bound[j] < (1 << _LIMB) and not force:
            return
        self._grow_hi(j, (self._bound[j] >> _LIMB) + 1)
        lo, hi = self._lo[j], self._hi_of(j)
        for s in range(0, lo.size, self.block):
            view = lo[s:s + self.block]
            carry = np.right_shift(view, _LIMB)  # floor division by 2**31
            hi[s:s + self.block] += carry
            np.left_shift(carry, _LIMB, out=carry)
            np.subtract(view, carry, out=view)
        self._bound[j] = (1 << _LIMB) - 1

    # -- results ---------------------------------------------------------------------------
    def _sum_f64(self, j: int, out: npt.NDArray[np.float64], s: int) -> None:
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

    def sums(self) -> list[npt.NDArray[np.float64]]:
        """The weighted sums ``sum_i w_i x_i`` per tensor, in float64 (full-size arrays)."""
        out = []
        for j, spec in enumerate(self.specs):
            if self._hi[j] is not None:
                self._normalize(j, force=True)
            a = np.empty(spec.size, np.float64)
            for s in range(0, spec.size, self.block):
                self._sum_f64(j, a[s:s + self.block], s)
            out.append(a.reshape(spec.shape))
        return out

    def mean(self) -> list[npt.NDArray[Any]]:
        """The weighted mean ``sum_i w_i x_i / sum_i w_i`` per tensor, in each spec's dtype.

        Only the output arrays are allocated (plus one block of float64).

        Raises
        ------
        ConfigError
            Nothing was folded, or the weights do not sum to a positive number.
        """
        self._check_total()
        out = []
        for j, spec in enumerate(self.specs):
            res = np.empty(spec.size, np.dtype(spec.dtype))
            self._mean_into(j, res)
            out.append(res.reshape(spec.shape))
        return out

    def mean_npy(self) -> list[tuple[str, tuple[int, ...], bytes]]:
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
        self._check_total()
        out = []
        for j, spec in enumerate(self.specs):
            dt = np.dtype(spec.dtype)
            header = npy_header(dt.str, spec.shape)
            data, view = writable_bytes(len(header) + spec.size * dt.itemsize)
            view[:len(header)] = np.frombuffer(header, np.uint8)
            self._mean_into(j, view[len(header):].view(dt))  # npy v1 headers keep it aligned
            del view
            out.append((str(dt), spec.shape, data.result()))
        return out

    def _check_total(self) -> None:
        if self._weight <= 0:
            raise ConfigError(explain("weights", float(self._weight),
                                      "must sum to a positive number", "fold at least one update"))

    def _mean_into(self, j: int, res: npt.NDArray[Any]) -> None:
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
            self._sum_f64(j, fb, s)
            fb /= total
            with np.errstate(over="ignore", invalid="ignore"):
                if np.issubdtype(dt, np.integer):
                    np.trunc(fb, out=fb)
                res[s:s + n] = fb  # inf from a float overflow is caught by model checks

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain-data state (arrays, ints, strings): specs, limbs (brought to canonical form
        first), their bounds, the exact weight as numerator and denominator, fold counts."""
        for j in range(len(self.specs)):
            if self._hi[j] is not None:
                self._normalize(j, force=True)
        return {
            "version": _STATE_VERSION,
            "specs": [{"shape": list(s.shape), "dtype": s.dtype, "exponent": s.exponent}
                      for s in self.specs],
            "lo": [a.copy() for a in self._lo],
            "hi": [None if a is None else a.copy() for a in self._hi],
            "bound": [str(b) for b in self._bound],
            "hbound": [str(b) for b in self._hbound],
            "weight": [str(self._weight.numerator), str(self._weight.denominator)],
            "count": self._count,
            "folds": self._folds_abs,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], *, block: int = BLOCK) -> Accumulator:
        """Rebuild an accumulator from :meth:`state_dict` output.

        Raises
        ------
        ConfigError
            A state of another version, or one whose arrays do not match its specs.
        """
        if state.get("version") != _STATE_VERSION:
            raise ConfigError(explain("accumulator state.version", state.get("version"),
                                      f"must be {_STATE_VERSION}",
                                      "restore a state written by this fedagg version"))
        try:
            specs = [TensorSpec(tuple(int(d) for d in s["shape"]), str(s["dtype"]),
                                int(s["exponent"])) for s in state["specs"]]
            acc = cls(specs, block=block)
            for j, spec in enumerate(specs):
                lo = np.asarray(state["lo"][j])
                hi = state["hi"][j]
                if lo.dtype != np.int64 or lo.shape != (spec.size,) or (
                        hi is not None and (np.asarray(hi).dtype != np.int64
                                            or np.asarray(hi).shape != (spec.size,))):
                    raise ValueError(f"limbs of tensor {j} do not match {spec}")
                acc._lo[j] = lo.copy()
                acc._hi[j] = None if hi is None else np.asarray(hi).copy()
                acc._bound[j] = int(state["bound"][j])
                acc._hbound[j] = int(state["hbound"][j])
            acc._weight = Fraction(int(state["weight"][0]), int(state["weight"][1]))
            acc._count = int(state["count"])
            acc._folds_abs = int(state["folds"])
        except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise ConfigError(explain("accumulator state", type(exc).__name__,
                                      f"is not a valid state ({exc})",
                                      "restore an intact state_dict")) from None
        return acc


def _kernel_agrees() -> str:
    """'' if the native kernel folds a tricky update exactly like the NumPy path, else the
    reason (registered with :func:`fedagg.accumulate.native.require`)."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=5000) * 3).astype(np.float32)
    x[:8] = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.0, -0.0]  # ties to even
    x[8:12] = np.float32(2.0 ** 60)  # the careful pass
    spec = [TensorSpec((x.size,), "float32", 0)]
    out = []
    for kernel in (True, False):
        acc = Accumulator(spec, block=1000, native=kernel)
        for w in (1.0, 3.0, -1.0, 7.0):
            acc.fold([x], w)
        out.append(acc._lo[0].copy())
        out.append(acc.mean()[0])  # with the high limb in use (2**60 x 7)
    if not all(np.array_equal(a, b) for a, b in zip(out[:2], out[2:], strict=True)) \
            or out[1].dtype != out[3].dtype:
        return "its integers or its mean differ from the NumPy path"
    return ""


native.require(_kernel_agrees)
