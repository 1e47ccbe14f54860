"""What the server keeps of one key-setup epoch (:class:`SetupBook`) and of one open round
(:class:`RoundBook`).

A :class:`~fedagg.secagg.server.ServerState` holds one of each: the setup book from
``begin_setup`` until the next epoch, the round book from ``begin_round`` until the next
round. The reply checks (:mod:`fedagg.secagg.server_checks`) read them; the server's
handlers change them.

Protocol: Bonawitz et al., CCS 2017, section 4; neighbour graph of Bell et al., CCS 2020.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedagg.secagg.messages import UnmaskRequest, UnmaskResponse
from fedagg.secagg.server_sum import UploadSum

__all__ = ["Ids", "MaskKey", "RoundBook", "SetupBook"]

Ids = tuple[int, ...]


@dataclass
class MaskKey:
    """A site's current mask key as the server knows it: generation, public key and the
    encrypted shares of its secret, per recipient."""

    gen: int
    public: bytes
    ciphertexts: dict[int, bytes]


@dataclass
class SetupBook:
    """One epoch's key setup.

    Attributes
    ----------
    invited : tuple of int
        The sites asked to advertise keys.
    c_public, s_public : dict of int to bytes
        Each advertised site's share-encryption and first mask public key.
    roster : tuple of int
        The sites that advertised (fixed by ``close_advertise``).
    graph : dict of int to tuple of int
        The neighbour graph over the roster.
    keys : dict of int to MaskKey
        Each site's current mask key.
    ready : set of int
        Sites that shared their keys.
    stale : set of int
        Sites that must re-key before they take part again (dropped, or blamed).
    """

    invited: Ids = ()
    c_public: dict[int, bytes] = field(default_factory=dict)
    s_public: dict[int, bytes] = field(default_factory=dict)
    roster: Ids = ()
    graph: dict[int, Ids] = field(default_factory=dict)
    keys: dict[int, MaskKey] = field(default_factory=dict, repr=False)
    ready: set[int] = field(default_factory=set)
    stale: set[int] = field(default_factory=set)


@dataclass
class RoundBook:
    """One round, from ``begin_round`` to its end.

    Attributes
    ----------
    round : int
        The round number.
    participants : tuple of int
        Sites asked to upload.
    dim, frac_bits, ring_bits : int
        Values per upload and the round's fixed-point encoding.
    binding : bytes
        What the round's masks are bound to (the model's round binding).
    nbrs : dict of int to tuple of int
        Each participant's neighbours among the participants.
    used : dict of int to (int, bytes)
        Each participant's mask key (generation, public key) in this round.
    uploads : set of int
        Sites whose masked upload was accepted.
    total : UploadSum or None
        The running sum of the uploads.
    commitments : dict of int to bytes
        Each uploader's self-mask seed commitment.
    refused : dict of int to int
        Owner -> recipients that could not open its shares.
    b_cts : dict of (int, int) to bytes
        ``(owner, recipient)`` -> encrypted self-mask seed share.
    dropped : set of int
        Participants that did not upload (fixed by ``close_uploads``).
    requests : dict of int to UnmaskRequest
        The unmask request sent to each uploader.
    responses : dict of int to UnmaskResponse
        The accepted answers.
    """

    round: int = 0
    participants: Ids = ()
    dim: int = 0
    frac_bits: int = 0
    ring_bits: int = 0
    binding: bytes = bytes(32)
    nbrs: dict[int, Ids] = field(default_factory=dict)
    used: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    uploads: set[int] = field(default_factory=set)
    total: UploadSum | None = field(default=None, repr=False)
    commitments: dict[int, bytes] = field(default_factory=dict, repr=False)
    refused: dict[int, int] = field(default_factory=dict)
    b_cts: dict[tuple[int, int], bytes] = field(default_factory=dict, repr=False)
    dropped: set[int] = field(default_factory=set)
    requests: dict[int, UnmaskRequest] = field(default_factory=dict, repr=False)
    responses: dict[int, UnmaskResponse] = field(default_factory=dict, repr=False)
