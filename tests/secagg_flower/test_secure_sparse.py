"""Sparse + secure: SecureAggregation with a public support over the real ClientApp.

Oracle: the plaintext Compressed(FedAvg()) with the same spec, support, public seed and sites,
fed the same global model every round (so site training and error-feedback residuals are
bit-identical); the only difference allowed is the fixed-point error the secure round
reports (``secagg-error-bound``) plus float32 rounding. Messages cross Flower's serialisation
(server.inprocess.InProcessGrid).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, Message

from clients.app import app
from clients.protocol import EF_KEY
from fedagg.config import RunConfig, load_config
from fedagg.data import load_dataset
from fedagg.errors import ConfigError
from fedagg.models import build_model
from fedagg.secagg import INLINE_BYTES, MaskedUpload
from fedagg.secagg.packing import packed_words
from fedagg.update import SECURE_METRICS, SupportHistory
from server.inprocess import InProcessGrid, nodes_by_partition
from server.runner import client_config
from strategies.base import RoundResult
from strategies.compressed import Compressed
from strategies.loop import run_train_round
from strategies.registry import build_strategy
from strategies.secure import SecureAggregation
from strategies.wire import (
    ARRAYS_KEY,
    CONFIG_KEY,
    PARAMS_KEY,
    arrays_to_record,
    record_to_arrays,
    unpack,
)

BASE = ["run.sites=5", "train.local_epochs=1", "data.max_train_examples=300",
        "secagg.weight_scale=300", "compression.up=topk:0.05+ef"]


def _cfg(*overrides: str) -> RunConfig:
    return load_config(None, [*BASE, *overrides])


def _initial(cfg: RunConfig) -> ArrayRecord:
    ds = load_dataset(cfg.data.dataset, test_fraction=cfg.data.test_fraction, seed=cfg.run.seed)
    model = build_model(cfg.model.name, ds.input_shape, ds.num_classes, seed=cfg.run.seed)
    sd = model.state_dict()
    return arrays_to_record([t.detach().numpy().copy() for t in sd.values()], list(sd))


def _round(strategy: Any, grid: InProcessGrid, rnd: int, arrays: ArrayRecord,
           cfg: RunConfig) -> RoundResult:
    return run_train_round(strategy, grid, rnd, arrays, client_config(cfg), 600.0)


def _flat(a: ArrayRecord) -> np.ndarray:
    return np.concatenate([x.astype(np.float64).ravel() for x in record_to_arrays(a)[1]])


def _bound(result: RoundResult) -> float:
    assert result.metrics is not None
    return float(result.metrics["secagg-error-bound"]) + 2e-6  # type: ignore[arg-type]


@pytest.mark.parametrize("support", ["random", "topk-aggregate"])
def test_secure_sparse_equals_plaintext_on_the_same_support_with_a_dropout(support: str) -> None:
    faults = ["faults.crash_site=2", "faults.crash_round=2"]
    cfg_sec = _cfg("strategy.name=secure", f"compression.support={support}", *faults,
                   "faults.crash_stage=upload")
    cfg_pl = _cfg("strategy.name=compressed", f"compression.support={support}", *faults,
                  "faults.crash_stage=train")
    secure, plain = build_strategy(cfg_sec), build_strategy(cfg_pl)
    assert isinstance(secure, SecureAggregation) and isinstance(plain, Compressed)
    g_sec, g_pl = InProcessGrid(app, 5, seed=3), InProcessGrid(app, 5, seed=3)
    arrays = _initial(cfg_sec)
    dim = _flat(arrays).size
    k = round(0.05 * dim)
    supports = []
    # topk-aggregate: round 3 derives its support from round 2's aggregate, and the site that
    # dropped in round 2 is sent the previous model to derive it
    for rnd in ((1, 2, 3) if support == "topk-aggregate" else (1, 2)):
        rs = _round(secure, g_sec, rnd, arrays, cfg_sec)
        rp = _round(plain, g_pl, rnd, arrays, cfg_pl)
        assert rs.arrays is not None and rp.arrays is not None and rs.metrics is not None
        counted = 4 if rnd == 2 else 5
        assert rs.metrics["secagg-counted"] == counted and rs.report.replies == counted
        assert secure.last_support is not None
        assert rs.metrics["secagg-values"] == secure.last_support.size  # only the support
        assert abs(secure.last_support.size - k) <= 1
        step_s, step_p = _flat(rs.arrays) - _flat(arrays), _flat(rp.arrays) - _flat(arrays)
        assert float(np.abs(step_s - step_p).max()) <= _bound(rs), rnd
        # the step is zero off the public support, on both sides
        off = np.ones(dim, bool)
        off[secure.last_support] = False
        assert not step_s[off].any() and not step_p[off].any()
        assert float(np.abs(step_p[~off]).max()) > 100 * _bound(rs)  # the oracle is sharp
        supports.append(secure.last_support.copy())
        arrays = rp.arrays
    assert not np.array_equal(supports[0], supports[1])  # a new support every round
    # the error-feedback residual lives in Context.state, identical on both sides
    for n_s, n_p in zip(nodes_by_partition(g_sec), nodes_by_partition(g_pl), strict=True):
        r_s = record_to_arrays(g_sec.contexts[n_s].state.array_records[EF_KEY])[1]
        r_p = record_to_arrays(g_pl.contexts[n_p].state.array_records[EF_KEY])[1]
        assert all(np.array_equal(a, b) for a, b in zip(r_s, r_p, strict=True))


def test_topk_aggregate_support_is_the_topk_of_the_applied_global_delta() -> None:
    cfg = _cfg("strategy.name=secure", "compression.support=topk-aggregate")
    secure = build_strategy(cfg)
    assert isinstance(secure, SecureAggregation)
    grid = InProcessGrid(app, 5)
    a0 = _initial(cfg)
    r1 = _round(secure, grid, 1, a0, cfg)
    assert r1.arrays is not None
    r2 = _round(secure, grid, 2, r1.arrays, cfg)
    assert r2.arrays is not None and secure.last_support is not None
    applied = (_flat(r1.arrays) - _flat(a0)).astype(np.float32)
    want = SupportHistory.at_site(secure.spec, cfg.run.seed, 2, record_to_arrays(r1.arrays)[1],
                                  1, record_to_arrays(a0)[1]).support()
    assert want is not None and np.array_equal(secure.last_support, want)
    # every position on the support is at least as large as every position off it
    off = np.ones(applied.size, bool)
    off[want] = False
    assert np.abs(applied[want]).min() >= np.abs(applied[off]).max()


def test_residual_persists_and_the_upload_is_only_the_masked_support_values() -> None:
    cfg = _cfg("strategy.name=secure", "compression.support=block")
    replies: list[Message] = []

    def recording_app(msg: Message, ctx: Any) -> Message:
        out = app(msg, ctx)
        if msg.content.config_records[PARAMS_KEY]["stage"] == "upload":
            replies.append(out)
        return out

    grid = InProcessGrid(recording_app, 5)
    secure = build_strategy(cfg)
    assert isinstance(secure, SecureAggregation)
    arrays = _initial(cfg)
    dim = _flat(arrays).size
    k = round(0.05 * dim)
    residuals = []
    for rnd in (1, 2):
        res = last = _round(secure, grid, rnd, arrays, cfg)
        assert res.arrays is not None
        arrays = res.arrays
        node = nodes_by_partition(grid)[0]
        residuals.append(np.concatenate([r.ravel() for r in record_to_arrays(
            grid.contexts[node].state.array_records[EF_KEY])[1]]))
    for reply in replies:
        masked = unpack(reply.content, MaskedUpload).masked
        assert set(reply.content.keys()) <= {CONFIG_KEY, ARRAYS_KEY}  # no indices, no metrics
        assert (ARRAYS_KEY in reply.content) == (masked.nbytes > INLINE_BYTES)
        bits = secure.last_result.ring_bits  # k + 1 values of b bits, packed
        assert masked.dtype == np.uint32
        slots = 2 * len(SECURE_METRICS)  # the metric slots after the values, then the weight
        assert any(masked.size == packed_words(v + slots, bits) for v in (k, k + 1, k + 2))
    # the residual is carried over: off both supports it accumulates two rounds of deltas
    assert np.abs(residuals[0]).max() > 0
    assert not np.array_equal(residuals[0], residuals[1])
    own = secure.history_log[-1]["bytes_up"]  # the wrapper's own exchanges (no setup in round 2)
    up = (last.report.bytes_up - sum(own.values())) / 5  # the train replies
    payload = 4 * packed_words(k + 1, bits)  # k values + weight at b bits
    assert payload < up <= payload + 4096  # plus keys / shares / headers


@pytest.mark.parametrize(("overrides", "field", "words"), [
    (["compression.up=topk:0.01+ef"], "compression.support", "reveal"),
    (["compression.up=randk:0.01"], "compression.support", "cannot be masked"),
    (["compression.up=topk:0.01+ef+int8", "compression.support=random"], "compression.up",
     "meaningless under secure aggregation"),
    (["compression.up=bf16"], "compression.up", "meaningless"),
])
def test_own_indices_and_quantizers_are_refused_under_secure(overrides: list[str], field: str,
                                                             words: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_strategy(load_config(None, ["strategy.name=secure", "run.sites=5", *overrides]))
    text = str(info.value)
    assert text.startswith(field) and words in text and "Fix:" in text


def test_a_replayed_reply_from_an_earlier_exchange_is_refused() -> None:
    """A reply to a message of a previous round's exchange is never handed to the protocol."""
    cfg = _cfg("strategy.name=secure", "compression.up=none")

    class ReplayGrid(InProcessGrid):
        def __init__(self) -> None:
            super().__init__(app, 5)
            self.saved: dict[str, Message] = {}
            self.replay = False
            self.kind, self.fresh = "", False

        # at the Grid's push / pull level: the round driver streams the train (upload)
        # replies with push_messages / pull_messages, the wrapper's own exchanges use
        # send_and_receive, which InProcessGrid runs as push + pull too
        def push_messages(self, messages: Any) -> Any:
            msgs = list(messages)
            self.kind = str(msgs[0].content.config_records[PARAMS_KEY]["stage"]) if msgs else ""
            self.fresh = True
            return super().push_messages(msgs)

        def pull_messages(self, message_ids: Any) -> Any:
            out = list(super().pull_messages(message_ids))
            kind, first, self.fresh = self.kind, self.fresh, False
            if self.replay and first and kind in self.saved:
                out.insert(0, self.saved[kind])  # the old reply arrives first
            if out and kind not in self.saved:  # keep one reply per kind, from two nodes
                self.saved[kind] = out[0] if kind == "upload" else out[-1]
            return out

    grid = ReplayGrid()
    secure = build_strategy(cfg)
    arrays = _initial(cfg)
    r1 = _round(secure, grid, 1, arrays, cfg)
    assert r1.arrays is not None
    grid.replay = True
    r2 = _round(secure, grid, 2, r1.arrays, cfg)
    assert r2.arrays is not None and r2.metrics is not None
    assert r2.report.failures == 0 and r2.metrics["secagg-counted"] == 5
    assert len(r2.report.refused) == 2  # the replayed upload and the replayed unmask reply
    assert all("stale or foreign" in why for why in r2.report.refused.values())
    # the replayed unmask reply is refused by the wrapper's own exchange, the replayed upload by
    # the round driver (fedagg's loop; Flower's own loop returns only replies to its messages)
    assert sorted(why.split(":")[0].split()[0] for why in r2.report.refused.values()) == ["node", "unmask"]
