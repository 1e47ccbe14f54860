"""Distributed DP in secure FedBuff: one ledger counts every unmasked cohort sum, carried
updates are clipped and noised like trained ones, the budget stops the run.

The asynchronous loop runs on a DelayedGrid (virtual clock) with the deterministic tiny
ClientApp of these tests (_async_helpers.fake_app) behind the real fedagg_mod.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _async_helpers import config, run

from fedagg.asyncagg import SpeedModel
from fedagg.errors import CheckpointError, ConfigError
from fedagg.privacy import PrivacyLedger, ddg_round_charge, min_survivors, round_params
from server.checkpoint import load_checkpoint, save_checkpoint

PRIVATE = ["strategy.name='secure'", "asynchronous.mode='fedbuff'", "secagg.weight_scale=100",
           "privacy.mode='distributed'", "privacy.epsilon=8", "privacy.clip=10"]
SLOW = (1.0, 1.0, 3.0, 1.0, 1.0, 1.0, 2.5, 1.0, 1.0, 1.0, 1.0, 4.0)


def _charge(cohort: int, rounds: int, dim: int = 8) -> object:
    return ddg_round_charge(round_params(
        epsilon=8.0, delta=1e-5, participations=rounds, clip=10.0, ring_bits=18,
        num_sites=cohort, min_sites=min_survivors(cohort, 0.2), dim=dim))


def test_every_cohort_sum_is_charged_to_one_ledger() -> None:
    """6 sites, cohorts of 3, two cohorts in flight: each version's record carries the
    epsilon spent by every cohort unmasked so far, as a ledger of that many charges."""
    cfg = config(6, "run.rounds=4", *PRIVATE, "asynchronous.buffer_size=3",
                 "asynchronous.concurrency=6")
    recs, _, _ = run(cfg, SpeedModel(seed=8, job_seconds=10.0, sigma=0.7, latency=0.2))
    assert [r["version"] for r in recs] == list(range(5))
    assert all(r["model_updated"] and r["secagg_counted"] == 3 for r in recs[1:]), recs
    spent = [r["privacy_epsilon"] for r in recs[1:]]
    ledger = PrivacyLedger(1e-5)
    expected = []
    for _ in recs[1:]:
        ledger.record(_charge(3, 4))  # type: ignore[arg-type]
        expected.append(ledger.epsilon())
    assert spent == sorted(spent) and spent[-1] <= 8.0 * (1 + 1e-9)
    assert spent == pytest.approx(expected, rel=1e-9)


def test_late_members_carry_their_update_clipped_and_noised() -> None:
    """12 sites, cohorts of 4 closing at 3: late members carry their update into their next
    cohort (masked with the DDG encoding of that cohort's round) and the run completes."""
    cfg = config(12, "run.rounds=8", *PRIVATE, "asynchronous.buffer_size=4",
                 "asynchronous.concurrency=8", "asynchronous.cohort_quorum=0.75",
                 "privacy.epsilon=50", "privacy.dropout_fraction=0.25")
    speed = SpeedModel(seed=4, job_seconds=10.0, sigma=0.3, latency=0.2, factors=SLOW)
    recs, _, _ = run(cfg, speed)
    assert [r["version"] for r in recs] == list(range(9))
    carried = sum(len(r.get("cohort_carried") or {}) for r in recs[1:])
    assert carried >= 1, recs
    assert not any("privacy" in str(v) for r in recs[1:] for v in (r.get("errors") or {}).values())
    assert all(r["privacy_epsilon"] <= 50.0 * (1 + 1e-9) for r in recs[1:])


def test_the_budget_stops_the_asynchronous_run() -> None:
    """privacy.target_epsilon below three cohorts' worth: no fourth cohort opens, the run ends
    with the versions it has, the last record says why."""
    ledger = PrivacyLedger(1e-5)
    spent = []
    for _ in range(3):
        ledger.record(_charge(3, 6))  # type: ignore[arg-type]
        spent.append(ledger.epsilon())
    cfg = config(3, "run.rounds=6", *PRIVATE, "asynchronous.buffer_size=3",
                 "asynchronous.concurrency=3", f"privacy.target_epsilon={(spent[1] + spent[2]) / 2}")
    recs, _, _ = run(cfg, SpeedModel(seed=8, job_seconds=10.0, sigma=0.1, latency=0.2))
    assert [r["version"] for r in recs] == [0, 1, 2]
    assert "would take the epsilon spent" in recs[-1]["stopped"]


def test_a_resumed_run_goes_on_counting_from_the_checkpoints_ledger(tmp_path: Path) -> None:
    """2 versions at epsilon 8 spend the budget; resumed with run.rounds = 4 (smaller charges
    per version), the checkpoint's ledger still holds the 8 spent, so no further cohort opens
    (a fresh ledger would have run versions 3 and 4); a checkpoint whose ledger was removed
    is refused, naming the field."""
    speed = SpeedModel(seed=8, job_seconds=10.0, sigma=0.1, latency=0.2)
    common = [*PRIVATE, "asynchronous.buffer_size=3", "asynchronous.concurrency=3",
              "run.checkpoint=true"]
    first, _, _ = run(config(3, "run.rounds=2", *common), speed, run_dir=tmp_path)
    assert [r["version"] for r in first] == [0, 1, 2]
    spent = first[-1]["privacy_epsilon"]
    assert 7.0 < spent <= 8.0 * (1 + 1e-9)
    recs, _, _ = run(config(3, "run.rounds=4", *common, f"run.resume='{tmp_path}'"), speed,
                     run_dir=tmp_path)
    assert [r["version"] for r in recs] == [0, 1, 2]
    assert "would take the epsilon spent from " + f"{spent:.4g}" in recs[-1]["stopped"]

    ck = load_checkpoint(tmp_path)  # rewritten without its ledger, with a valid digest
    state = dict(ck.strategy_state or {})
    del state["privacy"]
    save_checkpoint(tmp_path, round=ck.round, cfg=config(3, "run.rounds=4", *common),
                    keys=ck.keys, arrays=ck.arrays, records=ck.records, strategy_state=state)
    with pytest.raises(CheckpointError, match=r"strategy_state\.privacy"):
        run(config(3, "run.rounds=6", *common, f"run.resume='{tmp_path}'"), speed,
            run_dir=tmp_path)


def test_deadline_rounds_and_a_short_dropout_budget_are_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match="cohort_quorum"):
        config(4, *PRIVATE, "asynchronous.cohort_quorum=0.5")
    with pytest.raises(ConfigError, match="deadline"):
        config(3, *PRIVATE[:-4], "asynchronous.mode='deadline'", *PRIVATE[3:])
