"""Server side of the sketch and vote modes: one round's sum back to the delta to apply.

:class:`RoundDecoder` turns the (unmasked, or plaintext) aggregate of a round into the flat
dense delta handed to the inner strategy, and keeps the state these modes need across rounds:

* ``sketch`` — FetchSGD (Rothchild et al. 2020, Algorithm 1): the weighted-mean sketch table
  goes through :class:`fedagg.compression.FetchSGDServer` (momentum and error in sketch
  space); the delta is the top-k of the accumulated error, zero elsewhere;
* ``vote`` — the summed vote table (read from the packed part of the unmasked ring sum)
  becomes :attr:`SupportHistory.votes`, so the next round's support is derived from it on
  both sides; the values are placed on this round's support;
* dense and public supports — the mean as is, or placed on the public support.

A round is two-phase: :meth:`RoundDecoder.decode` computes the delta (FetchSGD's step is
proposed, not committed); the caller checks it and then calls :meth:`RoundDecoder.accept`
(commit the step, record the votes) or :meth:`RoundDecoder.reject` (the round leaves no trace:
the sketch state is restored, the votes are dropped). Flower-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.compression import FetchSGDServer, find_sketch, find_vote_support
from fedagg.compression.ring import unpack_counters
from fedagg.errors import ProtocolError, explain
from fedagg.update.decode import densify
from fedagg.update.history import SupportHistory
from fedagg.update.masked import MaskedLayout

__all__ = ["Decoded", "RoundDecoder"]


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
    """

    values: NDArray[np.float64]
    delta: NDArray[np.float64]
    votes: NDArray[np.int64] | None = None
    metrics: dict[str, float] = field(default_factory=dict)


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
               dim: int, num_sites: int, ring_bits: int) -> Decoded:
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
        if layout.vote_elements:
            if total is None:
                raise ProtocolError(explain("RoundResult.total", None,
                                            "a voting round needs the unmasked ring sum", "-"))
            votes = self._votes(layout, layout.split(total), dim=dim, num_sites=num_sites,
                                ring_bits=ring_bits)
        if layout.sketch_shape is not None:
            delta = self.sketch_delta(values, dim)
        else:
            support = self.history.support() if self.history.spec.public_support else None
            delta = densify(values, support, int(dim))
        if votes is not None:
            self._pending = (self.history.round, votes)
        return Decoded(values=values, delta=delta, votes=votes, metrics=layout.metrics(m))

    def _votes(self, layout: MaskedLayout, packed: NDArray[np.uint32], *, dim: int,
               num_sites: int, ring_bits: int) -> NDArray[np.int64]:
        vote = find_vote_support(self.history.compressor())
        if vote is None:
            raise ProtocolError(explain("compression.up", self.history.spec.up,
                                        "has no vote stage", "use a 'vote:...' spec"))
        vs = vote.sketch_for(int(dim))
        flat = unpack_counters(packed, layout.vote_counters, layout.vote_bits, int(ring_bits))
        if int(flat.max(initial=0)) > int(num_sites):
            raise ProtocolError(explain("vote sum", int(flat.max()),
                                        f"a summed Bloom counter is at most {num_sites} sites",
                                        "corrupted masks or a hostile site: round refused"))
        return flat.reshape(vs.rows, vs.cols)

    def accept(self) -> None:
        """The round was applied: commit FetchSGD's step, record this round's votes."""
        if self.fetchsgd is not None and self._snapshot is not None:
            self.fetchsgd.commit()
        self._snapshot = None
        if self._pending is not None:
            self.history.record_votes(*self._pending)
        self._pending = None

    def reject(self) -> None:
        """The round was refused: FetchSGD's state as before it, its votes dropped."""
        if self.fetchsgd is not None and self._snapshot is not None:
            self.fetchsgd.load_state_dict(self._snapshot)
        self._snapshot = None
        self._pending = None

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
