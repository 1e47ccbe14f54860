"""The Flower-free FedBuff core against a naive reference (fedagg.asyncagg).

The reference is FedBuff's Algorithm 1 written out with Python lists in float64: keep every
update of a buffer, and when ``K`` are in, compute ``sum w(s) n Delta / sum n`` (or ``/ K``)
and add it to the model through the same server rule. Arrival orders, staleness patterns and
weights come from hypothesis; the core must agree to float64 rounding.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagg.aggregate import ServerOptimizer
from fedagg.asyncagg import (
    AsyncServerState,
    SpeedModel,
    StalenessWeight,
    UpdateBuffer,
    VirtualClock,
)
from fedagg.errors import ConfigError, UpdateRejected


def naive_weight(kind: str, s: int, a: float, b: int) -> float:
    """The three staleness weights, written out as in Xie et al. 2019, section 5.2."""
    if kind == "constant":
        return 1.0
    if kind == "polynomial":
        return 1.0 / (s + 1) ** a
    return 1.0 if s <= b else 1.0 / (a * (s - b) + 1)


@pytest.mark.parametrize("kind", ["constant", "polynomial", "hinge"])
@given(s=st.integers(0, 200), a=st.floats(0, 4), b=st.integers(0, 20))
@settings(max_examples=60, deadline=None)
def test_staleness_weights_equal_the_naive_reference(kind: str, s: int, a: float, b: int) -> None:
    w = StalenessWeight(kind, a=a, b=b)
    assert w(s) == pytest.approx(naive_weight(kind, s, a, b), rel=1e-12)
    assert 0 < w(s) <= 1 and w(0) == 1.0


def test_staleness_weight_examples_and_errors() -> None:
    assert StalenessWeight("polynomial", a=0.5)(3) == 0.5  # FedBuff's 1/sqrt(1+s)
    assert StalenessWeight("hinge", a=1.0, b=2)(2) == 1.0
    assert StalenessWeight("hinge", a=1.0, b=2)(4) == pytest.approx(1 / 3)
    with pytest.raises(ConfigError, match=r"asynchronous\.staleness"):
        StalenessWeight("exponential")
    with pytest.raises(ConfigError, match="staleness_a"):
        StalenessWeight("polynomial", a=-1.0)
    with pytest.raises(ConfigError, match="must be >= 0"):
        StalenessWeight()(-1)


def naive_fedbuff(model: list[np.ndarray], arrivals: list[tuple[int, list[np.ndarray], float]],
                  *, k: int, weight: StalenessWeight, weighting: str, lr: float,
                  max_staleness: int | None) -> tuple[list[list[np.ndarray]], list[int]]:
    """Algorithm 1 with lists. ``arrivals``: (version trained from, delta, examples).

    Returns the model of every version and the indices of the refused arrivals.
    """
    versions = [[np.asarray(m, np.float64) for m in model]]
    kept: list[tuple[float, float, list[np.ndarray]]] = []
    refused = []
    for i, (v, delta, n) in enumerate(arrivals):
        s = len(versions) - 1 - v
        if max_staleness is not None and s > max_staleness:
            refused.append(i)
            continue
        kept.append((weight(s), n, delta))
        if len(kept) == k:
            norm = sum(n for _, n, _ in kept) if weighting == "examples" else k
            mean = [sum(w * (n if weighting == "examples" else 1.0) * d[j] for w, n, d in kept)
                    / norm for j in range(len(model))]
            versions.append([x + lr * m for x, m in zip(versions[-1], mean, strict=True)])
            kept = []
    return versions, refused


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    k = draw(st.integers(1, 5))
    n = draw(st.integers(1, 30))
    # each arrival says how many versions back it was trained from (clipped to what exists)
    backs = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    ns = draw(st.lists(st.integers(1, 500), min_size=n, max_size=n))
    return {"k": k, "backs": backs, "ns": ns, "seed": draw(st.integers(0, 2**16)),
            "kind": draw(st.sampled_from(["constant", "polynomial", "hinge"])),
            "weighting": draw(st.sampled_from(["examples", "uniform"])),
            "max_staleness": draw(st.one_of(st.none(), st.integers(0, 4))),
            "lr": draw(st.sampled_from([1.0, 0.5]))}


@given(sc=scenarios())
@settings(max_examples=120, deadline=None)
def test_fedbuff_state_equals_naive_reference_for_any_arrival_order(sc: dict) -> None:
    rng = np.random.default_rng(sc["seed"])
    model = [rng.standard_normal((3, 2)).astype(np.float32), rng.standard_normal(4).astype(np.float32)]
    weight = StalenessWeight(sc["kind"], a=0.7, b=1)
    state = AsyncServerState(model, buffer=UpdateBuffer(sc["k"], sc["weighting"]),
                             staleness=weight, max_staleness=sc["max_staleness"],
                             optimizer=ServerOptimizer("sgd", lr=sc["lr"]), seed=1)
    arrivals = []
    refused = []
    for i, (back, n) in enumerate(zip(sc["backs"], sc["ns"], strict=True)):
        v = max(state.version - back, 0)
        delta = [rng.standard_normal(a.shape) * 0.1 for a in model]
        arrivals.append((v, delta, float(n)))
        try:
            state.fold(delta, node=i, partition=i, job=i, version=v, weight=float(n))
        except UpdateRejected as exc:
            assert "asynchronous.max_staleness" in str(exc) and f"node {i}" in str(exc)
            refused.append(i)
            continue
        if state.buffer.full:
            state.apply()
    versions, naive_refused = naive_fedbuff(model, arrivals, k=sc["k"], weight=weight,
                                            weighting=sc["weighting"], lr=sc["lr"],
                                            max_staleness=sc["max_staleness"])
    assert refused == naive_refused
    assert state.version == len(versions) - 1
    for got, want in zip(state.model, versions[-1], strict=True):
        # the state keeps float32 models (as Flower ships them): one rounding per version
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * (state.version + 1))


def test_stale_update_never_reaches_the_model() -> None:
    model = [np.zeros(3, np.float32)]
    state = AsyncServerState(model, buffer=UpdateBuffer(1), staleness=StalenessWeight("constant"),
                             max_staleness=1, optimizer=ServerOptimizer("none"))
    for v in range(3):  # three fresh updates: versions 1, 2, 3
        state.fold([np.ones(3)], node=1, partition=0, job=v, version=state.version, weight=1.0)
        state.apply()
    before = [m.copy() for m in state.model]
    with pytest.raises(UpdateRejected, match=r"node 7\.staleness.*max_staleness = 1"):
        state.fold([np.full(3, 1e6)], node=7, partition=3, job=9, version=1, weight=1.0)
    assert len(state.buffer) == 0
    np.testing.assert_array_equal(state.model[0], before[0])


def test_refused_model_leaves_version_model_and_optimizer_unchanged() -> None:
    state = AsyncServerState([np.zeros(2, np.float32)], buffer=UpdateBuffer(1),
                             staleness=StalenessWeight(), max_staleness=None,
                             optimizer=ServerOptimizer("momentum", lr=1.0, beta1=0.9))
    state.fold([np.ones(2)], node=1, partition=0, job=1, version=0, weight=1.0)
    state.apply()
    momentum = state.optimizer.state_dict()
    state.fold([np.full(2, np.inf)], node=1, partition=0, job=2, version=1, weight=1.0)
    applied = state.apply(lambda new, old: "" if np.isfinite(new[0]).all() else "not finite")
    assert not applied.committed and applied.problem == "not finite"
    assert state.version == 1 and len(state.buffer) == 0
    np.testing.assert_array_equal(state.model[0], np.ones(2, np.float32))
    np.testing.assert_array_equal(state.optimizer.state_dict()["m"][0], momentum["m"][0])


def test_cohort_entry_folds_like_its_members() -> None:
    """A secure cohort hands over its example-weighted mean: the same buffer as its members'."""
    rng = np.random.default_rng(0)
    deltas = [rng.standard_normal(5) for _ in range(3)]
    ns = [10.0, 30.0, 60.0]
    a, b = UpdateBuffer(4), UpdateBuffer(4)
    from fedagg.asyncagg import BufferEntry

    for i, (d, n) in enumerate(zip(deltas, ns, strict=True)):
        a.fold([d], BufferEntry(i, i, i, 0, 2, 0.5, n))
    mean = sum(d * n for d, n in zip(deltas, ns, strict=True)) / sum(ns)
    b.fold([mean], BufferEntry(-1, -1, 1, 0, 2, 0.5, sum(ns), count=3))
    np.testing.assert_allclose(a.mean()[0], b.mean()[0], rtol=1e-12)
    assert a.count == b.count == 3 and not b.full


