"""A lying server against the sites' own checks (issue 17, item 3).

Each attack is played out as the issue describes it, with the server's real state and
messages forged from it; on the code before these defences every one of them succeeded:

* re-announcing a neighbour's used key generation and claiming the neighbour dropped made the
  other sites hand over shares of the old key, and one site's round-1 update was recovered;
* weak parameters (``t = 1``, ``k = 2``) were accepted from the server;
* the server alone picked the run id that seeds the neighbour graph (grinding);
* one wrong revealed share aborted the reconstruction (the ``t`` lowest shares were used).

The threat model and which test checks which defence: docs/protocols/secagg.md, section 4.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from secagg_net import Net, plain_mean, unmask_one, updates

from fedagg.errors import ConfigError, ProtocolError, VerificationError
from fedagg.secagg import (
    ClientStage,
    ClientState,
    SecAggParams,
    ShareKeysRequest,
    UnmaskRequest,
    deterministic_random_bytes,
    shamir,
)
from fedagg.secagg.graph import harary_graph
from fedagg.secagg.keys import SecretKey, context, derive_key
from fedagg.secagg.params import check_site_floor

DIM = 4


# -- re-announced key generations ------------------------------------------------------------


def _b_seed(responses: dict, owner: int, t: int) -> bytes:  # type: ignore[type-arg]
    shares = [
        shamir.Share(r + 1, row)
        for r, resp in responses.items()
        for o, row in zip(resp.b_owners, resp.b_shares, strict=True)
        if o == owner
    ]
    return shamir.reconstruct(shares, t)


def _reannounce(req, victim: int, gen: int, public: bytes):  # type: ignore[no-untyped-def]
    """The RoundRequest ``req`` with ``victim`` announced at ``gen`` with key ``public``."""
    pos = req.neighbours.index(victim)
    gens = list(req.neighbour_gens)
    gens[pos] = gen
    keys = bytearray(req.neighbour_s_public)
    keys[32 * pos : 32 * pos + 32] = public
    return dataclasses.replace(req, neighbour_gens=tuple(gens), neighbour_s_public=bytes(keys))


def _replay_attack(net: Net, victim: int, holders, ups2):  # type: ignore[no-untyped-def]
    """Round 2 of the attack: tell ``holders`` that ``victim`` is at generation 0 again and
    dropped; collect their shares of the generation-0 key. Returns (refusals, shares)."""
    t = net.params.threshold
    refused, shares = [], []
    requests = net.server.begin_round(2, net.server.usable_sites, DIM)
    for i in holders:
        lie = _reannounce(requests[i], victim, 0, net.gen0_public)  # type: ignore[attr-defined]
        try:
            net.clients[i].handle_round(lie, ups2[i], 1.0, rng=np.random.default_rng(i))
        except ProtocolError as err:
            assert "re-announced" in str(err)
            refused.append(i)
            continue
        ask = UnmaskRequest(
            epoch=net.server.epoch,
            round=2,
            b_senders=(),
            b_ciphertexts=b"",
            s_senders=(victim,),
            s_gens=(0,),
            s_ciphertexts=net.gen0_cts[i],  # type: ignore[attr-defined]
        )
        resp = net.clients[i].handle_unmask(ask)
        shares.extend(shamir.Share(i + 1, row) for row in resp.s_shares)
    del t
    return refused, shares


def _try_recover(  # type: ignore[no-untyped-def]
    net: Net, victim: int, upload, seed: bytes, shares, publics, n_part: int
):
    """The lying server's last step: rebuild the old key and unmask the victim's upload."""
    t = net.params.threshold
    if len(shares) < t:
        return None
    try:
        raw = shamir.reconstruct_verified(
            shares,
            t,
            lambda r: SecretKey(r).public_bytes() == net.gen0_public,  # type: ignore[attr-defined]
        )
    except VerificationError:
        return None
    nbrs = {j: publics[j] for j in net.server.graph[victim] if j in publics}
    return unmask_one(
        net,
        upload,
        seed=seed,
        key=SecretKey(raw),
        neighbour_publics=nbrs,
        num_participants=n_part,
        dim=DIM,
    )


@pytest.mark.parametrize("t", [3, 5])  # t > k/2, and t = k (the issue: "even with t = k")
def test_reannounced_key_generation_is_refused_and_the_update_stays_hidden(t: int) -> None:
    """Round 1 honest; in round 2 the server re-announces the victim at its used generation 0
    to every neighbour and claims it dropped. Every neighbour refuses the round request, so no
    share of the old key leaves a site and the victim's round-1 update stays masked."""
    n, victim = 6, 0
    net = Net(n, SecAggParams(threshold=t, weight_scale=1.0))  # k = 5 (complete graph)
    net.setup()
    net.gen0_public = net.server.setup.keys[victim].public  # type: ignore[attr-defined]
    net.gen0_cts = dict(net.server.setup.keys[victim].ciphertexts)  # type: ignore[attr-defined]
    publics = {i: net.server.setup.keys[i].public for i in range(n)}  # round-1 keys of everybody
    ups = updates(1, n, DIM)
    _, sent = net.uploads(1, ups)
    _, responses = net.unmask()
    net.server.finish_round()
    seed = _b_seed(responses, victim, t)  # legitimately revealed: the victim survived round 1
    holders = net.server.graph[victim]
    refused, shares = _replay_attack(net, victim, holders, updates(2, n, DIM))
    assert refused == list(holders) and shares == []
    recovered = _try_recover(net, victim, sent[victim], seed, shares, publics, n)
    assert recovered is None


