"""The issue 17 attacks on the model, one test each (items 1 and 2), and the per-round guard.

Each failed on the code before issue 17: two 1e308 weights zeroed the FedAvg model, one site
with 1e6 examples pulled it 0.999 of the way to its own, FLT_MAX deltas made the compressed
model Inf in two rounds, a momentum optimizer kept a refused delta in its state, a NaN
``partition-id`` or a metric sent as a list by one site and a number by the others raised in
the round, and an exception in one round's aggregation ended the run.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import guarded_fedavg, reply_message, train_reply
from flwr.app import ConfigRecord, MetricRecord, RecordDict
from hostile import fast_app

from fedagg.aggregate import UpdateGuards, cap_weights, model_change_problem, norm_outliers
from fedagg.compression import TensorPayload, WireDType, codec
from fedagg.compression.payload import Payload
from fedagg.config import load_config
from fedagg.errors import RunFailed
from server.inprocess import InProcessGrid
from server.runner import run_server
from strategies.compressed import Compressed
from strategies.fedavg import FedAvg
from strategies.wire import arrays_to_record, payload_record, record_to_arrays

FLT_MAX = float(np.finfo(np.float32).max)


class _Grid:
    def __init__(self, n: int) -> None:
        self.n = n

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.n + 1))


def _round(strategy: Any, glob: list[np.ndarray], replies: list[Any], rnd: int = 1
           ) -> list[np.ndarray] | None:
    strategy.configure_train(rnd, arrays_to_record(glob), ConfigRecord(), _Grid(max(len(replies), 3)))
    out, _ = strategy.aggregate_train(rnd, replies)
    return None if out is None else record_to_arrays(out)[1]


def test_two_weights_of_1e308_do_not_zero_the_model() -> None:
    s = guarded_fedavg(min_available_nodes=1)
    new = _round(s, [np.zeros(2, np.float32)], [train_reply(1, [np.ones(2, np.float32)], 1e308),
                                                 train_reply(2, [np.full(2, 3.0, np.float32)], 1e308)])
    assert new is not None
    np.testing.assert_allclose(new[0], [2.0, 2.0])  # was [0, 0]: w / sum(w) = 1e308 / inf


@pytest.mark.parametrize(("ratio", "most"), [(10.0, 10 / 14), (0.0, 1.0)])
def test_one_site_claiming_a_million_examples_is_capped(ratio: float, most: float) -> None:
    # the norm guard off: the liar's update is an ordinary one, only its weight lies
    s = guarded_fedavg(min_available_nodes=1, max_weight_ratio=ratio, norm_outlier_factor=0)
    replies = [train_reply(i, [np.zeros(2, np.float32)], 100) for i in range(1, 5)]
    replies.append(train_reply(5, [np.ones(2, np.float32)], 1e6))
    new = _round(s, [np.zeros(2, np.float32)], replies)
    assert new is not None
    pulled = float(new[0][0])  # how far towards the liar's model (1.0)
    assert pulled <= most + 1e-6
    if ratio:
        assert pulled == pytest.approx(1000 / 1400) and "5" in s.report.capped
        assert "capped to 1000" in s.report.capped["5"]
    else:
        assert pulled > 0.999 and not s.report.capped  # the off-switch: Flower's plain mean


def test_an_absolute_max_weight_refuses_the_reply() -> None:
    s = guarded_fedavg(min_available_nodes=1, max_weight=500)
    new = _round(s, [np.zeros(2, np.float32)], [train_reply(1, [np.ones(2, np.float32)], 10),
                                                 train_reply(2, [np.ones(2, np.float32)], 501)])
    assert new is not None and "strategy.max_weight" in s.report.refused["2"]


@pytest.mark.parametrize("factor", [10.0, 0.0])
def test_a_norm_bomb_is_refused_by_the_median_guard(factor: float) -> None:
    s = guarded_fedavg(min_available_nodes=1, norm_outlier_factor=factor)
    rng = np.random.default_rng(0)
    replies = [train_reply(i, [rng.normal(0, 0.01, 4).astype(np.float32)], 10) for i in range(1, 5)]
    replies.append(train_reply(5, [np.full(4, 1e4, np.float32)], 10))
    new = _round(s, [np.zeros(4, np.float32)], replies)
    assert new is not None
    if factor:
        assert "norm_outlier_factor" in s.report.refused["5"] and np.abs(new[0]).max() < 0.1
    else:
        assert "5" not in s.report.refused and np.abs(new[0]).max() > 1e3


def test_flt_max_deltas_never_make_the_compressed_model_infinite() -> None:
    """The issue's two rounds of FLT_MAX deltas under the compressed default config."""
    s = Compressed(guarded_fedavg(min_available_nodes=1), up="topk:0.5")
    glob = [np.zeros(4, np.float32)]
    for rnd in (1, 2):
        replies = []
        for node in range(1, 6):
            value = FLT_MAX if node == 5 else 0.01 * node
            t = TensorPayload((4,), WireDType.FLOAT32, np.full(2, value, np.float32),
                              indices=np.array([0, 2]))
            replies.append(reply_message(node, RecordDict({
                "compressed": payload_record(codec.encode(Payload((t,)))),
                "metrics": MetricRecord({"num-examples": 10, "server-round": rnd})})))
        new = _round(s, glob, replies, rnd)
        assert new is not None and np.isfinite(new[0]).all() and np.abs(new[0]).max() < 1
        assert "norm_outlier_factor" in s.report.refused["5"]
        glob = new


