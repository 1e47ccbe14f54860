"""Poisoned sites under secure aggregation: NaN, Inf, a wrong shape or a 1e6-norm update never
changes the global model. The server cannot see single updates, so the site's encoder refuses
non-finite or misshapen updates before masking (the site drops out of the round) and the
server checks the unmasked aggregate (a failing round is rolled back)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

from clients import make_client_app
from fedagg.config import load_config
from fedagg.errors import RunFailed
from server.inprocess import InProcessGrid
from server.runner import run_server
from strategies.wire import arrays_to_record, record_to_arrays

POISONED = 1


def poisoned_app(kind: str) -> ClientApp:
    """The real ClientApp with a mod that poisons site 1's trained model before masking.

    Mods given to ``make_client_app`` run inside fedagg's own (they see the plain reply), so
    the poison reaches the upload pipeline exactly as a site's bad training would.
    """

    def poison(msg: Message, ctx: Context, call_next):  # type: ignore[no-untyped-def]
        reply = call_next(msg, ctx)
        if ctx.node_config["partition-id"] != POISONED or reply.has_error():
            return reply
        keys, arrays = record_to_arrays(reply.content.array_records["arrays"])
        if kind == "nan":
            arrays[0].flat[3] = np.nan
        elif kind == "inf":
            arrays[-1].flat[0] = np.inf
        elif kind == "shape":
            arrays[0] = np.zeros((arrays[0].shape[0] + 1, *arrays[0].shape[1:]), np.float32)
        elif kind == "norm":
            arrays = [a + np.float32(1e6) / np.sqrt(sum(x.size for x in arrays)) for a in arrays]
        reply.content.array_records["arrays"] = arrays_to_record(arrays, keys)
        assert isinstance(reply.content.array_records["arrays"], ArrayRecord)
        return reply

    return make_client_app(mods=[poison])


def _run(tmp: Path, kind: str, *extra: str) -> list[dict[str, object]]:
    cfg = load_config(None, ["run.sites=5", "run.rounds=2", "train.local_epochs=1",
                             "strategy.name='secure'", "strategy.max_update_norm=5.0", *extra])
    return run_server(InProcessGrid(poisoned_app(kind), 5, seed=3), cfg, tmp / kind)


@pytest.mark.parametrize("kind", ["nan", "inf", "shape"])
def test_site_refuses_to_mask_a_bad_update_and_drops_out(tmp_path: Path, kind: str) -> None:
    records = _run(tmp_path, kind)
    clean = _run(tmp_path, "clean", "faults.crash_site=1", "faults.crash_round=1",
                 "faults.crash_stage='upload'") if kind == "nan" else None
    for rec in records[1:]:
        assert rec["model_updated"] is True
        assert rec["secagg_dropped"] == 1 and rec["secagg_counted"] == 4  # the poisoned site is out
    assert float(records[-1]["accuracy"]) > float(records[0]["accuracy"])  # type: ignore[arg-type]
    if clean is not None:  # same as the run where site 1 simply crashed before its upload
        assert abs(float(clean[1]["accuracy"]) - float(records[1]["accuracy"])) < 0.02  # type: ignore[arg-type]


def test_huge_norm_update_rolls_the_round_back(tmp_path: Path) -> None:
    with pytest.raises(RunFailed) as info:  # no round changed the model: the run fails loudly
        _run(tmp_path, "norm")
    assert "round 1: nothing aggregated" in str(info.value) and "norm" in str(info.value)
    records = info.value.records
    for rec in records[1:]:
        assert rec["model_updated"] is False  # the aggregate failed the norm check
    assert records[1]["accuracy"] == records[0]["accuracy"] == records[2]["accuracy"]
