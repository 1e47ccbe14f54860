"""The public round history that shared supports come from, kept alike by server and sites.

A shared support of round ``t`` is a function of public data only: the run seed, ``t`` and,
for ``topk-aggregate``, the previous public aggregate ``g_t - g_{t-1}`` (the model sent in
round ``t`` minus the one sent in the last round before it). The server keeps one
:class:`SupportHistory` per strategy; a site rebuilds the same object from the model it
received and the previous one (kept in its state, or sent by the server when the site missed
that round). Both then call :meth:`SupportHistory.compressor` / :meth:`SupportHistory.support`
and get bit-identical results.

Secure index voting (``vote``) adds one more piece of public history: the summed vote table
of the last round that completed (:attr:`SupportHistory.votes`, what the server unmasked;
it sends it down with the next round's instruction). The voted support of round ``t`` is a
function of that sum, so both sides again derive the same support.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.compression import Compressor, find_shared_support, find_vote_support
from fedagg.errors import ProtocolError, explain
from fedagg.update.spec import UploadSpec

__all__ = ["SupportHistory", "flat_difference"]


def flat_difference(a: Sequence[NDArray[Any]], b: Sequence[NDArray[Any]]) -> NDArray[np.float32]:
    """``concat(a) - concat(b)`` in float32 (the public aggregate of one round)."""
    out: NDArray[np.float32] = (np.concatenate([np.asarray(x, np.float32).ravel() for x in a])
                                - np.concatenate([np.asarray(x, np.float32).ravel() for x in b]))
    return out


class SupportHistory:
    """The models sent in the current and the previous round, and the supports they imply.

    Parameters
    ----------
    spec : UploadSpec
        The run's upload spec.
    run_seed : int
        ``run.seed`` (the public seed of supports is derived from it).

    Attributes
    ----------
    round, previous_round : int
        The current round and the last round before it that sent a model (``-1``: none).
    sent, previous : list of ndarray or None
        The global model as the sites decode it, in those rounds.
    votes : tuple of (int, ndarray) or None
        ``(round the votes were cast in, summed vote table)`` of the last completed round
        (``vote`` specs only; ``None``: no vote yet, the support is the seeded random one).
    """

    def __init__(self, spec: UploadSpec, run_seed: int) -> None:
        self.spec = spec
        self.run_seed = int(run_seed)
        self.round = -1
        self.sent: list[NDArray[np.float32]] | None = None
        self.previous_round = -1
        self.previous: list[NDArray[np.float32]] | None = None
        self._holders: set[int] = set()
        self.fresh: set[int] = set()
        self.votes: tuple[int, NDArray[np.int64]] | None = None
        self._support: tuple[int, NDArray[np.int64] | None] | None = None

    @classmethod
    def at_site(cls, spec: UploadSpec, run_seed: int, server_round: int,
                sent: Sequence[NDArray[Any]], previous_round: int = -1,
                previous: Sequence[NDArray[Any]] | None = None,
                votes: tuple[int, NDArray[Any]] | None = None) -> SupportHistory:
        """The history as a site sees it in ``server_round`` (``votes``: as the server sent
        them, see :attr:`votes`)."""
        h = cls(spec, run_seed)
        if previous is not None and previous_round >= 0:
            h.previous_round = int(previous_round)
            h.previous = [np.asarray(p, np.float32) for p in previous]
        h.round, h.sent = int(server_round), [np.asarray(s, np.float32) for s in sent]
        if votes is not None:
            h.record_votes(*votes)
        return h

    def record_votes(self, cast_round: int, vote_sum: NDArray[Any]) -> None:
        """The summed vote table cast in ``cast_round`` (server: unmasked; site: as sent).

        Raises
        ------
        ProtocolError
            Not a 2-D table of non-negative integer counts, or cast in a later round than
            the current one.
        """
        table = np.asarray(vote_sum)
        if (table.ndim != 2 or not np.issubdtype(table.dtype, np.integer)
                or (table.size and int(table.min()) < 0)):
            raise ProtocolError(explain("vote sum", f"{table.dtype}{table.shape}",
                                        "must be a 2-D table of counts >= 0",
                                        "send the unmasked vote table of the previous round"))
        if self.sent is not None and int(cast_round) > self.round:
            raise ProtocolError(explain("vote sum round", int(cast_round),
                                        f"must not be after the current round {self.round}",
                                        "send the votes of a completed round"))
        self.votes = (int(cast_round), table.astype(np.int64))
        self._support = None

    def forget_votes(self) -> None:
        """Server: the last vote sum was refused; the next round's support is the seeded
        random one again (as in the first round), until a vote sum is recorded."""
        self.votes = None

    def advance(self, server_round: int, sent: Sequence[NDArray[Any]]) -> None:
        """Server: ``sent`` is the model (as decoded) of ``server_round``.

        A new round moves the current model to :attr:`previous`; the sites that replied in
        the round that ends become :attr:`fresh` (they hold its model and need not be sent it).
        """
        if self.sent is not None and server_round != self.round:
            self.previous_round, self.previous = self.round, self.sent
            self.fresh, self._holders = self._holders, set()
        self.round, self.sent = int(server_round), [np.asarray(s, np.float32) for s in sent]
        self._support = None

    def replied(self, nodes: Iterable[int]) -> None:
        """Server: these nodes ran the pipeline in the current round (they keep its model)."""
        self._holders.update(int(n) for n in nodes)

    @property
    def previous_aggregate(self) -> NDArray[np.float32] | None:
        """``g_t - g_{t-1}`` when the spec needs it and both are known, else ``None``."""
        if not self.spec.needs_previous or self.previous is None or self.sent is None:
            return None
        return flat_difference(self.sent, self.previous)

    def compressor(self) -> Compressor:
        """A new compressor of the current round (stateful: one per site and round).

        A ``vote`` stage gets :attr:`votes` (:meth:`VoteSupport.use_votes`), so its support is
        the voted one; without votes it is the round's seeded random support.
        """
        comp = self.spec.compressor(run_seed=self.run_seed, server_round=self.round,
                                    previous_aggregate=self.previous_aggregate)
        if self.votes is not None:
            stage = find_vote_support(comp)
            if stage is not None:
                stage.use_votes(self.votes[1], round=self.votes[0])
        return comp

    def support(self) -> NDArray[np.int64] | None:
        """The public flat support of the current round (``None``: dense or own indices).

        Computed once per round (the server asks for it for every reply).
        """
        if self.sent is None or not self.spec.public_support:
            return None
        if self._support is None or self._support[0] != self.round:
            stage = find_shared_support(self.compressor())
            numel = sum(int(s.size) for s in self.sent)
            self._support = (self.round, None if stage is None else stage.support_for(numel))
        return self._support[1]

    def state_dict(self) -> dict[str, Any]:
        """Rounds, the two models and the fresh nodes (plain data, for checkpoints)."""
        return {"round": self.round, "previous_round": self.previous_round,
                "sent": None if self.sent is None else [s.copy() for s in self.sent],
                "previous": None if self.previous is None else [p.copy() for p in self.previous],
                "holders": sorted(self._holders), "fresh": sorted(self.fresh),
                "votes": None if self.votes is None else (self.votes[0], self.votes[1].copy())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.round, self.previous_round = int(state["round"]), int(state["previous_round"])
        self.sent = None if state["sent"] is None else [np.asarray(s, np.float32)
                                                        for s in state["sent"]]
        self.previous = None if state["previous"] is None else [np.asarray(p, np.float32)
                                                                for p in state["previous"]]
        self._holders, self.fresh = set(state["holders"]), set(state["fresh"])
        votes = state.get("votes")
        self.votes = None if votes is None else (int(votes[0]), np.asarray(votes[1], np.int64))
        self._support = None
