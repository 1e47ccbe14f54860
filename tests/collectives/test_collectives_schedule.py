"""Schedules: simulation oracle, per-rank byte counts, tree shapes, cost model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagg.collectives import CostModel, choose_algorithm, get_schedule, predict
from fedagg.collectives.backends.inprocess import run_inprocess
from fedagg.collectives.cost import calibrate, fit_alpha_beta
from fedagg.collectives.schedule import SCHEDULED_ALGORITHMS, Schedule, hierarchical_schedule
from fedagg.collectives.transfer import Op, Transfer
from fedagg.collectives.trees import binary_tree, double_binary_tree
from fedagg.errors import ConfigError

PRIMES = (2, 3, 5, 7, 11, 13, 97, 101)


def _lengths(n: int) -> list[int]:
    return sorted({0, 1, max(0, n - 1), n + 1, *PRIMES, 1000, 4099})


@pytest.mark.parametrize("algorithm", SCHEDULED_ALGORITHMS)
@pytest.mark.parametrize("n", range(1, 10))
def test_simulation_equals_plain_sum(algorithm: str, n: int) -> None:
    rng = np.random.default_rng(n)
    for d in _lengths(n):
        data = rng.standard_normal((n, d))
        out = get_schedule(algorithm, n, d).simulate(data)
        np.testing.assert_allclose(
            out, np.broadcast_to(data.sum(0), (n, d)), rtol=1e-12, atol=1e-12
        )


@given(
    algorithm=st.sampled_from(SCHEDULED_ALGORITHMS),
    n=st.integers(1, 17),
    d=st.integers(0, 300),
    group=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=150, deadline=None)
def test_simulation_property(algorithm: str, n: int, d: int, group: int, seed: int) -> None:
    data = np.random.default_rng(seed).integers(-1000, 1000, size=(n, d)).astype(np.float64)
    sched = get_schedule(algorithm, n, d, group_size=group)
    out = sched.simulate(data)
    assert np.array_equal(out, np.broadcast_to(data.sum(0), (n, d)))  # integers: exact
    sent = sum(sched.elements_sent(r) for r in range(n))
    received = sum(sched.elements_received(r) for r in range(n))
    assert sent == received


@pytest.mark.parametrize("n", range(1, 10))
def test_ring_moves_two_n_minus_one_over_n_of_d_per_rank(n: int) -> None:
    d = n * 37
    sched = get_schedule("ring", n, d)
    assert sched.num_steps == 2 * (n - 1)
    for r in range(n):
        assert sched.elements_sent(r) == 2 * (n - 1) * d // n
        assert sched.elements_received(r) == 2 * (n - 1) * d // n


def test_ring_uneven_lengths_move_at_most_one_extra_element_per_step() -> None:
    n, d = 5, 23
    sched = get_schedule("ring", n, d)
    for r in range(n):
        assert abs(sched.elements_sent(r) - 2 * (n - 1) * d / n) <= 2 * (n - 1)


@pytest.mark.parametrize("n", range(2, 17))
def test_binary_trees_span_all_ranks(n: int) -> None:
    for parents in (binary_tree(n), *double_binary_tree(n)):
        assert parents.count(-1) == 1
        for v in range(n):  # every node reaches the root without a cycle
            seen, u = set(), v
            while parents[u] >= 0:
                assert u not in seen
                seen.add(u)
                u = parents[u]


@pytest.mark.parametrize("n", [4, 8, 16])
def test_double_tree_interior_nodes_are_leaves_in_the_other_tree(n: int) -> None:
    first, second = double_binary_tree(n)
    interior1 = {p for p in first if p >= 0}
    interior2 = {p for p in second if p >= 0}
    assert len(interior1 & interior2) <= 1  # only where the two roots' chains cross


def test_tree_depth_is_logarithmic() -> None:
    for n in (2, 4, 8, 16, 32, 33):
        sched = get_schedule("tree", n, 64)
        assert sched.num_steps <= 2 * (int(np.ceil(np.log2(n))) + 1)


def test_hierarchical_groups_and_uneven_last_group() -> None:
    sched = hierarchical_schedule(7, 50, group_size=3)
    assert sched.meta["groups"] == ((0, 1, 2), (3, 4, 5), (6,))
    data = np.arange(350, dtype=np.float64).reshape(7, 50)
    assert np.array_equal(sched.simulate(data), np.broadcast_to(data.sum(0), (7, 50)))


def test_schedule_rejects_send_and_receive_of_same_chunk_in_one_step() -> None:
    with pytest.raises(ConfigError, match="same chunk"):
        Schedule(
            "bad", 2, 4, ((0, 4),), ((Transfer(0, 1, 0, Op.REDUCE), Transfer(1, 0, 0, Op.REDUCE)),)
        )


def test_unknown_algorithm_has_no_schedule() -> None:
    with pytest.raises(ConfigError, match="known"):
        get_schedule("butterfly", 4, 10)


def test_simulate_rejects_wrong_shape() -> None:
    with pytest.raises(ConfigError, match=r"data\.shape"):
        get_schedule("ring", 3, 4).simulate(np.zeros((2, 4)))


def test_cost_model_ring_formula() -> None:
    m = CostModel(alpha=1e-5, beta=1e-9, gamma=0.0)
    n, d = 4, 1 << 20
    assert predict("ring", n, d, model=m) == pytest.approx(2 * (n - 1) * (1e-5 + d / n * 1e-9))
    assert predict("ring", 1, d, model=m) == 0.0


def test_auto_prefers_tree_for_small_and_ring_for_large_messages() -> None:
    m = CostModel(alpha=1e-4, beta=1e-9, gamma=0.0, segment_bytes=1 << 20)
    assert choose_algorithm(16, 1024, model=m) == "tree"
    assert choose_algorithm(16, 1 << 30, model=m) == "ring"
    assert predict("tree", 16, 1024, model=m) < predict("ring", 16, 1024, model=m)


def test_fit_alpha_beta_recovers_line() -> None:
    sizes = [8.0, 1e4, 1e6, 4e6]
    alpha, beta = fit_alpha_beta(sizes, [3e-5 + s * 2e-9 for s in sizes])
    assert alpha == pytest.approx(3e-5)
    assert beta == pytest.approx(2e-9)
    with pytest.raises(ConfigError):
        fit_alpha_beta([8.0], [1.0])


def test_cost_model_rejects_negative_parameters() -> None:
    with pytest.raises(ConfigError, match="alpha"):
        CostModel(alpha=-1.0)


@pytest.mark.parametrize("n", range(2, 10))
@pytest.mark.parametrize("algorithm", SCHEDULED_ALGORITHMS)
def test_every_schedule_moves_2_n_minus_1_times_d_in_total(algorithm: str, n: int) -> None:
    # the max-rate term of the cost model relies on this volume
    d = 2 * 3 * 4 * 5 * 7 * 8 * 9
    sched = get_schedule(algorithm, n, d)
    assert sum(sched.elements_sent(r) for r in range(n)) == 2 * (n - 1) * d
    assert sum(sched.elements_received(r) for r in range(n)) == 2 * (n - 1) * d


def test_node_rate_term_binds_and_ranks_by_steps() -> None:
    # beta_node = 0 keeps the link formulas; a binding node rate charges every algorithm
    # 2 (N-1) D beta_node and the fewer steps win (tree/hierarchical over ring at N = 4)
    n, d = 4, 16 << 20
    link = CostModel(alpha=3e-3, beta=1 / 2e9, gamma=0.0)
    node = CostModel(alpha=3e-3, beta=1 / 2e9, gamma=0.0, beta_node=1 / 1.5e9)
    assert predict("ring", n, d, model=link) == pytest.approx(2 * (n - 1) * (3e-3 + d / n / 2e9))
    for alg in SCHEDULED_ALGORITHMS:
        steps = get_schedule(alg, n, d).num_steps
        assert predict(alg, n, d, model=node) == pytest.approx(
            max(predict(alg, n, d, model=link), steps * 3e-3 + 2 * (n - 1) * d / 1.5e9)
        )
    assert predict("tree", n, d, model=node) < predict("ring", n, d, model=node)
    assert predict("ring", n, d, model=link) < predict("tree", n, d, model=link)
    assert choose_algorithm(n, d, model=node) in ("tree", "hierarchical")
    with pytest.raises(ConfigError, match="beta_node"):
        CostModel(beta_node=-1.0)


@pytest.mark.parametrize("method", ["concurrent", "pingpong"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_calibrate_gives_one_model_on_every_rank(n: int, method: str) -> None:
    models = run_inprocess(
        n,
        lambda comm: calibrate(comm, sizes=(8, 1 << 14, 1 << 16), repeats=2, method=method),
    )
    assert all(m == models[0] for m in models), models
    m = models[0]
    assert m.gamma > 0
    if n >= 2:  # some cost per message (the fits clamp a noisy negative term to 0)
        assert m.alpha > 0 or m.beta > 0 or (method == "concurrent" and m.beta_node > 0), m
    if method == "pingpong" or n == 1:
        assert m.beta_node == 0.0


def test_calibrate_rejects_unknown_method() -> None:
    with pytest.raises(ConfigError, match="method"):
        run_inprocess(2, lambda comm: calibrate(comm, method="guess"))


def test_two_ranks_all_schedules_cost_the_same() -> None:
    # N = 2: tree and hierarchical are the ring's exchange, step for step and byte for byte
    ring = get_schedule("ring", 2, 1000)
    m = CostModel(alpha=1e-4, beta=1e-9, gamma=1e-10, beta_node=1e-9)
    for alg in SCHEDULED_ALGORITHMS:
        sched = get_schedule(alg, 2, 1000)
        assert sched.num_steps == ring.num_steps
        assert [sched.elements_sent(r) for r in (0, 1)] == [ring.elements_sent(r) for r in (0, 1)]
        for d in (4, 1 << 20, 1 << 26):
            assert predict(alg, 2, d, model=m) == pytest.approx(predict("ring", 2, d, model=m))
