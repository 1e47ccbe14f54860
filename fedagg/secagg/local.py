"""In-process driver that runs the server and every site (tests, docs, benchmarks).

:class:`LocalFederation` passes every message through ``to_dict`` / ``from_dict`` and every
site's state through ``state_dict`` / ``load_state_dict`` between steps, exactly as a
transport that starts a fresh process per message would. :func:`run_local` is the one-call
public entry point.

Randomness: with an integer ``seed`` every party draws its bytes from its own ChaCha20
stream keyed by ``SHA-256(seed, party)`` (deterministic, for tests and docs only); with
``seed=None`` they use ``os.urandom``.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.errors import ConfigError, explain
from fedagg.secagg.client import ClientState
from fedagg.secagg.keys import RandomBytes
from fedagg.secagg.messages import Message, MessageDict
from fedagg.secagg.params import (
    DEFAULT_MIN_NEIGHBOURS,
    DEFAULT_THRESHOLD_FLOOR,
    SecAggParams,
    check_site_floor,
    validate_site_floor,
)
from fedagg.secagg.prg import keystream
from fedagg.secagg.server import ServerState
from fedagg.secagg.server_sum import RoundResult

__all__ = ["LocalFederation", "deterministic_random_bytes", "run_local"]


def deterministic_random_bytes(seed: int, party: str) -> RandomBytes:
    """A reproducible ``random_bytes`` for one party (NOT for deployment)."""
    key = hashlib.sha256(f"fedagg/secagg/v1/local-drbg/{seed}/{party}".encode()).digest()
    counter = [0]

    def random_bytes(n: int) -> bytes:
        counter[0] += 1
        block_key = hashlib.sha256(key + counter[0].to_bytes(8, "big")).digest()
        return keystream(block_key, n)

    return random_bytes


def _roundtrip(msg: Message) -> Any:
    return type(msg).from_dict(msg.to_dict())


class LocalFederation:
    """A server and ``num_sites`` sites in one process.

    Parameters
    ----------
    num_sites : int
        Sites get ids ``0 .. num_sites - 1``.
    params : SecAggParams
        Shared parameters.
    seed : int or None
        Deterministic randomness when an int; ``os.urandom`` when None.
    threads : int or None
        Worker threads of the server and of each site (``None``: automatic; results do not
        depend on it, see :mod:`fedagg.secagg.threads`).
    threshold_floor, min_neighbours : float, int
        Each site's own floors on ``t`` and ``k`` (:class:`~fedagg.secagg.ClientState`);
        the sites refuse weaker parameters with ``ProtocolError``.
    """

    def __init__(
        self,
        num_sites: int,
        params: SecAggParams,
        *,
        seed: int | None = 0,
        threads: int | None = None,
        threshold_floor: float = DEFAULT_THRESHOLD_FLOOR,
        min_neighbours: int = DEFAULT_MIN_NEIGHBOURS,
    ) -> None:
        validate_site_floor(threshold_floor, min_neighbours)
        self.params = params
        self.seed = seed
        self.num_sites = num_sites
        self.threads = threads
        self.threshold_floor = threshold_floor
        self.min_neighbours = min_neighbours
        server_rb = self._random_bytes("server")
        self.server = ServerState(params, run_id=server_rb(16), threads=threads)
        self._rbs = {i: self._random_bytes(f"site-{i}") for i in range(num_sites)}
        self.states: dict[int, MessageDict] = {
            i: self.client(i).state_dict() for i in range(num_sites)
        }
        self._round = 0

    def _random_bytes(self, party: str) -> RandomBytes:
        return os.urandom if self.seed is None else deterministic_random_bytes(self.seed, party)

    def client(self, site: int) -> ClientState:
        """A fresh ClientState for ``site`` with this federation's settings (not loaded)."""
        return ClientState(
            site,
            self.params,
            random_bytes=self._rbs[site],
            threads=self.threads,
            threshold_floor=self.threshold_floor,
            min_neighbours=self.min_neighbours,
        )

    def _on_site(self, site: int, step: Callable[[ClientState], Message]) -> Any:
        client = self.client(site)
        client.load_state_dict(self.states[site])
        reply = step(client)
        self.states[site] = client.state_dict()
        return _roundtrip(reply)

    def setup(
        self, sites: Iterable[int] | None = None, *, drop: Iterable[int] = ()
    ) -> tuple[int, ...]:
        """Run the two key-setup exchanges; sites in ``drop`` vanish after advertising."""
        invited = tuple(range(self.num_sites)) if sites is None else tuple(sites)
        gone = set(drop)
        request = _roundtrip(self.server.begin_setup(invited))
        for i in invited:
            self.server.receive_advertise(
                self._on_site(i, functools.partial(ClientState.handle_advertise, request=request))
            )
        share_requests = self.server.close_advertise()
        for i, req in share_requests.items():
            if i in gone:
                continue
            req = _roundtrip(req)
            self.server.receive_share_keys(
                self._on_site(i, functools.partial(ClientState.handle_share_keys, request=req))
            )
        return self.server.close_share_keys()

    def run_round(
        self,
        updates: Sequence[NDArray[Any]],
        weights: Sequence[float],
        *,
        participants: Iterable[int] | None = None,
        drop_before_upload: Iterable[int] = (),
        drop_after_upload: Iterable[int] = (),
    ) -> RoundResult:
        """Run exchanges 1 (masked upload) and 2 (unmask) of one round.

        ``updates[i]`` / ``weights[i]`` belong to site ``i``. Sites in ``drop_before_upload``
        compute their upload but it never arrives; those in ``drop_after_upload`` upload but
        never answer the unmask request. Raises AbortRound when the round cannot complete.
        """
        part = self.server.usable_sites if participants is None else tuple(participants)
        before, after = set(drop_before_upload), set(drop_after_upload)
        self._round += 1
        dim = int(np.asarray(updates[part[0]]).size)
        requests = self.server.begin_round(self._round, part, dim)
        for i, req in requests.items():
            rng = np.random.default_rng([self.seed or 0, i, self._round])
            req = _roundtrip(req)
            step = functools.partial(
                ClientState.handle_round, request=req, update=updates[i], weight=weights[i], rng=rng
            )
            upload = self._on_site(i, step)
            if i not in before:
                self.server.receive_upload(upload)
        unmask = self.server.close_uploads()
        for i, ureq in unmask.items():
            if i in after:
                continue
            ureq = _roundtrip(ureq)
            self.server.receive_unmask(
                self._on_site(i, functools.partial(ClientState.handle_unmask, request=ureq))
            )
        return self.server.finish_round()


