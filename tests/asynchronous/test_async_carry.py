"""Secure FedBuff: a late cohort member carries its update into its next cohort.

The loop tests run the real SecAgg+ protocol over a DelayedGrid (as test_async_secure.py) and
check every applied buffer against the plaintext sum recomputed from the deterministic site
function, the carried members counted from the version and job they were trained in, scaled
by ``w(s_hat + older) / w(s_hat)``. The protocol tests check the two guarantees the site
relies on: the server has a drop proof only for an upload it removed (so that upload is never
unmasked), and a site carries an update only against that proof, and only once.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _async_helpers import config, run
from flwr.app import Context, RecordDict
from test_async_secure import SECURE, _check_against_plaintext

from clients import carry
from fedagg.asyncagg import SpeedModel, StalenessWeight
from fedagg.errors import ProtocolError
from fedagg.secagg import ClientState, LocalFederation, SecAggParams
from server.async_carry import Carry, CarryBook
from server.delayed import DelayedGrid
from strategies.wire import CARRY_KEY, CarryRequest

WEIGHT = StalenessWeight("polynomial", 0.5, 4)
SLOW = (1.0, 1.0, 3.0, 1.0, 1.0, 1.0, 2.5, 1.0, 1.0, 1.0, 1.0, 4.0)


def _slow_run(*extra: str, grid_cls: type[DelayedGrid] = DelayedGrid):  # type: ignore[no-untyped-def]
    """12 sites, C = 8, cohorts of 4 closing at 3: the slow sites are left out often."""
    speed = SpeedModel(seed=4, job_seconds=10.0, sigma=0.3, latency=0.2, factors=SLOW)
    cfg = config(12, "run.rounds=14", *SECURE, "asynchronous.buffer_size=4",
                 "asynchronous.concurrency=8", "asynchronous.cohort_quorum=0.75", *extra)
    return run(cfg, speed, grid_cls=grid_cls)


def _carries(msg) -> bool:  # type: ignore[no-untyped-def]
    rec = msg.content.config_records.get(CARRY_KEY) if msg.has_content() else None
    return rec is not None and CarryRequest.from_record(rec).carries


class _SlowCarryGrid(DelayedGrid):
    """A DelayedGrid whose carried uploads take ``CARRY`` simulated seconds (a loaded engine
    where the carrier's message waits behind the trainers'), not one latency; it logs the
    ``(node, server-round)`` of every carry request."""

    CARRY = 14.0

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.carry_requests: list[tuple[int, int]] = []

    def duration(self, msg) -> float:  # type: ignore[no-untyped-def]
        if _carries(msg):
            rnd = msg.content.config_records["config"]["server-round"]
            self.carry_requests.append((msg.metadata.dst_node_id, int(rnd)))
            return self.CARRY
        return float(super().duration(msg))


class _HungCarryGrid(_SlowCarryGrid):
    CARRY = 1e5  # never within the cohort's time (nor run.round_timeout)


def test_carried_updates_equal_the_plaintext_buffered_aggregate() -> None:
    recs, got, grid = _slow_run()
    assert [r["version"] for r in recs] == list(range(15))
    carried = _check_against_plaintext(recs, got, grid, WEIGHT, s_hat=8 // 4 - 1)
    assert carried >= 3, carried
    refused = [v for r in recs for v in r.get("rejected", {}).values()]
    assert any("carries its update into its next cohort" in v for v in refused)
    # a carried upload trains nothing: fewer training jobs than cohort members dispatched
    members = sum(len(r["cohort_nodes"]) for r in recs[1:])
    assert grid.jobs < members + sum(r["secagg_dropped"] for r in recs[1:])


def test_a_cohort_waits_for_its_carried_members() -> None:
    """Carried uploads slower than the quorum's trainers (14 s vs about 10 s): the cohort
    waits for them (up to its own time again) instead of closing at the quorum, so every
    carried update reaches the model, and the sums still equal the plaintext ones."""
    recs, got, grid = _slow_run(grid_cls=_SlowCarryGrid)
    assert [r["version"] for r in recs] == list(range(15))
    carried = _check_against_plaintext(recs, got, grid, WEIGHT, s_hat=8 // 4 - 1)
    closed = {r["cohort_round"] for r in recs[1:]}  # the run may stop with cohorts open
    asked = {(n, rnd) for n, rnd in grid.carry_requests if rnd in closed}
    counted = {(n, r["cohort_round"]) for r in recs[1:] for n in r["cohort_nodes"]
               if str(n) in r.get("cohort_carried", {})}
    assert carried >= 3 and asked == counted, (carried, asked ^ counted)


def test_a_hung_carrier_delays_its_cohort_by_at_most_the_cohort_time() -> None:
    """Carriers that never answer (run.round_timeout = 1000 s would not end the wait): each
    cohort closes at most its quorum's time again after the quorum, without them (counted as
    dropped), and the run goes on."""
    recs, got, grid = _slow_run("run.rounds=6", "run.round_timeout=1000",
                                grid_cls=_HungCarryGrid)
    assert [r["version"] for r in recs] == list(range(7))
    assert _check_against_plaintext(recs, got, grid, WEIGHT, s_hat=1) == 0
    assert grid.carry_requests and not any(r.get("cohort_carried") for r in recs)
    # a cohort's quorum comes within its third-slowest job (job_seconds = 10, factor <= 4,
    # lognormal sigma 0.3): two of those per version, far below the 1000 s timeout
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(recs)]
    assert max(gaps) < 2 * 2 * 4 * 10, gaps


def test_without_carry_late_updates_are_wasted() -> None:
    recs, got, grid = _slow_run("asynchronous.carry_late=false")
    assert _check_against_plaintext(recs, got, grid, WEIGHT, s_hat=1) == 0
    assert all(not r.get("cohort_carried") for r in recs[1:])
    refused = [v for r in recs for v in r.get("rejected", {}).values()]
    assert refused and not any("carries" in v for v in refused)


def test_a_carried_update_never_exceeds_max_staleness() -> None:
    recs, got, grid = _slow_run("asynchronous.max_staleness=2")
    _check_against_plaintext(recs, got, grid, WEIGHT, s_hat=1)
    for r in recs[1:]:
        [s] = [int(k) for k in r["staleness"]]
        for c in r.get("cohort_carried", {}).values():
            assert s + c["older"] <= 2, (r["version"], s, c)


def test_carry_book_scales_orders_and_forgets() -> None:
    book = CarryBook(enabled=True, staleness=WEIGHT, expected=1, max_staleness=4)
    book.removed([5, 7, 9], {5: b"p" * 32, 7: b"q" * 32}, server_round=3, version=2)
    assert set(book.pending) == {5, 7}  # 9: no proof (its key was not rebuilt), never carried
    assert book.replied(5, True) and not book.replied(7, False) and not book.replied(9, True)
    book.removed([8], {8: b"r" * 32}, server_round=6, version=4)
    assert book.replied(8, True)
    assert book.first([1, 5, 8], 3, version=4) == [5, 8]  # oldest first
    assert book.first([1, 5, 8], 3, version=6) == [8]  # 5: 1 + 6 - 2 > 4, forgotten
    [(req, c)] = book.requests([8], version=6).values()
    assert c == Carry(8, 6, 4, b"r" * 32) and req.round == 6 and req.proof == b"r" * 32
    assert req.scale == pytest.approx(WEIGHT(1 + 2) / WEIGHT(1))
    assert not book.ready and not book.pending
    assert set(book.too_stale({8: (c, 2), 3: (c, 4)}, staleness=1)) == {3}


def test_the_server_has_a_drop_proof_only_for_an_upload_it_removed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The drop proof is a function of the mask key the upload used: the server gets it by
    rebuilding that key from t shares, i.e. only for a site it counted as dropped, whose
    self-mask seed it then never gets (the honest neighbours reveal one kind of share)."""
    proofs: dict[int, bytes] = {}
    handle = ClientState.handle_round

    def spy(self: ClientState, request, update, weight, *, rng):  # type: ignore[no-untyped-def]
        out = handle(self, request, update, weight, rng=rng)
        proofs[self.site] = self.last_drop_proof
        return out

    monkeypatch.setattr(ClientState, "handle_round", spy)
    fed = LocalFederation(6, SecAggParams(threshold=4, num_neighbours=5), seed=2)
    fed.setup()
    ups = [np.full(3, 0.1 * i) for i in range(6)]
    res = fed.run_round(ups, [1.0] * 6, drop_before_upload=[4])
    assert res.dropped == (4,) and 4 not in res.counted
    assert fed.server.drop_proofs == {4: proofs[4]}
    assert len(set(proofs.values())) == 6 and all(len(p) == 32 for p in proofs.values())
    res = fed.run_round(ups, [1.0] * 6, participants=[0, 1, 2, 3, 5])
    assert fed.server.drop_proofs == {}  # nobody dropped: no proof for anyone