def test_state_dict_round_trip_continues_identically() -> None:
    rng = np.random.default_rng(1)
    make = lambda: AsyncServerState(  # noqa: E731
        [np.zeros(4, np.float32)], buffer=UpdateBuffer(3), staleness=StalenessWeight(),
        max_staleness=5, optimizer=ServerOptimizer("adam", lr=0.1), seed=3)
    a = make()
    deltas = [rng.standard_normal(4) for _ in range(10)]
    jobs = [a.dispatch(n, float(n)) for n in range(4)]
    for i, d in enumerate(deltas[:5]):
        a.fold([d], node=i, partition=i, job=i, version=max(a.version - 1, 0), weight=2.0 + i)
        if a.buffer.full:
            a.apply()
    b = make()
    b.load_state_dict(a.state_dict())
    assert b.jobs == a.jobs and b.version == a.version and b.buffer.count == a.buffer.count
    assert b.model_of(jobs[0].version) is not None
    for i, d in enumerate(deltas[5:], start=5):
        for s in (a, b):
            s.fold([d], node=i, partition=i, job=i, version=s.version, weight=1.0 + i)
            if s.buffer.full:
                s.apply()
    np.testing.assert_array_equal(a.model[0], b.model[0])
    assert a.choose(range(10), 3, "x") == b.choose(range(10), 3, "x")


