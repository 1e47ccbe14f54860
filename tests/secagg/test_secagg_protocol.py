"""State machines: multi-round key rotation, re-keying, clean aborts, and refusal of every
out-of-order, replayed, foreign or malicious message."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedagg.errors import AbortRound, ConfigError, ProtocolError, VerificationError
from fedagg.secagg import (
    ClientStage,
    ClientState,
    LocalFederation,
    SecAggParams,
    ServerStage,
    ServerState,
    deterministic_random_bytes,
)
from fedagg.secagg.messages import CIPHERTEXT_BYTES, KeyAdvertiseRequest, UnmaskRequest

N = 6
PARAMS = SecAggParams(threshold=3, weight_scale=10.0)


def updates(seed: int, n: int = N, dim: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, dim) for _ in range(n)]


def mean(ups: list[np.ndarray], w: list[float], sites: list[int]) -> np.ndarray:
    return np.asarray(sum(w[i] * ups[i] for i in sites) / sum(w[i] for i in sites))


W = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def fed() -> LocalFederation:
    f = LocalFederation(N, PARAMS, seed=11)
    f.setup()
    return f


def test_several_rounds_reuse_the_epoch_and_rotate_mask_keys() -> None:
    f = fed()
    publics = []
    for r in range(1, 4):
        ups = updates(r)
        res = f.run_round(ups, W)
        assert res.round == r and res.epoch == 1
        assert np.abs(res.mean - mean(ups, W, list(range(N)))).max() < 1e-6
        publics.append(f.server.setup.keys[0].public)
        assert f.server.setup.keys[0].gen == r
    assert len(set(publics)) == 3  # one mask key per round: a rebuilt key exposes one round


def test_dropout_before_upload_forces_rekey_then_rejoin() -> None:
    f = fed()
    ups = updates(1)
    res = f.run_round(ups, W, drop_before_upload=[2])
    assert res.dropped == (2,)
    assert np.abs(res.mean - mean(ups, W, [0, 1, 3, 4, 5])).max() < 1e-6
    assert 2 not in f.server.usable_sites and f.server.needs_rekey(range(N))
    with pytest.raises(ProtocolError, match="re-key"):
        f.server.begin_round(99, list(range(N)), 4)
    res = f.run_round(updates(2), W)  # continues with the usable sites
    assert res.counted == (0, 1, 3, 4, 5)
    f.setup()  # new epoch: site 2 gets fresh keys
    assert f.server.epoch == 2 and not f.server.needs_rekey(range(N))
    ups = updates(3)
    res = f.run_round(ups, W)
    assert res.counted == tuple(range(N))
    assert np.abs(res.mean - mean(ups, W, list(range(N)))).max() < 1e-6


def test_abort_leaves_server_ready_and_next_round_works() -> None:
    f = fed()
    with pytest.raises(AbortRound):
        f.run_round(updates(1), W, drop_after_upload=[0, 1, 2, 3])
    assert f.server.stage == ServerStage.READY
    ups = updates(2)
    res = f.run_round(ups, W)  # after-upload dropouts keep their keys: all still usable
    assert np.abs(res.mean - mean(ups, W, list(range(N)))).max() < 1e-6


def test_setup_dropout_shrinks_the_roster() -> None:
    f = LocalFederation(N, PARAMS, seed=3)
    usable = f.setup(drop=[4])
    assert usable == (0, 1, 2, 3, 5)
    ups = updates(1)
    res = f.run_round(ups, W)
    assert np.abs(res.mean - mean(ups, W, [0, 1, 2, 3, 5])).max() < 1e-6


def test_sampled_subset_of_sites() -> None:
    # weights are 1, so the public weight bound is 1 (precision is relative to weight_scale).
    # 4 of 10 sites in the round: each has 3 participating neighbours, so t <= 3 while the
    # graph has k = 9; the sites must accept t below their default k/2 floor for this
    params = SecAggParams(threshold=2, num_neighbours=9, weight_scale=1.0)
    f = LocalFederation(10, params, threshold_floor=0.2)
    f.setup()
    ups = updates(5, n=10)
    res = f.run_round(ups, [1.0] * 10, participants=[1, 3, 4, 8])
    assert np.abs(res.mean - mean(ups, [1.0] * 10, [1, 3, 4, 8])).max() < 1e-6


def test_participants_with_too_few_neighbours_abort_before_anything_is_sent() -> None:
    f = LocalFederation(12, SecAggParams(threshold=3, num_neighbours=4))
    f.setup()
    with pytest.raises(AbortRound, match="fewer than threshold"):
        f.server.begin_round(1, [0, 1, 2], 3)
    assert f.server.stage == ServerStage.READY


# -- a hand-driven round for negative tests ------------------------------------------------


@dataclasses.dataclass
class Round:
    server: ServerState
    clients: dict[int, ClientState]
    requests: dict  # type: ignore[type-arg]


def hand_round(upload: bool = True, params: SecAggParams = PARAMS, n: int = N) -> Round:
    server = ServerState(params, run_id=b"run-1")
    clients = {
        i: ClientState(i, params, random_bytes=deterministic_random_bytes(1, str(i)))
        for i in range(n)
    }
    adv = server.begin_setup(range(n))
    for c in clients.values():
        server.receive_advertise(c.handle_advertise(adv))
    for i, req in server.close_advertise().items():
        server.receive_share_keys(clients[i].handle_share_keys(req))
    server.close_share_keys()
    requests = server.begin_round(1, range(n), 2)
    rnd = Round(server, clients, requests)
    if upload:
        for i, c in clients.items():
            rng = np.random.default_rng(i)
            server.receive_upload(c.handle_round(requests[i], np.zeros(2), 1.0, rng=rng))
    return rnd


def test_client_refuses_replayed_round() -> None:
    r = hand_round()
    with pytest.raises(ProtocolError, match="replay"):
        r.clients[0].handle_round(r.requests[0], np.zeros(2), 1.0, rng=np.random.default_rng())


def test_client_refuses_out_of_order_messages() -> None:
    r = hand_round(upload=False)
    c = r.clients[0]
    with pytest.raises(ProtocolError):
        c.handle_unmask(UnmaskRequest(1, 1, (), b"", (), (), b""))  # before uploading
    fresh = ClientState(0, PARAMS, random_bytes=deterministic_random_bytes(1, "x"))
    with pytest.raises(ProtocolError):
        fresh.handle_round(r.requests[0], np.zeros(2), 1.0, rng=np.random.default_rng())


def test_client_refuses_wrong_generation_neighbours_or_size() -> None:
    r = hand_round(upload=False)
    c, req = r.clients[0], r.requests[0]
    rng = np.random.default_rng()
    with pytest.raises(ProtocolError, match="generation"):
        c.handle_round(dataclasses.replace(req, gen=5), np.zeros(2), 1.0, rng=rng)
    with pytest.raises(ProtocolError):
        c.handle_round(
            dataclasses.replace(req, neighbours=req.neighbours[1:]), np.zeros(2), 1.0, rng=rng
        )
    with pytest.raises(ProtocolError):
        c.handle_round(req, np.zeros(3), 1.0, rng=rng)
    assert c.memory.stage == ClientStage.READY  # nothing consumed by refused requests


def test_client_refuses_replayed_or_mismatched_setup() -> None:
    server = ServerState(PARAMS, run_id=b"run-2")
    client = ClientState(0, PARAMS, random_bytes=deterministic_random_bytes(1, "0"))
    adv = server.begin_setup([0, 1, 2, 3])
    client.handle_advertise(adv)
    with pytest.raises(ProtocolError, match="replay"):
        client.handle_advertise(adv)
    other = ClientState(
        1, SecAggParams(threshold=2), random_bytes=deterministic_random_bytes(1, "1")
    )
    with pytest.raises(ProtocolError, match="digest"):
        other.handle_advertise(adv)
    stranger = ClientState(7, PARAMS, random_bytes=deterministic_random_bytes(1, "7"))
    with pytest.raises(ProtocolError):
        stranger.handle_advertise(adv)
    with pytest.raises(ProtocolError):
        client.handle_advertise(KeyAdvertiseRequest(b"run-2", 0, (0, 1), PARAMS.digest()))


def _unmask_for(r: Round, site: int) -> UnmaskRequest:
    return r.server.close_uploads()[site]


def test_server_asking_for_both_shares_of_one_site_is_refused() -> None:
    r = hand_round()
    req = _unmask_for(r, 0)
    j = req.b_senders[0]
    ct = req.b_ciphertexts[:CIPHERTEXT_BYTES]
    both = dataclasses.replace(req, s_senders=(j,), s_gens=(0,), s_ciphertexts=ct)
    with pytest.raises(ProtocolError, match="both"):
        r.clients[0].handle_unmask(both)


def test_both_shares_across_two_requests_are_refused() -> None:
    r = hand_round()
    req = _unmask_for(r, 0)
    j = req.b_senders[0]
    first = UnmaskRequest(1, 1, (j,), req.b_ciphertexts[:CIPHERTEXT_BYTES], (), (), b"")
    r.clients[0].handle_unmask(first)
    r.clients[0].handle_unmask(first)  # an identical retry is answered
    second = UnmaskRequest(1, 1, (), b"", (j,), (0,), b"\x00" * CIPHERTEXT_BYTES)
    with pytest.raises(ProtocolError, match="both"):
        r.clients[0].handle_unmask(second)


def test_client_state_survives_serialisation_between_requests() -> None:
    r = hand_round()
    req = _unmask_for(r, 0)
    client = r.clients[0]
    clone = ClientState(0, PARAMS, random_bytes=deterministic_random_bytes(9, "0"))
    clone.load_state_dict(client.state_dict())
    a, b = client.handle_unmask(req), clone.handle_unmask(req)
    assert np.array_equal(a.b_shares, b.b_shares)
    assert all(isinstance(v, (int, bytes, np.ndarray)) for v in clone.state_dict().values())
    with pytest.raises(ProtocolError):
        ClientState(1, PARAMS, random_bytes=deterministic_random_bytes(9, "1")).load_state_dict(
            client.state_dict()
        )
    broken = client.state_dict()
    broken["c_secret"] = 5
    with pytest.raises(ProtocolError):
        clone.load_state_dict(broken)


def test_tampered_relayed_share_is_left_out_of_the_response(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A ciphertext that fails authentication costs only its sender's share: the site answers
    every other share (before, the whole response failed and knocked the site out)."""
    r = hand_round()
    req = _unmask_for(r, 0)
    blob = bytearray(req.b_ciphertexts)
    blob[30] ^= 0x80  # inside the first sender's ciphertext
    with caplog.at_level("WARNING", logger="fedagg"):
        resp = r.clients[0].handle_unmask(dataclasses.replace(req, b_ciphertexts=bytes(blob)))
    assert resp.b_owners == req.b_senders[1:]
    assert resp.b_shares.shape == (len(req.b_senders) - 1, 9)
    assert "did not decrypt" in caplog.text and bytes(blob).hex()[:16] not in caplog.text


