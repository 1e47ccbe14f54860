"""Model-consistent secure rounds over real Flower Messages and the real ClientApp.

A server that sends one member of a secure round another model than the others (Pasquini et
al., CCS 2022, "Eluding Secure Aggregation in Federated Learning via Model Inconsistency")
cannot complete the round: the model's digest (:func:`strategies.wire.model_digest`) is bound
into every pairwise mask key (:func:`fedagg.secagg.keys.round_binding`), so a site refuses a
round request that names another model than the one it received, and members that were
given requests naming different models derive masks that do not cancel (the canary slots are
not zero). fedagg's own server refuses to open such a round at all.

The protocol-level tests of the binding are in tests/secagg/test_secagg_model_binding.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict

from clients.app import app
from fedagg.config import RunConfig, load_config
from fedagg.data import load_dataset
from fedagg.errors import ConfigError
from fedagg.models import build_model
from server.inprocess import InProcessGrid, nodes_by_partition
from server.runner import client_config
from strategies.base import RoundResult
from strategies.loop import run_train_round
from strategies.registry import build_strategy
from strategies.secure import SecureAggregation
from strategies.wire import PARAMS_KEY, arrays_to_record, model_key, record_to_arrays

BASE = ["run.sites=5", "train.local_epochs=1", "data.max_train_examples=200",
        "secagg.weight_scale=300", "strategy.name=secure"]


def _cfg() -> RunConfig:
    return load_config(None, BASE)


def _initial(cfg: RunConfig) -> ArrayRecord:
    ds = load_dataset(cfg.data.dataset, test_fraction=cfg.data.test_fraction, seed=cfg.run.seed)
    model = build_model(cfg.model.name, ds.input_shape, ds.num_classes, seed=cfg.run.seed)
    sd = model.state_dict()
    return arrays_to_record([t.detach().numpy().copy() for t in sd.values()], list(sd))


def _nudged(record: ArrayRecord) -> ArrayRecord:
    keys, arrays = record_to_arrays(record)
    arrays[0] = arrays[0] + np.float32(1e-3)
    return arrays_to_record(arrays, keys)


class LyingGrid(InProcessGrid):
    """Sends ``victim`` a slightly different model in the upload message of ``rounds``."""

    def __init__(self, *args: Any, victim_partition: int, rounds: set[int], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.victim = nodes_by_partition(self)[victim_partition]
        self.rounds = rounds
        self.lied = 0

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        out = []
        for m in messages:
            content = m.content
            prec = content.config_records.get(PARAMS_KEY)
            rnd = content.config_records.get("config", {}).get("server-round")
            if (m.metadata.dst_node_id == self.victim and prec is not None
                    and prec.get("stage") == "upload" and rnd in self.rounds):
                key = model_key(content)
                swapped = RecordDict({k: v for k, v in content.items() if k != key})
                swapped[key] = _nudged(content.array_records[key])
                m = Message(content=swapped, dst_node_id=m.metadata.dst_node_id,
                            message_type=m.metadata.message_type)
                self.lied += 1
            out.append(m)
        return super().push_messages(out)


def _round(strategy: Any, grid: InProcessGrid, rnd: int, arrays: ArrayRecord,
           cfg: RunConfig) -> RoundResult:
    return run_train_round(strategy, grid, rnd, arrays, client_config(cfg), 600.0)


def test_a_member_sent_another_model_cannot_complete_the_round() -> None:
    """The lying server gives site 3 a nudged model in round 2: site 3 refuses the request
    (it names another model), so its update never enters a sum computed for the others'
    model; the round goes on without it, and round 3 (honest) counts everyone again."""
    cfg = _cfg()
    secure = build_strategy(cfg)
    assert isinstance(secure, SecureAggregation)
    grid = LyingGrid(app, 5, victim_partition=3, rounds={2})
    arrays = _initial(cfg)
    r1 = _round(secure, grid, 1, arrays, cfg)
    assert r1.arrays is not None and r1.metrics is not None
    assert r1.metrics["secagg-counted"] == 5
    r2 = _round(secure, grid, 2, r1.arrays, cfg)
    assert grid.lied == 1
    errors = " ".join(r2.report.errors.values())
    assert "binding" in errors and "another model" in errors, r2.report.errors
    assert str(grid.victim) in r2.report.errors
    if r2.arrays is not None:  # the others' round: the victim is not in it
        assert r2.metrics is not None and r2.metrics["secagg-counted"] == 4
    r3 = _round(secure, grid, 3, r2.arrays or r1.arrays, cfg)
    assert r3.arrays is not None and r3.metrics is not None
    assert r3.metrics["secagg-counted"] >= 4


def test_an_inner_strategy_sending_different_models_is_refused_before_any_site_trains() -> None:
    """A secure round sums updates from one model: an inner strategy that sends two models
    is refused with the reason, and no site is asked to upload."""
    cfg = _cfg()
    secure = build_strategy(cfg)
    assert isinstance(secure, SecureAggregation)
    inner = secure.inner
    original = inner.configure_train

    def two_models(server_round: int, arrays: ArrayRecord, config: Any, grid: Any) -> Any:
        msgs = list(original(server_round, arrays, config, grid))
        first = msgs[0]
        key = model_key(first.content)
        content = RecordDict({k: v for k, v in first.content.items() if k != key})
        content[key] = _nudged(first.content.array_records[key])
        msgs[0] = Message(content=content, dst_node_id=first.metadata.dst_node_id,
                          message_type=first.metadata.message_type)
        return msgs

    inner.configure_train = two_models  # type: ignore[method-assign]
    grid = InProcessGrid(app, 5)
    uploads: list[int] = []
    push = grid.push_messages

    def counting(messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        uploads.extend(1 for m in messages
                       if m.content.config_records.get(PARAMS_KEY, {}).get("stage") == "upload")
        return push(messages)

    grid.push_messages = counting  # type: ignore[method-assign]
    try:
        result = _round(secure, grid, 1, _initial(cfg), cfg)
    except ConfigError as exc:
        assert "2 different models" in str(exc)
    else:
        assert result.arrays is None
        assert "different models" in (result.report.aborted + " ".join(
            result.report.refused.values())), result.report
    assert uploads == []
