"""clients.fedagg_mod (compression) on real Flower Message / Context objects."""

from __future__ import annotations

import numpy as np
import pytest
from _cf_helpers import (
    SHAPES,
    compressed_fedavg,
    ef_residual,
    handler_adding,
    model,
    send,
    site_context,
)
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from clients.protocol import fedagg_mod
from fedagg.compression import bf16_bits_to_float32, codec, float32_to_bf16_bits
from fedagg.errors import ProtocolError
from strategies import build_strategy
from strategies.wire import (
    INSTRUCTION_KEY,
    PREVIOUS_KEY,
    REPLY_KEY,
    message_nbytes,
    payload_bytes,
    record_to_arrays,
)


def _decode(reply: Message) -> list[np.ndarray]:
    return codec.decode(payload_bytes(reply.content.array_records[REPLY_KEY])).to_dense()


def test_residual_persists_in_context_state_and_sum_invariant_holds() -> None:
    rng = np.random.default_rng(1)
    s = compressed_fedavg(up="topk:0.1+ef")
    ctx = site_context(7)
    deltas = [[rng.normal(size=sh).astype(np.float32) for sh in SHAPES] for _ in range(3)]
    carried = [np.zeros(sh, np.float32) for sh in SHAPES]
    for rnd, delta in enumerate(deltas, start=1):
        msg = send(s, model(rnd), rnd, [7])[7]
        reply = fedagg_mod(msg, ctx, handler_adding(delta))
        sent = _decode(reply)
        residual = ef_residual(ctx)
        for d, c, p, r in zip(delta, carried, sent, residual, strict=True):
            # decode(payload) + e_new == delta + e_old: nothing lost, only delayed
            np.testing.assert_allclose(p + r, d + c, rtol=1e-6, atol=1e-6)
            assert 0 < np.count_nonzero(p) <= int(np.ceil(0.1 * d.size))
        assert float(np.abs(np.concatenate([r.ravel() for r in residual])).sum()) > 0
        carried = residual
    state = ctx.state.config_records["fedagg.compression-state"]
    assert state["spec"] == "topk:0.1+ef" and state["round"] == 3


def test_only_the_payload_and_metrics_leave_the_site() -> None:
    s = compressed_fedavg(up="topk:0.05+ef+int8")
    ctx = site_context(3, partition=2)
    msg = send(s, model(), 1, [3])[3]
    delta = [np.full(sh, 0.25, np.float32) for sh in SHAPES]
    reply = fedagg_mod(msg, ctx, handler_adding(delta, num_examples=42))
    assert set(reply.content.keys()) == {REPLY_KEY, "metrics"}
    assert list(reply.content.array_records) == [REPLY_KEY]
    rec = reply.content.array_records[REPLY_KEY]
    assert list(rec.keys()) == ["payload"] and rec["payload"].dtype == "uint8"
    assert dict(reply.content.metric_records["metrics"]) == {
        "num-examples": 42, "partition-id": 2, "train-loss": 1.0}
    # the residual stays in ctx.state and its bytes are nowhere in the reply
    residual = ef_residual(ctx)
    assert any(np.any(r != 0) for r in residual)
    wire = b"".join(obj.deflate() for obj in _objects(reply))
    assert residual[0].tobytes()[:64] not in wire
    # and the reply is far smaller than a dense one
    dense = handler_adding(delta)(msg, ctx)
    assert message_nbytes(reply) < 0.2 * message_nbytes(dense)


def _objects(message: Message) -> list:  # type: ignore[type-arg]
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return list(get_all_nested_objects(message).values())


def test_downward_bf16_is_decoded_before_the_handler() -> None:
    s = compressed_fedavg(up="topk:0.1+ef", down="bf16")
    g = model(4)
    msg = send(s, g, 1, [5])[5]
    sent = msg.content.array_records["arrays"]
    assert all(sent[k].dtype == "uint16" for k in sent)  # bf16 bit patterns on the wire
    seen: list[list[np.ndarray]] = []
    records: list[set[str]] = []
    inner = handler_adding([np.zeros(sh, np.float32) for sh in SHAPES], seen=seen)

    def handler(m: Message, c: Context) -> Message:
        records.append(set(m.content.keys()))
        return inner(m, c)

    fedagg_mod(msg, site_context(5), handler)
    for got, want in zip(seen[0], g, strict=True):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, bf16_bits_to_float32(float32_to_bf16_bits(want)))
    assert records == [{"arrays", "config"}]  # the handler saw only records it knows
    assert INSTRUCTION_KEY in msg.content  # and the server's message was left as it was


