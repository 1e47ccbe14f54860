"""Buffered secure aggregation (secure FedBuff) against the plaintext buffered aggregate.

Every cohort runs the real SecAgg+ protocol (fedagg.secagg state machines through
``SecureAggregation`` and the real client mod) over a DelayedGrid; the oracle recomputes each
applied buffer in plaintext from the deterministic site function of ``_async_helpers``:
``w(s) * sum n_i Delta_i / sum n_i`` over the sites the server says it counted, trained from
the version the cohort was dispatched with. The two must agree within the error bound the
round reports (fixed-point encoding), also when sites drop or arrive after their cohort
closed (their masks are removed with Shamir shares).
"""

from __future__ import annotations

import numpy as np
import pytest
from _async_helpers import config, examples, fake_app, run, train

from fedagg.asyncagg import SpeedModel, StalenessWeight

SECURE = ["strategy.name='secure'", "asynchronous.mode='fedbuff'", "secagg.weight_scale=100"]


def _check_against_plaintext(recs: list[dict], got: list[list[np.ndarray]], grid,  # type: ignore[no-untyped-def]
                             weight: StalenessWeight, s_hat: int = 0) -> int:
    """Check every applied buffer; a member that carried its late update (``cohort_carried``:
    trained in job ``round`` from ``version``, ``older`` versions before the cohort's) counts
    ``w(s_hat + older) / w(s_hat)`` times its delta. Returns how many updates were carried."""
    part_of = {n: int(grid.contexts[n].node_config["partition-id"]) for n in grid.node_ids}
    carried = 0
    for r in range(1, len(recs)):
        rec = recs[r]
        assert rec["model_updated"] and rec["version"] == r
        v, rnd = rec["cohort_version"], rec["cohort_round"]
        [(s, count)] = rec["staleness"].items()
        assert int(s) == r - 1 - v and count == rec["secagg_counted"]
        num = [np.zeros(a.shape) for a in got[v]]
        total = 0.0
        for node in rec["cohort_nodes"]:
            part = part_of[node]
            c = rec.get("cohort_carried", {}).get(str(node))
            base, job, factor = got[v], rnd, 1.0
            if c is not None:
                assert c["older"] == v - c["version"] > 0 and c["round"] < rnd
                base, job = got[c["version"]], c["round"]
                factor = weight(s_hat + c["older"]) / weight(s_hat)
                carried += 1
            trained = train(base, part, job)
            for j, (a, b) in enumerate(zip(trained, base, strict=True)):
                num[j] += factor * examples(part) * (a.astype(np.float64) - b.astype(np.float64))
            total += examples(part)
        scale = weight(int(s))
        for j in range(len(num)):
            want = got[r - 1][j].astype(np.float64) + scale * num[j] / total
            err = float(np.abs(got[r][j].astype(np.float64) - want).max())
            assert err <= scale * rec["secagg_error_bound"] + 1e-6, (r, j, err)
    return carried


def test_secure_fedbuff_equals_the_plaintext_buffered_aggregate() -> None:
    n = 6
    speed = SpeedModel(seed=8, job_seconds=10.0, sigma=0.7, latency=0.2)
    cfg = config(n, "run.rounds=5", *SECURE, "asynchronous.buffer_size=3",
                 "asynchronous.concurrency=6")
    recs, got, grid = run(cfg, speed)
    assert [r["version"] for r in recs] == list(range(6))
    assert all(r["secagg_counted"] == 3 and r["secagg_dropped"] == 0 for r in recs[1:])
    assert any(int(next(iter(r["staleness"]))) > 0 for r in recs[1:])  # 2 cohorts in flight
    _check_against_plaintext(recs, got, grid, StalenessWeight("polynomial", 0.5, 4))


def test_secure_fedbuff_with_dropouts_and_late_uploads() -> None:
    """Cohorts of 7, quorum 5: site 6 fails in its first job, site 5 is 6x slower.

    With k = 6 neighbours and t = 4 two sites of a cohort may drop; both are removed with
    Shamir shares, the late upload of site 5 is refused (its self mask is never revealed), and
    the applied sums are the plaintext sums of the five counted sites.
    """
    def bad(part: int, rnd: int) -> str:
        return "raise" if (part, rnd) == (6, 1) else ""

    n = 7
    speed = SpeedModel(seed=3, job_seconds=10.0, sigma=0.2,
                       factors=(1.0, 1.0, 1.0, 1.0, 1.0, 6.0, 1.0))
    cfg = config(n, "run.rounds=3", *SECURE, "asynchronous.buffer_size=7",
                 "asynchronous.cohort_quorum=0.7")
    recs, got, grid = run(cfg, speed, app=fake_app(bad))
    first = recs[1]
    assert first["secagg_counted"] == 5 and first["secagg_dropped"] == 2
    slow, failing = grid.node_ids[5], grid.node_ids[6]
    assert slow not in first["cohort_nodes"] and failing not in first["cohort_nodes"]
    assert "injected" in first["errors"][str(failing)]
    refused = {k: v for r in recs for k, v in r.get("rejected", {}).items()}
    assert "arrived after the cohort closed" in refused[str(slow)]
    _check_against_plaintext(recs, got, grid, StalenessWeight("polynomial", 0.5, 4))