def _sampled_round_then_replay(threshold_floor: float, t: int):  # type: ignore[no-untyped-def]
    """The victim uploads in round 1 with only 4 of its 7 neighbours; the 3 absent ones never
    saw its generation 0 used, so they accept a re-announcement. Returns what the server can
    rebuild afterwards, and the victim's true update."""
    n, victim = 8, 0
    params = SecAggParams(threshold=t, weight_scale=1.0)  # k = 7 (complete graph over 8)
    net = Net(n, params, seed=3, threshold_floor=threshold_floor)
    net.setup()
    net.gen0_public = net.server.setup.keys[victim].public  # type: ignore[attr-defined]
    net.gen0_cts = dict(net.server.setup.keys[victim].ciphertexts)  # type: ignore[attr-defined]
    publics = {i: net.server.setup.keys[i].public for i in range(n)}
    present, absent = [1, 2, 3, 4], [5, 6, 7]
    ups = updates(4, n, DIM)
    _, sent = net.uploads(1, ups, participants=[victim, *present])
    _, responses = net.unmask()
    net.server.finish_round()
    seed = _b_seed(responses, victim, t)
    refused, shares = _replay_attack(net, victim, present + absent, updates(5, n, DIM))
    assert refused == present  # the neighbours that saw generation 0 used refuse
    nbr_publics = {j: publics[j] for j in present}
    recovered = _try_recover(net, victim, sent[victim], seed, shares, nbr_publics, 5)
    return recovered, ups[victim]


def test_reannounced_generation_to_absent_neighbours_fails_with_t_above_k_over_2() -> None:
    """The memory alone does not cover neighbours that were not in the round where the key was
    used; with t > k/2 those are too few: the t neighbours that revealed the self-mask share
    remember the generation, and the k - t < t others cannot rebuild the key."""
    recovered, _ = _sampled_round_then_replay(threshold_floor=0.5, t=4)
    assert recovered is None


def test_why_the_floor_matters_a_site_that_waives_it_is_exposed() -> None:
    """The same attack against sites that accept t = 3 <= k/2 (threshold_floor lowered to 0):
    the 3 absent neighbours hand over enough shares and the victim's update is recovered.
    This is the residual risk of lowering a site's floor, documented in the threat model."""
    recovered, truth = _sampled_round_then_replay(threshold_floor=0.0, t=3)
    assert recovered is not None
    assert np.abs(recovered - truth).max() < 1e-5


