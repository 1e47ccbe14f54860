"""The vote tables of secure index voting: what a site votes with, and what the sum says.

* :class:`VoteSketch` — ``rows`` x ``cols`` counters over public per-round hashes of the
  coordinates: in ``"bloom"`` mode a site's Bloom filter of its top-k indices (summed over
  sites: a counting Bloom filter [Fan2000]_), in ``"count"`` mode the count-min sketch of its
  indicator vector; the popularity of a coordinate is ``min_j T[j, h_j(i)]``, never below the
  number of sites that voted it [Cormode2005]_.
* :class:`BlockVote` — one exact counter per block of consecutive coordinates (no hashing):
  a site votes for the blocks of largest L1 mass.

Both pick the support from the summed table, ties broken by a public per-round SHAKE-256
priority, optionally with a share drawn at random from the rest.
:class:`fedagg.compression.vote.VoteSupport` uses either (the module docstring of
:mod:`fedagg.compression.vote` describes the whole scheme); both names are importable from
:mod:`fedagg.compression` as well.

References
----------
.. [Fan2000] L. Fan, P. Cao, J. Almeida, A. Z. Broder. "Summary Cache: A Scalable Wide-Area
   Web Cache Sharing Protocol". IEEE/ACM ToN 2000 (counting Bloom filters, Sec. V).
.. [Cormode2005] G. Cormode, S. Muthukrishnan. "An Improved Data Stream Summary: the
   Count-Min Sketch and its Applications". J. Algorithms 2005 (point query = min of rows).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from fedagg.compression.ring import to_ring
from fedagg.compression.select import topk_indices
from fedagg.compression.sketch import CHUNK, CountSketch, flatten
from fedagg.compression.support import random_support
from fedagg.errors import CodecError, ConfigError, explain

__all__ = ["BlockVote", "VoteMode", "VoteSketch"]

VoteMode = Literal["bloom", "count"]
_PRIORITY_DOMAIN = b"fedagg/compression/vote/tiebreak/v1"
_BLOCK_DOMAIN = b"fedagg/compression/vote/block-tiebreak/v1"


class VoteSketch:
    """Public-hash vote tables of ``rows`` x ``cols`` counters over ``dim`` coordinates.

    Parameters
    ----------
    dim, rows, cols : int
        Coordinates, rows (independent hashes) and counters per row.
    seed : bytes
        Public seed.
    round : int
        The round the votes are cast in (votes rehash every round).
    mode : {"bloom", "count"}
        Per-site counter: 0/1 (Bloom filter) or the number of the site's indices in it.

    Examples
    --------
    >>> vs = VoteSketch(1000, 3, 64, seed=b"public", round=1)
    >>> total = vs.encode([3, 500]) + vs.encode([3, 999]) + vs.encode([3])
    >>> vs.support(total, 1).tolist()
    [3]
    >>> int(vs.popularity(total)[3])
    3
    """

    def __init__(
        self, dim: int, rows: int, cols: int, *, seed: bytes, round: int, mode: VoteMode = "bloom"
    ) -> None:
        if mode not in ("bloom", "count"):
            raise ConfigError(explain("VoteSketch.mode", mode, "must be 'bloom' or 'count'", "-"))
        self.mode: VoteMode = mode
        self.hashes = CountSketch(dim, rows, cols, seed=seed, round=round, purpose=b"vote")
        self.dim, self.rows, self.cols, self.round = dim, rows, cols, round
        self.seed = seed

    @property
    def size(self) -> int:
        """Counters per table."""
        return self.hashes.size

    def encode(self, indices: NDArray[Any] | Sequence[int]) -> NDArray[np.int64]:
        """One site's vote table for its chosen ``indices`` (``(rows, cols)`` int64)."""
        idx = np.unique(np.asarray(indices, dtype=np.int64).ravel())
        if idx.size and (int(idx[0]) < 0 or int(idx[-1]) >= self.dim):
            raise ConfigError(
                explain("vote indices", "out of range", f"must be in [0, {self.dim})", "-")
            )
        if self.mode == "bloom":
            return self.hashes.touched(idx).astype(np.int64)
        buckets = self.hashes.buckets
        out = np.empty((self.rows, self.cols), dtype=np.int64)
        for j in range(self.rows):
            out[j] = np.bincount(buckets[j, idx], minlength=self.cols)
        return out

    def vote(self, vector: NDArray[Any] | Sequence[NDArray[Any]], k: int) -> NDArray[np.int64]:
        """Vote for the ``k`` largest ``|vector|`` coordinates (ties: lowest index)."""
        flat = flatten(vector)
        if flat.shape[0] != self.dim:
            raise ConfigError(explain("vote vector", flat.shape[0], f"must be {self.dim}", "-"))
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or not 0 <= k <= self.dim:
            raise ConfigError(explain("vote k", k, f"must be an int in [0, {self.dim}]", "-"))
        return self.encode(topk_indices(flat, int(k)))

    def decode_sum(self, total: NDArray[Any], ring_bits: int) -> NDArray[np.int64]:
        """Unmasked sum of ring-encoded tables -> ``(rows, cols)`` counts (read mod ``2^b``).

        Raises
        ------
        CodecError
            Wrong length or dtype.
        """
        t = np.asarray(total)
        if t.dtype != np.uint32 or t.shape != (self.size,):
            raise CodecError(
                explain("vote sum", (str(t.dtype), t.shape), f"must be {self.size} uint32", "-")
            )
        low = t.astype(np.int64) & np.int64((1 << ring_bits) - 1)
        return low.reshape(self.rows, self.cols)

    def encode_ring(self, table: NDArray[Any], ring_bits: int) -> NDArray[np.uint32]:
        """A vote table as ``uint32`` ring elements (low ``ring_bits`` bits), ready to mask."""
        return to_ring(self.hashes.table(table, "vote table"), ring_bits)

    def popularity(self, total: NDArray[Any]) -> NDArray[np.int64]:
        """Count-min estimate per coordinate, ``min_j T[j, h_j(i)]`` (never an underestimate)."""
        t = self.hashes.table(total, "vote sum").astype(np.int64)
        if t.size and int(t.min()) < 0:
            raise ConfigError(explain("vote sum", "negative", "counts must be >= 0", "-"))
        vals = np.take_along_axis(t, self.hashes.buckets.astype(np.intp), axis=1)
        out: NDArray[np.int64] = vals.min(axis=0)
        return out

    def priority(self) -> NDArray[np.uint64]:
        """Public per-round tie-break keys (SHAKE-256, one 64-bit word per coordinate)."""
        key = self.hashes._key  # the hash definition, incl. seed and round
        out = np.empty(self.dim, dtype=np.uint64)
        for lo in range(0, self.dim, CHUNK):
            n = min(CHUNK, self.dim - lo)
            xof = hashlib.shake_256(_PRIORITY_DOMAIN + key + (lo // CHUNK).to_bytes(8, "big"))
            out[lo : lo + n] = np.frombuffer(xof.digest(8 * n), dtype="<u8")
        return out

    def support(
        self, total: NDArray[Any], m: int, *, random_fraction: float = 0.0
    ) -> NDArray[np.int64]:
        """The ``m`` most popular coordinates (sorted), from the summed vote table.

        Ordered by popularity (descending), then :meth:`priority`, then index. A share
        ``random_fraction`` of ``m`` is instead drawn uniformly (public seed and round) from
        the coordinates not chosen by popularity.
        """
        if isinstance(m, bool) or not isinstance(m, int | np.integer) or not 0 <= m <= self.dim:
            raise ConfigError(explain("support size", m, f"must be in [0, {self.dim}]", "-"))
        if not (isinstance(random_fraction, int | float) and 0.0 <= random_fraction <= 1.0):
            raise ConfigError(explain("random_fraction", random_fraction, "must be in [0, 1]", "-"))
        pop = self.popularity(total)
        m_rand = math.floor(random_fraction * int(m) + 0.5)
        order = np.lexsort((np.arange(self.dim), self.priority(), -pop))
        top = np.sort(order[: int(m) - m_rand]).astype(np.int64)
        if m_rand == 0:
            return top
        rest = np.sort(order[int(m) - m_rand :]).astype(np.int64)
        pick = random_support(
            rest.shape[0], m_rand, round=self.round, seed=b"vote-random\x00" + self.seed
        )
        return np.sort(np.concatenate([top, rest[pick]])).astype(np.int64)

    def __repr__(self) -> str:
        return (
            f"VoteSketch(dim={self.dim}, rows={self.rows}, cols={self.cols}, "
            f"round={self.round}, mode={self.mode!r})"
        )


class BlockVote:
    """Exact vote tables over blocks of ``block`` consecutive coordinates (one row).

    Same interface as :class:`VoteSketch` (``rows``, ``cols``, ``size``, :meth:`vote`,
    :meth:`popularity`, :meth:`support`), so :class:`VoteSupport` uses either. Counter ``b``
    of a site's table is 1 if block ``b`` (coordinates ``[b * block, (b + 1) * block)``) is
    among the site's ``k`` blocks of largest L1 mass; summed over sites it is the number of
    sites that chose the block, exactly.

    Parameters
    ----------
    dim, block : int
        Coordinates and block length (``>= 1``; the last block may be shorter).
    seed : bytes
        Public seed (tie-break priorities).
    round : int
        The round the votes are cast in.

    Examples
    --------
    >>> bv = BlockVote(10, 4, seed=b"public", round=1)
    >>> x = np.array([0, 0, 0, 0, 5, 5, 0, 0, 1, 0.0])
    >>> bv.vote(x, 1).tolist(), bv.support(bv.vote(x, 1) * 3, 4).tolist()
    ([[0, 1, 0]], [4, 5, 6, 7])
    """

    mode: VoteMode = "bloom"

    def __init__(self, dim: int, block: int, *, seed: bytes, round: int) -> None:
        for name, value in (("dim", dim), ("block", block)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ConfigError(explain(f"BlockVote.{name}", value, "must be an int >= 1",
                                          "e.g. block=64"))
        self.dim, self.block = int(dim), int(block)
        self.blocks = -(-self.dim // self.block)
        self.rows, self.cols = 1, self.blocks
        self.seed, self.round = seed, int(round)

    @property
    def size(self) -> int:
        """Counters per table (one per block)."""
        return self.blocks

    def masses(self, vector: NDArray[Any] | Sequence[NDArray[Any]]) -> NDArray[np.float64]:
        """L1 mass of ``vector`` per block."""
        flat = flatten(vector)
        if flat.shape[0] != self.dim:
            raise ConfigError(explain("vote vector", flat.shape[0], f"must be {self.dim}", "-"))
        out: NDArray[np.float64] = np.add.reduceat(
            np.abs(flat), np.arange(0, self.dim, self.block))
        return out

    def vote(self, vector: NDArray[Any] | Sequence[NDArray[Any]], k: int) -> NDArray[np.int64]:
        """Vote for the ``k`` blocks of largest L1 mass (ties: lowest index), ``(1, blocks)``."""
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or not 0 <= k <= self.blocks:
            raise ConfigError(explain("vote blocks", k, f"must be in [0, {self.blocks}]", "-"))
        out = np.zeros((1, self.blocks), np.int64)
        out[0, topk_indices(self.masses(vector), int(k))] = 1
        return out

    def popularity(self, total: NDArray[Any]) -> NDArray[np.int64]:
        """Sites per block (the summed table itself)."""
        t = np.asarray(total)
        if t.shape not in ((1, self.blocks), (self.blocks,)) or not np.issubdtype(
                t.dtype, np.integer) or (t.size and int(t.min()) < 0):
            raise ConfigError(explain("block vote sum", f"{t.dtype}{t.shape}",
                                      f"must be {self.blocks} counts >= 0", "-"))
        out: NDArray[np.int64] = t.reshape(-1).astype(np.int64)
        return out

    def priority(self) -> NDArray[np.uint64]:
        """Public per-round tie-break keys per block (SHAKE-256, one 64-bit word each)."""
        head = b"".join(len(p).to_bytes(8, "big") + p for p in (
            _BLOCK_DOMAIN, self.seed, self.round.to_bytes(8, "big"),
            self.dim.to_bytes(8, "big"), self.block.to_bytes(8, "big")))
        return np.frombuffer(hashlib.shake_256(head).digest(8 * self.blocks), dtype="<u8").copy()

    def support(self, total: NDArray[Any], m: int, *, random_fraction: float = 0.0
                ) -> NDArray[np.int64]:
        """The coordinates of the ``max(1, m // block)`` most popular blocks (sorted).

        Ordered by popularity, then :meth:`priority`, then block index; a share
        ``random_fraction`` of the blocks is drawn uniformly (public seed and round) from
        the rest. The last block may be shorter, so the support has at most that many
        blocks' coordinates.
        """
        if isinstance(m, bool) or not isinstance(m, int | np.integer) or not 0 <= m <= self.dim:
            raise ConfigError(explain("support size", m, f"must be in [0, {self.dim}]", "-"))
        if not (isinstance(random_fraction, int | float) and 0.0 <= random_fraction <= 1.0):
            raise ConfigError(explain("random_fraction", random_fraction, "must be in [0, 1]", "-"))
        pop = self.popularity(total)
        nb = 0 if m == 0 else min(self.blocks, max(1, int(m) // self.block))
        n_rand = math.floor(random_fraction * nb + 0.5)
        order = np.lexsort((np.arange(self.blocks), self.priority(), -pop))
        chosen = order[: nb - n_rand]
        if n_rand:
            rest = np.sort(order[nb - n_rand:])
            pick = random_support(rest.shape[0], n_rand, round=self.round,
                                  seed=b"vote-block-random\x00" + self.seed)
            chosen = np.concatenate([chosen, rest[pick]])
        idx = (np.sort(chosen)[:, None] * self.block + np.arange(self.block)[None, :]).ravel()
        out: NDArray[np.int64] = idx[idx < self.dim].astype(np.int64)
        return out

    def __repr__(self) -> str:
        return f"BlockVote(dim={self.dim}, block={self.block}, round={self.round})"