def test_too_many_dropouts_abort_the_cohort_and_nothing_is_revealed() -> None:
    """Three of a cohort of 4 fail: the cohort aborts, the model stays, the run goes on."""
    def bad(part: int, rnd: int) -> str:
        return "raise" if part >= 1 and rnd == 1 else ""

    n = 4
    cfg = config(n, "run.rounds=2", *SECURE, "asynchronous.buffer_size=4")
    recs, _, _ = run(cfg, SpeedModel(seed=1, sigma=0.3), app=fake_app(bad))
    aborted = [k for r in recs for k in r.get("errors", {}) if k.startswith("cohort")]
    assert aborted == ["cohort 1"]
    assert recs[-1]["version"] == 2 and recs[1]["cohort"] == 2  # the next cohort went through


@pytest.mark.parametrize("quorum", [1.0])
def test_secure_cohort_timing_counts_key_setup(quorum: float) -> None:
    n = 4
    speed = SpeedModel(seed=2, job_seconds=10.0, sigma=0.0, latency=1.0)
    cfg = config(n, "run.rounds=1", *SECURE, "asynchronous.buffer_size=4",
                 f"asynchronous.cohort_quorum={quorum}")
    recs, _, _ = run(cfg, speed)
    # setup (2 exchanges) + upload + unmask: 3 latencies plus one job of 10 s
    assert recs[1]["time"] == pytest.approx(2 * 1.0 + 11.0 + 1.0)


@pytest.mark.parametrize("grace, factor, counted, closed_at", [
    (0.0, 1.5, 3, 13.0),   # no grace: closes at the quorum (3 of 4 at 13 s)
    (0.5, 1.5, 4, 18.0),   # grace until 13 + 0.5 x 13 = 19.5 s: the 4th (at 18 s) is in
    (0.5, 2.0, 3, 19.5),   # the 4th would upload at 23 s: closed at the grace's end without it
])
def test_a_cohort_waits_its_grace_for_the_members_after_its_quorum(
        grace: float, factor: float, counted: int, closed_at: float) -> None:
    """Cohort of 4, quorum 3, sites 0-2 at factor 1 and site 3 slower. Key setup takes two
    latencies (2 s), a job 10 s x factor plus one latency, the unmask one more latency."""
    n = 4
    speed = SpeedModel(seed=2, job_seconds=10.0, sigma=0.0, latency=1.0,
                       factors=(1.0, 1.0, 1.0, factor))
    cfg = config(n, "run.rounds=1", *SECURE, "asynchronous.buffer_size=4",
                 "asynchronous.cohort_quorum=0.75", f"asynchronous.cohort_grace={grace}")
    recs, got, grid = run(cfg, speed)
    rec = recs[1]
    assert rec["secagg_counted"] == counted and rec["secagg_dropped"] == 4 - counted
    assert rec["time"] == pytest.approx(closed_at + 1.0)
    slow = grid.node_ids[3]
    assert (slow in rec["cohort_nodes"]) == (counted == 4)
    if counted == 3:
        assert f"cohort_grace = {grace:g}" in rec["errors"][str(slow)]
    _check_against_plaintext(recs, got, grid, StalenessWeight("polynomial", 0.5, 4))


def test_an_uploaded_cohort_member_frees_its_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """FedBuff's C counts sites still training: a member that uploaded only waits for its
    cohort's unmask, so once K such slots are free the next cohort opens, even while the
    cohorts of those members are still open (here a third cohort at C = 2K), and the sums
    still equal the plaintext buffered aggregate."""
    from server.async_cohorts import SecureCohorts

    seen: list[tuple[int, int]] = []
    send = SecureCohorts.send

    def watch(self: SecureCohorts, cohort_id: int) -> None:
        training = sum(self.training(c.cohort, c.members)
                       for cid, c in self.state.cohorts.items() if cid != cohort_id)
        seen.append((len(self.open), training))
        send(self, cohort_id)

    monkeypatch.setattr(SecureCohorts, "send", watch)
    n = 16
    speed = SpeedModel(seed=5, job_seconds=10.0, sigma=0.8, latency=0.2)
    cfg = config(n, "run.rounds=8", *SECURE, "asynchronous.buffer_size=4",
                 "asynchronous.concurrency=8")
    recs, got, grid = run(cfg, speed)
    assert [r["version"] for r in recs] == list(range(9))
    assert all(training + 4 <= 8 for _, training in seen), seen  # never more than C training
    assert max(open_ for open_, _ in seen) >= 2, seen  # a third cohort beside two open ones
    _check_against_plaintext(recs, got, grid, StalenessWeight("polynomial", 0.5, 4))
