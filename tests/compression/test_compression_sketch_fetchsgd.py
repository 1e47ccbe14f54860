"""FetchSGD (Rothchild et al., ICML 2020, Algorithm 1): server state against a naive numpy
implementation, state_dict, the site stage and its spec, secure aggregation over the table
(real SecAgg+ rounds, with dropouts), and a CPU-cheap convergence check against dense."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagg.compression import (
    CountSketch,
    ErrorFeedback,
    FetchSGDServer,
    SketchCompressor,
    SketchUpdate,
    build_compressor,
    codec,
    find_sketch,
    reveals_indices,
)
from fedagg.compression import fetchsgd as fetchsgd_module
from fedagg.compression.sketch import sketch_update
from fedagg.errors import ConfigError
from fedagg.secagg import run_local

SEED = b"fedagg-public"


class NaiveFetchSGD:
    """Algorithm 1, lines 16-21, with a dense sketch matrix (plain numpy, no fedagg code)."""

    def __init__(self, cs: CountSketch, k: int, rho: float, eta: float, mode: str) -> None:
        r, c, d = cs.rows, cs.cols, cs.dim
        self.M = np.zeros((r * c, d))  # S(x) = M @ x, from the public hashes
        for j in range(r):
            self.M[j * c + cs.buckets[j], np.arange(d)] = cs.signs[j]
        self.rows, self.cols, self.k, self.rho, self.eta, self.mode = r, c, k, rho, eta, mode
        self.Su = np.zeros(r * c)
        self.Se = np.zeros(r * c)

    def unsketch(self, table: np.ndarray) -> np.ndarray:
        d = self.M.shape[1]
        est = np.empty(d)
        for i in range(d):
            rows = [self.M[j * self.cols : (j + 1) * self.cols, i] for j in range(self.rows)]
            est[i] = np.median(
                [
                    float(np.dot(col, table[j * self.cols : (j + 1) * self.cols]))
                    for j, col in enumerate(rows)
                ]
            )
        return est

    def step(self, mean_table: np.ndarray) -> tuple[list[int], np.ndarray]:
        self.Su = self.rho * self.Su + mean_table.ravel()
        self.Se = self.Se + self.eta * self.Su
        est = self.unsketch(self.Se)
        top = sorted(sorted(range(est.shape[0]), key=lambda i: (-abs(est[i]), i))[: self.k])
        delta = np.zeros(est.shape[0])
        delta[top] = est[top]
        if self.mode == "subtract":
            self.Se = self.Se - self.M @ delta
        else:
            hit = np.abs(self.M[:, top]).sum(axis=1) > 0
            self.Se[hit] = 0.0
            self.Su[hit] = 0.0
        return top, est[top]


@settings(max_examples=20, deadline=None)
@given(
    dim=st.integers(1, 60),
    rows=st.integers(1, 5),
    cols=st.integers(1, 30),
    k=st.integers(0, 8),
    rho=st.sampled_from([0.0, 0.5, 0.9]),
    eta=st.sampled_from([1.0, 0.1]),
    mode=st.sampled_from(["zero", "subtract"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_server_follows_algorithm_1(
    dim: int, rows: int, cols: int, k: int, rho: float, eta: float, mode: str, seed: int
) -> None:
    k = min(k, dim)
    rng = np.random.default_rng(seed)
    cs = CountSketch(dim, rows, cols, seed=SEED)
    server = FetchSGDServer(cs, k, momentum=rho, lr=eta, error_update=mode)  # type: ignore[arg-type]
    naive = NaiveFetchSGD(cs, k, rho, eta, mode)
    for _ in range(4):
        sites = rng.normal(size=(3, dim)) * (rng.random(dim) < 0.3)
        mean_table = np.mean([cs.sketch(x) for x in sites], axis=0)
        got = server.step(mean_table)
        top, vals = naive.step(mean_table)
        assert got.indices.tolist() == top
        np.testing.assert_allclose(got.values, vals, atol=1e-9)
        np.testing.assert_allclose(server.error.ravel(), naive.Se, atol=1e-9)
        np.testing.assert_allclose(server.velocity.ravel(), naive.Su, atol=1e-9)


def test_subtract_mode_keeps_the_error_sketch_equal_to_the_sketch_of_what_is_unapplied() -> None:
    """Momentum 0, lr 1: S_e after T rounds = S(sum of deltas - sum of applied updates)."""
    rng = np.random.default_rng(3)
    cs = CountSketch(400, 5, 60, seed=SEED)
    server = FetchSGDServer(cs, 10, momentum=0.0, error_update="subtract")
    pending = np.zeros(400)
    for _ in range(6):
        x = rng.normal(size=400)
        pending += x
        pending -= server.step(cs.sketch(x)).to_dense()
    np.testing.assert_allclose(server.error, cs.sketch(pending), atol=1e-9)


def test_heavy_coordinates_are_applied_and_small_ones_accumulate() -> None:
    cs = CountSketch(1000, 5, 200, seed=SEED)
    server = FetchSGDServer(cs, 1, momentum=0.0)
    x = np.zeros(1000)
    x[17], x[500] = 5.0, 1.0
    first = server.step(cs.sketch(x))
    assert first.indices.tolist() == [17] and first.values[0] == pytest.approx(5.0)
    y = np.zeros(1000)
    y[17], y[500] = 1.5, 1.0  # 500 was not applied: it accumulates 2.0 and overtakes 17
    second = server.step(cs.sketch(y))
    assert second.indices.tolist() == [500] and second.values[0] == pytest.approx(2.0)
    w = second.apply(first.apply(np.zeros(1000, dtype=np.float32)))
    assert w.dtype == np.float32 and w[17] == 5.0 and w[500] == 2.0


def test_propose_commit_with_exact_values_and_misuse() -> None:
    cs = CountSketch(50, 3, 40, seed=SEED)
    server = FetchSGDServer(cs, 2, momentum=0.0, error_update="subtract")
    x = np.zeros(50)
    x[[3, 9]] = [4.0, -2.0]
    proposal = server.propose(cs.sketch(x))
    with pytest.raises(ConfigError, match="propose\\(\\) called twice"):
        server.propose(cs.sketch(x))
    with pytest.raises(ConfigError, match="pending"):
        server.state_dict()
    with pytest.raises(ConfigError, match="proposed indices"):
        server.commit(SketchUpdate(50, np.array([1, 2]), np.zeros(2)))
    with pytest.raises(ConfigError, match="finite"):
        server.commit(SketchUpdate(50, proposal.indices, np.array([np.nan, 0.0])))
    exact = SketchUpdate(50, proposal.indices, np.array([3.0, -2.0]))  # e.g. a second round
    assert server.commit(exact) is exact
    # what was not applied (1.0 at coordinate 3) stays in the error sketch
    assert server.sketch.estimate(server.error)[3] == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="nothing proposed"):
        server.commit()


def test_state_dict_round_trip_resumes_identically() -> None:
    rng = np.random.default_rng(5)
    cs = CountSketch(300, 4, 50, seed=SEED)
    a = FetchSGDServer(cs, 5, momentum=0.9)
    tables = [cs.sketch(rng.normal(size=300)) for _ in range(5)]
    for t in tables[:2]:
        a.step(t)
    saved = a.state_dict()
    assert set(saved) == {"velocity", "error", "fingerprint"}
    b = FetchSGDServer(CountSketch(300, 4, 50, seed=SEED), 5, momentum=0.9)
    b.load_state_dict(saved)
    for t in tables[2:]:
        ua, ub = a.step(t), b.step(t)
        np.testing.assert_array_equal(ua.indices, ub.indices)
        np.testing.assert_array_equal(ua.values, ub.values)
    saved["error"][0, 0] = 123.0  # a copy: the server is unaffected
    assert a.error[0, 0] != 123.0
    b.load_state_dict({})
    assert not b.error.any() and not b.velocity.any()


def test_load_state_dict_rejects_other_sketches_and_bad_state() -> None:
    cs = CountSketch(300, 4, 50, seed=SEED)
    state = FetchSGDServer(cs, 5).state_dict()
    other = FetchSGDServer(CountSketch(300, 4, 50, seed=b"other"), 5)
    with pytest.raises(ConfigError, match="another sketch"):
        other.load_state_dict(state)
    server = FetchSGDServer(cs, 5)
    with pytest.raises(ConfigError, match="state keys"):
        server.load_state_dict({"error": state["error"]})
    with pytest.raises(ConfigError, match="finite"):
        server.load_state_dict({**state, "error": np.full((4, 50), np.inf)})
    with pytest.raises(ConfigError, match="finite \\(4, 50\\) table"):
        server.load_state_dict({**state, "velocity": np.zeros((4, 49))})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"k": 301}, "FetchSGDServer.k"),
        ({"k": True}, "FetchSGDServer.k"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": float("nan")}, "momentum"),
        ({"lr": 0.0}, "lr"),
        ({"error_update": "drop"}, "error_update"),
    ],
)
def test_server_bad_parameters(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"k": 5}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        FetchSGDServer(CountSketch(300, 4, 50, seed=SEED), **args)  # type: ignore[arg-type]


def test_server_rejects_bad_tables() -> None:
    server = FetchSGDServer(CountSketch(300, 4, 50, seed=SEED), 5)
    with pytest.raises(ConfigError, match="mean_table"):
        server.step(np.zeros(199))
    with pytest.raises(ConfigError, match="finite"):
        server.step(np.full(200, np.nan))
    with pytest.raises(ConfigError, match="CountSketch"):
        FetchSGDServer("sketch", 5)  # type: ignore[arg-type]


# -- site stage and spec ----------------------------------------------------------------------
def test_sketch_compressor_payload_and_codec_round_trip() -> None:
    rng = np.random.default_rng(0)
    tensors = [rng.normal(size=(20, 10)).astype(np.float32), rng.normal(size=50).astype(np.float32)]
    stage = SketchCompressor(rows=5, cols=30, k_ratio=0.01, seed=SEED)
    assert not reveals_indices(stage)
    payload = stage.compress(tensors, rng=rng)
    assert payload.shapes == [(5, 30)]
    decoded = codec.decode(codec.encode(payload)).to_dense()[0]
    cs = stage.sketch_for(250)
    np.testing.assert_allclose(
        decoded, cs.sketch(np.concatenate([t.ravel() for t in tensors])), rtol=1e-6, atol=1e-6
    )
    np.testing.assert_array_equal(stage.table(tensors), sketch_update(tensors, cs))
    server = stage.server(250)
    assert server.k == 3 and server.sketch.fingerprint() == cs.fingerprint()


def test_sketch_spec_builds_the_stage() -> None:
    c = build_compressor("sketch:0.01,rows=5,cols=400", seed=SEED)
    assert isinstance(c, SketchCompressor) and find_sketch(c) is c
    s = c.server(20_000)
    assert (s.sketch.rows, s.sketch.cols, s.k, s.momentum, s.lr) == (5, 400, 200, 0.0, 1.0)
    c = build_compressor(
        "Sketch:k=150,rows=3,size=0.03,momentum=0.9,lr=0.1,error=subtract,epoch=2", seed=SEED
    )
    s = c.server(10_000)
    assert (s.sketch.rows, s.sketch.cols, s.k, s.momentum, s.lr) == (3, 100, 150, 0.9, 0.1)
    assert s.error_update == "subtract" and s.sketch.round == 2
    # every round builds the same sketch: the hashes do not depend on the round
    a = build_compressor("sketch:0.01,rows=5,cols=40", seed=SEED, round=1)
    b = build_compressor("sketch:0.01,rows=5,cols=40", seed=SEED, round=7)
    assert isinstance(a, SketchCompressor) and isinstance(b, SketchCompressor)
    assert a.sketch_for(999).fingerprint() == b.sketch_for(999).fingerprint()
    assert find_sketch(ErrorFeedback(build_compressor("shared:0.01", seed=SEED, round=1))) is None


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("sketch:0.01,rows=5,cols=40+ef", "error at the server"),
        ("sketch:rows=5,cols=40", "exactly one amount"),
        ("sketch:0.01,k=5,rows=5,cols=40", "exactly one amount"),
        ("sketch:0.01,rows=5", "cols=<int> or size="),
        ("sketch:0.01,rows=5,cols=40,size=0.1", "cols=<int> or size="),
        ("sketch:0.01,rows=0,cols=40", "rows 0 must be in"),
        ("sketch:0.01,rows=5,cols=0", "cols must be >= 1"),
        ("sketch:0.01,rows=5,size=0", "size 0.0 must be in"),
        ("sketch:2.5,rows=5,cols=40", "ratio 2.5"),
        ("sketch:0.01,rows=5,cols=40,momentum=1", "momentum"),
        ("sketch:0.01,rows=5,cols=40,error=drop", "error 'drop'"),
        ("sketch:0.01,rows=5,cols=40,colour=red", "unknown option"),
    ],
)
def test_sketch_spec_errors(spec: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_compressor(spec, seed=SEED, round=1)


def test_sketch_spec_needs_the_public_seed() -> None:
    with pytest.raises(ConfigError, match="public seed"):
        build_compressor("sketch:0.01,rows=5,cols=40")


def test_sketch_compressor_bad_parameters() -> None:
    with pytest.raises(ConfigError, match="cols or size"):
        SketchCompressor(rows=5, k=1, seed=SEED)
    with pytest.raises(ConfigError, match="k or k_ratio"):
        SketchCompressor(rows=5, cols=4, seed=SEED)
    with pytest.raises(ConfigError, match=r"CountSketch\.rows"):
        SketchCompressor(rows=99, cols=4, k=1, seed=SEED)


# -- secure aggregation over the table (unchanged SecAgg+), with dropouts ---------------------
def test_secure_sum_of_sketch_tables_is_the_sketch_of_the_weighted_mean_with_dropouts() -> None:
    rng = np.random.default_rng(11)
    n, dim = 6, 3000
    deltas = [rng.normal(scale=0.01, size=dim) for _ in range(n)]
    weights = [float(w) for w in rng.integers(10, 100, size=n)]
    stage = SketchCompressor(rows=5, cols=60, k=30, seed=SEED)
    tables = [stage.table([d]) for d in deltas]
    mean = run_local(
        tables,
        weights,
        threshold=3,
        drop_before_upload=[1],
        drop_after_upload=[4],
        seed=1,
        clip=1.0,
    )
    counted = [i for i in range(n) if i != 1]  # dropped before upload: removed; after: counted
    w = np.array([weights[i] for i in counted])
    expected_mean = sum(weights[i] * deltas[i] for i in counted) / w.sum()
    cs = stage.sketch_for(dim)
    np.testing.assert_allclose(mean.reshape(cs.shape), cs.sketch(expected_mean), atol=1e-5)
    # ... so the server recovers the same heavy hitters as from the plaintext sketch
    plain = FetchSGDServer(cs, 30).step(cs.sketch(expected_mean))
    secure = FetchSGDServer(cs, 30).step(mean)
    assert np.intersect1d(plain.indices, secure.indices).shape[0] >= 28


# -- CPU-cheap convergence check ---------------------------------------------------------------
def _quadratic_federation(dim: int, sites: int, seed: int) -> tuple[list[np.ndarray], ...]:
    """Site i minimises 0.5 * sum a_i w^2 - b_i w (heterogeneous curvature, sparse optimum)."""
    rng = np.random.default_rng(seed)
    wstar = np.zeros(dim)
    wstar[rng.choice(dim, 50, replace=False)] = rng.normal(size=50)
    a = [rng.uniform(0.5, 1.5, size=dim) for _ in range(sites)]
    b = [ai * wstar + rng.normal(scale=0.01, size=dim) for ai in a]
    return a, b


def _progress(w: np.ndarray, a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """Share of the achievable loss decrease reached: 1 at the optimum, 0 at w = 0."""

    def loss(v: np.ndarray) -> float:
        return float(
            sum(0.5 * (ai * v * v).sum() - (bi * v).sum() for ai, bi in zip(a, b, strict=True))
        )

    opt = sum(b) / sum(a)
    return (loss(np.zeros_like(w)) - loss(w)) / (loss(np.zeros_like(w)) - loss(opt))


def test_fetchsgd_trains_within_a_few_percent_of_dense() -> None:
    """10 sites, 20,000 parameters, 150 rounds, one local step (lr 0.02) per round; the
    sketch has 4,000 counters (5x fewer values than dense) and the server applies 50 per
    round. Dense FedAvg reaches 0.997 of the achievable progress, FetchSGD 0.978."""
    dim, sites, rounds, lr = 20_000, 10, 150, 0.02
    a, b = _quadratic_federation(dim, sites, seed=0)
    dense = np.zeros(dim)
    stage = build_compressor("sketch:k=50,rows=5,cols=800", seed=SEED)
    assert isinstance(stage, SketchCompressor)
    server = stage.server(dim)
    w = np.zeros(dim)
    for _ in range(rounds):
        dense = dense + np.mean(
            [-lr * (ai * dense - bi) for ai, bi in zip(a, b, strict=True)], axis=0
        )
        tables = [stage.table([-lr * (ai * w - bi)]) for ai, bi in zip(a, b, strict=True)]
        w = server.step(np.mean(tables, axis=0)).apply(w)
    p_dense, p_sketch = _progress(dense, a, b), _progress(w, a, b)
    assert p_dense > 0.99
    assert p_sketch > 0.97 * p_dense


def test_docstring_examples() -> None:
    assert doctest.testmod(fetchsgd_module, optionflags=doctest.ELLIPSIS).failed == 0
