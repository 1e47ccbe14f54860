"""The asynchronous loop over a Grid whose replies arrive late and out of order.

Oracles: synchronous FedAvg (``server.runner.run_server``) for FedBuff with K = C = N and zero
delays, and the naive discrete-event references of ``_async_helpers`` for delayed arrivals
(hypothesis draws the speeds, hence the arrival orders).
"""

from __future__ import annotations

import numpy as np
import pytest
from _async_helpers import (
    config,
    fake_app,
    initial,
    naive_deadline,
    naive_fedbuff,
    run,
    tiny_model,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedagg.asyncagg import SpeedModel, StalenessWeight
from fedagg.errors import ConfigError, RunFailed
from server.async_dispatch import check_asynchronous
from server.inprocess import InProcessGrid
from server.runner import run_server
from strategies.wire import record_to_arrays

ZERO = SpeedModel(job_seconds=0.0, sigma=0.0)


def _sync(cfg_overrides: list[str], n: int, versions: int) -> list[list[np.ndarray]]:
    models: list[list[np.ndarray]] = []

    def capture(rec):  # type: ignore[no-untyped-def]
        models.append(record_to_arrays(rec)[1])
        return 0.0, 0.0

    cfg = config(n, f"run.rounds={versions}", *cfg_overrides)
    run_server(InProcessGrid(fake_app(), n, seed=3), cfg, None, model_fn=tiny_model,
               evaluate_fn=capture)
    return models


@pytest.mark.parametrize("extra", [
    [],
    ["strategy.server_optimizer='momentum'", "strategy.server_lr=0.5"],
    ["compression.up='topk:0.5+ef'"],
])
def test_fedbuff_with_k_c_n_and_zero_delays_equals_synchronous_fedavg(extra: list[str]) -> None:
    n, versions = 4, 4
    want = _sync(extra, n, versions)
    recs, got, _ = run(config(n, f"run.rounds={versions}", "asynchronous.mode='fedbuff'",
                              f"asynchronous.buffer_size={n}", *extra), ZERO)
    assert [r["version"] for r in recs] == list(range(versions + 1))
    assert all(r["staleness"] == {"0": n} for r in recs[1:])
    assert len(got) == len(want) == versions + 1
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert not np.allclose(got[-1][0], got[0][0])  # the model moved


@given(seed=st.integers(0, 10_000), sigma=st.sampled_from([0.3, 1.0]),
       k=st.integers(1, 4), kind=st.sampled_from(["constant", "polynomial", "hinge"]),
       max_staleness=st.sampled_from([None, 1, 3]))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fedbuff_equals_the_naive_reference_for_random_arrival_orders(
        seed: int, sigma: float, k: int, kind: str, max_staleness: int | None) -> None:
    n, versions = 5, 6
    speed = SpeedModel(seed=seed, job_seconds=10.0, sigma=sigma, site_sigma=0.5)
    over = [f"asynchronous.max_staleness={max_staleness}"] if max_staleness is not None else []
    cfg = config(n, f"run.rounds={versions}", "asynchronous.mode='fedbuff'",
                 f"asynchronous.buffer_size={k}", f"asynchronous.staleness='{kind}'",
                 "asynchronous.staleness_a=0.8", "asynchronous.staleness_b=1", *over)
    if max_staleness is None:
        cfg = cfg.model_copy(update={"asynchronous": cfg.asynchronous.model_copy(
            update={"max_staleness": None})})
    recs, got, grid = run(cfg, speed)
    want, log = naive_fedbuff(initial(), n, speed, k=k, versions=versions,
                              weight=StalenessWeight(kind, 0.8, 1), max_staleness=max_staleness)
    assert len(got) == versions + 1
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    refused = sum(1 for *_, r in log if r)
    assert sum(r.get("sites_rejected", 0) for r in recs) == refused
    times = [t for t, *_ in grid.arrivals]
    assert times == sorted(times)  # handled in arrival order


def test_stale_update_beyond_max_staleness_never_reaches_the_model() -> None:
    """Site 0 is 4x slower: by the time it replies the model is > 2 versions on."""
    n, versions = 4, 12
    speed = SpeedModel(seed=1, job_seconds=1.0, sigma=0.1, factors=(4.0, 1.0, 1.1, 1.2))
    recs, got, _ = run(config(n, f"run.rounds={versions}", "asynchronous.mode='fedbuff'",
                              "asynchronous.buffer_size=2", "asynchronous.max_staleness=2",
                              "asynchronous.staleness='constant'"), speed)
    rejected = {k: v for r in recs for k, v in r.get("rejected", {}).items()}
    assert len(rejected) == 1
    [why] = rejected.values()
    assert "staleness" in why and "max_staleness = 2" in why and "never reaches" in why
    assert all(0 not in r.get("sites", []) for r in recs)  # partition 0 never applied
    # the same run without site 0 at all gives the same models
    want, _ = naive_fedbuff(initial(), n, speed, k=2, versions=versions,
                            weight=StalenessWeight("constant"), max_staleness=None, never=(0,))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g[0], w[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("deadline", [12.0, 30.0])
def test_deadline_rounds_fold_late_updates_into_the_next_round(deadline: float) -> None:
    n, rounds = 5, 6
    speed = SpeedModel(seed=5, job_seconds=10.0, sigma=0.6, factors=(1.0, 1.0, 1.0, 2.5, 4.0))
    recs, got, _ = run(config(n, f"run.rounds={rounds}", "asynchronous.mode='deadline'",
                              f"asynchronous.deadline={deadline}",
                              "asynchronous.staleness='polynomial'"), speed)
    want, counts = naive_deadline(initial(), n, speed, deadline=deadline, rounds=rounds,
                                  weight=StalenessWeight("polynomial", 0.5, 4), max_staleness=10)
    assert [r.get("updates", 0) for r in recs[1:]] == counts
    late = [r for r in recs[1:] if any(int(s) > 0 for s in r.get("staleness", {}))]
    assert late, "the slow sites' updates should arrive in a later round"
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g[0], w[0], rtol=0, atol=1e-6)


def test_per_reply_guards_refuse_bad_updates_and_name_them() -> None:
    def bad(part: int, rnd: int) -> str:
        return {1: "nan", 2: "shape"}.get(part, "") if rnd == 1 else ""

    n = 4
    recs, got, _ = run(config(n, "run.rounds=3", "asynchronous.mode='fedbuff'",
                              "asynchronous.buffer_size=2"), SpeedModel(seed=2, sigma=0.5),
                       app=fake_app(bad))
    rejected = {k: v for r in recs for k, v in r.get("rejected", {}).items()}
    assert len(rejected) == 2
    assert any("finite" in v.lower() or "nan" in v.lower() for v in rejected.values())
    assert any("shape" in v for v in rejected.values())
    assert all(np.isfinite(a).all() for m in got for a in m)


def test_model_integrity_check_refuses_buffers_and_the_run_goes_on() -> None:
    n = 3
    with pytest.raises(RunFailed, match="max_model_change") as info:
        run(config(n, "run.rounds=3", "asynchronous.mode='fedbuff'",
                   "asynchronous.buffer_size=1", "strategy.max_model_change=1e-9"),
            SpeedModel(seed=2, sigma=0.5))
    recs = info.value.records
    assert [r["model_updated"] for r in recs[1:]] == [False] * 3  # three buffers, none applied
    assert all(r["version"] == 0 and r["model_digest"] == recs[0]["model_digest"]
               for r in recs[1:])


def test_dropped_site_times_out_and_the_others_go_on() -> None:
    n = 4
    recs, _, grid = run(config(n, "run.rounds=8", "run.round_timeout=30",
                               "asynchronous.mode='fedbuff'", "asynchronous.buffer_size=2"),
                        SpeedModel(seed=3, sigma=0.3), drop=[3])
    errors = {k: v for r in recs for k, v in r.get("errors", {}).items()}
    assert list(errors) == [str(grid.node_ids[3])]  # only the silent site, by its node id
    assert "no reply within run.round_timeout = 30 s" in errors[str(grid.node_ids[3])]
    assert recs[-1]["version"] == 8 and all(3 not in r.get("sites", []) for r in recs)


def test_error_feedback_residuals_stay_at_the_sites_across_versions() -> None:
    n = 3
    recs, _, grid = run(config(n, "run.rounds=4", "asynchronous.mode='fedbuff'",
                               "asynchronous.buffer_size=2", "compression.up='topk:0.34+ef'"),
                        SpeedModel(seed=4, sigma=0.7))
    assert recs[-1]["version"] == 4
    for node in grid.node_ids:
        state = grid.contexts[node].state
        assert "fedagg.ef" in state.array_records  # residual kept per site, never sent
    assert all(r["bytes_up"] > 0 for r in recs[1:])


def test_metrics_per_applied_buffer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    n = 4
    run(config(n, "run.rounds=3", "asynchronous.mode='fedbuff'", "asynchronous.buffer_size=3",
               "run.checkpoint=true"), SpeedModel(seed=6, sigma=0.8), run_dir=tmp_path)
    recs = json.loads((tmp_path / "metrics.json").read_text())
    assert [r["version"] for r in recs] == [0, 1, 2, 3]
    for r in recs[1:]:
        assert r["updates"] == 3 and sum(r["staleness"].values()) == 3
        assert len(r["sites"]) == 3 and r["bytes_up"] > 0 and r["bytes_down"] > 0
        assert r["time"] > 0 and r["seconds"] >= 0 and "wall_seconds" in r
    assert (tmp_path / "checkpoint.npz").exists() and (tmp_path / "model.npz").exists()


@pytest.mark.parametrize("over, field", [
    (["strategy.name='flwr:FedAdam'"], "strategy.name"),
    (["compression.up='topk:0.1'", "compression.support='topk-aggregate'"], "compression.up"),
    (["strategy.name='secure'", "asynchronous.mode='deadline'"], "asynchronous.mode"),
    (["strategy.name='secure'", "asynchronous.buffer_size=8", "asynchronous.concurrency=5"],
     "asynchronous.buffer_size"),
    (["strategy.name='secure'", "asynchronous.buffer_size=5", "asynchronous.cohort_quorum=0.2"],
     "asynchronous.cohort_quorum"),
    (["strategy.name='secure'", "asynchronous.weighting='uniform'"], "asynchronous.weighting"),
])
def test_combinations_the_loop_cannot_run_are_refused_with_the_fix(over: list[str],
                                                                   field: str) -> None:
    base = ["asynchronous.mode='fedbuff'", "asynchronous.buffer_size=5"]
    cfg = config(10, *base, *over)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        check_asynchronous(cfg)


def test_dispatch_strategies_skip_the_accumulator_grid_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's per-dispatch FedAvg builds one message and checks one reply (the buffer
    folds), so configure_train must not derive the accumulator's grid there; a synchronous
    FedAvg does (its round folds with it)."""
    import strategies.fedavg as fedavg_mod

    calls: list[int] = []
    real = fedavg_mod.grid_exponents

    def counted(arrays, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(arrays))
        return real(arrays, *args, **kwargs)

    monkeypatch.setattr(fedavg_mod, "grid_exponents", counted)
    cfg = config(4, "run.rounds=3", "asynchronous.mode='fedbuff'", "asynchronous.buffer_size=2",
                 "asynchronous.concurrency=4")
    recs, _, _ = run(cfg, SpeedModel(seed=1, sigma=0.5))
    assert recs[-1]["version"] == 3 and calls == []
    _sync([], 4, 1)
    assert calls  # the synchronous round precomputed it
