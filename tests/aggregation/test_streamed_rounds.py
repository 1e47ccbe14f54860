"""Streamed rounds through the strategies: aggregate_train on generators, the round guards
corrected exactly, the push/pull server loop."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import guarded_fedavg, reply_message, train_reply
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagg.compression import codec
from fedagg.compression.payload import Payload, TensorPayload, WireDType
from strategies.base import ExchangeLog, stream_exchange
from strategies.compressed import Compressed
from strategies.wire import arrays_to_record, payload_record, record_to_arrays


class _Grid:
    def __init__(self, n: int) -> None:
        self.n = n

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.n + 1))


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(x.dtype == y.dtype and x.tobytes() == y.tobytes()
               for x, y in zip(a, b, strict=True))


def _round(strategy: Any, glob: list[np.ndarray], replies: Iterable[Message], n: int = 8,
           rnd: int = 1) -> list[np.ndarray] | None:
    strategy.configure_train(rnd, arrays_to_record(glob), ConfigRecord(), _Grid(n))
    out, _ = strategy.aggregate_train(rnd, replies)
    return None if out is None else record_to_arrays(out)[1]


def _honest(rng: np.random.Generator, n: int, shape: tuple[int, ...] = (30, 20)
            ) -> list[tuple[list[np.ndarray], float]]:
    return [([rng.normal(0, 0.1, shape).astype(np.float32)], float(rng.integers(50, 150)))
            for _ in range(n)]


def _replies(updates: list[tuple[list[np.ndarray], float]], order: Iterable[int] | None = None
             ) -> Iterator[Message]:
    for i in order if order is not None else range(len(updates)):
        arrays, w = updates[i]
        yield train_reply(i + 1, arrays, w)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), data=st.data())
def test_fedavg_rounds_give_the_same_bits_for_every_arrival_order(seed: int,
                                                                  data: st.DataObject) -> None:
    rng = np.random.default_rng(seed)
    glob = [np.zeros((30, 20), np.float32)]
    updates = _honest(rng, 6)
    updates.append(([np.full((30, 20), 50.0, np.float32)], 100.0))  # a norm bomb: refused
    updates.append(([rng.normal(0, 0.1, (30, 20)).astype(np.float32)], 1e6))  # capped
    base = _round(guarded_fedavg(min_available_nodes=1), glob, _replies(updates))
    perm = data.draw(st.permutations(range(len(updates))))
    s = guarded_fedavg(min_available_nodes=1)
    again = _round(s, glob, _replies(updates, perm))
    assert base is not None and again is not None and _same(base, again)
    assert "norm_outlier_factor" in s.report.refused["7"] and "8" in s.report.capped


def test_the_guards_correct_the_streamed_sum_exactly() -> None:
    """A streamed round with a norm bomb and a capped liar has exactly the bits of the round
    without the bomb and with the liar at its cap (the integer sums are exact)."""
    rng = np.random.default_rng(1)
    glob = [np.zeros((30, 20), np.float32)]
    honest = _honest(rng, 5)
    liar = ([rng.normal(0, 0.1, (30, 20)).astype(np.float32)], 1e6)
    bomb = ([np.full((30, 20), 1e4, np.float32)], 90.0)
    s = guarded_fedavg(min_available_nodes=1)
    got = _round(s, glob, _replies([*honest, liar, bomb]))
    cap = float(np.median([w for _, w in honest] + [liar[1]])) * 10
    assert f"capped to {cap:.6g}" in s.report.capped["6"]
    clean = guarded_fedavg(min_available_nodes=1, max_weight_ratio=0, norm_outlier_factor=0)
    want = _round(clean, glob, _replies([*honest, (liar[0], cap)]))
    assert got is not None and want is not None and _same(got, want)
    assert "norm_outlier_factor" in s.report.refused["7"] and len(s.report.accepted) == 6


def test_more_corrections_than_kept_refuse_the_round_not_corrupt_it() -> None:
    rng = np.random.default_rng(2)
    glob = [np.zeros(50, np.float32)]
    honest = _honest(rng, 5, (50,))
    bombs = [([np.full(50, 1e3 * (k + 1), np.float32)], 100.0) for k in range(2)]
    s = guarded_fedavg(min_available_nodes=1, stream_retain=1, hostile_fraction=0.0)
    assert _round(s, glob, _replies([*honest, *bombs])) is None
    assert "stream_retain" in s.report.refused["server"]
    assert all("norm_outlier_factor" in s.report.refused[str(n)] for n in (6, 7))
    kept = guarded_fedavg(min_available_nodes=1, stream_retain=2, hostile_fraction=0.0)
    out = _round(kept, glob, _replies([*honest, *bombs]))
    assert out is not None and np.abs(out[0]).max() < 1.0
    # the default keeps a quarter of the round's updates (ceil(0.25 x 8) = 2 of the 8 sent)
    tolerant = guarded_fedavg(min_available_nodes=1, stream_retain=1)
    assert tolerant.retain_for(7) == 2 and tolerant.retain_for(None) == 1
    out = _round(tolerant, glob, _replies([*honest, *bombs]))
    assert out is not None and np.abs(out[0]).max() < 1.0


def test_aggregate_train_takes_a_generator_and_equals_the_list() -> None:
    rng = np.random.default_rng(3)
    glob = [rng.normal(size=(8, 8)).astype(np.float32), np.zeros(8, np.float32)]
    updates = [([g + rng.normal(0, 0.01, g.shape).astype(np.float32) for g in glob],
                float(rng.integers(1, 100))) for _ in range(5)]
    consumed: list[int] = []

    def gen() -> Iterator[Message]:
        for i, r in enumerate(_replies(updates)):
            consumed.append(i)
            yield r

    from_gen = _round(guarded_fedavg(min_available_nodes=1), glob, gen())
    from_list = _round(guarded_fedavg(min_available_nodes=1), glob, list(_replies(updates)))
    assert consumed == list(range(5)) and from_gen is not None and from_list is not None
    assert _same(from_gen, from_list)
    w = np.array([u[1] for u in updates])
    for j in range(2):
        mean = sum(np.asarray(u[0][j], np.float64) * wi for u, wi in zip(updates, w, strict=True))
        np.testing.assert_allclose(from_gen[j], mean / w.sum(), rtol=2**-24, atol=1e-9)


def _topk_reply(node: int, values: np.ndarray, idx: np.ndarray, rnd: int, w: float) -> Message:
    t = TensorPayload((40,), WireDType.FLOAT32, values.astype(np.float32), indices=idx)
    return reply_message(node, RecordDict({
        "compressed": payload_record(codec.encode(Payload((t,)))),
        "metrics": MetricRecord({"num-examples": w, "server-round": rnd})}))


def test_compressed_replies_stream_sparse_into_fedavg() -> None:
    rng = np.random.default_rng(4)
    glob = [np.zeros(40, np.float32)]
    parts = [(np.sort(rng.choice(40, 8, replace=False)).astype(np.int64),
              rng.normal(0, 0.1, 8), float(rng.integers(1, 50))) for _ in range(6)]

    def replies(order: Iterable[int]) -> Iterator[Message]:
        for i in order:
            idx, vals, w = parts[i]
            yield _topk_reply(i + 1, vals, idx, 1, w)

    outs = []
    for order in (range(6), [5, 3, 1, 0, 2, 4]):
        s = Compressed(guarded_fedavg(min_available_nodes=1), up="topk:0.2")
        outs.append(_round(s, glob, replies(order)))
    assert outs[0] is not None and outs[1] is not None and _same(outs[0], outs[1])
    dense = np.zeros(40)
    for idx, vals, w in parts:
        dense[idx] += w * vals.astype(np.float32)
    np.testing.assert_allclose(outs[0][0], dense / sum(p[2] for p in parts), atol=1e-7)


class _SlowGrid:
    """A Grid whose replies arrive one per pull (as sites finishing one after another)."""

    def __init__(self, replies_for: dict[int, Any], silent: set[int] = frozenset()) -> None:
        self.replies_for = replies_for  # node -> callable(msg) -> reply
        self.silent = silent
        self.queue: list[Message] = []
        self.pulls = 0

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for i, m in enumerate(messages):
            m.metadata.__dict__["_message_id"] = f"m{len(self.queue)}-{i}-{time.time_ns()}"
            ids.append(m.metadata.message_id)
            if m.metadata.dst_node_id not in self.silent:
                self.queue.append(self.replies_for[m.metadata.dst_node_id](m))
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        self.pulls += 1
        wanted = set(message_ids)
        for k, r in enumerate(self.queue):
            if r.metadata.reply_to_message_id in wanted:
                return [self.queue.pop(k)]
        return []


def _answer(values: float, *, error: str | None = None):  # type: ignore[no-untyped-def]
    def make(m: Message) -> Message:
        r = train_reply(m.metadata.dst_node_id, [np.full(3, values, np.float32)], 1.0)
        if error is not None:
            r = reply_message(m.metadata.dst_node_id, error=error)
        r.metadata.__dict__["_reply_to_message_id"] = m.metadata.message_id
        return r
    return make


def _msgs(nodes: list[int]) -> list[Message]:
    return [Message(RecordDict(), dst_node_id=n, message_type="train") for n in nodes]


def test_stream_exchange_hands_each_reply_over_as_it_arrives() -> None:
    grid = _SlowGrid({n: _answer(float(n)) for n in (1, 2, 3)})
    log = ExchangeLog()
    seen = []
    for r in stream_exchange(grid, _msgs([1, 2, 3]), 5.0, log=log, poll=0.001):  # type: ignore[arg-type]
        seen.append((r.metadata.src_node_id, grid.pulls))
    assert [n for n, _ in seen] == [1, 2, 3]
    assert [p for _, p in seen] == [1, 2, 3]  # one pull each: nothing waited for the rest
    assert log.replies == log.ok == 3 and log.bytes_up > 0 and not log.errors


def test_stream_exchange_retries_transient_errors_and_names_silent_nodes() -> None:
    calls = {"n": 0}

    def flaky(m: Message) -> Message:
        calls["n"] += 1
        return _answer(0.0, error="RuntimeError: hiccup")(m) if calls["n"] == 1 \
            else _answer(2.0)(m)

    grid = _SlowGrid({1: _answer(1.0), 2: flaky, 3: _answer(3.0)}, silent={3})
    log = ExchangeLog()
    by_node = {m.metadata.dst_node_id: m for m in _msgs([1, 2, 3])}
    got = list(stream_exchange(
        grid, list(by_node.values()), 0.3, retries=1, log=log, poll=0.001,  # type: ignore[arg-type]
        rebuild=lambda nodes: _msgs(nodes)))
    assert sorted(r.metadata.src_node_id for r in got) == [1, 2]
    assert not any(r.has_error() for r in got) and calls["n"] == 2 and log.attempts == 2
    assert "no reply within" in log.errors["3"]
    permanent = _SlowGrid({1: _answer(0.0, error="ConfigError: bad")})
    log2 = ExchangeLog()
    out = list(stream_exchange(permanent, _msgs([1]), 1.0, retries=3, log=log2,  # type: ignore[arg-type]
                               rebuild=lambda nodes: _msgs(nodes), poll=0.001))
    assert len(out) == 1 and out[0].has_error() and "ConfigError" in log2.errors["1"]


def test_stream_exchange_refuses_foreign_replies() -> None:
    def foreign(m: Message) -> Message:
        r = _answer(9.0)(m)
        r.metadata.__dict__["_src_node_id"] = 7  # answers in another node's name
        return r

    grid = _SlowGrid({1: foreign, 2: _answer(2.0)})
    log = ExchangeLog()
    got = list(stream_exchange(grid, _msgs([1, 2]), 0.2, log=log, poll=0.001))  # type: ignore[arg-type]
    assert [r.metadata.src_node_id for r in got] == [2]
    assert "addressed to node 1" in log.refused["7"]


@pytest.mark.parametrize("retain", [0, 2])
def test_an_honest_round_needs_no_correction(retain: int) -> None:
    rng = np.random.default_rng(5)
    glob = [np.zeros(10, np.float32)]
    s = guarded_fedavg(min_available_nodes=1, stream_retain=retain)
    out = _round(s, glob, _replies(_honest(rng, 6, (10,))))
    assert out is not None and not s.report.refused and not s.report.capped
