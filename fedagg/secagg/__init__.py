"""Secure aggregation (SecAgg+) without Flower: the server learns only the weighted sum.

Double masking of Bonawitz et al. (CCS 2017) on the k-regular neighbour graph of Bell et al.
(CCS 2020), with X25519 (RFC 7748), HKDF-SHA256 (RFC 5869), ChaCha20 / ChaCha20-Poly1305
(RFC 8439) and Shamir sharing (1979). Steady-state rounds take two exchanges (masked upload,
unmask); key setup takes two more, once per membership epoch. See ``docs/protocols/secagg.md``.

Public API: :func:`run_local` (one call, in process), :class:`SecAggParams`,
:class:`ClientState` / :class:`ServerState` (state machines), the message dataclasses and
:class:`RoundResult`.
"""

from fedagg.secagg.client import ClientState
from fedagg.secagg.local import LocalFederation, deterministic_random_bytes, run_local
from fedagg.secagg.messages import (
    CIPHERTEXT_BYTES,
    INLINE_BYTES,
    PROTOCOL_VERSION,
    KeyAdvertise,
    KeyAdvertiseRequest,
    MaskedUpload,
    Message,
    MessageDict,
    RoundRequest,
    ShareKeys,
    ShareKeysRequest,
    UnmaskRequest,
    UnmaskResponse,
)
from fedagg.secagg.params import SecAggParams, default_num_neighbours
from fedagg.secagg.server import ServerState
from fedagg.secagg.server_sum import RoundResult
from fedagg.secagg.stages import ClientStage, ServerStage

__all__ = [
    "CIPHERTEXT_BYTES",
    "INLINE_BYTES",
    "PROTOCOL_VERSION",
    "ClientStage",
    "ClientState",
    "KeyAdvertise",
    "KeyAdvertiseRequest",
    "LocalFederation",
    "MaskedUpload",
    "Message",
    "MessageDict",
    "RoundRequest",
    "RoundResult",
    "SecAggParams",
    "ServerStage",
    "ServerState",
    "ShareKeys",
    "ShareKeysRequest",
    "UnmaskRequest",
    "UnmaskResponse",
    "default_num_neighbours",
    "deterministic_random_bytes",
    "run_local",
]