def test_messages_without_instruction_pass_through() -> None:
    msg = Message(content=RecordDict({"arrays": ArrayRecord({"w": Array(np.ones(3, np.float32))}),
                                      "config": ConfigRecord({"compression.up": "topk:0.1"})}),
                  message_type="train", dst_node_id=1)
    ctx = site_context(1)
    reply = fedagg_mod(msg, ctx, handler_adding([np.ones(3, np.float32)]))
    assert "arrays" in reply.content and REPLY_KEY not in reply.content
    assert len(ctx.state) == 0


def test_error_replies_pass_through_and_state_is_untouched() -> None:
    s = compressed_fedavg(up="topk:0.1+ef")
    msg = send(s, model(), 1, [2])[2]
    ctx = site_context(2)
    from flwr.app import Error

    reply = fedagg_mod(msg, ctx, lambda m, c: Message(Error(code=1, reason="boom"), reply_to=m))
    assert reply.has_error() and len(ctx.state) == 0


def test_topk_aggregate_site_without_previous_model_refuses() -> None:
    s = compressed_fedavg(up="topk:0.1+ef", support="topk-aggregate")
    zero = [np.zeros(sh, np.float32) for sh in SHAPES]
    send(s, model(0), 1, [9])
    msg = send(s, model(1), 2, [9])[9]
    # the server did not hear from node 9 in round 1, so it attaches the previous model ...
    assert PREVIOUS_KEY in msg.content
    stripped = Message(content=RecordDict({k: v for k, v in msg.content.items()
                                           if k != PREVIOUS_KEY}),
                       message_type="train", dst_node_id=9)
    reply = fedagg_mod(msg, site_context(9), handler_adding(zero))
    assert REPLY_KEY in reply.content
    # ... without it, and with nothing kept in Context.state, the site refuses clearly
    with pytest.raises(ProtocolError, match="previous global model"):
        fedagg_mod(stripped, site_context(9), handler_adding(zero))


def test_real_client_app_replies_compressed() -> None:
    """The real ClientApp (clients.app:app, its MODS and train handler) on the digits set."""
    from clients.app import app
    from fedagg.config import load_config
    from fedagg.data import load_dataset
    from fedagg.models import build_model
    from server.runner import client_config
    from strategies.wire import arrays_to_record

    cfg = load_config(None, ["run.sites=2", "train.local_epochs=1", "compression.up='topk:0.1+ef'",
                             "compression.down='fp16'", "strategy.name='compressed'"])
    ds = load_dataset("digits")
    net = build_model("mlp", ds.input_shape, ds.num_classes, seed=0)
    keys = list(net.state_dict())
    g = [t.detach().numpy().copy() for t in net.state_dict().values()]
    s = build_strategy(cfg)

    class _G:
        def get_node_ids(self) -> list[int]:
            return [101, 102]

    msgs = list(s.configure_train(1, arrays_to_record(g, keys), client_config(cfg), _G()))  # type: ignore[arg-type]
    replies = []
    for i, m in enumerate(msgs):
        ctx = Context(run_id=1, node_id=m.metadata.dst_node_id,
                      node_config={"partition-id": i, "num-partitions": 2}, state=RecordDict(),
                      run_config={})
        replies.append(app(m, ctx))
        assert "fedagg.ef" in ctx.state.array_records
    assert all(set(r.content.keys()) == {REPLY_KEY, "metrics"} for r in replies)
    out, metrics = s.aggregate_train(1, replies)
    assert out is not None and s.report.refused == {}
    new = record_to_arrays(out)[1]
    changed = sum(int(np.count_nonzero(a != b)) for a, b in zip(new, g, strict=True))
    total = sum(a.size for a in g)
    assert 0 < changed <= 2 * int(0.1 * total) + 2 * len(g)  # at most both sites' top-10 %
    assert metrics is not None and "train_loss" in metrics


def test_state_namespaces_keep_strategies_apart() -> None:
    """Two strategies driving the same site keep separate residuals (benchmark use)."""
    ctx = site_context(4)
    a = compressed_fedavg(up="topk:0.1+ef", state_namespace=".a")
    b = compressed_fedavg(up="topk:0.1+ef", state_namespace=".b")
    da = [np.full(sh, 1.0, np.float32) for sh in SHAPES]
    db = [np.full(sh, -2.0, np.float32) for sh in SHAPES]
    fedagg_mod(send(a, model(), 1, [4])[4], ctx, handler_adding(da))
    fedagg_mod(send(b, model(), 1, [4])[4], ctx, handler_adding(db))
    ra, rb = ef_residual(ctx, ".a"), ef_residual(ctx, ".b")
    assert float(ra[0].max()) == 1.0 and float(rb[0].min()) == -2.0
    assert "fedagg.ef" not in ctx.state.array_records
