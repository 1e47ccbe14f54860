"""Shared supports: sparse positions every site derives from public information.

Pairwise secure-aggregation masks cancel only when all sites put their values on the *same*
positions. If each site chose its own top-k, the server would also learn each site's indices.
The functions here pick a support from public data only, so every site (and the server)
computes the same sorted index array, and the indices say nothing beyond that public data:

* :func:`random_support` -- ``k`` uniformly random positions from ``(seed, round)``;
* :func:`block_support` -- a contiguous (cyclic) block of ``k`` positions at a random offset;
* :func:`topk_of_aggregate` -- the top-k of the previous round's *public* aggregate,
  optionally mixed with a random part so every coordinate is eventually visited.

:class:`SharedSupport` then gathers the values of the (flattened) update on that support,
without index bytes on the wire. Wrap it in
:class:`~fedagg.compression.error_feedback.ErrorFeedback` so the values off the support stay
in the residual.

Determinism
-----------
Randomness is the SHAKE-256 extendable-output function (FIPS 202) of
``"fedagg/compression/support/v1" || purpose || seed || round`` (each part length-prefixed),
read as little-endian 64-bit words and mapped to ``[0, dim)`` by rejection sampling. The
result is a pure function of ``(dim, k, round, seed)``, specified without reference to any
library's random-number API, so sites on different NumPy builds agree.

References
----------
.. [Sattler2019] F. Sattler et al. "Robust and Communication-Efficient Federated Learning
   from Non-IID Data". IEEE TNNLS 2019 (sparse federated updates).
.. [Stich2018] S. U. Stich, J.-B. Cordonnier, M. Jaggi. "Sparsified SGD with Memory".
   NeurIPS 2018 (rand-k with memory converges like SGD).
.. [Bonawitz2017] K. Bonawitz et al. "Practical Secure Aggregation for Privacy-Preserving
   Machine Learning". CCS 2017 (masks cancel in the sum over a common vector space).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.compression.payload import (
    Payload,
    TensorPayload,
    WireDType,
    dense_float32,
    split_flat_support,
)
from fedagg.compression.select import topk_indices
from fedagg.errors import ConfigError, explain

__all__ = [
    "SharedSupport",
    "block_support",
    "find_shared_support",
    "random_support",
    "topk_of_aggregate",
]

_DOMAIN = b"fedagg/compression/support/v1"
_U64 = 2**64


def _check_common(fn: str, dim: int, k: int, round_: int, seed: bytes) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim < 0:
        raise ConfigError(explain(f"{fn}.dim", dim, "must be an int >= 0", "pass the model size"))
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or not 0 <= k <= dim:
        raise ConfigError(explain(f"{fn}.k", k, f"must be an int in [0, dim={dim}]", "fix k"))
    if isinstance(round_, bool) or not isinstance(round_, int | np.integer) or round_ < 0:
        raise ConfigError(explain(f"{fn}.round", round_, "must be an int >= 0", "fix"))
    if not isinstance(seed, bytes):
        raise ConfigError(
            explain(f"{fn}.seed", type(seed).__name__, "must be bytes", "pass a public bytes seed")
        )


def _stream_key(seed: bytes, round_: int, purpose: bytes) -> bytes:
    parts = (_DOMAIN, purpose, seed, int(round_).to_bytes(8, "big"))
    return b"".join(len(p).to_bytes(8, "big") + p for p in parts)


class _UniformStream:
    """Uniform integers in [0, dim) from a SHAKE-256 stream, by rejection (no modulo bias)."""

    def __init__(self, key: bytes, dim: int) -> None:
        self._xof = hashlib.shake_256(key)
        self._words = 0  # 64-bit words consumed so far
        self._dim = dim
        limit = (_U64 // dim) * dim
        self._limit = None if limit == _U64 else np.uint64(limit)

    def raw(self, n: int) -> NDArray[np.uint64]:
        """The next ``n`` 64-bit words of the stream."""
        start, self._words = self._words, self._words + n
        out = self._xof.digest(8 * self._words)[8 * start :]
        return np.frombuffer(out, dtype="<u8").astype(np.uint64)

    def draw(self, n: int) -> NDArray[np.int64]:
        """Map the next ``n`` words to [0, dim), dropping the (rare) rejected ones."""
        raw = self.raw(n)
        if self._limit is not None:
            raw = raw[raw < self._limit]
        return (raw % np.uint64(self._dim)).astype(np.int64)


def _first_distinct(stream: _UniformStream, m: int) -> NDArray[np.int64]:
    """The first ``m`` distinct values of the stream, in stream order (m <= dim / 2)."""
    parts: list[NDArray[np.int64]] = []
    known = np.empty(0, dtype=np.int64)  # sorted values taken so far
    have = 0
    while have < m:
        batch = stream.draw(2 * (m - have) + 64)
        order = np.argsort(batch, kind="stable")
        ranked = batch[order]
        is_first = np.ones(ranked.shape[0], dtype=bool)
        is_first[1:] = ranked[1:] != ranked[:-1]
        batch = batch[np.sort(order[is_first])]  # distinct within the batch, stream order kept
        if known.shape[0]:
            pos = np.searchsorted(known, batch).clip(max=known.shape[0] - 1)
            batch = batch[known[pos] != batch]
        fresh = batch[: m - have]
        parts.append(fresh)
        known = np.sort(np.concatenate([known, fresh]))
        have += fresh.shape[0]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def random_support(dim: int, k: int, *, round: int, seed: bytes) -> NDArray[np.int64]:
    """``k`` distinct uniformly random positions in ``[0, dim)``, from public ``(seed, round)``.

    Every party that calls this with the same arguments gets the same array; different
    rounds (or seeds) give independent supports.

    Parameters
    ----------
    dim : int
        Size of the flat vector (e.g. the number of model parameters).
    k : int
        Number of positions, ``0 <= k <= dim``.
    round : int
        Round number (>= 0), public.
    seed : bytes
        Public seed agreed by the federation (e.g. from the run config).

    Returns
    -------
    ndarray of int64
        Sorted, unique positions.
    """
    _check_common("random_support", dim, k, round, seed)
    dim, k = int(dim), int(k)
    if k == 0:
        return np.empty(0, dtype=np.int64)
    if k == dim:
        return np.arange(dim, dtype=np.int64)
    stream = _UniformStream(_stream_key(seed, round, b"random"), dim)
    if k <= dim // 2:
        return np.sort(_first_distinct(stream, k))
    excluded = _first_distinct(stream, dim - k)
    mask = np.ones(dim, dtype=bool)
    mask[excluded] = False
    return np.flatnonzero(mask).astype(np.int64)


def block_support(dim: int, k: int, *, round: int, seed: bytes) -> NDArray[np.int64]:
    """A cyclic block of ``k`` consecutive positions starting at a public random offset.

    Cheaper to describe than :func:`random_support` and cache-friendly; every position is
    covered with the same probability ``k / dim`` per round.

    Parameters
    ----------
    dim, k, round, seed
        As in :func:`random_support`.

    Returns
    -------
    ndarray of int64
        Sorted, unique positions (the block may wrap around the end).
    """
    _check_common("block_support", dim, k, round, seed)
    dim, k = int(dim), int(k)
    if k == 0:
        return np.empty(0, dtype=np.int64)
    stream = _UniformStream(_stream_key(seed, round, b"block"), dim)
    first = stream.draw(1)
    while first.shape[0] == 0:  # rejected (probability < 2**-63 per word)
        first = stream.draw(1)
    start = int(first[0])
    return np.sort((start + np.arange(k, dtype=np.int64)) % dim)


def topk_of_aggregate(
    previous_aggregate: NDArray[Any] | Sequence[NDArray[Any]],
    k: int,
    *,
    random_fraction: float = 0.0,
    round: int,
    seed: bytes,
) -> NDArray[np.int64]:
    """The ``k`` largest-magnitude positions of the previous round's public aggregate.

    The aggregate (global model delta) is known to every site after the round, so its top-k
    reveals nothing new. A share ``random_fraction`` of the ``k`` positions is instead drawn
    at random (from ``(seed, round)``) among the remaining positions, so coordinates outside
    the previous top-k still get sent.

    Parameters
    ----------
    previous_aggregate : ndarray or sequence of ndarray
        The public aggregate (flattened and concatenated in tensor order).
    k : int
        Total number of positions, ``0 <= k <= dim``.
    random_fraction : float
        Fraction in [0, 1] of ``k`` drawn at random; ``round(random_fraction * k)`` positions.
    round : int
        Current round (>= 0), public.
    seed : bytes
        Public seed.

    Returns
    -------
    ndarray of int64
        Sorted, unique positions. Ties in magnitude go to the lowest index.

    Raises
    ------
    ConfigError
        On bad arguments or a non-finite aggregate.
    """
    if isinstance(previous_aggregate, np.ndarray):
        agg = np.asarray(previous_aggregate, dtype=np.float64).ravel()
    else:
        parts = [np.asarray(a, dtype=np.float64).ravel() for a in previous_aggregate]
        agg = np.concatenate(parts) if parts else np.empty(0, dtype=np.float64)
    dim = int(agg.shape[0])
    _check_common("topk_of_aggregate", dim, k, round, seed)
    if not (isinstance(random_fraction, int | float) and 0.0 <= random_fraction <= 1.0):
        raise ConfigError(
            explain(
                "topk_of_aggregate.random_fraction", random_fraction, "must be in [0, 1]", "0.1"
            )
        )
    if not bool(np.all(np.isfinite(agg))):
        raise ConfigError(
            explain("previous_aggregate", "NaN/inf", "must be finite", "pass the applied aggregate")
        )
    k_rand = int(np.floor(random_fraction * k + 0.5))
    top = topk_indices(agg, int(k) - k_rand)
    if k_rand == 0:
        return top
    rest = np.setdiff1d(np.arange(dim, dtype=np.int64), top, assume_unique=True)
    pick = random_support(rest.shape[0], k_rand, round=round, seed=b"aggregate-random\x00" + seed)
    return np.sort(np.concatenate([top, rest[pick]])).astype(np.int64)


SupportSource = NDArray[Any] | Sequence[int] | Callable[[int], NDArray[np.int64]]


class SharedSupport:
    """Send only the values of the flattened update on a shared public support.

    The update's tensors are flattened and concatenated (length ``dim``); the values at the
    support's positions are sent, split back per tensor, with **no index bytes**: the
    payload's tensors have ``implicit_indices=True`` and the receiver recomputes the support
    and calls :meth:`Payload.with_support <fedagg.compression.payload.Payload.with_support>`.

    Leaks nothing beyond the public information the support was derived from
    (``reveals_indices = False``), and masks of secure aggregation cancel because all sites
    use the same positions. Use ``ErrorFeedback(SharedSupport(...))`` so the coordinates off
    the support are kept for later rounds.

    Parameters
    ----------
    support : array of int or callable
        Sorted unique flat positions, or a function ``dim -> positions`` evaluated at
        compression time (e.g. ``lambda d: random_support(d, d // 100, round=r, seed=s)``).

    Examples
    --------
    >>> import numpy as np
    >>> enc = SharedSupport(np.array([0, 3]))
    >>> p = enc.compress([np.arange(4, dtype=np.float32)], rng=np.random.default_rng(0))
    >>> p.tensors[0].values.tolist(), p.tensors[0].implicit_indices
    ([0.0, 3.0], True)
    """

    reveals_indices = False

    def __init__(self, support: SupportSource) -> None:
        self._source = support

    def support_for(self, dim: int) -> NDArray[np.int64]:
        """The validated flat support for an update of ``dim`` elements.

        Raises
        ------
        ConfigError
            If the positions are not sorted, unique and within ``[0, dim)``.
        """
        src = self._source
        raw = src(dim) if callable(src) else src
        sup = np.asarray(raw)
        if sup.ndim != 1 or not (sup.size == 0 or np.issubdtype(sup.dtype, np.integer)):
            raise ConfigError(
                explain("SharedSupport.support", sup.dtype, "must be a 1-D integer array", "fix")
            )
        sup = sup.astype(np.int64)
        if sup.size and (
            int(sup[0]) < 0 or int(sup[-1]) >= dim or not bool(np.all(np.diff(sup) > 0))
        ):
            raise ConfigError(
                explain(
                    "SharedSupport.support",
                    f"{sup.size} positions",
                    f"must be strictly increasing and within [0, {dim})",
                    "build it with random_support / block_support / topk_of_aggregate",
                )
            )
        return sup

    def compress(self, tensors: Sequence[NDArray[Any]], *, rng: np.random.Generator) -> Payload:
        """Gather the values on the support (``rng`` is unused)."""
        del rng
        arrs = dense_float32(tensors)
        sizes = [int(a.size) for a in arrs]
        flats = [a.ravel() for a in arrs]
        sup = self.support_for(sum(sizes))
        parts = split_flat_support(sup, sizes)
        return Payload(
            tuple(
                TensorPayload(
                    tuple(int(d) for d in a.shape),
                    WireDType.FLOAT32,
                    f[idx],
                    indices=idx,
                    implicit_indices=True,
                )
                for a, f, idx in zip(arrs, flats, parts, strict=True)
            )
        )

    def __repr__(self) -> str:
        kind = (
            "callable" if callable(self._source) else f"{np.asarray(self._source).size} positions"
        )
        return f"SharedSupport(<{kind}>)"


def find_shared_support(compressor: object) -> SharedSupport | None:
    """The :class:`SharedSupport` stage inside a pipeline, or ``None`` (own-index or dense).

    Unwraps ``ErrorFeedback.inner`` and ``Chain.first``. The server uses it to recompute the
    public support from the same spec the sites use::

        comp = build_compressor(spec, seed=seed, round=rnd)
        stage = find_shared_support(comp)
        if stage is not None:
            payload = payload.with_support(stage.support_for(payload.numel))
    """
    seen = 0
    node: object = compressor
    while node is not None and seen < 16:
        if isinstance(node, SharedSupport):
            return node
        node = getattr(node, "inner", None) or getattr(node, "first", None)
        seen += 1
    return None
