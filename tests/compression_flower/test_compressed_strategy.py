"""strategies.Compressed(FedAvg()): decoding, rejection, shared supports, downward codec."""

from __future__ import annotations

import numpy as np
import pytest
from _cf_helpers import (
    KEYS,
    SHAPES,
    Grid,
    compressed_fedavg,
    ef_residual,
    handler_adding,
    model,
    send,
    site_context,
)
from conftest import reply_message, train_reply
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from clients.protocol import fedagg_mod
from fedagg.compression import TensorPayload, WireDType, build_compressor, codec
from fedagg.compression.payload import Payload
from fedagg.config import load_config
from fedagg.errors import ConfigError
from fedagg.update import effective_spec
from strategies import Compressed, build_strategy
from strategies.fedavg import FedAvg
from strategies.wire import (
    PREVIOUS_KEY,
    REPLY_KEY,
    arrays_to_record,
    message_nbytes,
    payload_bytes,
    payload_record,
    record_to_arrays,
)


def _reply(node: int, data: bytes, n: float = 10.0, **metrics: float) -> object:
    return reply_message(node, RecordDict({REPLY_KEY: payload_record(data),
                                           "metrics": MetricRecord({"num-examples": n, **metrics})}))


def _deltas(rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


@pytest.mark.parametrize("spec", ["topk:0.1", "topk:0.01+ef+int8", "int8", "bf16", "fp16",
                                  "randk:0.05", "none"])
def test_compressed_equals_fedavg_on_the_decoded_deltas(spec: str) -> None:
    rng = np.random.default_rng(0)
    g = model(0)
    s = compressed_fedavg(up=spec)
    send(s, g, 1, [1, 2, 3])
    replies, dense = [], []
    for node, n in ((1, 5), (2, 17), (3, 40)):
        d = _deltas(rng)
        if spec == "none":
            replies.append(train_reply(node, [a + b for a, b in zip(g, d, strict=True)], n, KEYS))
            decoded = d
        else:
            data = codec.encode(build_compressor(spec).compress(d, rng=rng))
            replies.append(_reply(node, data, n))
            decoded = codec.decode(data).to_dense()
        dense.append(train_reply(node, [a + b for a, b in zip(g, decoded, strict=True)], n, KEYS))
    ours, _ = s.aggregate_train(1, replies)
    ref = FedAvg()
    ref.configure_train(1, arrays_to_record(g, KEYS), ConfigRecord(), Grid([1, 2, 3]))  # type: ignore[arg-type]
    theirs, _ = ref.aggregate_train(1, dense)
    assert ours is not None and theirs is not None and s.report.refused == {}
    for a, b in zip(record_to_arrays(ours)[1], record_to_arrays(theirs)[1], strict=True):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _good_payload(rng: np.random.Generator) -> bytes:
    return codec.encode(build_compressor("topk:0.1").compress(_deltas(rng), rng=rng))


def _corrupt(kind: str, rng: np.random.Generator) -> object:
    data = _good_payload(rng)
    if kind == "magic":
        return _reply(1, b"XXXX" + data[4:])
    if kind == "truncated":
        return _reply(1, data[: len(data) // 2])
    if kind == "trailing":
        return _reply(1, data + b"\x00")
    if kind == "flipped-count":
        b = bytearray(data)
        b[6] ^= 0xFF  # n_tensors
        return _reply(1, bytes(b))
    if kind == "random-bytes":
        return _reply(1, rng.integers(0, 256, size=300, dtype=np.uint8).tobytes())
    if kind == "shape":
        other = [rng.normal(size=(50, 200)).astype(np.float32), rng.normal(size=50).astype(np.float32)]
        return _reply(1, codec.encode(build_compressor("topk:0.1").compress(other, rng=rng)))
    if kind == "nan":
        vals = np.full(SHAPES[1][0], np.nan, np.float32)
        p = Payload((TensorPayload(SHAPES[0], WireDType.FLOAT32, np.zeros(10_000, np.float32)),
                     TensorPayload(SHAPES[1], WireDType.FLOAT32, vals)))
        return _reply(1, codec.encode(p))
    if kind == "dense-arrays":  # a site without the mod
        return train_reply(1, model(0), 10, KEYS)
    if kind == "payload-dtype":
        return reply_message(1, RecordDict({REPLY_KEY: ArrayRecord({"payload": Array(
            np.frombuffer(data, np.uint8).astype(np.int16))}), "metrics": MetricRecord({"num-examples": 3})}))
    if kind == "weight":
        return _reply(1, data, n=0.0)
    if kind == "error":
        return reply_message(1, error="site crashed")
    raise AssertionError(kind)


KINDS = ["magic", "truncated", "trailing", "flipped-count", "random-bytes", "shape", "nan",
         "dense-arrays", "payload-dtype", "weight", "error"]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_reply_is_rejected_and_model_unchanged_when_alone(kind: str) -> None:
    rng = np.random.default_rng(3)
    s = compressed_fedavg(up="topk:0.1")
    send(s, model(0), 1, [1])
    out, metrics = s.aggregate_train(1, [_corrupt(kind, rng)])  # type: ignore[list-item]
    assert out is None and metrics is None
    reasons = {**s.report.refused, **s.report.errors}  # an error reply is an error, not a refusal
    assert list(reasons) == ["1"] and reasons["1"]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_reply_does_not_spoil_the_good_ones(kind: str) -> None:
    rng = np.random.default_rng(4)
    g = model(0)
    s = compressed_fedavg(up="topk:0.1")
    send(s, g, 1, [1, 2])
    good = _good_payload(rng)
    out, _ = s.aggregate_train(1, [_corrupt(kind, rng), _reply(2, good, 7)])  # type: ignore[list-item]
    assert out is not None and list({**s.report.refused, **s.report.errors}) == ["1"]
    want = [a + d for a, d in zip(g, codec.decode(good).to_dense(), strict=True)]
    for a, b in zip(record_to_arrays(out)[1], want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("support", ["random", "block", "topk-aggregate"])
def test_shared_support_site_and_server_agree(support: str) -> None:
    """Sites send values only; the server recomputes the support and decodes exactly."""
    rng = np.random.default_rng(5)
    s = compressed_fedavg(up="topk:0.02+ef", support=support, seed=11)
    assert s.spec.up.startswith({"random": "shared", "block": "block",
                              "topk-aggregate": "aggtopk"}[support] + ":0.02")
    ctxs = {n: site_context(n, partition=n) for n in (1, 2, 3)}
    g = model(0)
    carried = {n: [np.zeros(sh, np.float32) for sh in SHAPES] for n in ctxs}
    nodes_per_round = [[1, 2, 3], [1, 2, 3], [1, 3], [1, 2, 3]]  # node 2 misses round 3
    for rnd, nodes in enumerate(nodes_per_round, start=1):
        msgs = send(s, g, rnd, nodes)
        replies, deltas = [], {}
        for n in nodes:
            if rnd == 4 and n == 2 and support == "topk-aggregate":
                assert PREVIOUS_KEY in msgs[n].content  # node 2 lacks round 3's model
            elif rnd > 1:
                assert PREVIOUS_KEY not in msgs[n].content
            deltas[n] = _deltas(rng)
            replies.append(fedagg_mod(msgs[n], ctxs[n], handler_adding(deltas[n], 10 + n)))
        for r in replies:  # values only: no index bytes on the wire
            p = codec.decode(payload_bytes(r.content.array_records[REPLY_KEY]))
            assert all(t.implicit_indices for t in p.tensors)
        out, _ = s.aggregate_train(rnd, replies)
        assert out is not None and s.report.refused == {}
        # the server's decoded deltas satisfy the sites' sum invariant => same support
        decoded = {}
        for r in replies:
            decoded[r.metadata.src_node_id] = s.codec.decode(r).tensors
        for n in nodes:
            res = ef_residual(ctxs[n])
            for d, c, p, e in zip(deltas[n], carried[n], decoded[n], res, strict=True):
                np.testing.assert_allclose(p + e, d + c, rtol=1e-5, atol=1e-6)
            carried[n] = res
        numel = sum(int(np.prod(sh)) for sh in SHAPES)
        support_idx = s.history.support()
        assert support_idx is not None and len(support_idx) == int(np.ceil(0.02 * numel))
        if support == "topk-aggregate" and rnd > 1:
            agg = s.history.previous_aggregate
            assert agg is not None and np.any(agg != 0)
        g = record_to_arrays(out)[1]


def test_topk_aggregate_support_follows_the_previous_aggregate() -> None:
    s = compressed_fedavg(up="topk:0.01+ef", support="topk-aggregate", seed=2)
    g0, g1 = model(0), model(1)
    send(s, g0, 1, [1])
    s.aggregate_train(1, [])
    send(s, g1, 2, [1])
    agg = np.concatenate([(b - a).ravel() for a, b in zip(g0, g1, strict=True)])
    sup = s.history.support()
    assert sup is not None
    top = np.sort(np.argsort(-np.abs(agg), kind="stable")[: sup.size])
    np.testing.assert_array_equal(sup, top)


def test_downward_bf16_halves_bytes_down_and_server_keeps_master_weights() -> None:
    g = model(2)
    plain = compressed_fedavg(up="topk:0.1+ef")
    bf = compressed_fedavg(up="topk:0.1+ef", down="bf16")
    m_plain = send(plain, g, 1, [1])[1]
    m_bf = send(bf, g, 1, [1])[1]
    assert message_nbytes(m_bf) < 0.6 * message_nbytes(m_plain)
    zero = [np.zeros(sh, np.float32) for sh in SHAPES]
    out, _ = bf.aggregate_train(1, [fedagg_mod(m_bf, site_context(1), handler_adding(zero))])
    assert out is not None
    for a, b in zip(record_to_arrays(out)[1], g, strict=True):
        np.testing.assert_array_equal(a, b)  # zero delta: exact master weights, not bf16


def test_downward_only_dense_replies() -> None:
    g = model(3)
    s = compressed_fedavg(up="none", down="fp16")
    msg = send(s, g, 1, [1])[1]
    d = [np.full(sh, 0.5, np.float32) for sh in SHAPES]
    reply = fedagg_mod(msg, site_context(1), handler_adding(d))
    assert "arrays" in reply.content  # dense reply, deltas against the fp16 model
    out, _ = s.aggregate_train(1, [reply])
    assert out is not None
    for a, b, x in zip(record_to_arrays(out)[1], g, d, strict=True):
        np.testing.assert_allclose(a, b + x, atol=1e-3)


def test_effective_spec_and_bad_specs() -> None:
    assert effective_spec("topk:0.01+ef", "own") == "topk:0.01+ef"
    assert effective_spec("topk:0.01,global+ef+int8", "random") == "shared:0.01+ef+int8"
    assert effective_spec("topk:k=100+ef", "block") == "block:k=100+ef"
    assert effective_spec("randk:0.05,private", "topk-aggregate") == "aggtopk:0.05"
    assert effective_spec("int8", "random") == "int8"
    with pytest.raises(ConfigError, match="contradicts"):
        effective_spec("block:0.01", "random")
    with pytest.raises(ConfigError, match="ratio"):
        compressed_fedavg(up="topk:2.0")
    with pytest.raises(ConfigError):
        compressed_fedavg(up="topk:0.1", down="int8")


def test_registry_builds_compressed_from_config() -> None:
    cfg = load_config(None, ["strategy.name='compressed'", "compression.up='topk:0.01+ef'",
                             "compression.support='block'", "compression.down='bf16'"])
    s = build_strategy(cfg)
    assert isinstance(s, Compressed)
    assert s.spec.up == "block:0.01+ef" and s.spec.down == "bf16"


def test_reveal_indices_is_the_explicit_name_of_own() -> None:
    """DESIGN.md: index-revealing modes say so in their config name; 'own' stays an alias."""
    for support in ("reveal-indices", "own"):
        assert effective_spec("topk:0.01+ef", support) == "topk:0.01+ef"
        cfg = load_config(None, ["strategy.name='compressed'", "compression.up='topk:0.01+ef'",
                                 f"compression.support='{support}'"])
        s = build_strategy(cfg)
        assert isinstance(s, Compressed) and s.spec.up == "topk:0.01+ef"
    with pytest.raises(ConfigError, match="reveal-indices"):
        effective_spec("topk:0.01", "mine")
    # under secure aggregation the revealing support is refused, whichever name it has
    for support in ("reveal-indices", "own"):
        cfg = load_config(None, ["strategy.name='secure'", "compression.up='topk:0.01+ef'",
                                 f"compression.support='{support}'"])
        with pytest.raises(ConfigError, match="chooses indices per site"):
            build_strategy(cfg)
