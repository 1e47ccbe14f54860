"""fedagg FedAvg == Flower FedAvg on the same replies; bad replies never reach the model."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import reply_message, train_reply
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies.fedavg import FedAvg
from strategies.wire import arrays_to_record, record_to_arrays


class _Grid:
    """Just enough of a Grid for configure_train's sampling (node ids only)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.n + 1))


def _configure(strategy: FedAvg, arrays: list[np.ndarray]) -> None:
    strategy.configure_train(1, arrays_to_record(arrays), ConfigRecord(), _Grid(3))


@settings(max_examples=25, deadline=None)
@given(n_sites=st.integers(1, 8), shapes=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 4)),
                                                   min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_fedavg_equals_flower_fedavg(n_sites: int, shapes: list[tuple[int, int]], seed: int) -> None:
    rng = np.random.default_rng(seed)
    global_arrays = [rng.normal(size=s).astype(np.float32) for s in shapes]
    replies = [train_reply(i + 1, [rng.normal(size=s).astype(np.float32) for s in shapes],
                           int(rng.integers(1, 500))) for i in range(n_sites)]
    # Flower's aggregate exactly: the round-level guards off (weights up to 500x apart would be
    # capped at 10 x the median, tests/reliability/test_round_guards.py)
    ours = FedAvg(max_weight_ratio=0, norm_outlier_factor=0)
    _configure(ours, global_arrays)
    mine, _ = ours.aggregate_train(1, replies)
    theirs, _ = FlowerFedAvg().aggregate_train(1, replies)
    assert mine is not None and theirs is not None
    for a, b in zip(record_to_arrays(mine)[1], record_to_arrays(theirs)[1], strict=True):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_weights_matter() -> None:
    g = [np.zeros(2, np.float32)]
    s = FedAvg()
    _configure(s, g)
    out, _ = s.aggregate_train(1, [train_reply(1, [np.ones(2, np.float32)], 3),
                                   train_reply(2, [np.full(2, 5.0, np.float32)], 1)])
    assert out is not None
    np.testing.assert_allclose(record_to_arrays(out)[1][0], [2.0, 2.0])


@pytest.mark.parametrize("bad", ["nan", "inf", "shape", "dtype", "norm", "weight", "error", "missing"])
def test_bad_reply_is_excluded_and_model_unchanged_when_alone(bad: str) -> None:
    g = [np.zeros(3, np.float32)]
    good = train_reply(1, [np.ones(3, np.float32)], 10)
    arrays = [np.ones(3, np.float32)]
    weight: float = 10
    if bad == "nan":
        arrays = [np.array([np.nan, 0, 0], np.float32)]
    elif bad == "inf":
        arrays = [np.array([np.inf, 0, 0], np.float32)]
    elif bad == "shape":
        arrays = [np.ones(4, np.float32)]
    elif bad == "dtype":  # an integer reply to a float model (floats of another width are cast)
        arrays = [np.ones(3, np.int64)]
    elif bad == "norm":
        arrays = [np.full(3, 1e6, np.float32)]
    elif bad == "weight":
        weight = -1
    if bad == "error":
        bad_reply = reply_message(2, error="site crashed")
    elif bad == "missing":
        bad_reply = reply_message(2, RecordDict({"arrays": arrays_to_record(arrays)}))
    else:
        bad_reply = train_reply(2, arrays, weight)
    s = FedAvg(max_update_norm=100.0, isolate_replies=True)
    _configure(s, g)
    out, _ = s.aggregate_train(1, [good, bad_reply])
    assert out is not None
    np.testing.assert_array_equal(record_to_arrays(out)[1][0], np.ones(3, np.float32))
    if bad != "error":
        assert "2" in s.report.refused
    # alone, the bad reply leaves the model unchanged (no arrays returned)
    s2 = FedAvg(max_update_norm=100.0, isolate_replies=True)
    _configure(s2, g)
    assert s2.aggregate_train(1, [bad_reply]) == (None, None)


def test_min_sites_keeps_model() -> None:
    s = FedAvg(min_sites=3)
    _configure(s, [np.zeros(1, np.float32)])
    out, metrics = s.aggregate_train(1, [train_reply(1, [np.ones(1, np.float32)], 1),
                                         train_reply(2, [np.ones(1, np.float32)], 1)])
    assert out is None and metrics is None


