"""Sparsifiers with site-chosen indices: TopK (by magnitude) and random-k.

Both are **own-index modes**: each site picks its own positions and sends them, so the
server learns every site's indices (for TopK, which coordinates mattered most to that site)
and secure-aggregation masks cannot cancel. Their ``reveals_indices`` is ``True``. For
secure aggregation use :class:`~fedagg.compression.support.SharedSupport` instead.

References
----------
.. [Stich2018] S. U. Stich, J.-B. Cordonnier, M. Jaggi. "Sparsified SGD with Memory".
   NeurIPS 2018. Sec. 2 (top-k and rand-k compression operators, Def. 2.1).
.. [Aji2017] A. F. Aji, K. Heafield. "Sparse Communication for Distributed Gradient
   Descent". EMNLP 2017. Sec. 2 (drop all but the largest-magnitude gradients).
.. [Lin2018] Y. Lin et al. "Deep Gradient Compression". ICLR 2018. Sec. 3.1.
.. [Sattler2019] F. Sattler et al. "Robust and Communication-Efficient Federated Learning
   from Non-IID Data" (STC). IEEE TNNLS 2019. Sec. IV (top-k for federated updates).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from fedagg.compression.payload import (
    Payload,
    TensorPayload,
    WireDType,
    dense_float32,
    split_flat_support,
)
from fedagg.compression.select import k_from_ratio, topk_indices
from fedagg.compression.support import random_support
from fedagg.errors import ConfigError, explain

__all__ = ["RandomK", "TopK"]

Scope = Literal["tensor", "global"]


def _check_ratio_k(cls: str, ratio: float | None, k: int | None) -> None:
    if (ratio is None) == (k is None):
        raise ConfigError(
            explain(
                f"{cls}",
                (ratio, k),
                "give exactly one of ratio or k",
                f"{cls}(0.01) or {cls}(k=1000)",
            )
        )
    if ratio is not None and not (isinstance(ratio, int | float) and 0.0 <= ratio <= 1.0):
        raise ConfigError(explain(f"{cls}.ratio", ratio, "must be in [0, 1]", "e.g. 0.01"))
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise ConfigError(explain(f"{cls}.k", k, "must be an int >= 0", "e.g. k=1000"))


def _sparse(
    shape: tuple[int, ...], flat: NDArray[np.float32], idx: NDArray[np.int64]
) -> TensorPayload:
    if idx.shape[0] == flat.shape[0]:
        return TensorPayload(shape, WireDType.FLOAT32, flat.copy())
    return TensorPayload(shape, WireDType.FLOAT32, flat[idx], indices=idx)


class TopK:
    """Keep the ``k`` largest-magnitude entries (exact), per tensor or over all tensors.

    The classic TopK operator of [Stich2018]_ / [Aji2017]_ / [Lin2018]_; pair it with
    :class:`~fedagg.compression.error_feedback.ErrorFeedback` so dropped mass is not lost.

    **Reveals indices**: each site's chosen positions are sent in clear to the server.

    Parameters
    ----------
    ratio : float, optional
        Fraction kept, in [0, 1]; ``k = ceil(ratio * n)`` (``n`` = tensor size, or the total
        size with ``scope="global"``).
    k : int, optional
        Absolute number kept (per tensor, or in total with ``scope="global"``), clipped to
        the size. Exactly one of ``ratio`` and ``k`` must be given.
    scope : {"tensor", "global"}
        ``"tensor"`` selects in each tensor separately; ``"global"`` selects the largest
        entries over the concatenation of all tensors (one threshold).

    Notes
    -----
    A tensor where every entry is kept is emitted dense (no index bytes). Ties at the
    threshold go to the lowest index.
    """

    reveals_indices = True

    def __init__(
        self, ratio: float | None = None, *, k: int | None = None, scope: Scope = "tensor"
    ) -> None:
        _check_ratio_k("TopK", ratio, k)
        if scope not in ("tensor", "global"):
            raise ConfigError(explain("TopK.scope", scope, "must be 'tensor' or 'global'", "fix"))
        self.ratio = ratio
        self.k = k
        self.scope: Scope = scope

    def _k_for(self, n: int) -> int:
        if self.k is not None:
            return min(self.k, n)
        return k_from_ratio(self.ratio if self.ratio is not None else 0.0, n)

    def compress(self, tensors: Sequence[NDArray[Any]], *, rng: np.random.Generator) -> Payload:
        """Select the top-k entries by magnitude (``rng`` is unused)."""
        del rng
        arrs = dense_float32(tensors)
        shapes = [tuple(int(d) for d in a.shape) for a in arrs]
        flats = [a.ravel() for a in arrs]
        if self.scope == "tensor":
            return Payload(
                tuple(
                    _sparse(s, f, topk_indices(f, self._k_for(f.shape[0])))
                    for s, f in zip(shapes, flats, strict=True)
                )
            )
        allv = np.concatenate(flats) if flats else np.empty(0, dtype=np.float32)
        idx = topk_indices(allv, self._k_for(allv.shape[0]))
        parts = split_flat_support(idx, [f.shape[0] for f in flats])
        return Payload(
            tuple(_sparse(s, f, p) for s, f, p in zip(shapes, flats, parts, strict=True))
        )

    def __repr__(self) -> str:
        amount = f"k={self.k}" if self.k is not None else f"{self.ratio}"
        return f"TopK({amount}, scope={self.scope!r})"


class RandomK:
    """Keep ``k`` uniformly random entries per tensor (rand-k of [Stich2018]_).

    **Reveals indices**: the positions are sent. With ``seed=None`` they are drawn from the
    site's private ``rng``: they say nothing about the data, but differ between sites, so
    secure-aggregation masks cannot cancel. With a public ``seed`` and ``round`` every site
    draws the same positions (still sent, for a self-describing payload); use
    :class:`~fedagg.compression.support.SharedSupport` to avoid sending them.

    Parameters
    ----------
    ratio : float, optional
        Fraction kept per tensor, in [0, 1].
    k : int, optional
        Number kept per tensor (clipped to the size).
    seed : bytes, optional
        Public seed shared by all sites; ``None`` uses the ``rng`` given to :meth:`compress`.
    round : int
        Round number mixed with ``seed`` (ignored without a seed).
    """

    reveals_indices = True

    def __init__(
        self,
        ratio: float | None = None,
        *,
        k: int | None = None,
        seed: bytes | None = None,
        round: int = 0,
    ) -> None:
        _check_ratio_k("RandomK", ratio, k)
        if seed is not None and not isinstance(seed, bytes):
            raise ConfigError(explain("RandomK.seed", type(seed).__name__, "must be bytes", "fix"))
        if isinstance(round, bool) or not isinstance(round, int) or round < 0:
            raise ConfigError(explain("RandomK.round", round, "must be an int >= 0", "fix"))
        self.ratio = ratio
        self.k = k
        self.seed = seed
        self.round = round

    def _k_for(self, n: int) -> int:
        if self.k is not None:
            return min(self.k, n)
        return k_from_ratio(self.ratio if self.ratio is not None else 0.0, n)

    def _indices(self, i: int, n: int, k: int, rng: np.random.Generator) -> NDArray[np.int64]:
        if self.seed is None:
            return np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)
        sub = hashlib.sha256(b"fedagg/randk/tensor\x00" + i.to_bytes(8, "big") + self.seed)
        return random_support(n, k, round=self.round, seed=sub.digest())

    def compress(self, tensors: Sequence[NDArray[Any]], *, rng: np.random.Generator) -> Payload:
        """Keep ``k`` random entries of each tensor."""
        out: list[TensorPayload] = []
        for i, a in enumerate(dense_float32(tensors)):
            f = a.ravel()
            n = f.shape[0]
            idx = self._indices(i, n, self._k_for(n), rng)
            out.append(_sparse(tuple(int(d) for d in a.shape), f, idx))
        return Payload(tuple(out))

    def __repr__(self) -> str:
        amount = f"k={self.k}" if self.k is not None else f"{self.ratio}"
        shared = "seed=<public>" if self.seed is not None else "seed=None"
        return f"RandomK({amount}, {shared}, round={self.round})"