def _serial(net: Net, i: int) -> ClientState:
    """Site ``i`` through state_dict / load_state_dict (a fresh process per message)."""
    fresh = ClientState(
        i, net.params, random_bytes=deterministic_random_bytes(9, f"clone-{i}"), threads=1
    )
    fresh.load_state_dict(net.clients[i].state_dict())
    return fresh


def test_generation_memory_survives_state_dict_and_refuses_older_and_equal() -> None:
    net = Net(6, SecAggParams(threshold=3, weight_scale=1.0))
    net.setup()
    gen0 = net.server.setup.keys[1].public
    net.round(1, updates(1, 6, DIM))
    net.round(2, updates(2, 6, DIM))  # site 1 is now at generation 2
    gen1 = net.server.setup.keys[1].public
    del gen1
    requests = net.server.begin_round(3, net.server.usable_sites, DIM)
    honest = requests[0]
    rng = np.random.default_rng(0)
    for gen in (0, 1):  # older than the newest seen (1) and equal to it
        lie = _reannounce(honest, 1, gen, gen0)
        with pytest.raises(ProtocolError, match="re-announced"):
            _serial(net, 0).handle_round(lie, np.zeros(DIM), 1.0, rng=rng)
    clone = _serial(net, 0)
    assert clone.handle_round(honest, np.zeros(DIM), 1.0, rng=rng).round == 3  # gen 2 is fine
    state = clone.state_dict()
    assert state["version"] == 2
    floor = state["gen_floor"].reshape(-1, 3)  # type: ignore[union-attr]
    assert {int(j): int(g) for j, _, g in floor} == {j: 2 for j in range(1, 6)}


def test_version_1_state_loads_with_no_memory_and_a_bad_floor_is_refused() -> None:
    net = Net(4, SecAggParams(threshold=2, weight_scale=1.0))
    net.setup()
    net.round(1, updates(1, 4, DIM))
    state = net.clients[0].state_dict()
    old = {k: v for k, v in state.items() if k != "gen_floor"}
    old["version"] = 1
    clone = ClientState(0, net.params, random_bytes=deterministic_random_bytes(1, "x"))
    clone.load_state_dict(old)
    assert clone.memory.gen_floor == {}
    for bad in (np.arange(4, dtype=np.int64), "x"):
        with pytest.raises(ProtocolError, match="malformed state"):
            clone.load_state_dict({**state, "gen_floor": bad})  # type: ignore[dict-item]


def test_memory_is_kept_across_epochs_of_a_run_and_dropped_for_a_new_run() -> None:
    net = Net(4, SecAggParams(threshold=2, weight_scale=1.0))
    net.setup()
    net.round(1, updates(1, 4, DIM))
    assert net.clients[0].memory.gen_floor
    net.setup()  # epoch 2 of the same run: generation 0 of the new epoch is newer
    assert net.clients[0].memory.gen_floor and net.server.epoch == 2
    res = net.round(2, updates(2, 4, DIM))
    assert res.counted == (0, 1, 2, 3)
    other = Net(4, net.params, run_id=b"another-run")
    other.clients[0] = _serial(net, 0)
    other.setup()
    assert other.clients[0].memory.gen_floor == {}


# -- the site's floor for t and k ----------------------------------------------------------


def _advertise_request(n: int, params: SecAggParams):  # type: ignore[no-untyped-def]
    return Net(n, params).server.begin_setup(range(n))


@pytest.mark.parametrize(
    ("n", "params", "field"),
    [
        (3, SecAggParams(threshold=1), "secagg.threshold"),  # t = 1, k = 2 (the case)
        (5, SecAggParams(threshold=2), "secagg.threshold"),  # t = k/2 = 2 is not > k/2
        (20, SecAggParams(threshold=5), "secagg.threshold"),  # k = 19: t >= 10 needed
        (10, SecAggParams(threshold=2, num_neighbours=2), "secagg.num_neighbours"),  # k = 2
        (2 + 8, SecAggParams(threshold=1, num_neighbours=1), "secagg.num_neighbours"),
    ],
)
def test_site_refuses_parameters_below_its_floor(n: int, params: SecAggParams, field: str) -> None:
    """The server sends t and k; a site refuses weaker ones at advertise, before making keys
    (the code before accepted t = 1, k = 2 and one update was recovered in a single round)."""
    client = ClientState(0, params, random_bytes=deterministic_random_bytes(0, "0"))
    with pytest.raises(ProtocolError, match=field) as err:
        client.handle_advertise(_advertise_request(n, params))
    assert "refused by site 0" in str(err.value) and "Fix:" in str(err.value)
    assert client.memory.stage == ClientStage.NEW and client.memory.c is None