def test_a_refused_model_leaves_no_trace_in_the_momentum() -> None:
    guarded = guarded_fedavg(min_available_nodes=1, server_optimizer="momentum", max_model_change=5.0)
    fresh = guarded_fedavg(min_available_nodes=1, server_optimizer="momentum")
    g = [np.zeros(2, np.float32)]
    bomb = [train_reply(1, [np.full(2, 100.0, np.float32)], 1)]
    assert _round(guarded, g, bomb) is None
    assert "max_model_change" in guarded.report.refused["server"]
    ok = [train_reply(1, [np.ones(2, np.float32)], 1)]
    a, b = _round(guarded, g, ok, 2), _round(fresh, g, ok, 2)
    assert a is not None and b is not None
    np.testing.assert_array_equal(a[0], b[0])  # the refused delta is not in the momentum


def test_momentum_that_would_overflow_is_refused_and_rolled_back() -> None:
    s = guarded_fedavg(min_available_nodes=1, server_optimizer="momentum", server_lr=3.0,
               norm_outlier_factor=0)
    g = [np.full(2, FLT_MAX / 2, np.float32)]
    assert _round(s, g, [train_reply(1, [np.full(2, FLT_MAX, np.float32)], 1)]) is None
    assert "not finite" in s.report.refused["server"]
    assert s.optimizer.snapshot() == (0, None, None)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, 2.5, 2**40, [1, 2]])
def test_a_bad_partition_id_rejects_that_reply_not_the_round(value: Any) -> None:
    s = guarded_fedavg(min_available_nodes=1)
    new = _round(s, [np.zeros(2, np.float32)], [
        train_reply(1, [np.ones(2, np.float32)], 10, **{"partition-id": 0}),
        train_reply(2, [np.full(2, 9.0, np.float32)], 10, **{"partition-id": value})])
    assert new is not None and "partition-id" in s.report.refused["2"]
    np.testing.assert_array_equal(new[0], [1.0, 1.0])


def test_a_metric_sent_as_a_list_by_one_site_does_not_break_the_round() -> None:
    s = guarded_fedavg(min_available_nodes=1)
    g = [np.zeros(2, np.float32)]
    s.configure_train(1, arrays_to_record(g), ConfigRecord(), _Grid(3))
    out, metrics = s.aggregate_train(1, [
        train_reply(1, [np.ones(2, np.float32)], 10, train_loss=0.5, eval_acc=0.9),
        train_reply(2, [np.ones(2, np.float32)], 10, train_loss=0.7, eval_acc=0.8),
        train_reply(3, [np.ones(2, np.float32)], 10, train_loss=[1.0, 2.0], eval_acc=float("nan"))])
    assert out is not None and metrics is not None and not s.report.refused
    assert "train_loss" not in metrics and "eval_acc" not in metrics  # not comparable this round


@pytest.mark.parametrize(("echo", "ok"), [(1, True), (1.0, True), (0, False), (float("nan"), False),
                                          ([1], False), ([1.0, 2.0], False)])
