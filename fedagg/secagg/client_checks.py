"""What a site checks in the server's requests before it touches a secret.

The defences of a site against a server that lies (docs/protocols/secagg.md, section 4), over
what the site remembers (:class:`~fedagg.secagg.client_memory.SiteMemory`) and its own floor on
the parameters (:class:`SiteFloor`), one function per request: a share-keys request must
carry every advertised key of the epoch, the site's own keys among them, and the neighbour
graph recomputed from their hash (:func:`check_share_keys`); a round request must name roster
sites, this site's key generation and graph neighbours, none announced at a key generation
this site has already seen used, since each mask key masks one round only
(:func:`check_round`); an unmask request must ask for this round's neighbours only and never
for both kinds of share of one site (:func:`check_unmask`). Each raises
:class:`~fedagg.errors.ProtocolError` (:class:`~fedagg.errors.AbortRound` where the request is
honest but the round cannot be done) and changes nothing; the caller has checked the stage.

Protocol: Bonawitz et al., CCS 2017 (double masking, section 4) on the neighbour graph of
Bell et al., CCS 2020 (SecAgg+).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fedagg.errors import AbortRound, ConfigError, ProtocolError, explain
from fedagg.secagg.client_memory import SiteMemory
from fedagg.secagg.graph import ADVERTISED_KEY_BYTES, graph_seed, harary_graph
from fedagg.secagg.keys import KEY_BYTES, check_public_key, split_keys
from fedagg.secagg.messages import RoundRequest, ShareKeysRequest, UnmaskRequest
from fedagg.secagg.params import SecAggParams, check_site_floor, validate_site_floor

__all__ = ["SiteFloor", "check_round", "check_share_keys", "check_unmask"]

_NONE = (-1, -1)  # no generation seen yet


@dataclass(frozen=True)
class SiteFloor:
    """A site's own floor on the server's parameters: it refuses a setup whose
    ``t <= threshold_floor * k`` or whose graph degree ``k < min(min_neighbours, N - 1)``
    (:func:`~fedagg.secagg.params.check_site_floor`).

    Raises
    ------
    ConfigError
        ``threshold_floor`` not in ``[0, 1)`` or ``min_neighbours < 1``.
    """

    site: int
    threshold_floor: float
    min_neighbours: int

    def __post_init__(self) -> None:
        validate_site_floor(self.threshold_floor, self.min_neighbours)

    def neighbours(self, params: SecAggParams, num_sites: int) -> int:
        """``k`` for ``num_sites``; ProtocolError when the server's parameters are too weak."""
        try:
            return check_site_floor(params, num_sites, threshold_floor=self.threshold_floor,
                                    min_neighbours=self.min_neighbours)
        except ConfigError as err:
            raise ProtocolError(f"refused by site {self.site}: {err}") from None


def check_share_keys(
    client: SiteMemory, params: SecAggParams, floor: SiteFloor, request: ShareKeysRequest
) -> tuple[tuple[int, ...], tuple[int, ...], dict[int, bytes]]:
    """The checks of setup exchange 2: ``(roster, neighbours, neighbour c public keys)``."""
    roster = tuple(request.roster)  # distinct ids (checked when the message was built)
    if client.site not in roster or roster != tuple(sorted(roster)):
        raise ProtocolError(
            explain("roster", "invalid", "must be sorted and list this site", "-")
        )
    try:
        params.neighbours_for(len(roster))
    except ConfigError as err:
        raise AbortRound(str(err)) from err
    k = floor.neighbours(params, len(roster))
    announced = request.roster_public
    if len(announced) != len(roster) * ADVERTISED_KEY_BYTES:
        raise ProtocolError(
            explain(
                "roster_public",
                len(announced),
                "this site checks the graph against every advertised key (wire version 2)",
                "send every roster site's c || s public keys",
            )
        )
    entry = {
        j: announced[pos * ADVERTISED_KEY_BYTES : (pos + 1) * ADVERTISED_KEY_BYTES]
        for pos, j in enumerate(roster)
    }
    own = client.key("c").public_bytes() + client.key("s").public_bytes()
    if entry[client.site] != own:
        raise ProtocolError(
            explain("roster_public", "own keys", "differ from the keys this site sent", "-")
        )
    graph = harary_graph(roster, k, graph_seed(client.run_id, client.epoch, roster, keys=announced))
    if tuple(request.neighbours) != graph[client.site]:
        raise ProtocolError(
            explain("neighbours", list(request.neighbours), "differ from the graph", "-")
        )
    keys = split_keys(request.neighbour_c_public, len(request.neighbours), "c_public")
    if keys != [entry[j][:KEY_BYTES] for j in graph[client.site]]:
        raise ProtocolError(
            explain("neighbour_c_public", "mismatch", "differ from the advertised keys", "-")
        )
    checked = {
        j: check_public_key(pk, "neighbour_c_public")
        for j, pk in zip(graph[client.site], keys, strict=True)
    }
    return roster, graph[client.site], checked


