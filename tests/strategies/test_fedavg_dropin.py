"""The contract Flower's own strategy tests check, held by fedagg's classes swapped in.

Replies are Flower-style message mocks (``Mock(spec=Message)``: real records, no metadata), as
``flwr/serverapp/strategy/strategy_utils_test.py`` builds them; ``aggregate_train`` is called
without ``configure_train`` first, as Flower's tests call it.
"""

from __future__ import annotations

from unittest.mock import Mock

import numpy as np
import pytest
from conftest import reply_message, train_reply
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import RdpAccountant
from flwr.serverapp.exception import InconsistentMessageReplies
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from flwr.serverapp.strategy import FedAvgM, FedTrimmedAvg
from flwr.serverapp.strategy import dp_fixed_clipping as flower_dp
from flwr.supercore.privacy_accounting import NeighboringRelation, PrivacyConfig, SamplingMethod
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies import Compressed, FedAvg
from strategies.wire import arrays_to_record, record_to_arrays


def mock_reply(arrays: ArrayRecord, num_examples: float, **metrics: object) -> Message:
    """A reply as Flower's own tests make one (its metadata a bare Mock)."""
    message = Mock(spec=Message)
    message.content = RecordDict({"arrays": arrays, "metrics": MetricRecord(
        {"num-examples": num_examples, **metrics})})  # type: ignore[dict-item]
    message.has_error.side_effect = lambda: False
    message.has_content.side_effect = lambda: True
    return message


def _arrays(*values: np.ndarray) -> ArrayRecord:
    return ArrayRecord([np.asarray(v) for v in values])


def test_aggregate_train_alone_with_mocks_equals_flower() -> None:
    replies = [mock_reply(_arrays(np.array([[1, 2, 3], [4, 5, 6]], np.float32),
                                  np.array([7, 8, 9, 10], np.float32)), 1),
               mock_reply(_arrays(np.array([[29, 23, 19], [17, 13, 11]], np.float32),
                                  np.array([7, 5, 3, 2], np.float32)), 2)]
    ours, om = FedAvg().aggregate_train(1, replies)
    theirs, tm = FlowerFedAvg().aggregate_train(1, replies)
    assert ours is not None and theirs is not None
    for a, b in zip(ours.to_numpy_ndarrays(), theirs.to_numpy_ndarrays(), strict=True):
        np.testing.assert_array_equal(a, b)  # Flower's own arithmetic: the same bits
    assert dict(om or {}) == dict(tm or {})


def test_scalar_arrays_keep_their_shape() -> None:
    replies = [mock_reply(_arrays(np.array(1.0)), 1), mock_reply(_arrays(np.array(3.0)), 2)]
    out, _ = FedAvg().aggregate_train(1, replies)
    assert out is not None and out.to_numpy_ndarrays()[0].shape == ()
    np.testing.assert_allclose(out.to_numpy_ndarrays()[0], 7.0 / 3.0)


def test_metrics_functions_are_honoured_with_list_metrics_kept() -> None:
    seen: dict[str, list[RecordDict]] = {}

    def train_fn(contents: list[RecordDict], key: str) -> MetricRecord:
        seen["train"] = contents
        return MetricRecord({"replies": len(contents), "key-is": float(key == "w")})

    def eval_fn(contents: list[RecordDict], key: str) -> MetricRecord:
        seen["eval"] = contents
        return MetricRecord({"evaluated": len(contents)})

    s = FedAvg(weighted_by_key="w", train_metrics_aggr_fn=train_fn,
               evaluate_metrics_aggr_fn=eval_fn)
    replies = []
    for i, w in enumerate((1.0, 3.0)):
        m = Mock(spec=Message)
        m.content = RecordDict({"arrays": _arrays(np.full(3, float(i), np.float32)),
                                "metrics": MetricRecord({"w": w, "acc": [0.5, float(i)]})})
        m.has_error.side_effect = lambda: False
        replies.append(m)
    _, metrics = s.aggregate_train(1, replies)
    assert dict(metrics or {}) == {"replies": 2, "key-is": 1.0}
    assert [c["metrics"]["acc"] for c in seen["train"]] == [[0.5, 0.0], [0.5, 1.0]]
    # Flower's default keeps lists (element by element) and leaves the weight key out
    _, default = FedAvg(weighted_by_key="w").aggregate_train(1, replies)
    assert dict(default or {}) == {"acc": [0.5, 0.75]}
    s.aggregate_evaluate(1, [_eval_reply(2.0), _eval_reply(1.0)])
    assert len(seen["eval"]) == 2


