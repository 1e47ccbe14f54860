"""The sites' train loss under secure aggregation: summed under the masks, their weighted mean."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients import fedagg_mod
from server.inprocess import InProcessGrid, partition_of
from strategies import Compressed, FedAvg, SecureAggregation
from strategies.loop import run_train_round
from strategies.wire import arrays_to_record

LOSS = {0: 0.5, 1: 1.25, 2: 2.0, 3: None, 4: 0.75}  # site 3 reports no train loss
WEIGHT = {0: 10, 1: 30, 2: 20, 3: 40, 4: 5}


def _app() -> ClientApp:
    app = ClientApp(mods=[fedagg_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        model = msg.content["arrays"]
        metrics: dict[str, float] = {"num-examples": WEIGHT[pid]}
        if LOSS[pid] is not None:
            metrics["train_loss"] = float(LOSS[pid])
        return Message(RecordDict({"arrays": model, "metrics": MetricRecord(metrics)}),
                       reply_to=msg)

    return app


@pytest.mark.parametrize("compressed", [False, True], ids=["dense", "public-support"])
def test_secure_train_loss_is_the_weighted_mean_of_the_reporting_sites(compressed: bool) -> None:
    grid = InProcessGrid(_app(), 5, seed=3)
    inner = FedAvg(fraction_evaluate=0.0, min_available_nodes=5)
    strategy = SecureAggregation(Compressed(inner, up="topk:0.5+ef", support="random")
                                 if compressed else inner)
    arrays: ArrayRecord = arrays_to_record([np.zeros(16, np.float32)])
    res = run_train_round(strategy, grid, 1, arrays, ConfigRecord(), 60.0)
    assert res.metrics is not None and res.arrays is not None
    reporting = [pid for pid, v in LOSS.items() if v is not None]
    want = sum(WEIGHT[p] * LOSS[p] for p in reporting) / sum(WEIGHT[p] for p in reporting)  # type: ignore[operator]
    assert abs(float(res.metrics["train_loss"]) - want) <= 1e-4
    assert sorted(partition_of(grid, n) for n in grid.node_ids) == list(range(5))
