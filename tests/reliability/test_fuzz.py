"""10,000+ generated hostile replies: each is rejected with a logged reason, nothing crashes,
and the global model never changes because of them (FedAvg and the compressed strategy)."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
from conftest import guarded_fedavg, reply_message, train_reply
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedagg.compression import TopK, codec
from strategies.compressed import Compressed
from strategies.wire import arrays_to_record, payload_record, record_to_arrays

SHAPES = [(4, 3), (3,)]
KEYS = ["w", "b"]
N_FEDAVG = 6000
N_COMPRESSED = 4000


class _Grid:
    def __init__(self, n: int) -> None:
        self.n = n

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.n + 1))


def _good(rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


def _array_with(data: bytes, like: Array) -> Array:
    return Array(dtype=like.dtype, shape=like.shape, stype=like.stype, data=data)


def hostile_dense(i: int, rng: np.random.Generator, node: int, server_round: int):  # type: ignore[no-untyped-def]
    """One hostile train reply of kind ``i % 20``."""
    good = _good(rng)
    kind = i % 20
    metrics = {"num-examples": 10, "server-round": server_round}
    if kind == 0:
        return reply_message(node, error="boom")
    if kind == 1:
        return reply_message(node, RecordDict())
    if kind == 2:  # a ConfigRecord where the arrays should be
        return reply_message(node, RecordDict({"arrays": ConfigRecord({"w": 1.0}), "metrics": MetricRecord(metrics)}))
    if kind == 3:  # too few tensors
        return train_reply(node, good[:1], 10, keys=KEYS[:1])
    if kind == 4:  # wrong keys
        return train_reply(node, good, 10, keys=["x", "y"])
    if kind == 5:  # wrong shape
        return train_reply(node, [good[0].T.copy(), good[1]], 10, keys=KEYS)
    if kind == 6:  # wrong dtype (a float of another width is cast, as Flower would: not hostile)
        return train_reply(node, [good[0].astype(rng.choice([np.int64, np.int32, np.uint8])), good[1]], 10, keys=KEYS)
    if kind == 7:  # NaN / Inf at a random place
        bad = good[0].copy()
        bad.flat[rng.integers(bad.size)] = rng.choice([np.nan, np.inf, -np.inf])
        return train_reply(node, [bad, good[1]], 10, keys=KEYS)
    if kind == 8:  # huge norm
        return train_reply(node, [good[0] * 1e6, good[1]], 10, keys=KEYS)
    if kind in (9, 10, 11):  # truncated, padded or garbage array bytes
        rec = arrays_to_record(good, KEYS)
        a = rec["w"]
        data = a.data
        if kind == 9:
            data = data[: int(rng.integers(0, len(data)))]
        elif kind == 10:
            data = data + bytes(rng.integers(1, 64))
        else:
            data = rng.bytes(len(data))
        rec["w"] = _array_with(data, a)
        return reply_message(node, RecordDict({"arrays": rec, "metrics": MetricRecord(metrics)}))
    if kind == 12:  # a header that claims a huge array
        rec = arrays_to_record(good, KEYS)
        a = rec["w"]
        hdr = a.data.replace(b"(4, 3)", b"(1099511627776, 3)")
        rec["w"] = _array_with(hdr, a)
        return reply_message(node, RecordDict({"arrays": rec, "metrics": MetricRecord(metrics)}))
    if kind == 13:  # missing weight
        return reply_message(node, RecordDict({"arrays": arrays_to_record(good, KEYS), "metrics": MetricRecord({"x": 1})}))
    if kind == 14:  # bad weight values
        w = [0, -5, float("nan"), float("inf"), [1, 2]][int(rng.integers(5))]
        return reply_message(node, RecordDict({"arrays": arrays_to_record(good, KEYS),
                                               "metrics": MetricRecord({"num-examples": w})}))
    if kind == 15:  # two ArrayRecords
        return reply_message(node, RecordDict({"a": arrays_to_record(good, KEYS), "b": arrays_to_record(good, KEYS),
                                               "metrics": MetricRecord(metrics)}))
    if kind == 16:  # replayed from an earlier round
        return train_reply(node, good, 10, keys=KEYS, **{"server-round": server_round - 1})
    if kind == 17:  # two MetricRecords
        return reply_message(node, RecordDict({"arrays": arrays_to_record(good, KEYS), "m1": MetricRecord(metrics),
                                               "m2": MetricRecord(metrics)}))
    if kind == 18:  # bool dtype
        return train_reply(node, [good[0] > 0, good[1]], 10, keys=KEYS)
    # kind 19: a string-typed "array" record
    return reply_message(node, RecordDict({"arrays": ArrayRecord({"w": Array(np.array([1], dtype=np.int8))}),
                                           "metrics": MetricRecord(metrics)}))


@pytest.mark.parametrize("seed", [0])
def test_fedavg_survives_hostile_replies(seed: int, caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(seed)
    glob = _good(rng)
    strategy = guarded_fedavg(max_update_norm=1e3, min_train_nodes=1, min_available_nodes=1)
    caplog.set_level(logging.WARNING, logger="strategies")
    batch, rejected, rnd = 50, 0, 5
    for start in range(0, N_FEDAVG, batch):
        strategy.configure_train(rnd, arrays_to_record(glob, KEYS), ConfigRecord(), _Grid(batch + 1))  # type: ignore[arg-type]
        replies = [hostile_dense(start + j, rng, j + 1, rnd) for j in range(batch)]
        good_reply = train_reply(batch + 1, glob_plus := [g + 1 for g in glob], 10, keys=KEYS, **{"server-round": rnd})
        mix = replies + ([good_reply] if start % 100 == 0 else [])
        random.Random(start).shuffle(mix)
        out, _ = strategy.aggregate_train(rnd, mix)
        errors_without_content = sum(1 for r in replies if r.has_error())
        left_out = {**strategy.report.refused, **strategy.report.errors}  # errors: error replies
        assert len(left_out) == batch, (start, set(range(1, batch + 1)) - set(map(int, left_out)))
        rejected += len(left_out)
        if start % 100 == 0:  # only the good reply counts
            assert out is not None
            for a, b in zip(record_to_arrays(out)[1], glob_plus, strict=True):
                np.testing.assert_array_equal(a, b)
        else:
            assert out is None  # nothing valid: the model stays unchanged
        assert errors_without_content >= 0
    assert rejected == N_FEDAVG
    logged = sum("rejected update" in r.getMessage() or "error reply" in r.getMessage()
                 for r in caplog.records)
    assert logged >= N_FEDAVG


def test_compressed_strategy_survives_hostile_payloads(caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(1)
    glob = _good(rng)
    strategy = Compressed(guarded_fedavg(min_train_nodes=1, min_available_nodes=1), up="topk:0.5")
    caplog.set_level(logging.WARNING, logger="strategies")
    valid = codec.encode(TopK(0.5).compress([g * 0.1 for g in glob], rng=rng))
    rnd, batch, seen = 3, 40, 0
    for start in range(0, N_COMPRESSED, batch):
        msgs = strategy.configure_train(rnd, arrays_to_record(glob, KEYS), ConfigRecord(), _Grid(batch))  # type: ignore[arg-type]
        assert len(list(msgs)) == batch
        replies = []
        for j in range(batch):
            kind = (start + j) % 8
            data = bytearray(valid)
            if kind == 0:
                data = bytearray(data[: int(rng.integers(0, len(data)))])
            elif kind == 1:
                for _ in range(int(rng.integers(1, 8))):
                    data[int(rng.integers(len(data)))] = int(rng.integers(256))
            elif kind == 2:
                data = bytearray(rng.bytes(int(rng.integers(0, 200))))
            elif kind == 3:
                data += rng.bytes(int(rng.integers(1, 16)))
            elif kind == 4:  # a valid payload of the wrong shapes
                data = bytearray(codec.encode(TopK(0.5).compress([np.ones(7, np.float32)], rng=rng)))
            elif kind == 5:  # NaN values inside an otherwise valid payload
                data = bytearray(codec.encode(TopK(0.5).compress([g * np.nan for g in glob], rng=rng)))
            if kind == 6:
                content = RecordDict({"arrays": arrays_to_record(glob, KEYS),
                                      "metrics": MetricRecord({"num-examples": 5, "server-round": rnd})})
            elif kind == 7:
                content = RecordDict({"compressed": payload_record(valid),
                                      "metrics": MetricRecord({"num-examples": 5, "server-round": rnd - 2})})
            else:
                content = RecordDict({"compressed": payload_record(bytes(data)),
                                      "metrics": MetricRecord({"num-examples": 5, "server-round": rnd})})
            replies.append(reply_message(j + 1, content))
        out, _ = strategy.aggregate_train(rnd, replies)
        # byte flips may still decode to a valid payload; everything else must be rejected
        n_rej = len(strategy.report.refused)
        assert n_rej >= batch - sum(1 for j in range(batch) if (start + j) % 8 == 1)
        if n_rej == batch:
            assert out is None
        seen += batch
    assert seen == N_COMPRESSED
    assert sum("rejected update" in r.getMessage() for r in caplog.records) >= N_COMPRESSED * 7 // 8
