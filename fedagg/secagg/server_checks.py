"""What the server checks in a site's reply before it changes any state.

One function per reply of :class:`~fedagg.secagg.server.ServerState`: the sender the transport
authenticated, the stage, the epoch and round, that the site was asked and has not answered
yet, and the reply's sizes, recipients (the neighbour graph), key generations and public keys.
Each raises :class:`~fedagg.errors.ProtocolError` and changes nothing, so the caller drops that
one reply and its sender and goes on (a bad message never aborts the round).

Protocol: Bonawitz et al., CCS 2017, section 4; neighbour graph of Bell et al., CCS 2020.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from fedagg.errors import ProtocolError, explain
from fedagg.secagg import packing
from fedagg.secagg.keys import check_public_key
from fedagg.secagg.messages import (
    KeyAdvertise,
    MaskedUpload,
    ShareKeys,
    UnmaskRequest,
    UnmaskResponse,
    split_blob,
)
from fedagg.secagg.stages import ServerStage

if TYPE_CHECKING:
    from fedagg.secagg.server import ServerState

__all__ = ["check_advertise", "check_share_keys", "check_unmask", "check_upload"]


def check_advertise(
    server: ServerState, msg: KeyAdvertise, sender: int | None
) -> tuple[bytes, bytes]:
    """The checks of a site's public keys: ``(c_public, s_public)``."""
    _check_sender(msg.site, sender)
    server._require(ServerStage.ADVERTISING, "advertise")
    server._check(msg.epoch)
    if msg.site not in server._invited or msg.site in server._c_public:
        raise ProtocolError(explain("site", msg.site, "not invited or duplicate", "drop it"))
    # both keys are checked before either is kept: a low-order or malformed key drops
    # only this site from the epoch (its neighbours never see it)
    c_public = check_public_key(msg.c_public, "c_public")
    s_public = check_public_key(msg.s_public, "s_public")
    return c_public, s_public


def check_share_keys(server: ServerState, msg: ShareKeys, sender: int | None) -> list[bytes]:
    """The checks of a site's encrypted key shares: the ciphertexts, one per recipient."""
    _check_sender(msg.site, sender)
    server._require(ServerStage.SHARING, "share_keys")
    server._check(msg.epoch)
    if msg.site not in server._graph or msg.site in server._ready or msg.gen != 0:
        raise ProtocolError(explain("site", msg.site, "unknown, duplicate or bad gen", "-"))
    if tuple(msg.recipients) != server._graph[msg.site]:
        raise ProtocolError(explain("recipients", "mismatch", "must be the neighbours", "-"))
    cts = split_blob(msg.ciphertexts, len(msg.recipients))
    return cts


def check_upload(
    server: ServerState, msg: MaskedUpload, sender: int | None
) -> tuple[bytes, list[bytes], list[bytes]]:
    """The checks of a masked upload: ``(next s public key, b ciphertexts, next ciphertexts)``."""
    _check_sender(msg.site, sender)
    server._require(ServerStage.COLLECTING, "upload")
    server._check(msg.epoch, msg.round)
    i = msg.site
    if i not in server._used or i in server._uploads:
        raise ProtocolError(explain("site", i, "not a participant, or duplicate", "drop it"))
    words = packing.packed_words(server._dim + 1, server._ring_bits)
    if msg.masked.shape != (words,) or msg.masked.dtype != np.uint32:
        raise ProtocolError(
            explain(
                "masked",
                msg.masked.shape,
                f"need {words} uint32 words ({server._dim + 1} values of {server._ring_bits} bits)",
                "-",
            )
        )
    if tuple(msg.b_recipients) != server._nbrs[i] or tuple(msg.next_recipients) != server._graph[i]:
        raise ProtocolError(explain("recipients", "mismatch", "must follow the graph", "-"))
    if msg.next_gen != server._used[i][0] + 1:
        raise ProtocolError(explain("next_gen", msg.next_gen, "must be gen + 1", "-"))
    public = check_public_key(msg.next_s_public, "next_s_public")
    if len(msg.b_commitment) != 32:
        raise ProtocolError(explain("b_commitment", len(msg.b_commitment), "need 32", "-"))
    b_cts = split_blob(msg.b_ciphertexts, len(server._nbrs[i]), "b_ciphertexts")
    next_cts = split_blob(msg.next_ciphertexts, len(server._graph[i]), "next_ciphertexts")
    return public, b_cts, next_cts


def check_unmask(server: ServerState, msg: UnmaskResponse, sender: int | None) -> UnmaskRequest:
    """The checks of a site's revealed shares: the request it answers."""
    _check_sender(msg.site, sender)
    server._require(ServerStage.UNMASKING, "unmask")
    server._check(msg.epoch, msg.round)
    req = server._requests.get(msg.site)
    if req is None or msg.site in server._responses:
        raise ProtocolError(explain("site", msg.site, "not asked, or duplicate", "drop it"))
    # owners: the requested senders in order, less those whose ciphertext the site refused
    if not (
        _subsequence(msg.b_owners, req.b_senders) and _subsequence(msg.s_owners, req.s_senders)
    ):
        raise ProtocolError(explain("shares", msg.site, "do not match the request", "-"))
    return req


def _subsequence(got: Sequence[int], asked: Sequence[int]) -> bool:
    """Whether ``got`` is ``asked`` with some entries left out (same order)."""
    rest = iter(asked)
    return all(any(g == a for a in rest) for g in got)


def _check_sender(site: int, sender: int | None) -> None:
    if sender is not None and sender != site:
        raise ProtocolError(
            explain("site", site, f"the reply came from site {sender}", "drop the reply")
        )
