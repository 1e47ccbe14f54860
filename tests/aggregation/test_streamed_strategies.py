"""Streamed aggregates equal the list-based ones: FedAvg replies and compressed payloads.

Replies are real Flower messages handed over by a generator; the checks are the strategies'
own per-reply checks (fedagg FedAvg's plain codec, the compressed decoder).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from conftest import reply_message, train_reply
from flwr.app import ConfigRecord, Message

from fedagg.accumulate import Accumulator, ShardPlan, Sparse
from fedagg.aggregate import weighted_mean
from fedagg.compression import codec
from fedagg.compression.payload import Payload, TensorPayload, WireDType
from fedagg.update.decode import decode_delta, decode_sparse
from strategies.fedavg import FedAvg
from strategies.wire import arrays_to_record, record_to_arrays


class _Grid:
    def get_node_ids(self) -> list[int]:
        return list(range(1, 9))


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(x.dtype == y.dtype and x.tobytes() == y.tobytes()
               for x, y in zip(a, b, strict=True))


def _model(rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.normal(size=(40, 30)).astype(np.float32), np.zeros(30, np.float32)]


def _replies(rng: np.random.Generator, ref: list[np.ndarray], nodes: list[int]
             ) -> Iterator[Message]:
    for n in nodes:
        yield train_reply(n, [(r + rng.normal(size=r.shape) * 0.1).astype(np.float32)
                              for r in ref], float(rng.integers(1, 500)),
                          keys=["w", "b"], **{"server-round": 1})


def _streamed(strategy: FedAvg, replies: Iterator[Message]) -> list[np.ndarray]:
    """FedAvg's engine over ``replies`` as they come (checked, folded, dropped)."""
    record, _ = strategy.aggregate_updates(1, strategy.decoded(replies), deltas=False)
    assert record is not None
    return record_to_arrays(record)[1]


def _configured() -> tuple[FedAvg, list[np.ndarray]]:
    ref = _model(np.random.default_rng(0))
    strategy = FedAvg(min_available_nodes=1, isolate_replies=True)
    strategy.configure_train(1, arrays_to_record(ref, ["w", "b"]), ConfigRecord(), _Grid())
    return strategy, ref


def test_fedavg_replies_streamed_equal_the_weighted_mean() -> None:
    strategy, ref = _configured()
    listed = list(_replies(np.random.default_rng(1), ref, [1, 2, 3, 4, 5]))
    bad = reply_message(1, listed[0].content)  # site 1 again, later in the stream

    def stream() -> Iterator[Message]:  # a generator: nothing is listed
        yield from _replies(np.random.default_rng(1), ref, [1, 2, 3, 4, 5])
        yield train_reply(7, [np.full((40, 30), np.nan, np.float32), ref[1]], 3.0,
                          keys=["w", "b"])
        yield bad

    with_bad = _streamed(strategy, stream())
    assert strategy.report.accepted == [-1] * 5  # no partition ids: the labels are unknown
    assert "non-finite" in strategy.report.refused["7"]
    assert "second update" in strategy.report.refused["1"]
    strategy.report = type(strategy.report)()
    good = _streamed(strategy, _replies(np.random.default_rng(1), ref, [1, 2, 3, 4, 5]))
    assert _same(good, with_bad)  # the refused replies left no trace
    # the streamed mean equals the float64 weighted mean of the same replies
    models = [record_to_arrays(r.content["arrays"])[1] for r in listed]
    weights = [float(r.content["metrics"]["num-examples"]) for r in listed]
    for g, e in zip(good, weighted_mean(models, weights), strict=True):
        np.testing.assert_allclose(g, e, rtol=0, atol=2e-7)
    # and the order of arrival does not change a bit
    rev = _streamed(strategy, reversed(list(_replies(np.random.default_rng(1), ref,
                                                      [1, 2, 3, 4, 5]))))
    assert _same(good, rev)


def test_a_second_reply_of_a_site_is_refused() -> None:
    strategy, ref = _configured()
    twice = list(_replies(np.random.default_rng(2), ref, [3])) * 2
    strategy.aggregate_updates(1, strategy.decoded(iter(twice)), deltas=False)
    assert strategy.report.accepted == [-1] and "second update" in strategy.report.refused["3"]


def _payload(rng: np.random.Generator, shapes: list[tuple[int, ...]], kind: str) -> bytes:
    tensors = []
    for shape in shapes:
        n = int(np.prod(shape))
        k = max(n // 10, 1)
        idx = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
        if kind == "int8":
            vals = rng.integers(-127, 128, size=k).astype(np.int8)
            scales = rng.uniform(0.001, 0.01, size=-(-k // 16)).astype(np.float32)
            tensors.append(TensorPayload(shape, WireDType.INT8, vals, idx, scales, 16))
        elif kind == "dense":
            tensors.append(TensorPayload(shape, WireDType.FLOAT32,
                                         rng.normal(size=n).astype(np.float32)))
        else:
            tensors.append(TensorPayload(shape, WireDType.FLOAT32,
                                         (rng.normal(size=k) * 0.01).astype(np.float32), idx))
    return codec.encode(Payload(tuple(tensors)))


def test_compressed_payloads_fold_sparse_and_equal_the_dense_decode() -> None:
    """TopK / int8 payloads folded as Sparse (no dense copy per reply) == the dense decode
    folded == weighted_mean of the dense deltas (within the grid bound); sharding too."""
    rng = np.random.default_rng(3)
    ref = _model(rng)
    shapes = [tuple(r.shape) for r in ref]
    payloads = [_payload(rng, shapes, kind) for kind in ("topk", "int8", "dense", "topk")]
    weights = [5.0, 17.0, 2.0, 40.0]
    no_support = lambda: None  # noqa: E731

    sparse = [decode_sparse(p, shapes=shapes, support=no_support) for p in payloads]
    dense = [decode_delta(p, shapes=shapes, support=no_support) for p in payloads]
    assert isinstance(sparse[0][0], Sparse) and isinstance(sparse[1][1], Sparse)
    assert not isinstance(sparse[2][0], Sparse)
    a, b = Accumulator.for_model(ref), Accumulator.for_model(ref)
    for s, d, w in zip(sparse, dense, weights, strict=True):
        a.fold(s, w)
        b.fold(d, w)
    assert _same(a.mean(), b.mean())
    ref_mean = weighted_mean(dense, weights)
    for got, want in zip(a.mean(), ref_mean, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)
    plan = ShardPlan.for_model(ref, 3)
    shards = [Accumulator(plan.shard_specs(k)) for k in range(3)]
    for s, w in zip(sparse[::-1], weights[::-1], strict=True):
        for k in range(3):
            shards[k].fold(plan.split(s, k), w)
    assert _same(a.mean(), plan.join([x.mean() for x in shards]))


def test_decode_sparse_keeps_the_decoders_checks() -> None:
    import pytest

    from fedagg.errors import UpdateRejected

    rng = np.random.default_rng(4)
    shapes = [(40, 30), (30,)]
    good = _payload(rng, shapes, "topk")
    with pytest.raises(UpdateRejected, match="shapes"):
        decode_sparse(good, shapes=[(30, 40), (30,)], support=lambda: None)
    with pytest.raises(UpdateRejected, match="undecodable"):
        decode_sparse(good[:-3], shapes=shapes, support=lambda: None)
    with pytest.raises(UpdateRejected, match="delta_norm"):
        decode_sparse(good, shapes=shapes, support=lambda: None, max_norm=1e-9)