def test_share_for_a_non_neighbour_or_wrong_generation_is_refused() -> None:
    r = hand_round(params=SecAggParams(threshold=3, num_neighbours=4), n=8)
    req = _unmask_for(r, 0)
    stranger = next(i for i in range(1, 8) if i not in req.b_senders)
    assert stranger not in r.clients[0].memory.neighbours
    bad = UnmaskRequest(1, 1, (), b"", (stranger,), (0,), b"\x00" * CIPHERTEXT_BYTES)
    with pytest.raises(ProtocolError):
        r.clients[0].handle_unmask(bad)
    j = req.b_senders[0]
    wrong_gen = UnmaskRequest(1, 1, (), b"", (j,), (7,), b"\x00" * CIPHERTEXT_BYTES)
    with pytest.raises(ProtocolError, match="generations"):
        r.clients[0].handle_unmask(wrong_gen)


def test_server_rejects_late_duplicate_and_foreign_uploads() -> None:
    r = hand_round(upload=False)
    s, c = r.server, r.clients
    rng = np.random.default_rng(0)
    up0 = c[0].handle_round(r.requests[0], np.zeros(2), 1.0, rng=rng)
    s.receive_upload(up0)
    with pytest.raises(ProtocolError):
        s.receive_upload(up0)  # duplicate
    with pytest.raises(ProtocolError):
        s.receive_upload(dataclasses.replace(up0, site=1, round=2))  # wrong round
    with pytest.raises(ProtocolError):
        s.receive_upload(dataclasses.replace(up0, site=1, masked=np.zeros(9, np.uint32)))
    for i in range(1, N):
        s.receive_upload(c[i].handle_round(r.requests[i], np.zeros(2), 1.0, rng=rng))
    s.close_uploads()
    with pytest.raises(ProtocolError):
        s.receive_upload(up0)  # late
    with pytest.raises(ProtocolError):
        s.begin_round(2, range(N), 2)  # round still open


