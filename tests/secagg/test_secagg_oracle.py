"""Oracle tests: secure aggregate == plaintext weighted mean (within the quantisation bound),
for N = 2..20 and dropout patterns at every stage; aborts happen exactly when predicted."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fedagg.errors import AbortRound, ConfigError, ProtocolError
from fedagg.secagg import LocalFederation, SecAggParams, run_local


def weighted_mean(updates: list[np.ndarray], weights: list[float], sites: list[int]) -> np.ndarray:
    num = sum(weights[i] * updates[i].astype(np.float64) for i in sites)
    return np.asarray(num / sum(weights[i] for i in sites))


def expect_abort(
    graph: dict[int, tuple[int, ...]], t: int, before: set[int], after: set[int]
) -> bool:
    """Independent statement of the abort rule: every needed secret needs t live holders."""
    sites = set(graph)
    uploaded = sites - before
    alive = uploaded - after
    if not uploaded:
        return True
    for i in uploaded:  # self-mask seed of every counted site
        if len(set(graph[i]) & uploaded) < t or len(set(graph[i]) & alive) < t:
            return True
    for j in before:  # mask key of a dropout that shares masks with counted sites
        if set(graph[j]) & uploaded and (
            len(set(graph[j]) & uploaded) < t or len(set(graph[j]) & alive) < t
        ):
            return True
    return False


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, object]:
    n = draw(st.integers(2, 20))
    k_param = draw(st.one_of(st.none(), st.integers(1, n)))
    params_k = SecAggParams(threshold=1, num_neighbours=k_param).neighbours_for(n)
    t = draw(st.integers(1, params_k if k_param is None else min(params_k, k_param)))
    dim = draw(st.integers(1, 6))
    stage = st.sampled_from(["live", "before", "after"])
    fates = draw(st.lists(stage, min_size=n, max_size=n))
    # keep most sites alive so that most examples complete
    if draw(st.booleans()):
        fates = ["live" if draw(st.integers(0, 3)) else f for f in fates]
    return {
        "n": n,
        "k": k_param,
        "t": t,
        "dim": dim,
        "before": {i for i, f in enumerate(fates) if f == "before"},
        "after": {i for i, f in enumerate(fates) if f == "after"},
        "seed": draw(st.integers(0, 2**16)),
    }


@given(scenarios())
@settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_secure_mean_matches_plaintext_or_aborts_as_predicted(sc: dict) -> None:  # type: ignore[type-arg]
    n, t, dim, seed = sc["n"], sc["t"], sc["dim"], sc["seed"]
    rng = np.random.default_rng(seed)
    updates = [rng.uniform(-1, 1, size=dim) for _ in range(n)]
    weights = [float(w) for w in rng.integers(1, 50, size=n)]
    params = SecAggParams(threshold=t, num_neighbours=sc["k"], clip=1.0, weight_scale=max(weights))
    # the arithmetic oracle covers every (t, k), also those a site refuses by default
    fed = LocalFederation(n, params, seed=seed, threshold_floor=0.0, min_neighbours=1)
    fed.setup()
    graph = fed.server.graph
    assert sorted(graph) == list(range(n))
    predicted_abort = expect_abort(graph, t, sc["before"], sc["after"])
    try:
        result = fed.run_round(
            updates, weights, drop_before_upload=sc["before"], drop_after_upload=sc["after"]
        )
    except AbortRound:
        event("aborted")
        assert predicted_abort
        return
    assert not predicted_abort
    event("completed with dropouts" if sc["before"] or sc["after"] else "completed, no dropout")
    counted = sorted(set(range(n)) - sc["before"])
    assert list(result.counted) == counted
    ref = weighted_mean(updates, weights, counted)
    err = float(np.abs(result.mean - ref).max())
    # independent bound: N 2^-f (1 + clip) / sum of scaled weights (+ weight rounding slack)
    scaled = sum(weights[i] for i in counted) / max(weights)
    bound = len(counted) * 2.0**-result.frac_bits * 2.0 / (scaled - len(counted) * 2.0**-25)
    assert err <= bound, (err, bound)
    assert err <= result.error_bound * 1.01
    assert result.total_weight == pytest.approx(sum(weights[i] for i in counted), rel=1e-6)


@pytest.mark.parametrize("n", [2, 3, 5, 8, 13, 20])
def test_run_local_defaults_reach_1e6(n: int) -> None:
    rng = np.random.default_rng(n)
    updates = [rng.normal(scale=0.5, size=(7, 3)) for _ in range(n)]
    weights = [float(w) for w in rng.integers(10, 100, size=n)]
    t = SecAggParams(threshold=1).neighbours_for(n) // 2 + 1  # the least t > k/2
    out = run_local(updates, weights, threshold=t)
    ref = weighted_mean(updates, weights, list(range(n)))
    assert out.shape == (7, 3) and out.dtype == np.float64
    assert float(np.abs(out - ref).max()) < 1e-6


def test_run_local_dropouts_at_both_stages() -> None:
    rng = np.random.default_rng(7)
    updates = [rng.normal(size=5) for _ in range(12)]
    weights = [float(w) for w in rng.integers(1, 9, size=12)]
    out = run_local(updates, weights, threshold=6, drop_before_upload=[2, 9], drop_after_upload={5})
    counted = [i for i in range(12) if i not in (2, 9)]  # 5 dropped after upload: counted
    assert float(np.abs(out - weighted_mean(updates, weights, counted)).max()) < 1e-6


def test_run_local_is_deterministic_for_a_seed() -> None:
    rng = np.random.default_rng(3)
    updates = [rng.normal(size=50) for _ in range(6)]
    a = run_local(updates, [1.0] * 6, threshold=3, seed=5)
    b = run_local(updates, [1.0] * 6, threshold=3, seed=5)
    c = run_local(updates, [1.0] * 6, threshold=3, seed=6)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)  # stochastic rounding differs (within the bound)
    assert run_local(updates, [1.0] * 6, threshold=3, seed=None).shape == (50,)


def test_run_local_aborts_with_protocol_error() -> None:
    updates = [np.ones(3)] * 4
    with pytest.raises(ProtocolError):
        run_local(updates, [1.0] * 4, threshold=3, drop_before_upload=[0, 1])
    with pytest.raises(AbortRound):  # 2 sites, t = 1: a dropout leaves the other exposed
        run_local(updates[:2], [1.0, 1.0], threshold=1, drop_before_upload=[0])


def test_run_local_zero_total_weight_aborts() -> None:
    with pytest.raises(AbortRound):
        run_local([np.ones(2)] * 3, [0.0, 0.0, 0.0], threshold=2)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"updates": [np.ones(3)], "weights": [1.0]},  # one site
        {"updates": [np.ones(3), np.ones(4)], "weights": [1.0, 1.0]},  # shapes differ
        {"updates": [np.ones(3), np.array([1.0, np.nan, 0])], "weights": [1.0, 1.0]},
        {"updates": [np.ones(3)] * 2, "weights": [1.0]},  # weights length
        {"updates": [np.ones(3)] * 2, "weights": [1.0, -1.0]},
        {"updates": [np.ones(3)] * 3, "weights": [1.0] * 3, "drop_before_upload": [3]},
        {
            "updates": [np.ones(3)] * 3,
            "weights": [1.0] * 3,
            "drop_before_upload": [1],
            "drop_after_upload": [1],
        },
        {"updates": [np.ones(3)] * 3, "weights": [1.0] * 3, "threshold": 3},  # t > N - 1
        {"updates": [np.ones(3)] * 9, "weights": [1.0] * 9, "num_neighbours": 2, "threshold": 3},
    ],
)
def test_run_local_rejects_bad_input(kwargs: dict) -> None:  # type: ignore[type-arg]
    kwargs.setdefault("threshold", 1)
    with pytest.raises(ConfigError):
        run_local(**kwargs)


def test_clip_range_is_applied() -> None:
    updates = [np.array([5.0, -5.0, 0.25]), np.array([0.5, 0.5, 0.25])]
    out = run_local(updates, [1.0, 1.0], threshold=1, clip=1.0)
    assert np.allclose(out, [0.75, -0.25, 0.25], atol=1e-6)
