"""A hand-driven server + sites for the attack tests (tests/secagg/test_secagg_lying_server.py,
tests/secagg/test_secagg_hostile_site.py): every message is a real object the test can read,
replace or forge before it reaches the other side, as a lying server or a hostile site would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from fedagg.errors import ProtocolError
from fedagg.secagg import (
    ClientState,
    MaskedUpload,
    RoundRequest,
    RoundResult,
    SecAggParams,
    ServerState,
    UnmaskRequest,
    UnmaskResponse,
    deterministic_random_bytes,
    fixed_point,
    packing,
)
from fedagg.secagg.keys import NO_BINDING, SecretKey, pairwise_mask_key, self_mask_key
from fedagg.secagg.masking import add_masks, canary_slots, pairwise_sign

Hook = Callable[[int, Any], Any]  # (site, message) -> message to deliver, or None to drop it


def _keep(_site: int, msg: Any) -> Any:
    return msg


class Net:
    """Server and ``n`` sites in one process, messages passed through ``to_dict``/``from_dict``.

    ``floors`` are keyword arguments of every :class:`ClientState` (``threshold_floor``,
    ``min_neighbours``). With ``tolerate=True`` a site handler that raises ProtocolError
    counts as that site not answering (as at the Flower edge); ``failed`` lists them.
    """

    def __init__(
        self,
        n: int,
        params: SecAggParams,
        *,
        seed: int = 1,
        run_id: bytes = b"lying-server-run",
        tolerate: bool = False,
        **floors: Any,
    ) -> None:
        self.n, self.params, self.run_id = n, params, run_id
        self.tolerate = tolerate
        self.failed: list[tuple[str, int]] = []
        self.server = ServerState(params, run_id=run_id, threads=1)
        self.clients = {
            i: ClientState(
                i,
                params,
                random_bytes=deterministic_random_bytes(seed, f"site-{i}"),
                threads=1,
                **floors,
            )
            for i in range(n)
        }

    @staticmethod
    def wire(msg: Any) -> Any:
        return type(msg).from_dict(msg.to_dict())

    def _site(self, stage: str, i: int, call: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        try:
            return call(*args, **kw)
        except ProtocolError:
            if not self.tolerate:
                raise
            self.failed.append((stage, i))
            return None

    def setup(
        self,
        sites: Iterable[int] | None = None,
        *,
        advertise: Hook = _keep,
        share: Hook = _keep,
    ) -> tuple[int, ...]:
        """Both setup exchanges; hooks may replace (or drop, with None) a site's reply."""
        invited = tuple(range(self.n)) if sites is None else tuple(sites)
        request = self.wire(self.server.begin_setup(invited))
        for i in invited:
            msg = advertise(i, self.clients[i].handle_advertise(request))
            if msg is not None:
                self.server.receive_advertise(self.wire(msg))
        for i, req in self.server.close_advertise().items():
            reply = self._site("share", i, self.clients[i].handle_share_keys, self.wire(req))
            msg = None if reply is None else share(i, reply)
            if msg is not None:
                self.server.receive_share_keys(self.wire(msg))
        return self.server.close_share_keys()

    def uploads(
        self,
        round_number: int,
        updates: Sequence[np.ndarray],
        *,
        participants: Iterable[int] | None = None,
        upload: Hook = _keep,
    ) -> tuple[dict[int, RoundRequest], dict[int, MaskedUpload]]:
        """Round exchange 1; the hook sees each upload before the server does."""
        part = self.server.usable_sites if participants is None else tuple(participants)
        dim = int(np.asarray(updates[part[0]]).size)
        requests = self.server.begin_round(round_number, part, dim)
        sent: dict[int, MaskedUpload] = {}
        for i, req in requests.items():
            rng = np.random.default_rng([round_number, i])
            up = self._site(
                "upload", i, self.clients[i].handle_round, self.wire(req), updates[i], 1.0, rng=rng
            )
            if up is None:
                continue
            sent[i] = up
            msg = upload(i, up)
            if msg is not None:
                self.server.receive_upload(self.wire(msg))
        return requests, sent

    def unmask(
        self, *, respond: Hook = _keep
    ) -> tuple[dict[int, UnmaskRequest], dict[int, UnmaskResponse]]:
        """Round exchange 2 (``close_uploads`` first); the hook sees each response."""
        requests = self.server.close_uploads()
        answers: dict[int, UnmaskResponse] = {}
        for i, req in requests.items():
            resp = self._site("unmask", i, self.clients[i].handle_unmask, self.wire(req))
            if resp is None:
                continue
            answers[i] = resp
            msg = respond(i, resp)
            if msg is not None:
                self.server.receive_unmask(self.wire(msg))
        return requests, answers

    def round(
        self,
        round_number: int,
        updates: Sequence[np.ndarray],
        *,
        participants: Iterable[int] | None = None,
        upload: Hook = _keep,
        respond: Hook = _keep,
    ) -> RoundResult:
        self.uploads(round_number, updates, participants=participants, upload=upload)
        self.unmask(respond=respond)
        return self.server.finish_round()


def updates(seed: int, n: int, dim: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, dim) for _ in range(n)]


def plain_mean(ups: Sequence[np.ndarray], sites: Iterable[int]) -> np.ndarray:
    chosen = list(sites)
    return np.asarray(sum(ups[i] for i in chosen) / len(chosen))


def unmask_one(
    net: Net,
    upload: MaskedUpload,
    *,
    seed: bytes,
    key: SecretKey,
    neighbour_publics: dict[int, bytes],
    num_participants: int,
    dim: int,
) -> np.ndarray:
    """What a server holding ``b_i`` and ``s_i`` of one upload computes: the site's update."""
    frac_bits, bits = net.params.encoding_for(num_participants)
    i, rnd, epoch = upload.site, upload.round, upload.epoch
    vector = packing.unpack(upload.masked, dim + 1 + canary_slots(bits), bits)
    keys = [(-1, self_mask_key(seed, run_id=net.run_id, epoch=epoch, round_number=rnd, site=i))]
    for j, pk in neighbour_publics.items():
        shared = key.exchange(pk)
        k = pairwise_mask_key(shared, run_id=net.run_id, epoch=epoch, round_number=rnd, a=i, b=j,
                              binding=NO_BINDING)
        keys.append((-pairwise_sign(i, j), k))
    add_masks(vector, keys, threads=1)
    weighted, weight = fixed_point.decode_sum(vector[:dim + 1], frac_bits, bits)
    return np.asarray(weighted / weight)