def test_server_rejects_reused_round_numbers_and_bad_stage_calls() -> None:
    r = hand_round()
    s = r.server
    with pytest.raises(ProtocolError):
        s.finish_round()  # before close_uploads
    for i, req in s.close_uploads().items():
        s.receive_unmask(r.clients[i].handle_unmask(req))
    s.finish_round()
    with pytest.raises(ProtocolError, match="reuse"):
        s.begin_round(1, range(N), 2)


def _corrupt(resp, rows=slice(None)):  # type: ignore[no-untyped-def]
    shares = resp.b_shares.copy()
    shares[rows, 0] = (shares[rows, 0] + 1) % (2**31 - 1)
    return dataclasses.replace(resp, b_shares=shares)


def test_server_decodes_around_a_corrupted_revealed_share() -> None:
    """Site 0 lies about every share it reveals; each secret still has t good shares among
    its k = 5 holders, so the round completes (before: VerificationError, round lost)."""
    r = hand_round()
    s = r.server
    for i, req in s.close_uploads().items():
        resp = r.clients[i].handle_unmask(req)
        s.receive_unmask(_corrupt(resp) if i == 0 else resp)
    res = s.finish_round()
    assert res.counted == tuple(range(N)) and np.abs(res.mean).max() <= res.error_bound
    assert s.stage == ServerStage.READY and s.blamed_sites == ()


