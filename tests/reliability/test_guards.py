"""Stale / foreign / duplicate replies are refused; transient errors are retried within the
deadline; permanent errors are not retried."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import train_reply
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from clients.app import app as client_app
from fedagg.config import load_config
from server.inprocess import InProcessGrid
from server.runner import client_config, run_server
from strategies.base import filter_replies
from strategies.fedavg import FedAvg
from strategies.loop import run_train_round
from strategies.wire import arrays_to_record, record_to_arrays


def _sent(node: int) -> Message:
    m = Message(RecordDict(), dst_node_id=node, message_type="train")
    m.metadata.__dict__["_message_id"] = f"msg-{node}"
    return m


def _reply_to(msg_id: str, node: int) -> Message:
    r = train_reply(node, [np.ones(2, np.float32)], 1)
    r.metadata.__dict__["_reply_to_message_id"] = msg_id
    return r


def test_filter_refuses_stale_foreign_and_duplicate_replies() -> None:
    sent = [_sent(1), _sent(2)]
    replies = [_reply_to("msg-1", 1), _reply_to("msg-1", 1), _reply_to("old-msg", 2), _reply_to("msg-2", 3)]
    kept, refused = filter_replies(sent, replies)
    assert [r.metadata.src_node_id for r in kept] == [1]
    assert "duplicate" in refused["1"] and "stale or foreign" in refused["2"] and "addressed to node 2" in refused["3"]


def test_reply_echoing_an_earlier_round_is_never_aggregated() -> None:
    s = FedAvg()
    s.configure_train(3, arrays_to_record([np.zeros(2, np.float32)]), ConfigRecord(), _Grid())
    stale = train_reply(1, [np.full(2, 9.0, np.float32)], 1, **{"server-round": 2})
    fresh = train_reply(2, [np.ones(2, np.float32)], 1, **{"server-round": 3})
    out, _ = s.aggregate_train(3, [stale, fresh])
    assert out is not None
    np.testing.assert_array_equal(record_to_arrays(out)[1][0], [1.0, 1.0])
    assert "earlier round" in s.report.refused["1"]


class _Grid:
    def get_node_ids(self) -> list[int]:
        return [1, 2]


class _Flaky:
    """The real ClientApp, failing the first ``fails`` calls of one partition."""

    def __init__(self, partition: int, fails: int, error: type[Exception]) -> None:
        self.partition, self.fails, self.error, self.calls = partition, fails, error, 0

    def __call__(self, msg: Message, ctx: Context) -> Message:
        if ctx.node_config["partition-id"] == self.partition and msg.metadata.message_type == "train":
            self.calls += 1
            if self.calls <= self.fails:
                raise self.error("transient network hiccup")
        return client_app(msg, ctx)


def _round(flaky: _Flaky, retries: int) -> tuple[int, int]:
    cfg = load_config(None, ["run.sites=3", "train.local_epochs=1", f"run.retries={retries}"])
    grid = InProcessGrid(flaky, 3, seed=1)
    s = FedAvg(min_available_nodes=3)
    from fedagg.data import load_dataset
    from fedagg.models import build_model, get_weights

    ds = load_dataset("digits")
    m = build_model("mlp", ds.input_shape, ds.num_classes, seed=0)
    arrays: ArrayRecord = arrays_to_record(get_weights(m), list(m.state_dict().keys()))
    res = run_train_round(s, grid, 1, arrays, client_config(cfg), timeout=120, retries=retries)
    return res.report.replies, res.report.exchanges


def test_transient_error_is_retried_within_deadline() -> None:
    flaky = _Flaky(1, fails=1, error=RuntimeError)
    replies, attempts = _round(flaky, retries=2)
    assert replies == 3 and attempts == 2 and flaky.calls == 2


def test_no_retry_when_not_allowed_and_permanent_errors_not_retried() -> None:
    assert _round(_Flaky(1, fails=1, error=RuntimeError), retries=0) == (2, 1)
    from fedagg.errors import ConfigError

    flaky = _Flaky(1, fails=5, error=ConfigError)
    assert _round(flaky, retries=3) == (2, 1) and flaky.calls == 1


def test_min_sites_unmet_keeps_model_and_run_continues(tmp_path: Path) -> None:
    cfg = load_config(None, ["run.sites=3", "run.rounds=2", "run.min_sites=3", "train.local_epochs=1",
                             "faults.crash_site=2", "faults.crash_round=1"])
    records = run_server(InProcessGrid(client_app, 3, seed=2), cfg, tmp_path)
    assert records[1]["model_updated"] is False and records[1]["sites_failed"] == 1
    assert records[1]["accuracy"] == records[0]["accuracy"]  # unchanged model, same evaluation
    assert records[2]["model_updated"] is True and records[2]["sites"] == [0, 1, 2]
    per_site = records[2]["site_metrics"]  # keyed by node id, the partition id a label
    assert sorted(m["partition-id"] for m in per_site.values()) == [0, 1, 2]
    assert all(m["num-examples"] > 0 and m["compute_seconds"] > 0 for m in per_site.values())