def test_dispatch_rounds_and_version_store() -> None:
    state = AsyncServerState([np.zeros(1, np.float32)], buffer=UpdateBuffer(1),
                             staleness=StalenessWeight(), max_staleness=None,
                             optimizer=ServerOptimizer("none"))
    j1 = state.dispatch(5, 0.0)
    state.fold([np.ones(1)], node=9, partition=0, job=0, version=0, weight=1.0)
    state.apply()
    j2 = state.dispatch(5, 1.0)
    assert (j1.server_round, j2.server_round) == (1, 2)  # a site never repeats a round seed
    assert state.model_of(0)[0][0] == 0.0 and state.busy() == {5}
    state.arrive(j1.job)
    with pytest.raises(KeyError):
        state.model_of(0)  # no dispatch references version 0 any more


def test_speed_model_is_a_pure_function_of_seed_site_and_job() -> None:
    m = SpeedModel(seed=4, job_seconds=10.0, sigma=0.8, site_sigma=0.5, factors=(3.0,),
                   latency=0.5)
    assert m.duration(0, 7) == m.duration(0, 7) == SpeedModel(
        seed=4, job_seconds=10.0, sigma=0.8, site_sigma=0.5, factors=(3.0,),
        latency=0.5).duration(0, 7)
    assert m.factor(0) == 3.0 and m.duration(1, 1) != m.duration(1, 2)
    draws = np.log([SpeedModel(seed=1, job_seconds=1.0, sigma=0.5).delay(0, j)
                    for j in range(4000)])
    assert abs(draws.mean()) < 0.05 and abs(draws.std() - 0.5) < 0.05  # lognormal(0, 0.5)
    assert SpeedModel(job_seconds=0.0, sigma=0.9).duration(3, 3) == 0.0
    with pytest.raises(ConfigError, match="sim_factors"):
        SpeedModel(factors=(0.0,))


def test_virtual_clock() -> None:
    c = VirtualClock()
    c.advance_to(5.0)
    c.advance_to(2.0)  # never backwards
    assert c.now() == 5.0
    c.set(1.0)  # except to replay dispatches after a resume
    assert c.now() == 1.0
    with pytest.raises(ConfigError, match="finite"):
        c.advance_to(math.inf)
