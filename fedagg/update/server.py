"""Server side of the sketch and vote modes: one round's sum back to the delta to apply.

:class:`RoundDecoder` turns the (unmasked, or plaintext) aggregate of a round into the flat
dense delta handed to the inner strategy, and keeps the state these modes need across rounds:

* ``sketch`` — FetchSGD (Rothchild et al. 2020, Algorithm 1): the weighted-mean sketch table
  goes through :class:`fedagg.compression.FetchSGDServer` (momentum and error in sketch
  space); the delta is the top-k of the accumulated error, zero elsewhere;
* ``vote`` — the summed vote table (read from the packed part of the unmasked ring sum)
  becomes :attr:`SupportHistory.votes`, so the next round's support is derived from it on
  both sides; the values are placed on this round's support. The table is first checked
  against the votes' budget (:func:`vote_sum_problem`: what can be checked on a sum); a table
  that fails is refused -- the round's values still count, the next round's support is the
  seeded random one -- and :attr:`Decoded.vote_problem` says why;
* dense and public supports — the mean as is, or placed on the public support.

A round is two-phase: :meth:`RoundDecoder.decode` computes the delta (FetchSGD's step is
proposed, not committed); the caller checks it and then calls :meth:`RoundDecoder.accept`
(commit the step, record the votes) or :meth:`RoundDecoder.reject` (the round leaves no trace:
the sketch state is restored, the votes are dropped). Flower-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from fedagg.compression import FetchSGDServer, find_sketch, find_vote_support
from fedagg.compression.ring import unpack_counters
from fedagg.errors import ProtocolError, explain
from fedagg.update.decode import densify
from fedagg.update.history import SupportHistory
from fedagg.update.masked import MaskedLayout

__all__ = ["Decoded", "RoundDecoder", "vote_sum_problem"]


@dataclass
class Decoded:
    """One round's aggregate, decoded.

    Attributes
    ----------
    values : ndarray of float64
        The aggregate as it arrived (mean delta, mean values on the support, or the mean
        sketch table, flat): what range checks apply to.
    delta : ndarray of float64
        The flat dense delta to apply (zero off the support / off the sketch's top-k).
    votes : ndarray of int64 or None
        The summed vote table of this round (``vote`` specs).
    metrics : dict
        The sites' mean metrics summed under the masks (``train_loss``), where reported.
    vote_problem : str
        Why this round's vote table was refused ('' when it was not, or there is none).
    """

    values: NDArray[np.float64]
    delta: NDArray[np.float64]
    votes: NDArray[np.int64] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    vote_problem: str = ""


def vote_sum_problem(table: NDArray[Any], *, uploaders: int, units: int,
                     mode: Literal["bloom", "count"], exact: bool) -> str:
    """Why a summed vote table cannot be the sum of ``uploaders`` honest votes ('' if it can).

    What the server can check on the sum alone (the votes are masked, one site's table is
    never seen): every honest table is non-negative with its budget of ``units`` votes, so

    * every counter is within ``[0, uploaders]`` (Bloom and block votes: 0 or 1 per site) or
      ``[0, uploaders x units]`` (count-min votes);
    * the mass of each row is ``uploaders x units`` exactly (block votes, ``exact``: one site
      sets exactly ``units`` ones; count-min rows: each sums to ``units``), or within
      ``[uploaders, uploaders x units]`` (hashed Bloom rows: colliding hashes merge ones).

    A table that passes can still hold one site's budget spent as it likes (concentrated on
    few counters, or moved away from counters others voted for): docs/compression.md.
    """
    t = np.asarray(table, np.int64)
    n, u = int(uploaders), int(units)
    top = n if mode == "bloom" else n * u
    if t.size and (int(t.min()) < 0 or int(t.max()) > top):
        bad = int(t.max()) if int(t.max()) > top else int(t.min())
        return explain("vote sum counter", bad,
                       f"must be in [0, {top}] ({n} uploaders"
                       + (")" if mode == "bloom" else f" x {u} votes each)"),
                       "a site sent a counter beyond its own vote: this round's votes are "
                       "refused (the round's values still count; the next support is the "
                       "seeded random one)")
    rows = t.reshape(t.shape[0] if t.ndim > 1 else 1, -1).sum(axis=1)
    want = n * u
    low = want if (exact or mode == "count") else n * min(u, 1)
    for j, mass in enumerate(rows.tolist()):
        if not low <= mass <= want:
            rule = (f"must be {n} uploaders x {u} votes per site = {want}" if low == want
                    else f"must be in [{low}, {want}] ({n} uploaders, at most {u} votes each)")
            return explain(f"vote sum mass (row {j})", int(mass), rule,
                           "a site voted beyond its budget (or not at all): this round's "
                           "votes are refused (the round's values still count; the next "
                           "support is the seeded random one)")
    return ""


class RoundDecoder:
    """Decodes each round's aggregate and keeps FetchSGD's server state (see module doc).

    Parameters
    ----------
    history : SupportHistory
        The server's public history (its spec says the mode; votes are recorded in it).
    """

    def __init__(self, history: SupportHistory) -> None:
        self.history = history
        self.fetchsgd: FetchSGDServer | None = None
        self._snapshot: dict[str, NDArray[Any]] | None = None
        self._pending: tuple[int, NDArray[np.int64]] | None = None
        self._forget = False
        """This round's vote table was refused: accepting the round forgets the votes."""

    # -- FetchSGD -----------------------------------------------------------------------------
    def _server(self, dim: int) -> FetchSGDServer:
        if self.fetchsgd is None or self.fetchsgd.sketch.dim != dim:
            stage = find_sketch(self.history.compressor())
            if stage is None:
                raise ProtocolError(explain("compression.up", self.history.spec.up,
                                            "has no sketch stage", "use a 'sketch:...' spec"))
            self.fetchsgd = stage.server(int(dim))
        return self.fetchsgd

    def sketch_shape(self, dim: int) -> tuple[int, int]:
        """``(rows, cols)`` of the run's sketch for a model of ``dim`` entries."""
        stage = find_sketch(self.history.compressor())
        if stage is None:
            raise ProtocolError(explain("compression.up", self.history.spec.up,
                                        "has no sketch stage", "use a 'sketch:...' spec"))
        return stage.sketch_for(int(dim)).shape

    def sketch_delta(self, mean_table: NDArray[Any], dim: int) -> NDArray[np.float64]:
        """FetchSGD lines 17-19 on the round's weighted-mean table: the proposed delta.

        Raises
        ------
        ConfigError
            A non-finite table or one of the wrong size.
        """
        server = self._server(int(dim))
        self._snapshot = server.state_dict()
        proposal = server.propose(np.asarray(mean_table, np.float64).reshape(
            server.sketch.shape))
        return proposal.to_dense()

    # -- a secure round -------------------------------------------------------------------------
    def decode(self, layout: MaskedLayout, mean: NDArray[Any], total: NDArray[Any] | None, *,
               dim: int, num_sites: int, ring_bits: int, counted: int | None = None
               ) -> Decoded:
        """The delta of a secure round from its :class:`~fedagg.secagg.RoundResult` parts.

        Parameters
        ----------
        layout : MaskedLayout
            The round's layout (:func:`fedagg.update.masked_layout`).
        mean : ndarray
            ``RoundResult.mean`` (``layout.dim`` elements).
        total : ndarray or None
            ``RoundResult.total`` (needed when the layout carries votes).
        dim : int
            The model's size.
        num_sites, ring_bits : int
            Participants of the round and its ring width (the vote counters' packing).
        counted : int, optional
            Sites whose inputs are in the sum (default ``num_sites``): the vote budget's
            uploaders.

        Raises
        ------
        ProtocolError
            Sizes that do not match the layout, or votes without the ring sum.
        """
        m = np.asarray(mean, np.float64)
        if m.shape != (layout.dim,):
            raise ProtocolError(explain("unmasked mean", m.shape,
                                        f"must have {layout.dim} elements", "-"))
        values = m[:layout.values]
        votes = None
        problem = ""
        self._forget = False
        if layout.vote_elements:
            if total is None:
                raise ProtocolError(explain("RoundResult.total", None,
                                            "a voting round needs the unmasked ring sum", "-"))
            votes = self._votes(layout, layout.split(total), dim=dim, num_sites=num_sites,
                                ring_bits=ring_bits)
            vote = find_vote_support(self.history.compressor())
            assert vote is not None  # _votes found it
            problem = vote_sum_problem(
                votes, uploaders=num_sites if counted is None else counted,
                units=vote.vote_units(int(dim)), mode=vote.mode, exact=vote.block > 1)
            if problem:
                votes, self._forget = None, True
        if layout.sketch_shape is not None:
            delta = self.sketch_delta(values, dim)
        else:
            support = self.history.support() if self.history.spec.public_support else None
            delta = densify(values, support, int(dim))
        self._pending = (self.history.round, votes) if votes is not None else None
        return Decoded(values=values, delta=delta, votes=votes, metrics=layout.metrics(m),
                       vote_problem=problem)

    def _votes(self, layout: MaskedLayout, packed: NDArray[np.uint32], *, dim: int,
               num_sites: int, ring_bits: int) -> NDArray[np.int64]:
        vote = find_vote_support(self.history.compressor())
        if vote is None:
            raise ProtocolError(explain("compression.up", self.history.spec.up,
                                        "has no vote stage", "use a 'vote:...' spec"))
        vs = vote.sketch_for(int(dim))
        flat = unpack_counters(packed, layout.vote_counters, layout.vote_bits, int(ring_bits))
        return flat.reshape(vs.rows, vs.cols)

    def accept(self) -> None:
        """The round was applied: commit FetchSGD's step, record this round's votes."""
        if self.fetchsgd is not None and self._snapshot is not None:
            self.fetchsgd.commit()
        self._snapshot = None
        if self._pending is not None:
            self.history.record_votes(*self._pending)
        elif self._forget:
            self.history.forget_votes()
        self._pending, self._forget = None, False

    def reject(self) -> None:
        """The round was refused: FetchSGD's state as before it, its votes dropped."""
        if self.fetchsgd is not None and self._snapshot is not None:
            self.fetchsgd.load_state_dict(self._snapshot)
        self._snapshot = None
        self._pending, self._forget = None, False

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """FetchSGD's tables (empty before the first sketch round), for checkpoints."""
        if self.fetchsgd is None:
            return {}
        return {"dim": self.fetchsgd.sketch.dim, **self.fetchsgd.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (``{}``: no FetchSGD state yet).

        Raises
        ------
        ConfigError
            A state saved for another sketch (see :meth:`FetchSGDServer.load_state_dict`).
        """
        self._snapshot = self._pending = None
        if not state:
            self.fetchsgd = None
            return
        server = self._server(int(state["dim"]))
        server.load_state_dict({k: v for k, v in state.items() if k != "dim"})