def test_site_floors_are_constructor_parameters() -> None:
    params = SecAggParams(threshold=3)  # 5 sites: k = 4, t = 3 > 2: fine by default
    req = _advertise_request(5, params)
    ClientState(0, params, random_bytes=deterministic_random_bytes(0, "a")).handle_advertise(req)
    strict_k = ClientState(0, params, random_bytes=bytes, min_neighbours=5)
    strict_k.handle_advertise(req)  # k = 4 = N - 1: the complete graph is always accepted
    sparse = SecAggParams(threshold=3, num_neighbours=4)  # 9 sites, k = 4
    ClientState(0, sparse, random_bytes=bytes).handle_advertise(_advertise_request(9, sparse))
    strict_k = ClientState(0, sparse, random_bytes=bytes, min_neighbours=5)
    with pytest.raises(ProtocolError, match="degree >= 5"):
        strict_k.handle_advertise(_advertise_request(9, sparse))
    strict_t = ClientState(0, params, random_bytes=bytes, threshold_floor=0.75)
    with pytest.raises(ProtocolError, match=r"t > 0\.75"):
        strict_t.handle_advertise(req)
    lax = ClientState(1, SecAggParams(threshold=1), random_bytes=bytes, threshold_floor=0.0)
    lax.handle_advertise(_advertise_request(3, SecAggParams(threshold=1)))  # tests only


