"""What the server checks in a site's reply before it changes any state.

One function per reply of :class:`~fedagg.secagg.server.ServerState`, over its stage, epoch and
books (:mod:`fedagg.secagg.server_books`): the sender the transport
authenticated, the stage, the epoch and round, that the site was asked and has not answered
yet, and the reply's sizes, recipients (the neighbour graph), key generations and public keys.
Each raises :class:`~fedagg.errors.ProtocolError` and changes nothing, so the caller drops that
one reply and its sender and goes on (a bad message never aborts the round).

Protocol: Bonawitz et al., CCS 2017, section 4; neighbour graph of Bell et al., CCS 2020.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedagg.errors import ProtocolError, explain
from fedagg.secagg import packing
from fedagg.secagg.keys import check_public_key
from fedagg.secagg.masking import canary_slots
from fedagg.secagg.messages import (
    KeyAdvertise,
    MaskedUpload,
    ShareKeys,
    UnmaskRequest,
    UnmaskResponse,
    split_blob,
)
from fedagg.secagg.server_books import RoundBook, SetupBook
from fedagg.secagg.stages import ServerStage

__all__ = ["check_advertise", "check_share_keys", "check_unmask", "check_upload", "require_stage"]


def require_stage(current: ServerStage, needed: ServerStage, what: str) -> None:
    """ProtocolError unless the server is in stage ``needed`` for ``what``."""
    if current != needed:
        raise ProtocolError(
            explain(what, current.name, f"needs stage {needed.name}", "follow the stages")
        )


def _fresh(epoch: int, msg_epoch: int, rnd: int | None = None,
           msg_round: int | None = None) -> None:
    if msg_epoch != epoch or (msg_round is not None and msg_round != rnd):
        raise ProtocolError(
            explain("epoch/round", (msg_epoch, msg_round), "stale or foreign message", "drop it")
        )


def check_advertise(
    stage: ServerStage, epoch: int, setup: SetupBook, msg: KeyAdvertise, sender: int | None
) -> tuple[bytes, bytes]:
    """The checks of a site's public keys: ``(c_public, s_public)``."""
    _check_sender(msg.site, sender)
    require_stage(stage, ServerStage.ADVERTISING, "advertise")
    _fresh(epoch, msg.epoch)
    if msg.site not in setup.invited or msg.site in setup.c_public:
        raise ProtocolError(explain("site", msg.site, "not invited or duplicate", "drop it"))
    # both keys are checked before either is kept: a low-order or malformed key drops
    # only this site from the epoch (its neighbours never see it)
    c_public = check_public_key(msg.c_public, "c_public")
    s_public = check_public_key(msg.s_public, "s_public")
    return c_public, s_public


def check_share_keys(
    stage: ServerStage, epoch: int, setup: SetupBook, msg: ShareKeys, sender: int | None
) -> list[bytes]:
    """The checks of a site's encrypted key shares: the ciphertexts, one per recipient."""
    _check_sender(msg.site, sender)
    require_stage(stage, ServerStage.SHARING, "share_keys")
    _fresh(epoch, msg.epoch)
    if msg.site not in setup.graph or msg.site in setup.ready or msg.gen != 0:
        raise ProtocolError(explain("site", msg.site, "unknown, duplicate or bad gen", "-"))
    if tuple(msg.recipients) != setup.graph[msg.site]:
        raise ProtocolError(explain("recipients", "mismatch", "must be the neighbours", "-"))
    cts = split_blob(msg.ciphertexts, len(msg.recipients))
    return cts


def check_upload(
    stage: ServerStage, epoch: int, setup: SetupBook, book: RoundBook, msg: MaskedUpload,
    sender: int | None
) -> tuple[bytes, list[bytes], list[bytes]]:
    """The checks of a masked upload: ``(next s public key, b ciphertexts, next ciphertexts)``."""
    _check_sender(msg.site, sender)
    require_stage(stage, ServerStage.COLLECTING, "upload")
    _fresh(epoch, msg.epoch, book.round, msg.round)
    i = msg.site
    if i not in book.used or i in book.uploads:
        raise ProtocolError(explain("site", i, "not a participant, or duplicate", "drop it"))
    slots = book.dim + 1 + canary_slots(book.ring_bits)
    words = packing.packed_words(slots, book.ring_bits)
    if msg.masked.shape != (words,) or msg.masked.dtype != np.uint32:
        raise ProtocolError(
            explain(
                "masked",
                msg.masked.shape,
                f"need {words} uint32 words ({slots} values of {book.ring_bits} bits)",
                "-",
            )
        )
    if tuple(msg.b_recipients) != book.nbrs[i] or tuple(msg.next_recipients) != setup.graph[i]:
        raise ProtocolError(explain("recipients", "mismatch", "must follow the graph", "-"))
    if msg.next_gen != book.used[i][0] + 1:
        raise ProtocolError(explain("next_gen", msg.next_gen, "must be gen + 1", "-"))
    public = check_public_key(msg.next_s_public, "next_s_public")
    if len(msg.b_commitment) != 32:
        raise ProtocolError(explain("b_commitment", len(msg.b_commitment), "need 32", "-"))
    b_cts = split_blob(msg.b_ciphertexts, len(book.nbrs[i]), "b_ciphertexts")
    next_cts = split_blob(msg.next_ciphertexts, len(setup.graph[i]), "next_ciphertexts")
    return public, b_cts, next_cts


def check_unmask(
    stage: ServerStage, epoch: int, book: RoundBook, msg: UnmaskResponse, sender: int | None
) -> UnmaskRequest:
    """The checks of a site's revealed shares: the request it answers."""
    _check_sender(msg.site, sender)
    require_stage(stage, ServerStage.UNMASKING, "unmask")
    _fresh(epoch, msg.epoch, book.round, msg.round)
    req = book.requests.get(msg.site)
    if req is None or msg.site in book.responses:
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