def test_server_detects_shares_it_cannot_decode_around() -> None:
    """When every holder lies, no candidate opens the commitment: opaque VerificationError."""
    r = hand_round()
    s = r.server
    for i, req in s.close_uploads().items():
        s.receive_unmask(_corrupt(r.clients[i].handle_unmask(req)))
    with pytest.raises(VerificationError) as err:
        s.finish_round()
    assert str(err.value) == "verification failed"
    assert s.stage == ServerStage.READY


def test_server_abort_round_marks_missing_uploaders_stale() -> None:
    r = hand_round(upload=False)
    rng = np.random.default_rng(0)
    r.server.receive_upload(r.clients[0].handle_round(r.requests[0], np.zeros(2), 1.0, rng=rng))
    r.server.abort_round()
    assert r.server.usable_sites == (0,)
    with pytest.raises(ProtocolError):
        r.server.abort_round()


def test_server_restart_with_new_run_id_rekeys_cleanly() -> None:
    f = fed()
    f.run_round(updates(1), W)
    f.server = ServerState(PARAMS, run_id=b"restarted-run")  # epoch counter starts again at 1
    f.setup()
    ups = updates(2)
    res = f.run_round(ups, W)
    assert np.abs(res.mean - mean(ups, W, list(range(N)))).max() < 1e-6


def test_numpy_site_ids_are_accepted_and_huge_ids_refused() -> None:
    assert ClientState(np.int64(3), PARAMS, random_bytes=bytes).site == 3  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="map node ids"):
        ClientState(2**40, PARAMS, random_bytes=bytes)
    with pytest.raises(ConfigError, match="map node ids"):
        ServerState(PARAMS, run_id=b"r").begin_setup([0, 2**40])