def check_round(
    client: SiteMemory, params: SecAggParams, request: RoundRequest, binding: bytes | None = None
) -> tuple[dict[int, int], tuple[int, ...], list[bytes]]:
    """The checks of round exchange 1: ``(neighbour generations, neighbours, their s keys)``.

    ``binding``: the round binding of the model this site received; the request must name it
    (a server that sends members different models is refused here when it says so, and
    otherwise fails the round's canary: the masks are derived from the request's binding).
    """
    if binding is not None and not hmac.compare_digest(binding, request.binding):
        raise ProtocolError(
            explain("binding", "another model", "the round request names another model than "
                    "the one this site was sent", "send every participant the same model")
        )
    if request.round <= client.round:
        raise ProtocolError(
            explain("round", request.round, f"must be > {client.round} (replay?)", "next round")
        )
    participants = tuple(request.participants)
    if (
        client.site not in participants
        or len(set(participants)) != len(participants)
        or not set(participants) <= set(client.roster)
    ):
        raise ProtocolError(explain("participants", "invalid", "must be roster ids", "-"))
    if request.gen != client.gen:
        raise ProtocolError(
            explain("gen", request.gen, f"this site holds key generation {client.gen}", "re-key")
        )
    nbrs = tuple(j for j in client.neighbours if j in set(participants))
    if tuple(request.neighbours) != nbrs or len(request.neighbour_gens) != len(nbrs):
        raise ProtocolError(explain("neighbours", "mismatch", "differ from the graph", "-"))
    gens = dict(zip(nbrs, request.neighbour_gens, strict=True))
    if any((j, g) in client.revealed_keys for j, g in gens.items()):
        raise ProtocolError(
            explain("neighbour_gens", "revealed key", "a neighbour key was rebuilt", "re-key")
        )
    stale = sorted(
        j for j, g in gens.items() if (client.epoch, g) <= client.gen_floor.get(j, _NONE)
    )
    if stale:
        # A mask key is used in one round only. Announcing a neighbour at a generation this
        # site has already seen used (or an older one) is how a lying server would collect
        # shares of a key whose masked upload it already holds and has unmasked.
        raise ProtocolError(
            explain(
                "neighbour_gens",
                f"sites {stale}",
                "re-announced or older key generation (each key masks one round only)",
                "an honest server announces every neighbour's newest key; request refused",
            )
        )
    if len(nbrs) < params.threshold:
        raise AbortRound(
            explain(
                "neighbours", len(nbrs), f"fewer than threshold={params.threshold}", "-"
            )
        )
    pks = [
        check_public_key(pk, "neighbour_s_public")
        for pk in split_keys(request.neighbour_s_public, len(nbrs), "neighbour_s_public")
    ]
    return gens, nbrs, pks


def check_unmask(
    client: SiteMemory, request: UnmaskRequest
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The checks of round exchange 2: ``(self-mask share senders, key share senders)``."""
    if request.round != client.round:
        raise ProtocolError(explain("round", request.round, f"must be {client.round}", "-"))
    b_ids, s_ids = tuple(request.b_senders), tuple(request.s_senders)
    known = set(client.round_gens)
    for name, ids in (("b_senders", b_ids), ("s_senders", s_ids)):
        if len(set(ids)) != len(ids) or not set(ids) <= known:
            raise ProtocolError(
                explain(name, list(ids), "must be this round's neighbours", "-")
            )
    both = (set(b_ids) & set(s_ids)) | (set(b_ids) & client.revealed_s)
    both |= set(s_ids) & client.revealed_b
    if both:
        raise ProtocolError(
            explain(
                "unmask request",
                sorted(both),
                "asks for both the self-mask and the key share of the same site",
                "an honest server never does this; the request is refused",
            )
        )
    if tuple(request.s_gens) != tuple(client.round_gens[j] for j in s_ids):
        raise ProtocolError(explain("s_gens", list(request.s_gens), "wrong generations", "-"))
    return b_ids, s_ids
