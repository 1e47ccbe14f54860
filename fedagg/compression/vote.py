"""Secure index voting: sites agree on a shared support from the *sum* of their top-k votes.

Masks of secure aggregation cancel only on a support every site uses, and a site must not
reveal its own top-k. Voting splits the choice in two securely aggregated parts:

1. **Vote.** Each site takes the ``k`` largest-magnitude coordinates of its
   error-compensated update and encodes them in a small integer table over public hashes
   (:class:`VoteSketch`): in ``"bloom"`` mode its Bloom filter (counter ``[j, b]`` is 1 if one
   of its indices hashes to ``b`` in row ``j``), in ``"count"`` mode the count-min sketch of
   its indicator vector. The tables are masked and summed like any update; the sum of Bloom
   filters is a counting Bloom filter. The server learns only that sum.
2. **Support.** The popularity of coordinate ``i`` is ``min_j T[j, h_j(i)]``, never below the
   number of sites that voted ``i`` (count-min, Cormode & Muthukrishnan 2005). The support
   is the ``m`` most popular coordinates, ties broken by a public per-round hash priority
   (so ties do not favour low indices), optionally with a share drawn at random from the
   rest (coordinates nobody voted still get visited).
3. **Values.** Sites send their values on that support with error feedback
   (:class:`VoteSupport` is a :class:`~fedagg.compression.support.SharedSupport`), masked,
   as in the other secure sparse modes.

**Block votes** (``block=B``, :class:`BlockVote`): instead of hashed coordinates a site
votes for the ``b`` blocks of ``B`` consecutive coordinates of the flattened update that hold
the most L1 mass of its unsent residual; the table has one exact counter per block (no
hashing, no collisions: ``ceil(dim / B)`` counters), the support is the ``m // B`` most
popular blocks. Parameters of one tensor row lie next to each other in the flattened update
(a neuron's input weights), and a model's update is mass-structured along them, so block
votes capture more of the aggregate's mass per counter than hashed coordinate votes.

The two phases can run in one round (vote, then values), or pipelined: the values of round
``t`` use the support voted in round ``t - 1``, so each round carries one upload
(``[values on S_t | votes for S_{t+1}]``). :class:`VoteSupport` does the pipelined form: its
``compress`` leaves the next round's vote in :attr:`VoteSupport.last_votes`, taken on what
the site has *not* sent yet (the error-compensated update minus the values sent now).

Counters are non-negative integers, not fixed-point values: a summed Bloom counter is at most
the number of sites, so a counter needs only ``ceil(log2(N + 1))`` bits
(:func:`vote_ring_bits`). It can travel in a ring of its own, or several to a ring element of
the values' vector (:func:`fedagg.compression.ring.pack_counters`: sums never carry across
fields), so one secure sum carries both parts; :func:`round_nbytes` accounts for every byte.

The vote tables (:class:`~fedagg.compression.vote_tables.VoteSketch`,
:class:`~fedagg.compression.vote_tables.BlockVote`) are in
:mod:`fedagg.compression.vote_tables`.

References
----------
.. [Fan2000] L. Fan, P. Cao, J. Almeida, A. Z. Broder. "Summary Cache: A Scalable Wide-Area
   Web Cache Sharing Protocol". IEEE/ACM ToN 2000 (counting Bloom filters, Sec. V).
.. [Cormode2005] G. Cormode, S. Muthukrishnan. "An Improved Data Stream Summary: the
   Count-Min Sketch and its Applications". J. Algorithms 2005 (point query = min of rows).
.. [Bonawitz2017] K. Bonawitz et al. "Practical Secure Aggregation for Privacy-Preserving
   Machine Learning". CCS 2017 (masks cancel on a common vector space).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.compression.payload import Payload
from fedagg.compression.ring import (
    counters_per_element,
    pack_counters,
    ring_nbytes,
    unpack_counters,
)
from fedagg.compression.select import k_from_ratio
from fedagg.compression.sketch import flatten
from fedagg.compression.support import SharedSupport, random_support
from fedagg.compression.vote_tables import BlockVote, VoteMode, VoteSketch
from fedagg.errors import ConfigError, explain

__all__ = [
    "VoteSupport",
    "find_vote_support",
    "round_nbytes",
    "vote_ring_bits",
]



def vote_ring_bits(num_sites: int, k: int, mode: VoteMode = "bloom") -> int:
    """Fewest ring bits (1..32) whose ``Z_2^b`` holds a summed vote counter without wrapping.

    A counter sums at most ``num_sites`` (``"bloom"``) or ``num_sites * k`` (``"count"``).

    Raises
    ------
    ConfigError
        The bound needs more than 32 bits.
    """
    if isinstance(num_sites, bool) or not isinstance(num_sites, int) or num_sites < 1:
        raise ConfigError(explain("num_sites", num_sites, "must be an int >= 1", "-"))
    if mode not in ("bloom", "count"):
        raise ConfigError(explain("mode", mode, "must be 'bloom' or 'count'", "'bloom'"))
    top = num_sites if mode == "bloom" else num_sites * max(int(k), 1)
    bits = max(1, top.bit_length())
    if bits > 32:
        raise ConfigError(
            explain("vote counters", top, "need more than 32 bits", "use mode='bloom'")
        )
    return bits


def round_nbytes(
    *,
    vote_counters: int,
    vote_bits: int,
    support: int,
    value_bits: int,
    one_vector: bool = True,
) -> dict[str, int]:
    """Upward bytes of one site in one voting round, masked payloads only (bit-packed).

    Parameters
    ----------
    vote_counters : int
        Counters of the vote table (``rows * cols``).
    vote_bits : int
        Bits per vote counter (:func:`vote_ring_bits`).
    support : int
        Values on the support; the weight adds one element.
    value_bits : int
        Ring width of the values (``secagg.ring_bits`` of the round).
    one_vector : bool
        ``True``: the vote rides in the values' masked vector, ``value_bits // vote_bits``
        counters per element (:func:`fedagg.compression.ring.pack_counters`); one secure sum.
        ``False``: the vote is a separate vector in a ``vote_bits`` ring (a second secure
        sum, whose fixed per-round cost comes on top).

    Returns
    -------
    dict
        ``{"vote", "values", "total"}`` bytes. Secure aggregation's fixed per-round cost
        (key shares, headers) is not included.
    """
    values = ring_nbytes(support + 1, value_bits)
    if one_vector:
        elements = -(-vote_counters // counters_per_element(vote_bits, value_bits))
        vote = ring_nbytes(support + 1 + elements, value_bits) - values
    else:
        vote = ring_nbytes(vote_counters, vote_bits)
    return {"vote": vote, "values": values, "total": vote + values}


def _amount(ratio: float | None, k: int | None, dim: int) -> int:
    return min(int(k), dim) if k is not None else k_from_ratio(ratio or 0.0, dim)


class VoteSupport(SharedSupport):
    """Values on the support voted in the previous round; casts this round's vote.

    Parameters
    ----------
    support_ratio, support_k : float or None, int or None
        Support size ``m``: a fraction of ``dim`` or an absolute count (exactly one).
    vote_ratio, vote_k : float or None, int or None
        Indices each site votes for (default: the support size).
    rows : int
        Vote table rows.
    cols : int or None
        Counters per row; or ``None`` with ``size`` (table size as a fraction of ``dim``).
    size : float or None
        See ``cols``.
    seed : bytes
        Public seed.
    round : int
        Current round: this round's vote uses ``VoteSketch(..., round=round)``.
    mode : {"bloom", "count"}
        Vote counters, see :class:`VoteSketch`.
    block : int
        ``1`` (default): hashed coordinate votes (:class:`VoteSketch`, ``rows`` x ``cols``).
        ``B > 1``: exact block votes (:class:`BlockVote`; ``rows``, ``cols`` and ``size`` are
        not used); a site votes for ``ceil(votes / B)`` blocks.
    random_fraction : float
        Share of the support drawn at random from the rest.

    Notes
    -----
    Without a vote sum (:meth:`use_votes` not called, e.g. the first round) the support is
    the public :func:`~fedagg.compression.support.random_support` of the round. Wrap in
    ``ErrorFeedback`` so what is off the support stays at the site.

    The values reveal no per-site index, but a site's *vote table* does (it is a Bloom filter
    of its top-k): it must only ever travel masked. ``requires_secure_aggregation`` says so;
    a plaintext upload path must refuse this stage.
    """

    reveals_indices = False
    requires_secure_aggregation = True

    def __init__(
        self,
        *,
        support_ratio: float | None = None,
        support_k: int | None = None,
        vote_ratio: float | None = None,
        vote_k: int | None = None,
        rows: int = 3,
        cols: int | None = None,
        size: float | None = None,
        seed: bytes,
        round: int,
        mode: VoteMode = "bloom",
        random_fraction: float = 0.0,
        block: int = 1,
    ) -> None:
        if isinstance(block, bool) or not isinstance(block, int | np.integer) or block < 1:
            raise ConfigError(explain("VoteSupport.block", block, "must be an int >= 1",
                                      "1 (hashed coordinate votes) or e.g. 64"))
        if block > 1:
            if mode != "bloom":
                raise ConfigError(explain("VoteSupport.mode", mode,
                                          "block votes count sites per block (bloom)",
                                          "drop mode= with block="))
            cols, size = cols if cols is not None else 1, None
        if (support_ratio is None) == (support_k is None):
            raise ConfigError(
                explain("VoteSupport", (support_ratio, support_k), "give one support size", "-")
            )
        if vote_ratio is not None and vote_k is not None:
            raise ConfigError(explain("VoteSupport", (vote_ratio, vote_k), "give one vote k", "-"))
        if (cols is None) == (size is None):
            raise ConfigError(explain("VoteSupport", (cols, size), "give cols or size", "-"))
        super().__init__(self._support)
        self.support_ratio, self.support_k = support_ratio, support_k
        self.vote_ratio, self.vote_k = vote_ratio, vote_k
        self.rows, self.cols, self.size = rows, cols, size
        self.seed, self.round, self.mode = seed, round, mode
        self.random_fraction = random_fraction
        self.block = int(block)
        self._votes: tuple[NDArray[np.int64], int] | None = None
        self._memo: tuple[int, NDArray[np.int64]] | None = None
        self.last_votes: NDArray[np.int64] | None = None
        self.sketch_for(max(1, int(support_k or 1)), round)  # validate now

    def m_for(self, dim: int) -> int:
        """Support size for ``dim`` coordinates."""
        return _amount(self.support_ratio, self.support_k, dim)

    def votes_for(self, dim: int) -> int:
        """Indices each site votes for."""
        if self.vote_ratio is None and self.vote_k is None:
            return self.m_for(dim)
        return _amount(self.vote_ratio, self.vote_k, dim)

    def sketch_for(self, dim: int, round: int | None = None) -> VoteSketch | BlockVote:
        """The vote table of ``round`` (default: this round) for ``dim`` coordinates."""
        if self.block > 1:
            rnd = self.round if round is None else round
            return BlockVote(dim, self.block, seed=self.seed, round=rnd)
        cols = (
            self.cols
            if self.cols is not None
            else max(1, math.ceil((self.size or 0.0) * dim / max(1, int(self.rows))))
        )
        rnd = self.round if round is None else round
        return VoteSketch(dim, self.rows, cols, seed=self.seed, round=rnd, mode=self.mode)

    def use_votes(self, vote_sum: NDArray[Any], *, round: int) -> None:
        """Base this round's support on the public vote sum cast in ``round``."""
        self._votes = (np.asarray(vote_sum, dtype=np.int64).copy(), int(round))
        self._memo = None

    def _support(self, dim: int) -> NDArray[np.int64]:
        if self._memo is not None and self._memo[0] == dim:
            return self._memo[1]
        m = self.m_for(dim)
        if self._votes is None:
            sup = random_support(dim, m, round=self.round, seed=b"vote-first\x00" + self.seed)
        else:
            total, rnd = self._votes
            sup = self.sketch_for(dim, rnd).support(total, m, random_fraction=self.random_fraction)
        self._memo = (dim, sup)
        return sup

    def vote(self, tensors: Sequence[NDArray[Any]] | NDArray[Any]) -> NDArray[np.int64]:
        """This round's vote table for an (error-compensated) update."""
        flat = flatten(tensors)
        dim = int(flat.shape[0])
        return self.sketch_for(dim).vote(flat, self.vote_units(dim))

    def vote_units(self, dim: int) -> int:
        """What one site votes for, its vote budget: ``votes_for`` coordinates, or as many
        blocks (a block vote's table holds exactly this many ones; a Bloom row at most this
        many, hashes may collide; a count-min row sums to exactly this)."""
        k = self.votes_for(dim)
        if self.block == 1:
            return k
        return min(-(-dim // self.block), -(-k // self.block))

    def compress(self, tensors: Sequence[NDArray[Any]], *, rng: np.random.Generator) -> Payload:
        """Values on the support; :attr:`last_votes` = vote on what is left unsent."""
        payload = super().compress(tensors, rng=rng)
        rest = np.array(flatten(tensors), dtype=np.float64, copy=True)
        rest[self.support_for(rest.shape[0])] = 0.0
        self.last_votes = self.sketch_for(rest.shape[0]).vote(rest, self.vote_units(rest.shape[0]))
        return payload

    def vote_field_bits(self, dim: int, num_sites: int) -> int:
        """Bits per packed vote counter for a round of ``num_sites`` sites."""
        return vote_ring_bits(num_sites, self.votes_for(dim), self.mode)

    def packed_votes(self, *, dim: int, num_sites: int, ring_bits: int) -> NDArray[np.uint32]:
        """:attr:`last_votes` as ring elements to append to the masked values vector.

        Raises
        ------
        ConfigError
            No vote was cast yet (call :meth:`compress` first), or a counter does not fit.
        """
        if self.last_votes is None:
            raise ConfigError(explain("VoteSupport.last_votes", None, "no vote yet", "compress()"))
        field = self.vote_field_bits(dim, num_sites)
        return pack_counters(self.last_votes, field, ring_bits)

    def unpack_votes(
        self, total: NDArray[Any], *, dim: int, num_sites: int, ring_bits: int
    ) -> NDArray[np.int64]:
        """Server side: the summed vote table from the vote part of the unmasked sum."""
        vs = self.sketch_for(dim)
        field = self.vote_field_bits(dim, num_sites)
        flat = unpack_counters(np.asarray(total), vs.size, field, ring_bits)
        return flat.reshape(vs.rows, vs.cols)

    def __repr__(self) -> str:
        m = self.support_k if self.support_k is not None else self.support_ratio
        table = f"block={self.block}" if self.block > 1 else f"rows={self.rows}"
        return f"VoteSupport(m={m}, {table}, mode={self.mode!r}, round={self.round})"


def find_vote_support(compressor: object) -> VoteSupport | None:
    """The :class:`VoteSupport` stage inside a pipeline, or ``None``."""
    node: object = compressor
    for _ in range(16):
        if node is None:
            return None
        if isinstance(node, VoteSupport):
            return node
        node = getattr(node, "inner", None) or getattr(node, "first", None)
    return None
