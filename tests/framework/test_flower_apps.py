"""Flower's own apps and strategies with fedagg, on Flower's real simulation engine.

One stock ServerApp (``@app.main()`` calling ``strategy.start(...)``, as Flower's examples do)
drives the quickstart-pytorch ClientApp (:mod:`quickstart_app`, with ``fedagg_mod`` added) with
four strategies in turn, on the same virtual SuperNodes:

1. Flower's FedAvg and fedagg's FedAvg, 2 rounds each from the same model: the global models
   are equal within 1e-6;
2. ``Compressed(FedAvg(), up="topk:0.1+ef")``: the model changes, the sites' training loss
   falls, and the inner strategy's federated evaluation runs;
3. ``SecureAggregation(FedAvg())``, one round, started by Flower's own ``Strategy.start()``:
   the aggregate equals Flower's plaintext FedAvg of the same round within the error bound
   the secure round reports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
import quickstart_app
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from strategies import Compressed, FedAvg, SecureAggregation

cloudpickle.register_pickle_by_value(quickstart_app)  # Ray's actors get the app by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SITES = 3


def _arrays(rec: ArrayRecord) -> list[np.ndarray]:
    return [np.asarray(a.numpy(), np.float64) for a in rec.values()]


def _max_diff(a: ArrayRecord, b: ArrayRecord) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(_arrays(a), _arrays(b), strict=True))


def stock_server_app(out: Path) -> ServerApp:
    """A ServerApp written as Flower's quickstart writes one, running four strategies."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        initial = ArrayRecord(quickstart_app.Net().state_dict())
        lr = ConfigRecord({"lr": 0.05})
        res: dict[str, Any] = {}

        def start(strategy: Any, rounds: int) -> Any:
            return strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds,
                                  train_config=ConfigRecord(dict(lr)), timeout=300)

        # every site in every round, on both sides: Flower sizes the sample before it waits
        # (0 nodes connected -> min_train_nodes, default 2), so round 1 may sample the two
        # nodes that connected first unless min_train_nodes is every site
        every = {"min_available_nodes": SITES, "min_train_nodes": SITES}
        flower = start(FlowerFedAvg(fraction_evaluate=0.0, **every), 2)
        ours = start(FedAvg(fraction_evaluate=0.0, **every), 2)
        res["fedavg_diff"] = _max_diff(flower.arrays, ours.arrays)
        res["fedavg_moved"] = _max_diff(flower.arrays, initial)

        compressed = Compressed(FedAvg(), up="topk:0.1+ef")
        comp = start(compressed, 2)
        res["compressed_moved"] = _max_diff(comp.arrays, initial)
        res["compressed_train_loss"] = [float(m["train_loss"]) for _, m in
                                        sorted(comp.train_metrics_clientapp.items())]
        res["compressed_eval"] = {str(r): dict(m) for r, m in
                                  comp.evaluate_metrics_clientapp.items()}
        res["compressed_rejected"] = dict(compressed.report.refused)

        plain1 = start(FlowerFedAvg(fraction_evaluate=0.0, **every), 1)
        secure = SecureAggregation(FedAvg(fraction_evaluate=0.0))
        sec = start(secure, 1)
        res["secure_diff"] = _max_diff(plain1.arrays, sec.arrays)
        res["secure_moved"] = _max_diff(sec.arrays, initial)
        res["secure_bound"] = float(secure.last_result.error_bound)
        res["secure_counted"] = len(secure.last_result.counted)
        out.write_text(json.dumps(res))

    return app


@pytest.mark.flower
@pytest.mark.slow
def test_quickstart_clientapp_with_flower_and_fedagg_strategies(tmp_path: Path) -> None:
    from flwr.simulation import run_simulation

    out = tmp_path / "results.json"
    run_simulation(server_app=stock_server_app(out), client_app=quickstart_app.with_fedagg(),
                   num_supernodes=SITES,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"log_to_driver": False,
                                                 "include_dashboard": False}})
    res = json.loads(out.read_text())
    # 1. fedagg's FedAvg is Flower's FedAvg (same sites, same seeded training)
    assert res["fedavg_moved"] > 1e-3
    assert res["fedavg_diff"] < 1e-5, res  # float32 summation order, amplified by round 2
    # 2. compressed updates from the stock app plus one mod: the model trains
    assert res["compressed_moved"] > 1e-3 and res["compressed_rejected"] == {}
    losses = res["compressed_train_loss"]
    assert len(losses) == 2 and losses[1] < losses[0], losses  # round 2 starts from a better model
    assert len(res["compressed_eval"]) == 2  # the inner FedAvg's federated evaluation ran
    # 3. secure aggregation under Flower's own Strategy.start(): the plaintext mean
    assert res["secure_counted"] == SITES and res["secure_moved"] > 1e-3
    assert res["secure_diff"] <= res["secure_bound"] + 1e-6, res