@pytest.mark.parametrize(
    "kwargs",
    [
        {"threshold_floor": -0.1},
        {"threshold_floor": 1.0},
        {"threshold_floor": "0.5"},
        {"threshold_floor": True},
        {"threshold_floor": float("nan")},
        {"min_neighbours": 0},
        {"min_neighbours": 2.5},
        {"min_neighbours": True},
    ],
)
def test_bad_floor_settings_are_refused(kwargs: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        ClientState(0, SecAggParams(threshold=2), random_bytes=bytes, **kwargs)


def test_floor_is_checked_again_on_the_roster_of_share_keys() -> None:
    """The server may show a bigger roster at share-keys than it invited: k grows, and t must
    still be above k/2."""
    params = SecAggParams(threshold=3)
    net = Net(5, params)
    req = net.server.begin_setup(range(5))
    advs = {i: c.handle_advertise(req) for i, c in net.clients.items()}
    for a in advs.values():
        net.server.receive_advertise(a)
    honest = net.server.close_advertise()[0]
    bigger = dataclasses.replace(
        honest,
        roster=tuple(range(12)),
        roster_public=honest.roster_public + bytes(64 * 7),
    )
    with pytest.raises(ProtocolError, match=r"secagg\.threshold"):
        net.clients[0].handle_share_keys(bigger)
    assert net.clients[0].memory.stage == ClientStage.ADVERTISED


@given(
    n=st.integers(2, 40),
    k=st.one_of(st.none(), st.integers(1, 40)),
    t=st.integers(1, 40),
    floor=st.sampled_from([0.0, 0.5, 2 / 3]),
    min_k=st.integers(1, 8),
)
@settings(max_examples=200, deadline=None)
def test_floor_rule_matches_its_statement(
    n: int, k: int | None, t: int, floor: float, min_k: int
) -> None:
    """Accepted exactly when t <= k, t > floor * k and k >= min(min_k, N - 1)."""
    try:
        params = SecAggParams(threshold=t, num_neighbours=k)
        degree = params.neighbours_for(n)
    except ConfigError:
        return
    expect = t > floor * degree and degree >= min(min_k, n - 1)
    try:
        got = check_site_floor(params, n, threshold_floor=floor, min_neighbours=min_k)
    except ConfigError:
        assert not expect
    else:
        assert expect and got == degree


# -- the neighbour-graph seed ----------------------------------------------------------------


def _old_seed(run_id: bytes, epoch: int, roster: list[int]) -> bytes:
    """The pre-issue-17 seed: run id, epoch and roster only (what a grinding server used)."""
    ids = np.asarray(sorted(roster), dtype=">u8").tobytes()
    ctx = context(run_id=run_id, epoch=epoch, counter=0, first=len(roster), second=0)
    tag = b"fedagg/secagg/v1/neighbour-graph"
    return derive_key(run_id + b"\x01", tag, ctx + hashlib.sha256(ids).digest())


def test_graph_depends_on_the_advertised_keys_not_on_the_run_id_alone() -> None:
    """Same run id, epoch and roster; the sites' fresh keys differ: so does the graph (before,
    the graph was a function of what the server chose)."""
    params = SecAggParams(threshold=4, num_neighbours=6)
    graphs = []
    for seed in range(6):
        net = Net(12, params, seed=seed, run_id=b"fixed-run")
        net.setup()
        graphs.append(net.server.graph)
    assert len({tuple(sorted(g.items())) for g in graphs}) == len(graphs)
    assert len({g[0] for g in graphs}) > 1  # the victim's neighbourhood moves too


def test_grinding_run_ids_does_not_pick_the_victims_neighbourhood() -> None:
    """The issue's attack: grind run ids offline until the victim's neighbours include every
    colluder (>= t of them), then run the epoch with that run id. The sites now accept only
    the graph seeded with the keys they draw after receiving the run id, not the ground one."""
    n, victim, colluders = 12, 0, {8, 9, 10, 11}
    params = SecAggParams(threshold=4, num_neighbours=6)
    roster = list(range(n))
    run_id = next(
        r
        for r in (b"grind-%d" % i for i in range(20_000))
        if colluders <= set(harary_graph(roster, 6, _old_seed(r, 1, roster))[victim])
    )
    target = harary_graph(roster, 6, _old_seed(run_id, 1, roster))
    net = Net(n, params, seed=5, run_id=run_id)
    net.setup()
    assert net.server.graph != target
    # and a server that tells the sites the ground graph instead is refused by them
    net2 = Net(n, params, seed=6, run_id=run_id)
    req = net2.server.begin_setup(roster)
    for c in net2.clients.values():
        net2.server.receive_advertise(c.handle_advertise(req))
    honest = net2.server.close_advertise()
    refused = 0
    for i in roster:
        keys = honest[i].roster_public
        forged = ShareKeysRequest(
            epoch=1,
            roster=tuple(roster),
            neighbours=target[i],
            neighbour_c_public=b"".join(keys[64 * j : 64 * j + 32] for j in target[i]),
            roster_public=keys,
        )
        with pytest.raises(ProtocolError, match="differ from the graph"):
            net2.clients[i].handle_share_keys(forged)
        refused += 1
    assert refused == n


def test_site_checks_its_own_keys_and_the_neighbour_keys_in_roster_public() -> None:
    net = Net(5, SecAggParams(threshold=3))
    req = net.server.begin_setup(range(5))
    for c in net.clients.values():
        net.server.receive_advertise(c.handle_advertise(req))
    honest = net.server.close_advertise()[2]
    keys = bytearray(honest.roster_public)
    keys[2 * 64 + 40] ^= 1  # this site's own s key, as the server tells it
    with pytest.raises(ProtocolError, match="own keys"):
        net.clients[2].handle_share_keys(dataclasses.replace(honest, roster_public=bytes(keys)))
    with pytest.raises(ProtocolError, match="roster_public"):
        net.clients[2].handle_share_keys(dataclasses.replace(honest, roster_public=b""))
    swapped = honest.neighbour_c_public[32:64] + honest.neighbour_c_public[:32]
    swapped += honest.neighbour_c_public[64:]
    with pytest.raises(ProtocolError, match="advertised keys"):
        net.clients[2].handle_share_keys(
            dataclasses.replace(honest, neighbour_c_public=swapped)
        )
    unsorted = dataclasses.replace(honest, roster=tuple(reversed(honest.roster)))
    with pytest.raises(ProtocolError, match="sorted"):
        net.clients[2].handle_share_keys(unsorted)
    assert net.clients[2].memory.stage == ClientStage.ADVERTISED
    assert net.clients[2].handle_share_keys(honest).recipients == honest.neighbours


def test_share_keys_request_without_roster_public_parses_and_is_then_refused() -> None:
    """roster_public is an optional wire field (older senders omit it); a site refuses a
    request without it, since it cannot check the graph."""
    net = Net(4, SecAggParams(threshold=2))
    req = net.server.begin_setup(range(4))
    for c in net.clients.values():
        net.server.receive_advertise(c.handle_advertise(req))
    d = net.server.close_advertise()[0].to_dict()
    del d["roster_public"]
    parsed = ShareKeysRequest.from_dict(d)
    assert parsed.roster_public == b""
    with pytest.raises(ProtocolError, match="wire version 2"):
        net.clients[0].handle_share_keys(parsed)


# -- one bad share -------------------------------------------------------------------------


def _lie_rows(resp, field: str):  # type: ignore[no-untyped-def]
    """Every revealed share replaced by random field elements (no structure to exploit)."""
    rows = getattr(resp, field)
    rng = np.random.default_rng(resp.site)
    lies = rng.integers(0, shamir.PRIME, rows.shape, dtype=np.int64).astype(np.uint32)
    return dataclasses.replace(resp, **{field: lies})


def test_one_bad_share_with_exactly_t_good_ones_does_not_abort() -> None:
    """Site 4 drops after uploading, so each other site's self-mask seed has 4 = t + 1 shares,
    and site 0 (x = 1, always among the t lowest) lies about all of its shares. Decoding
    cannot correct one error in t + 1 shares; the subset search finds the t good ones (the
    code before used the t lowest shares and aborted the round)."""
    n = 6
    net = Net(n, SecAggParams(threshold=3, weight_scale=1.0))  # k = 5
    net.setup()
    ups = updates(7, n, DIM)

    def respond(i: int, resp):  # type: ignore[no-untyped-def]
        if i == 4:
            return None
        return _lie_rows(resp, "b_shares") if i == 0 else resp

    res = net.round(1, ups, respond=respond)
    assert res.counted == tuple(range(n))
    assert np.abs(res.mean - plain_mean(ups, range(n))).max() <= res.error_bound


def test_a_lying_holder_of_a_dropped_sites_key_shares_does_not_abort() -> None:
    n = 6
    net = Net(n, SecAggParams(threshold=3, weight_scale=1.0))
    net.setup()
    ups = updates(8, n, DIM)

    def respond(i: int, resp):  # type: ignore[no-untyped-def]
        return _lie_rows(resp, "s_shares") if i == 1 else resp

    res = net.round(1, ups, upload=lambda i, up: None if i == 3 else up, respond=respond)
    assert res.dropped == (3,)
    assert np.abs(res.mean - plain_mean(ups, [0, 1, 2, 4, 5])).max() <= res.error_bound


def test_too_few_good_shares_abort_opaquely_and_the_next_round_works() -> None:
    n = 6
    net = Net(n, SecAggParams(threshold=3, weight_scale=1.0))
    net.setup()
    liars = {0, 1, 2}  # 3 of 5 holders lie: only 2 good shares of sites 3, 4, 5

    def respond(i: int, resp):  # type: ignore[no-untyped-def]
        return _lie_rows(resp, "b_shares") if i in liars else resp

    with pytest.raises(VerificationError) as err:
        net.round(1, updates(9, n, DIM), respond=respond)
    assert str(err.value) == "verification failed"
    ups = updates(10, n, DIM)
    usable = net.server.usable_sites
    res = net.round(2, ups, participants=usable)
    assert np.abs(res.mean - plain_mean(ups, usable)).max() <= res.error_bound
