"""Median-relative guards of the asynchronous loop: norm bombs refused, lying weights capped.

Oracles: a naive sliding-window reference (Python lists, ``statistics.median``) for the
decisions of :class:`fedagg.asyncagg.GuardWindow`, and the naive FedBuff reference of
``_async_helpers`` with the bomb's update dropped (or the liar's weight set to the cap) for
whole runs on a DelayedGrid. Each guard is also turned off (0) to show the test can fail.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

import numpy as np
import pytest
from _async_helpers import config, examples, fake_app, initial, naive_fedbuff, run
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagg.aggregate import MEDIAN_MIN_UPDATES, ServerOptimizer
from fedagg.asyncagg import AsyncServerState, GuardWindow, SpeedModel, StalenessWeight, UpdateBuffer
from fedagg.config import RunConfig, load_config
from fedagg.errors import ConfigError, UpdateRejected
from server.checkpoint import load_checkpoint, save_checkpoint

N, K = 5, 2
SPEED = SpeedModel(seed=1, job_seconds=10.0, sigma=0.8, site_sigma=0.5)
BOMB = (2, 3)  # site 2's third job


def _bad(kind: str, at: tuple[int, int] = BOMB):  # type: ignore[no-untyped-def]
    return lambda part, rnd: kind if (part, rnd) == at else ""


def _cfg(versions: int, *extra: str):  # type: ignore[no-untyped-def]
    return config(N, f"run.rounds={versions}", "asynchronous.mode='fedbuff'",
                  f"asynchronous.buffer_size={K}", "asynchronous.staleness='constant'", *extra)


def _rejected(recs: list[dict]) -> dict[str, str]:
    return {k: v for r in recs for k, v in r.get("rejected", {}).items()}


def _close(got: list[list[np.ndarray]], want: list[list[np.ndarray]]) -> bool:
    return len(got) == len(want) and all(
        np.allclose(a, b, rtol=0, atol=1e-6) for g, w in zip(got, want, strict=True)
        for a, b in zip(g, w, strict=True))


# -- the window, against a naive reference ---------------------------------------------------------
def naive_judge(window: list[tuple[int, float, float]], node: int, norm: float, weight: float, *,
                factor: float, ratio: float) -> float | None:
    """The weight to fold with, or None (refused): the synchronous rule on a round made of the
    window's entries of the other sites and the arriving update."""
    others = [(n, w) for site, n, w in window if site != node]
    norms = [n for n, _ in others] + [norm]
    if len(norms) < MEDIAN_MIN_UPDATES:
        return weight
    if factor > 0 and norm > factor * statistics.median(norms):
        return None
    weights = [w for _, w in others] + [weight]
    cap = ratio * statistics.median(weights)
    return min(weight, cap) if ratio > 0 else weight


def naive_accept(window: list[tuple[int, float, float]], node: int, norm: float, weight: float,
                 size: int) -> list[tuple[int, float, float]]:
    """The window after an accepted update: the site's entry replaced and made the newest, the
    oldest dropped beyond ``size``."""
    kept = [e for e in window if e[0] != node] + [(node, norm, weight)]
    return kept[-size:]


@given(arrivals=st.lists(st.tuples(st.integers(0, 6), st.floats(0.0, 1e4), st.floats(0.5, 1e6)),
                         max_size=60),
       size=st.integers(3, 12), factor=st.sampled_from([0.0, 1.5, 10.0]),
       ratio=st.sampled_from([0.0, 2.0, 10.0]))
@settings(max_examples=80, deadline=None)
def test_window_decisions_equal_the_naive_sliding_round(
        arrivals: list[tuple[int, float, float]], size: int, factor: float, ratio: float) -> None:
    g = GuardWindow(size, norm_outlier_factor=factor, max_weight_ratio=ratio)
    window: list[tuple[int, float, float]] = []
    for node, norm, weight in arrivals:
        want = naive_judge(window, node, norm, weight, factor=factor, ratio=ratio)
        try:
            v = g.judge(norm, weight, site=f"node {node}", node=node)
        except UpdateRejected as exc:
            assert want is None, exc
            assert f"node {node}.delta_norm" in str(exc) and "norm_outlier_factor" in str(exc)
            continue
        assert want is not None and v.weight == pytest.approx(want, rel=1e-12)
        g.accept(v)
        window = naive_accept(window, node, norm, v.weight, size)
        assert g.nodes == [e[0] for e in window]  # one entry per site, newest last
        assert g.weights == pytest.approx([e[2] for e in window], rel=1e-12)