def test_server_optimizer_sgd_scales_delta_and_state_roundtrips() -> None:
    s = FedAvg(server_optimizer="sgd", server_lr=0.5)
    _configure(s, [np.zeros(2, np.float32)])
    out, _ = s.aggregate_train(1, [train_reply(1, [np.full(2, 4.0, np.float32)], 1)])
    assert out is not None
    np.testing.assert_allclose(record_to_arrays(out)[1][0], [2.0, 2.0])
    m = FedAvg(server_optimizer="momentum", server_lr=1.0, server_momentum=0.5)
    _configure(m, [np.zeros(1, np.float32)])
    m.aggregate_train(1, [train_reply(1, [np.ones(1, np.float32)], 1)])
    m2 = FedAvg(server_optimizer="momentum", server_lr=1.0, server_momentum=0.5)
    m2.load_state_dict(m.state_dict())
    for strat in (m, m2):
        _configure(strat, [np.zeros(1, np.float32)])
    a = m.aggregate_train(2, [train_reply(1, [np.ones(1, np.float32)], 1)])[0]
    b = m2.aggregate_train(2, [train_reply(1, [np.ones(1, np.float32)], 1)])[0]
    assert a is not None and b is not None
    np.testing.assert_allclose(record_to_arrays(a)[1][0], [1.5])  # 1 + 0.5 * 1
    np.testing.assert_array_equal(record_to_arrays(a)[1][0], record_to_arrays(b)[1][0])


def test_sampling_is_seeded() -> None:
    s1, s2 = FedAvg(fraction_train=0.5, seed=3), FedAvg(fraction_train=0.5, seed=3)
    grid = _Grid(10)
    a = [m.metadata.dst_node_id for m in s1.configure_train(4, ArrayRecord(), ConfigRecord(), grid)]
    b = [m.metadata.dst_node_id for m in s2.configure_train(4, ArrayRecord(), ConfigRecord(), grid)]
    assert a == b and len(a) == 5


def test_float64_reply_is_cast_as_flower_would_and_strict_mode_refuses_it() -> None:
    g = [np.zeros(3, np.float32)]
    a = train_reply(1, [np.full(3, 1.0, np.float32)], 10)
    b = train_reply(2, [np.full(3, 3.0, np.float64)], 30)
    s = FedAvg()
    _configure(s, g)
    out, _ = s.aggregate_train(1, [a, b])
    assert out is not None and not s.report.refused
    got = record_to_arrays(out)[1][0]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, np.full(3, 2.5, np.float32))
    strict = FedAvg(strict_dtypes=True)
    _configure(strict, g)
    out, _ = strict.aggregate_train(1, [a, b])
    assert "2" in strict.report.refused and "strict_dtypes" in strict.report.refused["2"]
    np.testing.assert_array_equal(record_to_arrays(out)[1][0], np.ones(3, np.float32))


@pytest.mark.parametrize("max_norm", [None, 100.0])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_is_refused_by_the_fold_and_leaves_no_trace(
        value: float, max_norm: float | None) -> None:
    """A streamed round has no separate finiteness pass: the fold reads every value and
    refuses a NaN / Inf, undoing what it had folded of that reply (here the whole first
    tensor, large enough for the threaded native path, and part of the second)."""
    rng = np.random.default_rng(0)
    g = [np.zeros(1_200_000, np.float32), np.zeros(200_000, np.float32)]
    good = [rng.normal(size=t.size).astype(np.float32) * 0.01 for t in g]
    bad = [rng.normal(size=t.size).astype(np.float32) * 0.01 for t in g]
    bad[1][150_001] = value

    def run(*replies: Message) -> tuple[ArrayRecord | None, FedAvg]:
        s = FedAvg(max_update_norm=max_norm)
        _configure(s, g)
        return s.aggregate_train(1, list(replies))[0], s

    alone, _ = run(train_reply(1, good, 10))
    out, s = run(train_reply(2, bad, 10), train_reply(1, good, 10))
    assert alone is not None and out is not None
    for a, b in zip(record_to_arrays(alone)[1], record_to_arrays(out)[1], strict=True):
        np.testing.assert_array_equal(a, b)  # bit for bit: the refused fold left nothing
    assert list(s.report.refused) == ["2"]
    why = s.report.refused["2"]
    assert "node 2.arrays[1]" in why and "1 non-finite values" in why, why
