"""The server side of secure aggregation as a state machine over plain messages.

Stages::

    IDLE/READY --begin_setup--> ADVERTISING --close_advertise--> SHARING --close_share_keys--> READY
    READY --begin_round--> COLLECTING --close_uploads--> UNMASKING --finish_round--> READY

``receive_*`` methods accept one message each and validate it (stage, epoch, round, sender,
sizes, public keys) *before* changing any state; late, duplicate, foreign or malformed
messages raise :class:`~fedagg.errors.ProtocolError`, so the caller drops that one message and
its sender and goes on (a bad message never aborts the round). A round that cannot complete
raises :class:`~fedagg.errors.AbortRound` and returns the server to READY with nothing
aggregated; the next round can start at once with the sites in
:attr:`ServerState.usable_sites`. Sites that dropped before uploading must re-key (a new
epoch via :meth:`ServerState.begin_setup`) before they take part again.

The checks of each reply are in :mod:`fedagg.secagg.server_checks`; the running sum of the
uploads and :class:`RoundResult` in :mod:`fedagg.secagg.server_sum`.

Reconstruction tolerates lying share holders: every rebuilt secret is checked against the
owner's announced public key or seed commitment, and wrong shares are decoded around
(:func:`fedagg.secagg.shamir.reconstruct_verified`).

Protocol: Bonawitz et al., CCS 2017, section 4; neighbour graph of Bell et al., CCS 2020.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import numpy as np

from fedagg.errors import AbortRound, ConfigError, ProtocolError, VerificationError, explain
from fedagg.secagg import fixed_point, shamir
from fedagg.secagg.graph import graph_seed, harary_graph
from fedagg.secagg.keys import (
    NO_BINDING,
    SecretKey,
    commit_seed,
    drop_proof,
    pairwise_mask_key,
    self_mask_key,
)
from fedagg.secagg.masking import add_masks, canary_slots, pairwise_sign
from fedagg.secagg.messages import (
    KeyAdvertise,
    KeyAdvertiseRequest,
    MaskedUpload,
    RoundRequest,
    ShareKeys,
    ShareKeysRequest,
    UnmaskRequest,
    UnmaskResponse,
)
from fedagg.secagg.params import SecAggParams
from fedagg.secagg.server_books import Ids, MaskKey, RoundBook, SetupBook
from fedagg.secagg.server_checks import (
    check_advertise,
    check_share_keys,
    check_unmask,
    check_upload,
    require_stage,
)
from fedagg.secagg.server_sum import RoundResult, UploadSum
from fedagg.secagg.stages import ServerStage
from fedagg.secagg.threads import resolve_threads

__all__ = ["ServerState"]

logger = logging.getLogger(__name__)
class ServerState:
    """Secure-aggregation state of the server (one per run).

    Parameters
    ----------
    params : SecAggParams
        Public parameters (the sites hold equal ones).
    run_id : bytes
        Identifier of the run, bound into every derived key (e.g. 16 random bytes).
    threads : int, optional
        Worker threads for unpacking / adding uploads and expanding the self masks
        (``None`` / ``0``: automatic, one per CPU up to 4; ``1``: none). Results do not
        depend on it (:mod:`fedagg.secagg.threads`).
    """

    def __init__(
        self, params: SecAggParams, *, run_id: bytes, threads: int | None = None
    ) -> None:
        if not isinstance(run_id, bytes) or not 1 <= len(run_id) <= 256:
            raise ConfigError(explain("run_id", run_id, "must be 1..256 bytes", "use 16 bytes"))
        self.params = params
        self.run_id = run_id
        self.threads = resolve_threads(threads)
        self.stage = ServerStage.IDLE
        self.epoch = 0
        self.last_round = 0
        self._blamed: set[int] = set()
        self._drop_proofs: dict[int, bytes] = {}
        self._new_epoch(())

    def __repr__(self) -> str:
        return (
            f"ServerState(stage={self.stage.name}, epoch={self.epoch}, "
            f"round={self.last_round}, usable={len(self.usable_sites)})"
        )

    def _new_epoch(self, invited: Ids) -> None:
        self.setup = SetupBook(invited=invited)
        """The epoch's key setup (:class:`~fedagg.secagg.server_books.SetupBook`)."""
        self.open = RoundBook()
        """The current round (:class:`~fedagg.secagg.server_books.RoundBook`)."""

    @property
    def roster(self) -> Ids:
        """The epoch's sites that advertised keys (empty before ``close_advertise``)."""
        return self.setup.roster

    @property
    def graph(self) -> dict[int, Ids]:
        """The epoch's neighbour graph (site -> sorted neighbours; empty before setup)."""
        return dict(self.setup.graph)

    @property
    def blamed_sites(self) -> Ids:
        """Sites that made a round of this run abort through their own relayed shares.

        A counted site whose self-mask seed (or a dropped site whose mask key) could not be
        rebuilt because recipients refused its share ciphertexts is named in the AbortRound
        and kept here; it is also marked as needing a re-key. The protocol cannot tell such a
        site from one framed by more than ``k - t`` lying neighbours, so leaving it out of
        later rounds is the caller's policy.
        """
        return tuple(sorted(self._blamed))

    @property
    def usable_sites(self) -> Ids:
        """Sites that may take part in the next round without re-keying."""
        return tuple(sorted(self.setup.ready - self.setup.stale))

    @property
    def drop_proofs(self) -> dict[int, bytes]:
        """``site -> drop_proof`` of the dropped sites whose mask keys the last completed round
        rebuilt (:func:`~fedagg.secagg.keys.drop_proof`): the server's evidence, to the site,
        that the site's upload of that round was not counted."""
        return dict(self._drop_proofs)

    def needs_rekey(self, sites: Sequence[int]) -> bool:
        """Whether taking ``sites`` into a round needs a new epoch first."""
        return not set(sites) <= set(self.usable_sites)

    def _require(self, stage: ServerStage, what: str) -> None:
        require_stage(self.stage, stage, what)

    # -- setup -----------------------------------------------------------------------------
    def begin_setup(self, sites: Iterable[int]) -> KeyAdvertiseRequest:
        """Start a new membership epoch with ``sites`` (broadcast the returned request)."""
        if self.stage in (ServerStage.COLLECTING, ServerStage.UNMASKING):
            raise ProtocolError(explain("begin_setup", self.stage.name, "round open", "finish"))
        given = [int(s) for s in sites]
        invited = tuple(sorted(set(given)))
        if len(invited) < 2 or len(invited) != len(given) or invited[0] < 0:
            raise ConfigError(explain("sites", given, "need >= 2 distinct ids >= 0", "-"))
        if invited[-1] >= shamir.PRIME - 1:
            raise ConfigError(
                explain("sites", invited[-1], "ids must be < 2^31 - 2", "map node ids to indices")
            )
        self.epoch += 1
        self._new_epoch(invited)
        self.stage = ServerStage.ADVERTISING
        logger.debug("server: epoch %d setup with %d sites", self.epoch, len(invited))
        return KeyAdvertiseRequest(
            run_id=self.run_id, epoch=self.epoch, roster=invited, params_digest=self.params.digest()
        )

    def receive_advertise(self, msg: KeyAdvertise, *, sender: int | None = None) -> None:
        """Accept one site's public keys.

        Every ``receive_*`` method takes an optional ``sender``: the site index the transport
        authenticated for this reply (e.g. from the Flower node id). When given, a message
        whose ``site`` differs is refused, so one site cannot answer in another's name.
        """
        c_public, s_public = check_advertise(self.stage, self.epoch, self.setup, msg, sender)
        self.setup.c_public[msg.site] = c_public
        self.setup.s_public[msg.site] = s_public

    def close_advertise(self) -> dict[int, ShareKeysRequest]:
        """Fix the epoch roster and graph; one ShareKeysRequest per advertised site.

        The graph seed mixes a hash of every advertised public key into the run id and epoch
        (:func:`fedagg.secagg.graph.graph_seed`), and each request carries all those keys so
        that every site can recompute the graph it is told.
        """
        self._require(ServerStage.ADVERTISING, "close_advertise")
        roster = tuple(sorted(self.setup.c_public))
        try:
            k = self.params.neighbours_for(len(roster))
        except ConfigError as err:
            self.stage = ServerStage.IDLE
            raise AbortRound(f"setup failed: {err}") from err
        self.setup.roster = roster
        announced = b"".join(self.setup.c_public[i] + self.setup.s_public[i] for i in roster)
        seed = graph_seed(self.run_id, self.epoch, roster, keys=announced)
        self.setup.graph = harary_graph(roster, k, seed)
        self.setup.keys = {i: MaskKey(0, self.setup.s_public[i], {}) for i in roster}
        self.stage = ServerStage.SHARING
        return {
            i: ShareKeysRequest(
                epoch=self.epoch,
                roster=roster,
                neighbours=self.setup.graph[i],
                neighbour_c_public=b"".join(self.setup.c_public[j] for j in self.setup.graph[i]),
                roster_public=announced,
            )
            for i in roster
        }

    def receive_share_keys(self, msg: ShareKeys, *, sender: int | None = None) -> None:
        """Accept one site's encrypted key shares (``sender``: see :meth:`receive_advertise`)."""
        cts = check_share_keys(self.stage, self.epoch, self.setup, msg, sender)
        self.setup.keys[msg.site].ciphertexts = dict(zip(msg.recipients, cts, strict=True))
        self.setup.ready.add(msg.site)

    def close_share_keys(self) -> Ids:
        """Finish setup; returns the sites that completed it (the usable roster)."""
        self._require(ServerStage.SHARING, "close_share_keys")
        if len(self.setup.ready) < 2:
            self.stage = ServerStage.IDLE
            raise AbortRound(f"setup failed: only {len(self.setup.ready)} site(s) shared keys")
        self.stage = ServerStage.READY
        logger.debug("server: epoch %d ready with %d sites", self.epoch, len(self.setup.ready))
        return self.usable_sites

    # -- round -----------------------------------------------------------------------------
    def begin_round(
        self, round_number: int, participants: Sequence[int], dim: int, *,
        binding: bytes = NO_BINDING,
    ) -> dict[int, RoundRequest]:
        """Open round ``round_number`` (strictly increasing) for ``participants``.

        ``binding``: the round binding of the model every participant is sent
        (:func:`~fedagg.secagg.keys.round_binding`); the masks are derived from it, so sites
        sent another model cannot complete the round. Returns one RoundRequest per
        participant. Raises AbortRound when some participant has
        fewer than ``threshold`` neighbours among the participants (nothing is revealed).
        """
        self._require(ServerStage.READY, "begin_round")
        self._drop_proofs = {}  # of the last completed round only
        if round_number <= self.last_round:
            raise ProtocolError(
                explain(
                    "round",
                    round_number,
                    f"must be > {self.last_round}; reusing a number would reuse masks",
                    "use a monotonically increasing secagg round counter",
                )
            )
        part = tuple(sorted(set(int(p) for p in participants)))
        if len(part) != len(participants) or not set(part) <= set(self.usable_sites):
            raise ProtocolError(
                explain(
                    "participants",
                    sorted(set(participants) - set(self.usable_sites)),
                    "not usable in this epoch (unknown, or dropped and not re-keyed)",
                    "call begin_setup to re-key before they rejoin",
                )
            )
        if dim < 1:
            raise ProtocolError(explain("dim", dim, "must be >= 1", "-"))
        if not isinstance(binding, bytes) or len(binding) != 32:
            raise ProtocolError(explain("binding", binding, "must be 32 bytes", "round_binding"))
        frac_bits, ring_bits = self.params.encoding_for(len(part))
        self.last_round = round_number
        pset = set(part)
        nbrs = {i: tuple(j for j in self.setup.graph[i] if j in pset) for i in part}
        short = [i for i in part if len(nbrs[i]) < self.params.threshold]
        if short:
            raise AbortRound(
                explain(
                    "participants",
                    short,
                    f"have fewer than threshold={self.params.threshold} participating neighbours",
                    "sample more sites or lower the threshold",
                )
            )
        self.open = RoundBook(round=round_number, participants=part, dim=dim,
                              frac_bits=frac_bits, ring_bits=ring_bits, binding=binding,
                              nbrs=nbrs)
        self.open.used = {i: (self.setup.keys[i].gen, self.setup.keys[i].public) for i in part}
        self.stage = ServerStage.COLLECTING
        return {
            i: RoundRequest(
                epoch=self.epoch,
                round=round_number,
                participants=part,
                dim=dim,
                gen=self.open.used[i][0],
                neighbours=nbrs[i],
                neighbour_gens=tuple(self.open.used[j][0] for j in nbrs[i]),
                neighbour_s_public=b"".join(self.open.used[j][1] for j in nbrs[i]),
                binding=binding,
            )
            for i in part
        }

    def receive_upload(self, msg: MaskedUpload, *, sender: int | None = None) -> None:
        """Accept one masked upload (late or duplicate uploads are refused; ``sender``: see
        :meth:`receive_advertise`)."""
        public, b_cts, next_cts = check_upload(self.stage, self.epoch, self.setup, self.open,
                                               msg, sender)
        i = msg.site
        if self.open.total is None:
            self.open.total = UploadSum(self.open.dim + 1 + canary_slots(self.open.ring_bits),
                                        self.open.ring_bits, self.threads)
        self.open.total.add(msg.masked)
        self.open.uploads.add(i)
        self.open.commitments[i] = msg.b_commitment
        self.open.b_cts.update({(i, j): ct for j, ct in zip(self.open.nbrs[i], b_cts, strict=True)})
        self.setup.keys[i] = MaskKey(
            msg.next_gen, public, dict(zip(self.setup.graph[i], next_cts, strict=True))
        )

    def _recoverable(self, alive: set[int], dropped: set[int]) -> list[str]:
        t = self.params.threshold
        problems = [
            f"site {i}: self mask has {n} live holders"
            for i in sorted(self.open.uploads)
            if (n := len(set(self.open.nbrs[i]) & alive)) < t
        ]
        problems += [
            f"site {j}: mask key has {n} live holders"
            for j in sorted(dropped)
            if 0 < (n := len(set(self.open.nbrs[j]) & alive)) < t
        ]
        return problems

    def close_uploads(self) -> dict[int, UnmaskRequest]:
        """End collection; one UnmaskRequest per site that uploaded.

        Raises AbortRound (before any share is revealed) when some needed secret has fewer
        than ``threshold`` holders among the uploaders.
        """
        self._require(ServerStage.COLLECTING, "close_uploads")
        counted = set(self.open.uploads)
        dropped = set(self.open.participants) - counted
        self.setup.stale |= dropped
        problems = self._recoverable(counted, dropped)
        if not counted:
            problems.append("no site uploaded")
        if problems:
            self.stage = ServerStage.READY
            raise AbortRound(f"round {self.open.round} aborted: " + "; ".join(problems))
        self.open.dropped = dropped
        requests = {}
        for i in sorted(counted):
            b_from = tuple(j for j in self.open.nbrs[i] if j in counted)
            s_from = tuple(j for j in self.open.nbrs[i] if j in dropped)
            requests[i] = UnmaskRequest(
                epoch=self.epoch,
                round=self.open.round,
                b_senders=b_from,
                b_ciphertexts=b"".join(self.open.b_cts[(j, i)] for j in b_from),
                s_senders=s_from,
                s_gens=tuple(self.open.used[j][0] for j in s_from),
                s_ciphertexts=b"".join(self.setup.keys[j].ciphertexts[i] for j in s_from),
            )
        self.open.requests = requests
        self.stage = ServerStage.UNMASKING
        logger.debug(
            "server: round %d: %d uploads, %d dropped", self.open.round, len(counted), len(dropped)
        )
        return requests

    def receive_unmask(self, msg: UnmaskResponse, *, sender: int | None = None) -> None:
        """Accept one site's revealed shares (``sender``: see :meth:`receive_advertise`).

        The owners must be the requested senders in order; some may be left out (the site
        could not decrypt their ciphertexts).
        """
        req = check_unmask(self.stage, self.epoch, self.open, msg, sender)
        left_out = set(req.b_senders) - set(msg.b_owners)
        left_out |= set(req.s_senders) - set(msg.s_owners)
        for j in left_out:
            self.open.refused[j] = self.open.refused.get(j, 0) + 1
        self.open.responses[msg.site] = msg

    def _abort_for(self, owners: Sequence[int]) -> None:
        """Blame the owners whose shares recipients refused, and make them re-key."""
        blamed = {j for j in owners if self.open.refused.get(j, 0)}
        if blamed:
            logger.warning(
                "server: round %d: shares of sites %s refused by their recipients",
                self.open.round,
                sorted(blamed),
            )
        self._blamed |= blamed
        self.setup.stale |= blamed
        if self.open.total is not None:
            self.open.total.cancel()
            self.open.total = None

    def abort_round(self) -> None:
        """Abandon the open round (e.g. on a timeout at the edge); nothing is aggregated."""
        if self.stage == ServerStage.COLLECTING:
            self.setup.stale |= set(self.open.participants) - set(self.open.uploads)
        elif self.stage != ServerStage.UNMASKING:
            raise ProtocolError(explain("abort_round", self.stage.name, "no open round", "-"))
        self.stage = ServerStage.READY
        if self.open.total is not None:
            self.open.total.cancel()
            self.open.total = None

    def finish_round(self) -> RoundResult:
        """Reconstruct the needed secrets, unmask the sum and decode the weighted mean.

        Each secret needs ``threshold`` shares; wrong shares among them are decoded around
        and every rebuilt secret is checked (seed against its commitment, mask key against the
        announced public key), so one bad share never aborts a round with ``t`` good ones.

        Raises
        ------
        AbortRound
            Fewer than ``threshold`` shares arrived for a needed secret (owners whose
            ciphertexts were refused by recipients are added to :attr:`blamed_sites`).
        VerificationError
            No candidate secret verified (opaque; the owner is added to
            :attr:`blamed_sites`).
        """
        self._require(ServerStage.UNMASKING, "finish_round")
        self.stage = ServerStage.READY  # whatever happens below, the round is over
        t = self.params.threshold
        b_shares: dict[int, list[shamir.Share]] = {}
        s_shares: dict[int, list[shamir.Share]] = {}
        for r, msg in self.open.responses.items():  # rows were checked (< p) when the reply came
            for owner, row in zip(msg.b_owners, msg.b_shares, strict=True):
                b_shares.setdefault(owner, []).append(shamir.Share(r + 1, row))
            for owner, row in zip(msg.s_owners, msg.s_shares, strict=True):
                s_shares.setdefault(owner, []).append(shamir.Share(r + 1, row))
        self._drop_proofs = {}
        counted = tuple(sorted(self.open.uploads))
        need_s = [j for j in sorted(self.open.dropped) if set(self.open.nbrs[j]) & set(counted)]
        short = [i for i in counted if len(b_shares.get(i, ())) < t]
        short += [j for j in need_s if len(s_shares.get(j, ())) < t]
        if short:
            self._abort_for(short)
            raise AbortRound(
                f"round {self.open.round} aborted: fewer than threshold={t} shares for sites {short}"
            )
        run_id, epoch, rnd = self.run_id, self.epoch, self.open.round
        seeds: dict[int, bytes] = {}
        secrets: dict[int, SecretKey] = {}
        owner = -1
        try:
            for owner in counted:

                def opens(seed: bytes, i: int = owner) -> bool:
                    commitment = commit_seed(
                        seed, run_id=run_id, epoch=epoch, round_number=rnd, site=i
                    )
                    return commitment == self.open.commitments[i]

                seeds[owner] = shamir.reconstruct_verified(b_shares[owner], t, opens)
            for owner in need_s:

                def matches(raw: bytes, j: int = owner) -> bool:
                    return SecretKey(raw).public_bytes() == self.open.used[j][1]

                raw = shamir.reconstruct_verified(s_shares[owner], t, matches)
                secrets[owner] = SecretKey(raw)
                self._drop_proofs[owner] = drop_proof(raw, run_id=run_id, epoch=epoch,
                                                      site=owner, gen=self.open.used[owner][0])
        except VerificationError:
            # no candidate opened the commitment / matched the public key: the owner shared
            # inconsistent shares, or more holders lied than decoding can get around
            self.open.refused[owner] = self.open.refused.get(owner, 0) + 1
            self._abort_for([owner])
            raise
        acc = self.open.total
        assert acc is not None  # close_uploads refuses a round without uploads
        self.open.total = None
        total = acc.result()
        self_keys = [
            (-1, self_mask_key(seeds[i], run_id=run_id, epoch=epoch, round_number=rnd, site=i))
            for i in counted
        ]
        add_masks(total, self_keys, threads=self.threads)
        for j in need_s:
            secret = secrets[j]
            pair_keys = [
                (
                    -pairwise_sign(i, j),
                    pairwise_mask_key(
                        secret.exchange(self.open.used[i][1]),
                        run_id=run_id,
                        epoch=epoch,
                        round_number=rnd,
                        a=i,
                        b=j,
                        binding=self.open.binding,
                    ),
                )
                for i in self.open.nbrs[j]
                if i in self.open.uploads
            ]
            add_masks(total, pair_keys, threads=self.threads)
        canary = total[self.open.dim + 1:] & np.uint32((1 << self.open.ring_bits) - 1)
        if canary.any():
            # masks that did not cancel: members derived them from different models (or a
            # site sent a malformed upload); nothing of the sum is usable
            raise AbortRound(explain(
                f"round {self.open.round}", "canary not zero", "the pairwise masks did not "
                "cancel: members held different models (or an upload was malformed)",
                "send every participant the same model; the round is refused"))
        total = total[:self.open.dim + 1]
        weighted_sum, weight = fixed_point.decode_sum(total, self.open.frac_bits, self.open.ring_bits)
        bound = fixed_point.error_bound(len(counted), weight, self.params.clip, self.open.frac_bits)
        logger.debug("server: round %d unmasked (%d counted)", self.open.round, len(counted))
        return RoundResult(
            epoch=self.epoch,
            round=self.open.round,
            mean=np.divide(weighted_sum, weight, out=weighted_sum),  # a fresh array: in place
            total_weight=weight * self.params.weight_scale,
            counted=counted,
            dropped=tuple(sorted(self.open.dropped)),
            frac_bits=self.open.frac_bits,
            error_bound=bound,
            ring_bits=self.open.ring_bits,
            total=total,
        )