def test_window_acts_on_a_round_of_three_sites_and_refuses_a_non_finite_norm_always() -> None:
    g = GuardWindow(5)
    g.accept(g.judge(1.0, 10.0, site="node 1", node=1))
    assert g.judge(1e6, 1e9, site="node 2", node=2).weight == 1e9  # a round of 2: too few
    with pytest.raises(UpdateRejected, match="must be finite"):
        g.judge(math.inf, 10.0, site="node 2", node=2)
    for _ in range(5):  # one site's stream is one value of the round, however long
        g.accept(g.judge(1.0, 10.0, site="node 1", node=1))
    assert len(g) == 1 and g.judge(1e6, 1e9, site="node 2", node=2).weight == 1e9
    g.accept(g.judge(1.0, 10.0, site="node 3", node=3))
    with pytest.raises(UpdateRejected, match=r"node 2\.delta_norm = 11.*2 other site.*10 x 1\b"):
        g.judge(11.0, 10.0, site="node 2", node=2)
    v = g.judge(9.0, 1e9, site="node 2", node=2)
    assert v.capped and v.weight == 100.0 and v.reported == 1e9
    assert not g.judge(9.0, 1e9, site="cohort 3", cap=False).capped  # a secure cohort's sum
    # a site is not judged against its own earlier update: node 3 is one value of its round
    g.accept(g.judge(1.0, 10.0, site="node 2", node=2))
    assert g.nodes == [1, 3, 2]
    with pytest.raises(UpdateRejected):
        g.judge(11.0, 10.0, site="node 3", node=3)


def test_one_site_cannot_walk_the_window() -> None:
    """A site that answers far more often than the others raises its norm and weight by 1.15x
    per update: it stays one value of the median, so its updates are refused once above 10 x
    the other sites' median norm and its weight stays capped at 10 x their median weight."""
    g = GuardWindow(20)
    for site in range(1, 6):
        g.accept(g.judge(1.0, 20.0, site=f"node {site}", node=site))
    folded = []
    for i in range(200):
        try:
            v = g.judge(1.15 ** i, 20.0 * 1.15 ** i, site="node 9", node=9)
        except UpdateRejected:
            continue
        g.accept(v)
        folded.append((v.norm, v.weight))
    assert max(n for n, _ in folded) <= 10.0 and max(w for _, w in folded) <= 200.0
    assert sorted(g.nodes) == [1, 2, 3, 4, 5, 9]


@pytest.mark.parametrize("kwargs, field", [
    ({"size": 2}, "asynchronous.guard_window"),
    ({"size": 3.5}, "asynchronous.guard_window"),
    ({"norm_outlier_factor": 0.5}, "strategy.norm_outlier_factor"),
    ({"max_weight_ratio": -1.0}, "strategy.max_weight_ratio"),
    ({"max_weight_ratio": math.nan}, "strategy.max_weight_ratio"),
])
def test_bad_guard_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(field) + r".*Fix:"):
        GuardWindow(**kwargs)


def test_config_validates_the_window() -> None:
    assert load_config(None, []).asynchronous.guard_window == 20
    with pytest.raises(ConfigError, match=r"asynchronous\.guard_window = 2"):
        load_config(None, ["asynchronous.guard_window=2"])


def _state(guards: GuardWindow | None) -> AsyncServerState:
    return AsyncServerState([np.zeros(3)], buffer=UpdateBuffer(2), staleness=StalenessWeight(),
                            max_staleness=None, optimizer=ServerOptimizer(), guards=guards)


