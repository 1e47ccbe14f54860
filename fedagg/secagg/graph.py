"""The SecAgg+ neighbour graph: a random k-regular Harary graph from a public seed.

Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS 2020,
section 4: sites are placed on a ring in a pseudorandom order and each is connected to its
``k / 2`` nearest ring neighbours on either side (plus the antipodal site when ``k`` is odd).
Masks and secret shares are exchanged only along edges, so per-site work is ``O(k)``
instead of ``O(N)``; ``k = N - 1`` is the complete graph of classic SecAgg.

The order is a Fisher-Yates shuffle driven by a ChaCha20 stream keyed by
``HKDF(run_id, epoch, roster, H(advertised keys))``, so every party computes the same graph
from public data, independent of numpy versions. The hash of every public key announced in the
epoch's first setup exchange is mixed in because the server alone picks the run id: with the
run id as the only randomness, a server could try run ids offline until some victim's
neighbourhood is made of colluding sites (grinding). The keys are drawn by the sites *after*
they have received the run id and epoch, so the server can no longer predict or choose the
graph by itself (see the threat model in ``docs/protocols/secagg.md`` for what remains).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Final

import numpy as np

from fedagg.errors import ConfigError, ProtocolError, explain
from fedagg.secagg.keys import KEY_BYTES, TAG_ADVERTISED_KEYS, TAG_GRAPH, context, derive_key
from fedagg.secagg.prg import keystream

__all__ = [
    "ADVERTISED_KEY_BYTES",
    "advertised_keys_digest",
    "graph_seed",
    "harary_graph",
    "shuffled",
]

ADVERTISED_KEY_BYTES: Final = 2 * KEY_BYTES
"""One roster entry of the advertised keys: ``c_public || s_public``."""


def advertised_keys_digest(roster: Sequence[int], keys: bytes) -> bytes:
    """SHA-256 of the public keys announced for ``roster`` in one epoch.

    Parameters
    ----------
    roster : sequence of int
        The epoch's roster, sorted ascending.
    keys : bytes
        :data:`ADVERTISED_KEY_BYTES` per site, ``c_public || s_public``, in roster order.

    Returns
    -------
    bytes
        ``SHA-256(tag || 0x00 || N || (id || c || s) for each site)`` with 64-bit big-endian
        ``N`` and ids (an injective encoding).
    """
    if len(keys) != len(roster) * ADVERTISED_KEY_BYTES:
        raise ProtocolError(
            explain(
                "roster_public",
                len(keys),
                f"must be {len(roster)} x {ADVERTISED_KEY_BYTES} bytes (c || s per roster site)",
                "resend",
            )
        )
    h = hashlib.sha256(TAG_ADVERTISED_KEYS + b"\x00" + len(roster).to_bytes(8, "big"))
    for pos, site in enumerate(roster):
        h.update(int(site).to_bytes(8, "big"))
        h.update(keys[pos * ADVERTISED_KEY_BYTES : (pos + 1) * ADVERTISED_KEY_BYTES])
    return h.digest()


def graph_seed(run_id: bytes, epoch: int, roster: Sequence[int], *, keys: bytes) -> bytes:
    """Public 32-byte seed of the graph for ``roster`` in ``epoch`` of run ``run_id``.

    ``keys`` are the epoch's advertised public keys (see :func:`advertised_keys_digest`; the
    roster is sorted first), so the seed is not the server's choice alone (Bell et al. 2020,
    section 4, assume a graph the server cannot pick).
    """
    ordered = sorted(roster)
    ids = np.asarray(ordered, dtype=">u8").tobytes()
    ctx = context(run_id=run_id, epoch=epoch, counter=0, first=len(roster), second=0)
    digest = advertised_keys_digest(ordered, keys)
    return derive_key(run_id + b"\x01", TAG_GRAPH, ctx + hashlib.sha256(ids).digest() + digest)


def _words(seed: bytes) -> Iterator[int]:
    block = 0
    while True:
        chunk = keystream(seed, 4096, counter=block)
        block += 4096 // 64
        yield from (int(w) for w in np.frombuffer(chunk, dtype="<u8"))


def shuffled(items: Sequence[int], seed: bytes) -> list[int]:
    """Fisher-Yates shuffle of ``items`` with unbiased (rejection-sampled) draws."""
    out = list(items)
    words = _words(seed)
    for i in range(len(out) - 1, 0, -1):
        bound = i + 1
        limit = 2**64 - (2**64 % bound)
        w = next(words)
        while w >= limit:
            w = next(words)
        j = w % bound
        out[i], out[j] = out[j], out[i]
    return out


def harary_graph(roster: Sequence[int], k: int, seed: bytes) -> dict[int, tuple[int, ...]]:
    """Neighbour lists (sorted) of a k-regular graph on ``roster``.

    Parameters
    ----------
    roster : sequence of int
        Distinct site ids.
    k : int
        Degree, ``1 <= k <= len(roster) - 1`` with ``k * len(roster)`` even.
    seed : bytes
        Public seed from :func:`graph_seed`.
    """
    n = len(roster)
    if len(set(roster)) != n:
        raise ConfigError(explain("roster", list(roster), "site ids must be distinct", "dedupe"))
    if not 1 <= k <= n - 1 or (k * n) % 2:
        raise ConfigError(
            explain("num_neighbours", k, f"need 1 <= k <= {n - 1} and k * N even", "adjust k")
        )
    order = shuffled(sorted(roster), seed)
    out: dict[int, tuple[int, ...]] = {}
    for pos, site in enumerate(order):
        nbrs = {order[(pos + d) % n] for d in range(1, k // 2 + 1)}
        nbrs |= {order[(pos - d) % n] for d in range(1, k // 2 + 1)}
        if k % 2:
            nbrs.add(order[(pos + n // 2) % n])
        out[site] = tuple(sorted(nbrs))
    return out
