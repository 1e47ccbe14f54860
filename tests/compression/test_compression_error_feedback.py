"""Error feedback: sum invariant, state round trips, convergence of the delivered sum."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagg.compression import (
    BF16,
    Chain,
    ErrorFeedback,
    Int8,
    SharedSupport,
    TopK,
    codec,
    random_support,
)
from fedagg.errors import ConfigError

PIPELINES = {
    "topk": lambda: TopK(0.1),
    "topk-global": lambda: TopK(k=7, scope="global"),
    "topk+int8": lambda: Chain(TopK(0.2), Int8(8)),
    "topk+int8-nearest": lambda: Chain(TopK(0.2), Int8(8, stochastic=False)),
    "topk+bf16": lambda: Chain(TopK(0.3), BF16()),
    "int8": lambda: Int8(16),
    "shared": lambda: SharedSupport(lambda d: random_support(d, d // 4, round=0, seed=b"s")),
}


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(PIPELINES)), st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_sum_invariant(name: str, seed: int, rounds: int) -> None:
    """decoded(sent) + residual_new == input + residual_old, every round."""
    rng = np.random.default_rng(seed)
    ef = ErrorFeedback(PIPELINES[name]())
    shapes = [(5, 8), (13,), ()]
    old = [np.zeros(s, np.float32) for s in shapes]
    for _ in range(rounds):
        x = [rng.normal(size=s).astype(np.float32) for s in shapes]
        payload = ef.compress(x, rng=rng)
        sent = codec.decode(codec.encode(payload))
        if payload.tensors[0].implicit_indices:
            stage = ef.inner
            assert isinstance(stage, SharedSupport)
            sent = sent.with_support(stage.support_for(sent.numel))
        assert ef.residuals is not None
        for s, r, xi, o in zip(sent.to_dense(), ef.residuals, x, old, strict=True):
            np.testing.assert_allclose(s + r, xi + o, rtol=1e-6, atol=1e-6)
        old = [r.copy() for r in ef.residuals]


def test_topk_residual_is_exact_complement() -> None:
    ef = ErrorFeedback(TopK(k=1))
    rng = np.random.default_rng(0)
    ef.compress([np.array([3.0, -1.0, 0.5], np.float32)], rng=rng)
    assert ef.residuals is not None and ef.residuals[0].tolist() == [0.0, -1.0, 0.5]
    p = ef.compress([np.array([0.0, -0.25, 0.0], np.float32)], rng=rng)
    assert p.to_dense()[0].tolist() == [0.0, -1.25, 0.0]  # the residual made it win
    assert ef.residuals[0].tolist() == [0.0, 0.0, 0.5]


def test_quantization_error_is_fed_back() -> None:
    """EF wraps the whole pipeline: after many rounds the delivered sum tracks the input sum."""
    rng = np.random.default_rng(3)
    x = [rng.normal(size=1000).astype(np.float32)]
    for stochastic in (True, False):
        ef = ErrorFeedback(TopK(0.05), quantizer=Int8(32, stochastic=stochastic))
        delivered = np.zeros(1000, np.float64)
        rounds = 200
        for _ in range(rounds):
            delivered += ef.compress(x, rng=rng).to_dense()[0]
        assert ef.residuals is not None
        np.testing.assert_allclose(delivered + ef.residuals[0], rounds * x[0], rtol=1e-4, atol=1e-2)
        # the residual stays bounded (it does not grow with the number of rounds)
        assert ef.residual_norm() < 0.2 * rounds * float(np.linalg.norm(x[0]))
    # without feedback, TopK drops 95 % of the mass for ever
    no_ef = sum(TopK(0.05).compress(x, rng=rng).to_dense()[0] for _ in range(10))
    assert np.count_nonzero(no_ef) == 50


def test_state_dict_round_trip_continues_identically() -> None:
    rng = np.random.default_rng(0)
    xs = [
        [rng.normal(size=(4, 6)).astype(np.float32), rng.normal(size=5).astype(np.float32)]
        for _ in range(3)
    ]
    a = ErrorFeedback(TopK(0.2), quantizer=Int8(4, stochastic=False))
    a.compress(xs[0], rng=rng)
    state = a.state_dict()
    assert sorted(state) == ["residual.0", "residual.1"]
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in state.values())
    b = ErrorFeedback(TopK(0.2), quantizer=Int8(4, stochastic=False))  # e.g. next round's object
    b.load_state_dict({k: v.copy() for k, v in state.items()})
    pa = a.compress(xs[1], rng=np.random.default_rng(1))
    pb = b.compress(xs[1], rng=np.random.default_rng(1))
    assert pa.equals(pb)
    state["residual.0"][:] = 99  # state_dict returns copies, not live handles
    assert a.residuals is not None and not np.any(a.residuals[0] == 99)


def test_empty_state_and_reset() -> None:
    ef = ErrorFeedback(TopK(0.5))
    assert ef.state_dict() == {}
    assert ef.residual_norm() == 0.0
    ef.load_state_dict({})
    ef.compress([np.ones(4, np.float32)], rng=np.random.default_rng(0))
    assert ef.state_dict()
    ef.load_state_dict({})
    assert ef.residuals is None
    ef.compress([np.ones(4, np.float32)], rng=np.random.default_rng(0))
    ef.reset()
    assert ef.state_dict() == {}


@pytest.mark.parametrize(
    "state",
    [
        {"residual": np.zeros(3)},
        {"residual.1": np.zeros(3)},
        {"residual.0": np.zeros(3), "residual.2": np.zeros(3)},
        {"residual.0": np.array([np.nan])},
        {"other.0": np.zeros(3)},
    ],
)
def test_load_state_dict_rejects_bad_state(state: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError):
        ErrorFeedback(TopK(0.5)).load_state_dict(state)


def test_shape_mismatch_is_a_config_error() -> None:
    ef = ErrorFeedback(TopK(0.5))
    ef.load_state_dict({"residual.0": np.zeros(3, np.float32)})
    with pytest.raises(ConfigError, match="load_state_dict"):
        ef.compress([np.zeros(4, np.float32)], rng=np.random.default_rng(0))
    with pytest.raises(ConfigError):
        ef.compress(
            [np.zeros(3, np.float32), np.zeros(1, np.float32)], rng=np.random.default_rng(0)
        )


def test_reveals_indices_follows_inner() -> None:
    assert ErrorFeedback(TopK(0.1)).reveals_indices
    assert not ErrorFeedback(SharedSupport(np.arange(3))).reveals_indices
    assert not ErrorFeedback(Chain(SharedSupport(np.arange(3)), Int8())).reveals_indices


def test_compress_does_not_modify_inputs() -> None:
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(6, 6)).astype(np.float32), rng.normal(size=4).astype(np.float32)]
    before = [a.copy() for a in x]
    ef = ErrorFeedback(TopK(0.2), quantizer=Int8(4))
    for _ in range(3):
        ef.compress(x, rng=rng)
    for stage in (SharedSupport(np.arange(5)), TopK(0.5, scope="global"), Int8(), BF16()):
        stage.compress(x, rng=rng)
    for a, b in zip(x, before, strict=True):
        np.testing.assert_array_equal(a, b)