def test_window_is_in_the_state_dict_and_old_checkpoints_load_with_an_empty_one() -> None:
    st_ = _state(GuardWindow(4))
    for i in range(6):
        st_.fold([np.full(3, 1.0 + i / 10)], node=i, partition=i, job=i + 1, version=0,
                 weight=10.0 + i)
        if st_.buffer.full:
            st_.apply()
    saved = st_.state_dict()
    assert saved["guard_window"]["size"] == 4 and len(saved["guard_window"]["norms"]) == 4
    other = _state(GuardWindow(4))
    other.load_state_dict(saved)
    assert other.guards is not None and other.guards.state_dict() == saved["guard_window"]
    with pytest.raises(UpdateRejected):  # the restored window refuses the bomb
        other.fold([np.full(3, 1e3)], node=9, partition=9, job=9, version=other.version,
                   weight=10.0)
    old = {k: v for k, v in saved.items() if k not in ("guard_window", "evaluations",
                                                      "waiting")}
    fresh = _state(GuardWindow(4))
    fresh.load_state_dict(old)  # a checkpoint from before the window existed
    assert fresh.guards is not None and len(fresh.guards) == 0 and not fresh.evaluations
    smaller = _state(GuardWindow(3))
    smaller.load_state_dict(saved)
    assert smaller.guards is not None and len(smaller.guards) == 3  # the newest 3 kept
    with pytest.raises(ConfigError, match="guard_window"):
        fresh.load_state_dict({**saved, "guard_window": {"norms": [1.0], "weights": []}})


def test_a_cohort_sum_is_norm_guarded_but_never_weight_capped() -> None:
    st_ = _state(GuardWindow(5))
    for c in range(1, 4):
        st_.fold([np.full(3, 0.1)], node=-1, partition=-1, job=c, version=st_.version,
                 weight=100.0, count=2)
        st_.apply()
    entry = st_.fold([np.full(3, 0.1)], node=-1, partition=-1, job=4, version=st_.version,
                     weight=1e9, count=2)
    assert entry.weight == 1e9  # the members' weights are masked: nothing to cap per site
    st_.apply()
    with pytest.raises(UpdateRejected, match=r"cohort 5\.delta_norm"):
        st_.fold([np.full(3, 100.0)], node=-1, partition=-1, job=5, version=st_.version,
                 weight=100.0, count=2)


# -- whole runs -------------------------------------------------------------------------------------
def test_a_norm_bomb_never_reaches_the_model_and_is_named() -> None:
    versions = 8
    recs, got, grid = run(_cfg(versions), SPEED, app=fake_app(_bad("bomb")))
    rejected = _rejected(recs)
    bomber = str(grid.node_ids[BOMB[0]])
    assert list(rejected) == [bomber]
    why = rejected[bomber]
    assert f"node {bomber}.delta_norm" in why and "strategy.norm_outlier_factor" in why
    assert "never reaches the model" in why and "Fix:" in why
    # exactly the run in which that one update was dropped on arrival
    want, _ = naive_fedbuff(initial(), N, SPEED, k=K, versions=versions,
                            weight=StalenessWeight("constant"), max_staleness=None,
                            refuse=[BOMB])
    assert _close(got, want)
    assert sum(r.get("sites_rejected", 0) for r in recs) == 1


def test_with_the_norm_guard_off_the_bomb_gets_in() -> None:
    versions = 8
    recs, got, _ = run(_cfg(versions, "strategy.norm_outlier_factor=0"), SPEED,
                       app=fake_app(_bad("bomb")))
    assert not _rejected(recs)
    want, _ = naive_fedbuff(initial(), N, SPEED, k=K, versions=versions,
                            weight=StalenessWeight("constant"), max_staleness=None,
                            refuse=[BOMB])
    assert not _close(got, want)
    assert max(float(np.abs(a).max()) for a in got[-1]) > 10 * max(
        float(np.abs(a).max()) for a in want[-1])