def _eval_reply(w: float) -> Message:
    m = Mock(spec=Message)
    m.content = RecordDict({"metrics": MetricRecord({"w": w, "eval_acc": 0.5})})
    m.has_error.side_effect = lambda: False
    return m


def test_the_weight_key_is_not_averaged_into_the_metrics_when_configured() -> None:
    s = FedAvg(weighted_by_key="n", min_available_nodes=1)
    g = [np.zeros(3, np.float32)]
    s.configure_train(1, arrays_to_record(g), ConfigRecord(), _Nodes(2))
    replies = [reply_message(i, RecordDict({
        "arrays": arrays_to_record([np.ones(3, np.float32) * i]),
        "metrics": MetricRecord({"n": float(i), "loss": float(i)})})) for i in (1, 3)]
    _, metrics = s.aggregate_train(1, replies)
    assert dict(metrics or {}) == pytest.approx({"loss": 2.5})


@pytest.mark.parametrize("content", [
    RecordDict({"a": ArrayRecord([np.zeros(2)]), "b": ArrayRecord([np.zeros(2)]),
                "metrics": MetricRecord({"num-examples": 1})}),  # two ArrayRecords
    RecordDict({"arrays": ArrayRecord([np.zeros(2)])}),  # no MetricRecord
    RecordDict({"arrays": ArrayRecord([np.zeros(2)]),
                "metrics": MetricRecord({"loss": 0.1})}),  # no weight
    RecordDict({"arrays": ArrayRecord([np.zeros(2)]),
                "metrics": MetricRecord({"num-examples": [1.0]})}),  # the weight a list
    RecordDict({"model": ArrayRecord([np.zeros(2)]),
                "metrics": MetricRecord({"num-examples": 1})}),  # another record name
    RecordDict({"arrays": ArrayRecord({"b": Array(np.zeros(2))}),
                "metrics": MetricRecord({"num-examples": 1})}),  # other array names
    RecordDict({"arrays": ArrayRecord([np.zeros(2)]),
                "other": MetricRecord({"num-examples": 1})}),  # another metric record name
], ids=["two-arrayrecords", "no-metrics", "no-weight", "weight-list", "record-name",
        "array-names", "metric-record-name"])
def test_inconsistent_replies_raise_as_flower_raises(content: RecordDict) -> None:
    good = mock_reply(ArrayRecord([np.zeros(2)]), 1)
    bad = Mock(spec=Message)
    bad.content = content
    bad.has_error.side_effect = lambda: False
    with pytest.raises(InconsistentMessageReplies):
        FlowerFedAvg().aggregate_train(1, [good, bad])
    with pytest.raises(InconsistentMessageReplies):
        FedAvg().aggregate_train(1, [good, bad])
    # fedagg's runs isolate such a reply instead: the round goes on without it
    out, _ = FedAvg(isolate_replies=True).aggregate_train(1, [good, bad])
    assert out is not None


