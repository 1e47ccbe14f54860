"""The site (client) side of secure aggregation as a serialisable state machine.

Stages and the messages that move between them (see ``docs/protocols/secagg.md``)::

    NEW/any --KeyAdvertiseRequest--> ADVERTISED --ShareKeysRequest--> READY
    READY/UPLOADED/UNMASKED --RoundRequest(+update)--> UPLOADED --UnmaskRequest--> UNMASKED

Every handler checks its preconditions (stage, epoch, strictly increasing round, neighbour
lists recomputed from public data) and raises :class:`~fedagg.errors.ProtocolError` when they
fail, before touching any secret. Mask keys are single use: every upload carries the public
half and encrypted shares of the *next* mask key, and the used secret is dropped, so a key
reconstructed after a dropout exposes one round only (see the threat model in the docs).

Against a server that lies (docs/protocols/secagg.md, section 4), a site also

* enforces its own floor on the parameters (``t > threshold_floor * k``, ``k >= min_neighbours``;
  :func:`~fedagg.secagg.params.check_site_floor`);
* recomputes the neighbour graph from a hash of every advertised key of the epoch, and checks
  that its own keys are among them;
* remembers, per run, the highest key generation of every neighbour it has seen used in a
  round, and refuses a round that announces a neighbour at that generation or an older one
  (a re-announced key would let the server collect shares of a key that already masked an
  upload it has unmasked);
* answers an unmask request even when some relayed ciphertexts do not decrypt: it leaves out
  only those senders' shares.

These checks are in :mod:`fedagg.secagg.client_checks`; what the site remembers between
messages, and its saved form (:meth:`ClientState.state_dict`), is a
:class:`~fedagg.secagg.client_memory.SiteMemory`.

Protocol: Bonawitz et al., CCS 2017 (double masking, section 4) on the neighbour graph of
Bell et al., CCS 2020 (SecAgg+).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.errors import AbortRound, ConfigError, ProtocolError, VerificationError, explain
from fedagg.secagg import fixed_point, packing, shamir
from fedagg.secagg.client_checks import SiteFloor, check_round, check_share_keys, check_unmask
from fedagg.secagg.client_memory import SiteMemory
from fedagg.secagg.keys import (
    RandomBytes,
    SecretKey,
    ShareKind,
    commit_seed,
    decrypt_share,
    drop_proof,
    encrypt_share,
    pairwise_mask_key,
    self_mask_key,
)
from fedagg.secagg.masking import add_masks, canary_slots, pairwise_sign
from fedagg.secagg.messages import (
    KeyAdvertise,
    KeyAdvertiseRequest,
    MaskedUpload,
    MessageDict,
    RoundRequest,
    ShareKeys,
    ShareKeysRequest,
    UnmaskRequest,
    UnmaskResponse,
    split_blob,
)
from fedagg.secagg.params import (
    DEFAULT_MIN_NEIGHBOURS,
    DEFAULT_THRESHOLD_FLOOR,
    SecAggParams,
)
from fedagg.secagg.stages import ClientStage
from fedagg.secagg.threads import resolve_threads

__all__ = ["ClientState"]

logger = logging.getLogger(__name__)


class ClientState:
    """Secure-aggregation state of one site.

    Parameters
    ----------
    site : int
        This site's id (``>= 0``; Shamir evaluation point ``site + 1``).
    params : SecAggParams
        Public parameters; must equal the server's (checked through a digest).
    random_bytes : callable
        ``random_bytes(n)`` -> ``n`` bytes for keys, seeds, Shamir coefficients and nonces
        (``os.urandom`` in deployment; a seeded generator in tests).
    threads : int, optional
        Worker threads for expanding the masks (``None`` / ``0``: automatic, one per CPU up
        to 4; ``1``: none). The upload does not depend on it (:mod:`fedagg.secagg.threads`).
    threshold_floor : float, optional
        The site's own floor for the threshold: it refuses (``ProtocolError``) a setup whose
        ``t <= threshold_floor * k``. The default ``0.5`` means ``t > k / 2``, which keeps a
        server that lies about who dropped from collecting both kinds of share of one site.
        ``0`` accepts any ``t >= 1`` (tests only). The server sends ``params``, so this is
        the site's protection, not a setting to match the server's.
    min_neighbours : int, optional
        The site refuses a neighbour graph of degree ``k < min(min_neighbours, N - 1)``
        (default 3; ``N - 1`` is the complete graph). Raise it for large federations, e.g.
        to ``3 * ceil(log2 N)``, the SecAgg+ default (Bell et al. 2020).

    Raises
    ------
    ProtocolError
        ``site`` is not a small non-negative int.
    ConfigError
        ``threshold_floor`` not in ``[0, 1)`` or ``min_neighbours < 1``.
    """

    def __init__(
        self,
        site: int,
        params: SecAggParams,
        *,
        random_bytes: RandomBytes,
        threads: int | None = None,
        threshold_floor: float = DEFAULT_THRESHOLD_FLOOR,
        min_neighbours: int = DEFAULT_MIN_NEIGHBOURS,
    ) -> None:
        if isinstance(site, bool) or not isinstance(site, (int, np.integer)):
            raise ProtocolError(explain("site", site, "must be an int", "map node ids to indices"))
        if not 0 <= site < shamir.PRIME - 1:
            raise ProtocolError(
                explain("site", site, "must be in [0, 2^31 - 2)", "map node ids to small indices")
            )
        self.site = int(site)
        self.floor = SiteFloor(self.site, threshold_floor, min_neighbours)
        self.params = params
        self._random_bytes = random_bytes
        self.threads = resolve_threads(threads)
        self.memory = SiteMemory(self.site)
        """What the site remembers of the protocol (its keys among it: never sent)."""
        self.last_drop_proof = b""
        """:func:`~fedagg.secagg.keys.drop_proof` of the mask key of this site's last upload
        (what the server can show only if it declared that upload dropped); not saved."""

    def __repr__(self) -> str:
        return (
            f"ClientState(site={self.site}, stage={self.memory.stage.name}, epoch={self.memory.epoch}, "
            f"round={self.memory.round}, gen={self.memory.gen})"
        )

    # -- helpers -------------------------------------------------------------------------
    def _require(self, stages: tuple[ClientStage, ...], epoch: int, what: str) -> None:
        if self.memory.stage not in stages:
            raise ProtocolError(
                explain(what, self.memory.stage.name, f"not allowed in this stage ({what})", "restart")
            )
        if epoch != self.memory.epoch:
            raise ProtocolError(
                explain("epoch", epoch, f"this site is in epoch {self.memory.epoch}", "re-key first")
            )

    def _encrypt_shares(
        self, secret: bytes, recipients: tuple[int, ...], kind: ShareKind, counter: int
    ) -> bytes:
        shares = shamir.split(
            secret, [j + 1 for j in recipients], self.params.threshold, self._random_bytes
        )
        c = self.memory.key("c")
        return b"".join(
            encrypt_share(
                c,
                self.memory.neighbour_c[j],
                share.to_bytes(),
                run_id=self.memory.run_id,
                epoch=self.memory.epoch,
                kind=kind,
                counter=counter,
                src=self.site,
                dst=j,
                random_bytes=self._random_bytes,
            )
            for j, share in zip(recipients, shares, strict=True)
        )

    def _decrypt_share(self, src: int, blob: bytes, kind: ShareKind, counter: int) -> shamir.Share:
        plain = decrypt_share(
            self.memory.key("c"),
            self.memory.neighbour_c[src],
            blob,
            run_id=self.memory.run_id,
            epoch=self.memory.epoch,
            kind=kind,
            counter=counter,
            src=src,
            dst=self.site,
        )
        try:
            share = shamir.Share.from_bytes(plain)
        except ProtocolError:
            raise VerificationError() from None
        if share.x != self.site + 1:
            raise VerificationError()
        return share

    def _open_all(
        self,
        senders: tuple[int, ...],
        blobs: list[bytes],
        kind: ShareKind,
        counter: Callable[[int], int],
    ) -> list[tuple[int, NDArray[np.uint32]]]:
        """Decrypt each relayed share; a ciphertext that fails costs only its sender's share."""
        out = []
        for j, blob in zip(senders, blobs, strict=True):
            try:
                out.append((j, self._decrypt_share(j, blob, kind, counter(j)).y))
            except VerificationError:
                continue
        return out

    # -- setup ---------------------------------------------------------------------------
    def handle_advertise(self, request: KeyAdvertiseRequest) -> KeyAdvertise:
        """Setup exchange 1: make fresh ``c`` and ``s`` key pairs for a new epoch."""
        if request.params_digest != self.params.digest():
            raise ProtocolError(
                explain("secagg params", "digest mismatch", "site and server differ", "align")
            )
        if self.site not in request.roster:
            raise ProtocolError(explain("roster", "site absent", "site not invited", "-"))
        if request.run_id == self.memory.run_id and request.epoch <= self.memory.epoch:
            raise ProtocolError(
                explain("epoch", request.epoch, f"must be > {self.memory.epoch} (replay?)", "new epoch")
            )
        try:
            self.params.neighbours_for(len(request.roster))
        except ConfigError as err:
            raise AbortRound(str(err)) from err
        self.floor.neighbours(self.params, len(request.roster))  # before any key is made
        self.memory.reset(request.run_id, request.epoch)
        self.last_drop_proof = b""
        self.memory.c = SecretKey.generate(self._random_bytes)
        self.memory.s = SecretKey.generate(self._random_bytes)
        self.memory.stage = ClientStage.ADVERTISED
        logger.debug("site %d: advertised keys for epoch %d", self.site, self.memory.epoch)
        return KeyAdvertise(
            site=self.site,
            epoch=self.memory.epoch,
            c_public=self.memory.c.public_bytes(),
            s_public=self.memory.s.public_bytes(),
        )

    def handle_share_keys(self, request: ShareKeysRequest) -> ShareKeys:
        """Setup exchange 2: share the generation-0 mask key among the graph neighbours."""
        self._require((ClientStage.ADVERTISED,), request.epoch, "share keys")
        roster, neighbours, checked = check_share_keys(self.memory, self.params, self.floor, request)
        self.memory.roster = roster
        self.memory.neighbours = neighbours
        self.memory.neighbour_c = checked
        blob = self._encrypt_shares(
            self.memory.key("s").secret_bytes(), self.memory.neighbours, ShareKind.MASK_KEY, 0
        )
        self.memory.gen = 0
        self.memory.stage = ClientStage.READY
        logger.debug("site %d: shared mask key with %d neighbours", self.site, len(neighbours))
        return ShareKeys(
            site=self.site, epoch=self.memory.epoch, gen=0, recipients=self.memory.neighbours, ciphertexts=blob
        )

    # -- round ---------------------------------------------------------------------------
    def handle_round(
        self,
        request: RoundRequest,
        update: NDArray[np.floating[Any]],
        weight: float,
        *,
        rng: np.random.Generator,
        binding: bytes | None = None,
    ) -> MaskedUpload:
        """Round exchange 1: encode, double-mask and upload ``update`` with its ``weight``.

        Parameters
        ----------
        request : RoundRequest
            The server's round instruction.
        update : numpy.ndarray
            The site's update, ``request.dim`` floats (any shape).
        weight : float
            Number of examples (``0 <= weight <= params.weight_scale``).
        rng : numpy.random.Generator
            Randomness of the stochastic rounding.
        binding : bytes, optional
            The round binding of the model this site received
            (:func:`~fedagg.secagg.keys.round_binding`); the request must name the same, and
            the masks are derived from it. ``None``: the request's binding.
        """
        gens, nbrs, pks = self._check_round(request, binding)
        values = np.asarray(update, dtype=np.float64).reshape(-1)
        if values.size != request.dim:
            raise ProtocolError(explain("update size", values.size, f"must be {request.dim}", "-"))
        frac_bits, _ = self.params.encoding_for(len(request.participants))
        weight_q = fixed_point.quantize_weight(float(weight), self.params.weight_scale, frac_bits)
        vector = fixed_point.encode(
            values, weight_q, frac_bits=frac_bits, clip=self.params.clip, rng=rng
        )
        return self._mask_and_upload(request, vector, gens, nbrs, pks)

    def round_encoding(self, request: RoundRequest, weight: float) -> tuple[int, int, int]:
        """``(frac_bits, ring_bits, weight_q)`` of ``request`` for a site of ``weight``.

        What :meth:`handle_round` uses to encode, for callers that encode themselves and
        upload with :meth:`handle_round_encoded` (public: it follows from the parameters and
        the number of participants).

        Raises
        ------
        ConfigError
            ``weight`` is negative, not finite or above ``params.weight_scale``.
        """
        frac_bits, ring_bits = self.params.encoding_for(len(tuple(request.participants)))
        weight_q = fixed_point.quantize_weight(float(weight), self.params.weight_scale, frac_bits)
        return frac_bits, ring_bits, weight_q

    def handle_round_encoded(
        self, request: RoundRequest, vector: NDArray[np.uint32], *, binding: bytes | None = None
    ) -> MaskedUpload:
        """Round exchange 1 for an input the caller has already encoded into the ring.

        The same checks, masks and shares as :meth:`handle_round`, over ``vector`` as given:
        ``request.dim + 1`` ``uint32`` ring elements whose last one is the quantised weight
        ``w_q`` (:meth:`round_encoding`), which the server decodes as the round's weight.
        Only the low ``ring_bits`` bits of each element travel. The caller is responsible for
        the headroom of the sum (e.g. :func:`fedagg.compression.ring.encode_table` clips its
        counters to ``params.clip``; packed vote counters sum within their fields); the server
        learns the modular sum (:attr:`RoundResult.total`) as for any input.

        Used for inputs that are not a float vector to be fixed-point encoded: integer count
        sketch tables (FetchSGD's exact path) and packed vote counters riding with the values
        (secure index voting), see docs/compression.md.

        Raises
        ------
        ProtocolError
            The request fails the checks of :meth:`handle_round`, or ``vector`` is not
            ``request.dim + 1`` ``uint32`` elements.
        """
        gens, nbrs, pks = self._check_round(request, binding)
        vec = np.asarray(vector)
        if vec.dtype != np.uint32 or vec.shape != (request.dim + 1,):
            raise ProtocolError(
                explain(
                    "encoded update",
                    (str(vec.dtype), vec.shape),
                    f"must be request.dim + 1 = {request.dim + 1} uint32 ring elements",
                    "encode [values..., w_q] (round_encoding gives w_q)",
                )
            )
        return self._mask_and_upload(request, vec.copy(), gens, nbrs, pks)

    def _check_round(
        self, request: RoundRequest, binding: bytes | None
    ) -> tuple[dict[int, int], tuple[int, ...], list[bytes]]:
        """Every precondition of a round, before any secret is touched."""
        stages = (ClientStage.READY, ClientStage.UPLOADED, ClientStage.UNMASKED)
        self._require(stages, request.epoch, "round")
        return check_round(self.memory, self.params, request, binding)

    def _mask_and_upload(
        self,
        request: RoundRequest,
        vector: NDArray[np.uint32],
        gens: dict[int, int],
        nbrs: tuple[int, ...],
        pks: list[bytes],
    ) -> MaskedUpload:
        """Append the canary, double-mask, share the self-mask seed, rotate the mask key."""
        _, ring_bits = self.params.encoding_for(len(tuple(request.participants)))
        vector = np.concatenate([vector, np.zeros(canary_slots(ring_bits), np.uint32)])
        s = self.memory.key("s")
        seed = bytes(self._random_bytes(shamir.SECRET_BYTES))
        signed = [
            (
                1,
                self_mask_key(
                    seed,
                    run_id=self.memory.run_id,
                    epoch=self.memory.epoch,
                    round_number=request.round,
                    site=self.site,
                ),
            )
        ]
        for j, pk in zip(nbrs, pks, strict=True):
            key = pairwise_mask_key(
                s.exchange(pk),
                run_id=self.memory.run_id,
                epoch=self.memory.epoch,
                round_number=request.round,
                a=self.site,
                b=j,
                binding=request.binding,  # checked equal to the site's own (check_round)
            )
            signed.append((pairwise_sign(self.site, j), key))
        add_masks(vector, signed, threads=self.threads)
        b_blob = self._encrypt_shares(seed, nbrs, ShareKind.SELF_MASK_SEED, request.round)
        nxt = SecretKey.generate(self._random_bytes)
        next_blob = self._encrypt_shares(
            nxt.secret_bytes(), self.memory.neighbours, ShareKind.MASK_KEY, self.memory.gen + 1
        )
        self.last_drop_proof = drop_proof(s.secret_bytes(), run_id=self.memory.run_id,
                                          epoch=self.memory.epoch, site=self.site,
                                          gen=self.memory.gen)
        self.memory.s, self.memory.gen = nxt, self.memory.gen + 1  # the used key is forgotten here
        self.memory.round = request.round
        self.memory.round_gens = gens
        self.memory.gen_floor.update({j: (self.memory.epoch, g) for j, g in gens.items()})
        self.memory.revealed_b, self.memory.revealed_s = set(), set()
        self.memory.stage = ClientStage.UPLOADED
        logger.debug(
            "site %d: uploaded round %d (%d neighbours, %d values)",
            self.site,
            self.memory.round,
            len(nbrs),
            request.dim,
        )
        return MaskedUpload(
            site=self.site,
            epoch=self.memory.epoch,
            round=self.memory.round,
            masked=packing.pack(vector, ring_bits),
            b_commitment=commit_seed(
                seed,
                run_id=self.memory.run_id,
                epoch=self.memory.epoch,
                round_number=request.round,
                site=self.site,
            ),
            b_recipients=nbrs,
            b_ciphertexts=b_blob,
            next_gen=self.memory.gen,
            next_s_public=nxt.public_bytes(),
            next_recipients=self.memory.neighbours,
            next_ciphertexts=next_blob,
        )

    def handle_unmask(self, request: UnmaskRequest) -> UnmaskResponse:
        """Round exchange 2: reveal self-mask shares of survivors, key shares of dropouts.

        Never reveals both kinds of share for one site in a round (also across repeated
        requests), nor a key share of a site that was not a neighbour in this round.
        """
        self._require((ClientStage.UPLOADED, ClientStage.UNMASKED), request.epoch, "unmask")
        b_ids, s_ids = check_unmask(self.memory, request)
        b_cts = split_blob(request.b_ciphertexts, len(b_ids), "b_ciphertexts")
        s_cts = split_blob(request.s_ciphertexts, len(s_ids), "s_ciphertexts")
        b_pairs = self._open_all(b_ids, b_cts, ShareKind.SELF_MASK_SEED, lambda j: self.memory.round)
        s_pairs = self._open_all(s_ids, s_cts, ShareKind.MASK_KEY, self.memory.round_gens.__getitem__)
        # what was asked for counts as revealed, opened or not (the server never gets the
        # other kind of share for these senders in this round)
        self.memory.revealed_b |= set(b_ids)
        self.memory.revealed_s |= set(s_ids)
        self.memory.revealed_keys |= {(j, self.memory.round_gens[j]) for j in s_ids}
        self.memory.stage = ClientStage.UNMASKED
        refused = sorted((set(b_ids) | set(s_ids)) - {j for j, _ in b_pairs + s_pairs})
        if refused:
            logger.warning(
                "site %d: unmask round %d: shares relayed from sites %s did not decrypt; "
                "left out of the response",
                self.site,
                self.memory.round,
                refused,
            )
        logger.debug(
            "site %d: unmask round %d: %d self-mask shares, %d key shares",
            self.site,
            self.memory.round,
            len(b_pairs),
            len(s_pairs),
        )
        b_rows = [y for _, y in b_pairs]
        s_rows = [y for _, y in s_pairs]

        def rows(r: list[NDArray[np.uint32]]) -> NDArray[np.uint32]:
            return np.stack(r) if r else np.empty((0, shamir.NUM_LIMBS), np.uint32)

        return UnmaskResponse(
            site=self.site,
            epoch=self.memory.epoch,
            round=self.memory.round,
            b_owners=tuple(j for j, _ in b_pairs),
            b_shares=rows(b_rows),
            s_owners=tuple(j for j, _ in s_pairs),
            s_shares=rows(s_rows),
        )

    # -- persistence -----------------------------------------------------------------------
    def state_dict(self) -> MessageDict:
        """Plain ``str -> int | bytes | ndarray`` state (holds secret keys: keep it local)."""
        return self.memory.state_dict()

    def load_state_dict(self, state: MessageDict) -> None:
        """Restore from :meth:`state_dict` (raises ProtocolError on a foreign or bad state)."""
        self.memory.load_state_dict(state)
