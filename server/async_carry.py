"""Secure FedBuff: late cohort members carry their update into their next cohort.

A secure cohort closes at its quorum (:mod:`server.async_cohorts`); a member that uploads
later is counted as dropped: its pairwise masks are removed with Shamir shares of its mask
key, its own self mask is never revealed, so its masked upload is useless to the server and
its training would be wasted. With ``asynchronous.carry_late`` (dense secure uploads) the
site keeps the update of its last upload (:mod:`clients.carry`) and the server, when it puts
the site in a later cohort, asks it to upload that update under the new cohort's masks
instead of training afresh (:class:`strategies.wire.CarryRequest`), with

* the **drop proof** of the late upload's mask key (:func:`fedagg.secagg.keys.drop_proof`,
  from :attr:`fedagg.secagg.ServerState.drop_proofs`): the site carries only an update the
  server shows it removed, so no update is in two unmasked sums, and only once;
* a **staleness correction** ``r = w(s_hat + delta) / w(s_hat)``: the cohort's sum is folded
  with the cohort's weight ``w(s)``; the carried update is ``delta`` versions older than the
  cohort (its version minus the late upload's), and ``s_hat = ceil(C / K) - 1`` is the
  staleness a cohort typically has when it closes (docs/protocols/async-secagg.md). At the
  close, a carried update whose staleness ``s + delta`` exceeds ``asynchronous.max_staleness``
  is removed from the cohort like a dropped site.

Sites holding an update are put first into the next cohort (oldest first), so updates are
carried while they are fresh. A carried upload needs no training, so it takes one message
latency. Carried updates are held by the sites and are not part of the server's checkpoint:
after a resume they are not carried.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fedagg.asyncagg import StalenessWeight
from fedagg.config import RunConfig
from fedagg.update import UploadSpec
from strategies.wire import CarryRequest

__all__ = ["Carry", "CarryBook"]


@dataclass(frozen=True)
class Carry:
    """A late upload the server removed from its cohort and may ask its site to carry."""

    node: int
    round: int  # the late job's server-round (what the site holds)
    version: int  # the model version it was trained from
    proof: bytes = field(repr=False)


@dataclass
class CarryBook:
    """Which sites hold a carriable update; the carry requests of a new cohort."""

    enabled: bool
    staleness: StalenessWeight
    expected: int  # s_hat: a cohort's staleness when it closes
    max_staleness: int | None
    pending: dict[int, Carry] = field(default_factory=dict)  # removed, reply not back yet
    ready: dict[int, Carry] = field(default_factory=dict)  # the late reply came back

    @classmethod
    def from_config(cls, cfg: RunConfig, *, concurrency: int, secure: bool,
                    staleness: StalenessWeight) -> CarryBook:
        """The book of a run (``enabled`` only for secure FedBuff with dense uploads), with
        the run's own staleness weight."""
        a, c = cfg.asynchronous, cfg.compression
        dense = secure and UploadSpec.parse(c.up, support=c.support, secure=True).dense
        return cls(enabled=bool(a.carry_late and dense and a.mode == "fedbuff"),
                   staleness=staleness,
                   expected=max(math.ceil(concurrency / max(a.buffer_size, 1)) - 1, 0),
                   max_staleness=a.max_staleness)

    def removed(self, late: Iterable[int], proofs: dict[int, bytes], *, server_round: int,
                version: int) -> None:
        """A cohort closed without ``late`` (node -> drop proof in ``proofs`` when rebuilt)."""
        if not self.enabled:
            return
        for node in late:
            proof = proofs.get(node)
            if proof is not None:
                self.pending[node] = Carry(node, server_round, version, proof)

    def replied(self, node: int, ok: bool) -> bool:
        """The late upload of ``node`` came back: carriable from now on (True) or not."""
        carry = self.pending.pop(node, None)
        if carry is None or not ok:
            return False
        self.ready[node] = carry
        return True

    def _fits(self, carry: Carry, version: int) -> bool:
        limit = self.max_staleness
        return limit is None or self.expected + version - carry.version <= limit

    def first(self, free: Sequence[int], k: int, version: int) -> list[int]:
        """Up to ``k`` free sites holding an update that may still be carried, oldest first
        (holders of one too stale are forgotten: they train afresh)."""
        for node in [n for n in free if n in self.ready]:
            if not self._fits(self.ready[node], version):
                del self.ready[node]
        holders = sorted((c.version, c.node) for n, c in self.ready.items() if n in free)
        return [node for _, node in holders[:k]]

    def requests(self, nodes: Iterable[int], version: int
                 ) -> dict[int, tuple[CarryRequest, Carry | None]]:
        """The carry record of each member of a cohort at ``version``: carry a held update
        (with its scale) or hold this one. The carried sites leave the book."""
        out: dict[int, tuple[CarryRequest, Carry | None]] = {}
        for node in nodes:
            self.pending.pop(node, None)
            carry = self.ready.pop(node, None)
            if carry is None or not self._fits(carry, version):
                out[node] = (CarryRequest(), None)
                continue
            s = self.expected
            scale = self.staleness(s + version - carry.version) / self.staleness(s)
            out[node] = (CarryRequest(carry.round, carry.proof, min(scale, 1.0)), carry)
        return out

    def too_stale(self, carried: dict[int, tuple[Carry, int]], staleness: int
                  ) -> dict[int, str]:
        """Carried members (node -> (carry, versions older than the cohort)) of a cohort
        closing ``staleness`` versions old, whose own staleness is past ``max_staleness``:
        node -> why (the caller removes them from the cohort as dropped)."""
        limit = self.max_staleness
        out: dict[int, str] = {}
        for node, (carry, older) in carried.items():
            own = staleness + older
            if limit is not None and own > limit:
                out[node] = (f"node {node}: its carried update of round {carry.round} (version "
                             f"{carry.version}) would be {own} versions stale, past "
                             f"asynchronous.max_staleness = {limit}: removed from the cohort "
                             "as dropped (its masks removed with Shamir shares)")
        return out
