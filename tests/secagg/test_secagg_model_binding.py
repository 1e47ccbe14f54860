"""Model consistency: a secure round's masks are bound to the model its members were sent.

A lying server that sends members different models (to difference their updates, or to
single one out: Pasquini et al., CCS 2022, "Eluding Secure Aggregation in Federated Learning
via Model Inconsistency") cannot complete the round: a site refuses a request that names
another model than the one it received, and members whose requests name different models
derive pairwise masks that do not cancel, so the sum the server unmasks is noise and the
round's canary refuses it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedagg.errors import AbortRound, ProtocolError
from fedagg.secagg import ClientState, SecAggParams, ServerState
from fedagg.secagg.keys import round_binding
from fedagg.secagg.local import deterministic_random_bytes

N, DIM = 4, 64
A, B = round_binding(b"model A"), round_binding(b"model B")


def _ready(seed: int = 0) -> tuple[ServerState, dict[int, ClientState]]:
    params = SecAggParams(threshold=3, weight_scale=100.0)
    server = ServerState(params, run_id=b"binding-%d" % seed)
    clients = {i: ClientState(i, params, random_bytes=deterministic_random_bytes(seed, str(i)))
               for i in range(N)}
    adv = server.begin_setup(range(N))
    for c in clients.values():
        server.receive_advertise(c.handle_advertise(adv))
    for i, req in server.close_advertise().items():
        server.receive_share_keys(clients[i].handle_share_keys(req))
    server.close_share_keys()
    return server, clients


def _updates() -> dict[int, np.ndarray]:
    rng = np.random.default_rng(5)
    return {i: rng.uniform(-1, 1, DIM) for i in range(N)}


def _unmask(server: ServerState, clients: dict[int, ClientState]) -> None:
    for i, req in server.close_uploads().items():
        server.receive_unmask(clients[i].handle_unmask(req))


def test_an_honest_round_bound_to_its_model_gives_the_mean() -> None:
    server, clients = _ready()
    x = _updates()
    reqs = server.begin_round(1, range(N), DIM, binding=A)
    for i, req in reqs.items():
        assert req.binding == A
        server.receive_upload(clients[i].handle_round(req, x[i], 10.0,
                                                      rng=np.random.default_rng(i), binding=A))
    _unmask(server, clients)
    res = server.finish_round()
    want = np.mean([x[i] for i in range(N)], axis=0)
    assert np.abs(res.mean - want).max() <= res.error_bound + 1e-9


def test_a_site_refuses_a_request_naming_another_model_than_it_received() -> None:
    server, clients = _ready(1)
    req = server.begin_round(1, range(N), DIM, binding=A)[0]
    before = (clients[0].memory.round, clients[0].memory.gen)
    with pytest.raises(ProtocolError, match="names another model"):
        clients[0].handle_round(req, np.zeros(DIM), 1.0, rng=np.random.default_rng(0),
                                binding=B)
    assert (clients[0].memory.round, clients[0].memory.gen) == before  # nothing used up


def test_members_sent_different_models_cannot_complete_the_round() -> None:
    """The lying server tells site 3 (model B) a request that names B, the others A: every
    site's own check passes, but the masks of pairs across A / B do not cancel."""
    server, clients = _ready(2)
    x = _updates()
    reqs = server.begin_round(1, range(N), DIM, binding=A)
    for i, req in reqs.items():
        own = B if i == 3 else A
        lie = dataclasses.replace(req, binding=own)
        server.receive_upload(clients[i].handle_round(lie, x[i], 10.0,
                                                      rng=np.random.default_rng(i), binding=own))
    _unmask(server, clients)
    with pytest.raises(AbortRound, match="canary not zero"):
        server.finish_round()