@pytest.mark.parametrize("extra", [[], ["compression.up='topk:0.5+ef'"]], ids=["plain", "topk"])
def test_the_bomb_is_refused_in_deadline_rounds_and_compressed(extra: list[str]) -> None:
    recs, got, grid = run(config(N, "run.rounds=6", "asynchronous.mode='deadline'",
                                 "asynchronous.deadline=12", *extra), SPEED,
                          app=fake_app(_bad("bomb", (3, 4))))
    assert list(_rejected(recs)) == [str(grid.node_ids[3])]
    assert "delta_norm" in _rejected(recs)[str(grid.node_ids[3])]
    assert max(float(np.abs(a).max()) for m in got for a in m) < 5


def test_a_weight_lie_is_capped_at_the_ratio_times_the_median() -> None:
    versions = 8
    recs, got, grid = run(_cfg(versions), SPEED, app=fake_app(_bad("weight")))
    liar = str(grid.node_ids[BOMB[0]])
    capped = {k: v for r in recs for k, v in r.get("weights_capped", {}).items()}
    assert list(capped) == [liar] and not _rejected(recs)
    m = re.search(r"weight 1e\+06 capped to ([0-9.e+]+) \(strategy\.max_weight_ratio = 10 ",
                  capped[liar])
    assert m, capped[liar]
    cap = float(m.group(1))
    assert cap <= 10 * max(examples(p) for p in range(N))  # 10 x a median of honest weights
    # the run equals the reference in which the liar's update had that weight
    want, _ = naive_fedbuff(initial(), N, SPEED, k=K, versions=versions,
                            weight=StalenessWeight("constant"), max_staleness=None,
                            weights={BOMB: cap})
    assert _close(got, want)
    # with the cap off, the liar's weight of 1e6 is used (the test can fail)
    recs0, got0, _ = run(_cfg(versions, "strategy.max_weight_ratio=0"), SPEED,
                         app=fake_app(_bad("weight")))
    assert not any(r.get("weights_capped") for r in recs0)
    assert not _close(got0, want)
    lie, _ = naive_fedbuff(initial(), N, SPEED, k=K, versions=versions,
                           weight=StalenessWeight("constant"), max_staleness=None,
                           weights={BOMB: 1e6})
    assert _close(got0, lie)


def _rewrite_without_window(run_dir: Path) -> None:
    """The checkpoint as a fedagg without the guard window would have written it."""
    ckpt = load_checkpoint(run_dir)
    state = dict(ckpt.strategy_state or {})
    state["asynchronous"] = {k: v for k, v in state["asynchronous"].items()
                             if k != "guard_window"}
    cfg = RunConfig.model_validate(ckpt.config)
    save_checkpoint(run_dir, round=ckpt.round, cfg=cfg, keys=ckpt.keys, arrays=ckpt.arrays,
                    records=ckpt.records, strategy_state=state)


@pytest.mark.parametrize("strip", [False, True], ids=["window-kept", "window-lost"])
def test_the_window_survives_checkpoint_and_resume(tmp_path: Path, strip: bool) -> None:
    """Stop right after the checkpoint of version 5 (the bomb arrives next) and resume."""
    versions = 8
    _, want, _ = run(_cfg(versions), SPEED, app=fake_app(_bad("bomb")))
    recs, _, _ = run(_cfg(5, "run.checkpoint=true"), SPEED, app=fake_app(_bad("bomb")),
                     run_dir=tmp_path)
    assert not _rejected(recs)  # the bomb is still in flight at the checkpoint
    state = (load_checkpoint(tmp_path).strategy_state or {})["asynchronous"]
    assert len(state["guard_window"]["norms"]) >= MEDIAN_MIN_UPDATES
    if strip:
        _rewrite_without_window(tmp_path)
    recs, got, _ = run(_cfg(versions, "run.checkpoint=true", f"run.resume='{tmp_path}'"),
                       SPEED, app=fake_app(_bad("bomb")), run_dir=tmp_path)
    resumed = got  # the models of the records written after the resume
    if not strip:
        assert len(_rejected(recs)) == 1
        assert _close(resumed, want[-len(resumed):])
    else:  # an old checkpoint still loads; with an empty window the bomb gets in
        assert not _rejected(recs[6:])
        assert not _close(resumed, want[-len(resumed):])