def test_unbalanced_honest_sites_average_as_flower() -> None:
    """One large hospital, three small sites (1:1:1:100): no weight cap by default."""
    rng = np.random.default_rng(0)
    g = [rng.normal(size=(20, 5)).astype(np.float32), np.zeros(5, np.float32)]
    models = [[(a + rng.normal(size=a.shape) * 0.1).astype(np.float32) for a in g]
              for _ in range(4)]
    replies = [train_reply(i + 1, m, n) for i, (m, n) in enumerate(zip(models, (1, 1, 1, 100),
                                                                         strict=True))]
    theirs, _ = FlowerFedAvg().aggregate_train(1, replies)
    s = FedAvg(min_available_nodes=1)
    s.configure_train(1, arrays_to_record(g), ConfigRecord(), _Nodes(4))
    ours, _ = s.aggregate_train(1, replies)
    assert ours is not None and theirs is not None and not s.report.capped
    for a, b in zip(record_to_arrays(ours)[1], record_to_arrays(theirs)[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(weights=st.lists(st.integers(1, 10_000), min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_configured_fedavg_equals_flower_for_honest_replies(weights: list[int], seed: int
                                                              ) -> None:
    rng = np.random.default_rng(seed)
    g = [rng.normal(size=(7, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)]
    replies = [train_reply(i + 1, [(a + rng.normal(size=a.shape)).astype(np.float32)
                                   for a in g], w) for i, w in enumerate(weights)]
    s = FedAvg(min_available_nodes=1)
    s.configure_train(1, arrays_to_record(g), ConfigRecord(), _Nodes(max(len(weights), 2)))
    ours, om = s.aggregate_train(1, replies)
    theirs, tm = FlowerFedAvg().aggregate_train(1, replies)
    assert ours is not None and theirs is not None
    for a, b in zip(record_to_arrays(ours)[1], record_to_arrays(theirs)[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert dict(om or {}) == pytest.approx(dict(tm or {}))


class _Nodes:
    def __init__(self, n: int) -> None:
        self.n = n

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.n + 1))


def test_robust_inner_strategies_see_exactly_flowers_replies() -> None:
    def replies() -> list[Message]:  # fresh ones: Flower's FedTrimmedAvg pops their arrays
        return [mock_reply(_arrays(np.array(v)), 1) for v in (0.5, 1.0, 2.0, 100.0)]

    theirs, _ = FedTrimmedAvg(beta=0.25).aggregate_train(1, replies())
    ours, _ = Compressed(FedTrimmedAvg(beta=0.25)).aggregate_train(1, replies())
    assert ours is not None and theirs is not None
    np.testing.assert_equal(ours.to_numpy_ndarrays()[0], np.array(1.5))
    np.testing.assert_equal(ours.to_numpy_ndarrays()[0], theirs.to_numpy_ndarrays()[0])


def test_a_wrapper_is_transparent_for_the_inner_strategys_attributes() -> None:
    """Flower's FedAvgM tests set ``current_arrays`` and the learning rate on the strategy."""
    wrapped = Compressed(FedAvgM())
    wrapped.current_arrays = ArrayRecord([np.zeros(4, np.float32)])
    wrapped.server_learning_rate = 1.0 + 1e-9
    assert wrapped.inner.current_arrays is wrapped.current_arrays  # type: ignore[attr-defined]
    replies = [mock_reply(_arrays(np.array([1, 2, 3, 4], np.float32)), 1),
               mock_reply(_arrays(np.array([7, 5, 3, 2], np.float32)), 2)]
    out, _ = wrapped.aggregate_train(1, replies)
    assert out is not None
    np.testing.assert_almost_equal(out.to_numpy_ndarrays()[0],
                                   (np.array([1, 2, 3, 4]) + 2 * np.array([7, 5, 3, 2])) / 3,
                                   decimal=5)


def test_flowers_privacy_accountant_accepts_fedaggs_fedavg() -> None:
    accountant = RdpAccountant(PrivacyConfig(
        target_delta=1e-5, population_size=4,
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=SamplingMethod.NO_AMPLIFICATION))
    dp = flower_dp.DifferentialPrivacyServerSideFixedClipping(
        FedAvg(), noise_multiplier=1.0, clipping_norm=1.0, num_sampled_clients=4,
        accountant=accountant)
    assert dp.privacy_spent() is not None