def _site(held_round: int = 7, proof: bytes = b"k" * 32) -> Context:
    ctx = Context(run_id=1, node_id=11, node_config={}, state=RecordDict(), run_config={})
    carry.hold(ctx, held_round, np.arange(4, dtype=np.float64), 30.0, proof)
    return ctx


@pytest.mark.parametrize("request_, why", [
    (CarryRequest(7, b"x" * 32, 0.5), "drop proof"),   # a server that did not remove it
    (CarryRequest(6, b"k" * 32, 0.5), "round"),        # another job's update
])
def test_a_site_refuses_a_carry_without_the_proof(request_: CarryRequest, why: str) -> None:
    ctx = _site()
    with pytest.raises(ProtocolError, match=why):
        carry.take(ctx, request_, 4)
    with pytest.raises(ProtocolError, match="no held update"):  # and the update is gone
        carry.take(ctx, CarryRequest(7, b"k" * 32, 0.5), 4)


def test_a_site_carries_its_update_once_and_only_at_its_size() -> None:
    ctx = _site()
    values, weight = carry.take(ctx, CarryRequest(7, b"k" * 32, 0.5), 4)
    assert values.tolist() == [0.0, 0.5, 1.0, 1.5] and weight == 30.0
    with pytest.raises(ProtocolError, match="no held update"):
        carry.take(ctx, CarryRequest(7, b"k" * 32, 0.5), 4)
    with pytest.raises(ProtocolError, match="size"):
        carry.take(_site(), CarryRequest(7, b"k" * 32, 0.5), 5)


@pytest.mark.parametrize("record", [
    {"round": 3, "proof": b"k" * 32, "scale": 1.5},   # scaled up
    {"round": 3, "proof": b"k" * 31, "scale": 0.5},
    {"round": "3"},
])
def test_a_malformed_carry_record_is_refused(record: dict) -> None:  # type: ignore[type-arg]
    from flwr.app import ConfigRecord

    with pytest.raises(ProtocolError, match=r"fedagg\.carry"):
        CarryRequest.from_record(ConfigRecord(record))
    assert "k" * 8 not in repr(CarryRequest(3, b"k" * 32, 0.5))  # the proof is not shown