def test_the_round_echo_is_an_integer_equal_to_the_round(echo: Any, ok: bool) -> None:
    s = guarded_fedavg(min_available_nodes=1)
    new = _round(s, [np.zeros(2, np.float32)],
                 [train_reply(1, [np.ones(2, np.float32)], 10, **{"server-round": echo})])
    assert (new is not None) == ok
    if not ok:
        assert "server-round" in s.report.refused["1"]


def test_guard_functions_oracle() -> None:
    w, over = cap_weights([1, 2, 3, 1000], 10)
    assert over == [3] and w[3] == 25.0
    assert cap_weights([1, 1000], 10)[1] == []  # < 3 weights: no median to trust
    assert norm_outliers([1, 1.1, 0.9, 50], 10) == [3]
    assert norm_outliers([1, 1.1, float("nan")], 10) == [2]
    assert norm_outliers([1, 500], 10) == []
    assert model_change_problem([np.ones(2)], [np.zeros(2)], max_change=1.5) == ""
    assert "max_model_change" in model_change_problem([np.ones(2) * 2], [np.zeros(2)],
                                                      max_change=1.5)
    assert "not finite" in model_change_problem([np.array([np.inf])], [np.zeros(1)])
    assert UpdateGuards().max_weight_ratio == 10 and UpdateGuards().norm_outlier_factor == 10


def test_guard_settings_are_validated() -> None:
    from fedagg.errors import ConfigError

    for bad in ("strategy.max_weight_ratio=0.5", "strategy.norm_outlier_factor=1",
                "strategy.max_weight=0", "strategy.max_model_change=-1"):
        with pytest.raises(ConfigError):
            load_config(None, [bad])
    cfg = load_config(None, ["strategy.norm_outlier_factor=0", "strategy.max_weight_ratio=0"])
    assert cfg.strategy.norm_outlier_factor == 0  # the off-switches


# -- the server loop's per-round guard ---------------------------------------------------------
class _Flaky(FedAvg):
    """fedagg's FedAvg whose aggregation raises in the given rounds (a strategy bug)."""

    def __init__(self, fail: set[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail = fail

    def aggregate_train(self, server_round: int, replies: Any) -> Any:
        if server_round in self.fail:
            raise ZeroDivisionError("boom in the aggregate")
        return super().aggregate_train(server_round, replies)


def _serve(tmp: Path, strategy: Any, monkeypatch: pytest.MonkeyPatch,
           rounds: int = 3) -> list[dict[str, Any]]:
    cfg = load_config(None, ["run.sites=3", f"run.rounds={rounds}", "run.checkpoint=false",
                             "run.wait_for_sites=0"])
    monkeypatch.setattr("server.runner.build_strategy", lambda _cfg: strategy)
    return run_server(InProcessGrid(fast_app(), 3, seed=1, wire=False), cfg, tmp,
                      model_fn=lambda: torch.nn.Linear(4, 3), evaluate_fn=lambda a: (0.0, 0.0))


def test_an_error_in_one_rounds_aggregation_costs_that_round_not_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records = _serve(tmp_path, _Flaky({2}, min_available_nodes=3), monkeypatch)
    assert [r["model_updated"] for r in records[1:]] == [True, False, True]
    assert "ZeroDivisionError: boom" in records[2]["errors"]["server"]
    assert "unexpected error" in records[2]["summary"]
    assert records[2]["model_digest"] == records[1]["model_digest"]  # model unchanged


def test_a_run_whose_every_round_fails_still_fails_loudly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RunFailed, match="boom in the aggregate") as info:
        _serve(tmp_path, _Flaky({1, 2, 3}, min_available_nodes=3), monkeypatch)
    assert all("server" in r["errors"] for r in info.value.records[1:])


class _Poisoner(FedAvg):
    """A strategy (a plugin, say) that returns a non-finite model in round 2."""

    def aggregate_train(self, server_round: int, replies: Any) -> Any:
        out, metrics = super().aggregate_train(server_round, replies)
        if server_round == 2 and out is not None:
            keys, arrays = record_to_arrays(out)
            out = arrays_to_record([a * np.float32(math.inf) for a in arrays], keys)
        return out, metrics


def test_the_backstop_refuses_any_strategys_non_finite_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records = _serve(tmp_path, _Poisoner(min_available_nodes=3), monkeypatch)
    assert [r["model_updated"] for r in records[1:]] == [True, False, True]
    assert "not finite" in records[2]["rejected"]["server"]