def _validate(
    updates: Sequence[NDArray[Any]], weights: Sequence[float], drops: Sequence[Iterable[int]]
) -> tuple[list[NDArray[np.float64]], list[float], list[set[int]]]:
    arrays = [np.asarray(u, dtype=np.float64) for u in updates]
    n = len(arrays)
    if n < 2:
        raise ConfigError(explain("updates", n, "need at least 2 sites", "pass one array per site"))
    if any(a.shape != arrays[0].shape for a in arrays) or arrays[0].size == 0:
        raise ConfigError(
            explain("updates", [a.shape for a in arrays], "must be non-empty, equal shapes", "-")
        )
    if not all(bool(np.isfinite(a).all()) for a in arrays):
        raise ConfigError(explain("updates", "non-finite", "must be finite", "drop NaN/Inf"))
    w = [float(x) for x in weights]
    if len(w) != n or any(not math.isfinite(x) or x < 0 for x in w):
        raise ConfigError(explain("weights", list(weights), f"need {n} finite values >= 0", "-"))
    sets = [set(d) for d in drops]
    for s in sets:
        if any(not isinstance(i, (int, np.integer)) or not 0 <= i < n for i in s):
            raise ConfigError(explain("drop sets", sorted(s), f"ids must be in [0, {n})", "-"))
    if sets[0] & sets[1]:
        raise ConfigError(
            explain("drop sets", sorted(sets[0] & sets[1]), "a site drops only once", "pick one")
        )
    return arrays, w, sets


def run_local(
    updates: Sequence[NDArray[Any]],
    weights: Sequence[float],
    *,
    threshold: int,
    num_neighbours: int | None = None,
    drop_before_upload: Iterable[int] = (),
    drop_after_upload: Iterable[int] = (),
    seed: int | None = 0,
    clip: float | None = None,
    frac_bits: int | None = None,
    threads: int | None = None,
    threshold_floor: float = DEFAULT_THRESHOLD_FLOOR,
    min_neighbours: int = DEFAULT_MIN_NEIGHBOURS,
) -> NDArray[np.float64]:
    """Run key setup and one secure-aggregation round in process; return the weighted mean.

    Parameters
    ----------
    updates : sequence of numpy.ndarray
        One equal-shape float array per site (site ``i`` is ``updates[i]``).
    weights : sequence of float
        Non-negative weight (number of examples) per site.
    threshold, num_neighbours : int, int or None
        See :class:`~fedagg.secagg.params.SecAggParams`.
    drop_before_upload, drop_after_upload : iterable of int
        Site indices that drop before sending their masked update, or after sending it (still
        counted).
    seed : int or None
        Deterministic randomness (tests, docs) when an int; ``os.urandom`` when None.
    clip, frac_bits : float or None, int or None
        Encoding parameters. ``clip=None`` uses the smallest power of two covering all
        entries (convenient in simulation; in deployment the clip range is public config).
    threads : int or None
        Worker threads per party (``None``: automatic); the result does not depend on it.
    threshold_floor, min_neighbours : float, int
        The sites' own floors (:class:`~fedagg.secagg.ClientState`): by default every site
        needs ``t > k / 2`` and ``k >= min(3, N - 1)``; weaker parameters raise ConfigError.

    Returns
    -------
    numpy.ndarray
        ``sum_i w_i x_i / sum_i w_i`` over the counted sites, shape of one update, float64.

    Raises
    ------
    fedagg.errors.AbortRound
        Too few live holders for a needed secret (the round must abort).
    fedagg.errors.ConfigError
        Invalid inputs or impossible parameter combinations.
    """
    arrays, w, (before, after) = _validate(
        updates, weights, [drop_before_upload, drop_after_upload]
    )
    if clip is None:
        peak = max(float(np.abs(a).max()) for a in arrays)
        clip = 2.0 ** math.ceil(math.log2(peak)) if peak > 0 else 1.0
    scale = max(w) if max(w) > 0 else 1.0
    params = SecAggParams(
        threshold=threshold,
        num_neighbours=num_neighbours,
        clip=clip,
        frac_bits=frac_bits,
        weight_scale=scale,
    )
    # explain impossible (threshold, k, N) and parameters the sites would refuse, up front
    check_site_floor(
        params, len(arrays), threshold_floor=threshold_floor, min_neighbours=min_neighbours
    )
    fed = LocalFederation(
        len(arrays),
        params,
        seed=seed,
        threads=threads,
        threshold_floor=threshold_floor,
        min_neighbours=min_neighbours,
    )
    fed.setup()
    result = fed.run_round(arrays, w, drop_before_upload=before, drop_after_upload=after)
    return result.mean.reshape(arrays[0].shape)
