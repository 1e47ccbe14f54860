"""SecureAggregation + the site protocol over real Flower Messages, Contexts and the real ClientApp
(``clients.app.app``: training, fault injection, mods), delivered by an in-process Grid that
serialises every message as Flower does (server.inprocess.InProcessGrid).

Oracle: fedagg's plaintext FedAvg run on the same sites, same data and the same global model,
with the dropped site excluded (its fault injected at "train", so it never contributes). Both
see bit-identical site training (same process, same seeds), so the only difference allowed is
the fixed-point error the secure round reports (``secagg-error-bound``) plus float32 rounding.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord

from clients.app import app
from clients.protocol import SECAGG_STATE_CONFIG as STATE_CONFIG_KEY
from fedagg.config import RunConfig, load_config
from fedagg.data import load_dataset
from fedagg.models import build_model
from fedagg.secagg import INLINE_BYTES, MaskedUpload
from fedagg.secagg.packing import packed_words
from fedagg.secagg.packing import unpack as unpack_bits
from server.inprocess import InProcessGrid, nodes_by_partition
from server.runner import client_config
from strategies.base import RoundResult
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
        "secagg.weight_scale=300"]


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


def _max_diff(a: ArrayRecord, b: ArrayRecord) -> float:
    return max(float(np.abs(x.astype(np.float64) - y).max())
               for x, y in zip(record_to_arrays(a)[1], record_to_arrays(b)[1], strict=True))


def _bound(result: RoundResult) -> float:
    assert result.metrics is not None
    return float(result.metrics["secagg-error-bound"]) + 2e-6  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["crash-before-upload", "no-reply"])
def test_dropout_before_upload_matches_plain_fedavg_of_survivors(how: str) -> None:
    faults = ["faults.crash_site=2", "faults.crash_round=2"]
    cfg_sec = _cfg("strategy.name=secure",
                   *([*faults, "faults.crash_stage=upload"] if how != "no-reply" else []))
    cfg_avg = _cfg("strategy.name=fedavg", *faults, "faults.crash_stage=train")
    secure, plain = build_strategy(cfg_sec), build_strategy(cfg_avg)
    assert isinstance(secure, SecureAggregation)
    g_sec, g_avg = InProcessGrid(app, 5, seed=3), InProcessGrid(app, 5, seed=3)
    arrays = _initial(cfg_sec)
    exchanges = []
    for rnd in (1, 2, 3):
        if how == "no-reply":  # partition 2 never answers in round 2 (deadline missed)
            g_sec.drop = {nodes_by_partition(g_sec)[2]} if rnd == 2 else set()
        rs = _round(secure, g_sec, rnd, arrays, cfg_sec)
        ra = _round(plain, g_avg, rnd, arrays, cfg_avg)
        assert rs.arrays is not None and ra.arrays is not None
        assert _max_diff(rs.arrays, ra.arrays) <= _bound(rs), rnd
        assert rs.metrics is not None
        counted = 4 if rnd == 2 else 5
        assert rs.metrics["secagg-counted"] == counted and rs.report.replies == counted
        assert rs.metrics["secagg-dropped"] == 5 - counted and rs.report.failures == 5 - counted
        exchanges.append(rs.report.exchanges)
        if rnd == 2:
            # The oracle is sharp: had the dropped site been counted, the model would differ
            # by far more than the bound.
            cfg_all = _cfg("strategy.name=fedavg")
            r_all = _round(build_strategy(cfg_all), InProcessGrid(app, 5, seed=3), rnd, arrays,
                           cfg_all)
            assert r_all.arrays is not None
            assert _max_diff(r_all.arrays, ra.arrays) > 100 * _bound(rs)
        arrays = ra.arrays
    # setup + round; round only; re-key (the dropped site must get new keys) + round
    assert exchanges == [4, 2, 4]


def test_dropout_after_upload_is_still_counted() -> None:
    cfg_sec = _cfg("strategy.name=secure", "faults.crash_site=1", "faults.crash_round=1",
                   "faults.crash_stage=unmask")
    cfg_avg = _cfg("strategy.name=fedavg")
    rs = _round(build_strategy(cfg_sec), InProcessGrid(app, 5), 1, _initial(cfg_sec), cfg_sec)
    ra = _round(build_strategy(cfg_avg), InProcessGrid(app, 5), 1, _initial(cfg_sec), cfg_avg)
    assert rs.arrays is not None and ra.arrays is not None and rs.metrics is not None
    assert rs.metrics["secagg-counted"] == 5 and rs.metrics["secagg-dropped"] == 0
    assert rs.report.failures == 1  # it failed the unmask exchange, but its upload counts
    assert _max_diff(rs.arrays, ra.arrays) <= _bound(rs)


def test_too_few_live_neighbours_aborts_cleanly_and_the_run_continues() -> None:
    # k = 4 neighbours, t = 4: one site dropping before upload leaves its neighbours 3 holders.
    cfg = _cfg("strategy.name=secure", "secagg.threshold=4", "faults.crash_site=0",
               "faults.crash_round=2", "faults.crash_stage=upload")
    secure = build_strategy(cfg)
    grid = InProcessGrid(app, 5)
    arrays = _initial(cfg)
    r1 = _round(secure, grid, 1, arrays, cfg)
    assert r1.arrays is not None
    r2 = _round(secure, grid, 2, r1.arrays, cfg)
    assert r2.arrays is None and r2.metrics is None  # aborted: the runner keeps the model
    assert r2.report.exchanges == 1 and r2.report.failures == 1  # aborted before any share was revealed
    assert isinstance(secure, SecureAggregation) and secure.history_log[-1]["aborted"]
    assert "live holders" in secure.history_log[-1]["reason"]
    r3 = _round(secure, grid, 3, r1.arrays, cfg)
    assert r3.arrays is not None and r3.report.exchanges == 4 and r3.report.replies == 5


def test_site_reply_holds_only_the_masked_upload_and_secrets_stay_local(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = _cfg("strategy.name=secure")
    replies: list[Any] = []
    base_app = app

    def recording_app(msg: Any, ctx: Any) -> Any:
        out = base_app(msg, ctx)
        if msg.content.config_records[PARAMS_KEY]["stage"] == "upload":
            replies.append(out)
        return out

    grid = InProcessGrid(recording_app, 5)
    secure = build_strategy(cfg)
    assert isinstance(secure, SecureAggregation)
    result = _round(secure, grid, 1, _initial(cfg), cfg)
    dim = sum(a.size for a in record_to_arrays(_initial(cfg))[1])
    assert result.arrays is not None and len(replies) == 5
    for reply in replies:
        masked = unpack(reply.content, MaskedUpload).masked
        # no weights, no metrics; the masked words inline unless over INLINE_BYTES (wire 3)
        big = masked.nbytes > INLINE_BYTES
        assert set(reply.content.keys()) == ({CONFIG_KEY, ARRAYS_KEY} if big else {CONFIG_KEY})
        bits = secure.last_result.ring_bits
        assert bits < 32  # the auto ring is narrower than fp32 here, and packed on the wire
        assert masked.dtype == np.uint32 and masked.size == packed_words(dim + 1, bits)
        assert abs(masked.mean() / 2**31 - 1) < 0.05  # masked: spread over the whole ring
        values = unpack_bits(masked, dim + 1, bits)
        assert abs(values.mean() / 2 ** (bits - 1) - 1) < 0.05
    for ctx in grid.contexts.values():
        secret = ctx.state.config_records[STATE_CONFIG_KEY]["s_secret"]
        assert isinstance(secret, bytes) and len(secret) == 32
        assert secret.hex() not in caplog.text and repr(secret) not in caplog.text
    # the masked upload per site: 4 bytes per packed word + a fixed overhead (keys, shares,
    # headers); the words are over INLINE_BYTES here, so they travel as an array
    up = secure.history_log[-1]["bytes_up"]  # the wrapper's own exchanges
    assert set(up) == {"setup", "unmask"}
    upload = (result.report.bytes_up - up["setup"] - up["unmask"]) / 5  # the train replies
    words = 4 * packed_words(dim + 1, bits)
    assert words > INLINE_BYTES
    assert words < upload <= words + 2048, upload - words  # measured: words + 1,823 B (5 sites)
