"""fedagg's wrappers and Flower's composed both ways, on Flower's real simulation engine.

One stock ServerApp drives the quickstart-pytorch ClientApp (``fedagg_mod`` outermost, then
Flower's ``fixedclipping_mod`` where the round asks for clipping) with, 2 rounds each:

1. ``SecureAggregation(Compressed(FedAvg(), up="topk:0.1+ef", support="random"))`` -- secure
   sparse aggregation as one composition -- under Flower's own ``Strategy.start()``; the
   sites' train loss reaches Flower's Result (summed under the masks);
2. ``Compressed(DifferentialPrivacyClientSideFixedClipping(FedAvg(), ...), up=...)`` -- the
   sites clip, then compress -- under ``Strategy.start()``;
3. ``DifferentialPrivacyServerSideFixedClipping(Compressed(FedAvg(), up=...), ...)`` -- Flower's
   wrapper reads models from the replies, so fedagg's round loop decodes them at the edge
   (``server.runner.run_server(strategy=...)``);
4. Flower's privacy accountant around fedagg's FedAvg (``DifferentialPrivacyServerSide
   FixedClipping(FedAvg(), accountant=RdpAccountant(...))``) under ``Strategy.start()``.

A secure run against the same ClientApp without ``fedagg_mod`` fails before round 1, naming
the fix (in process: the stock app's replies are plain models).
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
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.clientapp.mod import fixedclipping_mod
from flwr.serverapp import Grid, RdpAccountant, ServerApp
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
)
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM
from flwr.supercore.privacy_accounting import NeighboringRelation, PrivacyConfig, SamplingMethod

from strategies import Compressed, FedAvg, SecureAggregation

cloudpickle.register_pickle_by_value(quickstart_app)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SITES = 3
UP = "topk:0.1+ef"


def clip_when_asked(msg: Message, ctx: Context, call_next: Any) -> Message:
    """Flower's ``fixedclipping_mod`` for the rounds whose config carries a clipping norm."""
    config = next(iter(msg.content.config_records.values()), {}) if msg.has_content() else {}
    if KEY_CLIPPING_NORM in config:
        return fixedclipping_mod(msg, ctx, call_next)
    result: Message = call_next(msg, ctx)
    return result


def client_app() -> Any:
    from clients import fedagg_mod

    return quickstart_app.make_app([fedagg_mod, clip_when_asked])


def _moved(a: ArrayRecord, b: ArrayRecord) -> float:
    return max(float(np.abs(np.asarray(x.numpy(), np.float64) - np.asarray(y.numpy())).max())
               for x, y in zip(a.values(), b.values(), strict=True))


def server_app(out: Path, run_dir: Path) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        from fedagg.config import load_config
        from server.runner import run_server

        initial = ArrayRecord(quickstart_app.Net().state_dict())
        res: dict[str, Any] = {}
        every = {"fraction_evaluate": 0.0, "min_available_nodes": SITES,
                 "min_train_nodes": SITES}

        def start(strategy: Any) -> Any:
            return strategy.start(grid=grid, initial_arrays=initial, num_rounds=2,
                                  train_config=ConfigRecord({"lr": 0.05}), timeout=300)

        secure = SecureAggregation(Compressed(FedAvg(**every), up=UP, support="random"))
        r = start(secure)
        res["secure_sparse"] = {"moved": _moved(r.arrays, initial),
                                "train_loss": [m.get("train_loss") for _, m in
                                               sorted(r.train_metrics_clientapp.items())],
                                "counted": len(secure.last_result.counted),
                                "support": int(secure.last_support.size),
                                "aborted": secure.report.aborted}

        client_dp = Compressed(DifferentialPrivacyClientSideFixedClipping(
            FedAvg(**every), noise_multiplier=0.01, clipping_norm=10.0,
            num_sampled_clients=SITES), up=UP)
        r = start(client_dp)
        res["compressed_client_dp"] = {"moved": _moved(r.arrays, initial),
                                       "refused": dict(client_dp.report.refused)}

        cfg = load_config(None, [f"run.sites={SITES}", "run.rounds=2", "run.evaluate_every=99",
                                 "run.wait_for_sites=60", "run.checkpoint=false"])
        server_dp = DifferentialPrivacyServerSideFixedClipping(
            Compressed(FedAvg(**every), up=UP), noise_multiplier=0.01, clipping_norm=10.0,
            num_sampled_clients=SITES)
        records = run_server(grid, cfg, run_dir, model_fn=quickstart_app.Net,
                             strategy=server_dp, train_config=ConfigRecord({"lr": 0.05}))
        res["server_dp_compressed"] = [{"updated": rec["model_updated"],
                                        "rejected": rec.get("rejected", {}),
                                        "bytes_up": rec["bytes_up"]} for rec in records[1:]]

        accountant = RdpAccountant(PrivacyConfig(
            target_delta=1e-5, population_size=SITES,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION))
        accounted = DifferentialPrivacyServerSideFixedClipping(
            FedAvg(**every), noise_multiplier=1.0, clipping_norm=1.0,
            num_sampled_clients=SITES, accountant=accountant)
        r = start(accounted)
        spent = accounted.privacy_spent()
        res["accountant"] = {"moved": _moved(r.arrays, initial),
                             "epsilon": spent.epsilon, "releases": spent.num_releases}
        out.write_text(json.dumps(res))

    return app


@pytest.mark.flower
@pytest.mark.slow
def test_fedagg_and_flower_wrappers_compose_on_the_simulation_engine(tmp_path: Path) -> None:
    from flwr.simulation import run_simulation

    out = tmp_path / "results.json"
    run_simulation(server_app=server_app(out, tmp_path / "run"), client_app=client_app(),
                   num_supernodes=SITES,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"log_to_driver": False,
                                                 "include_dashboard": False}})
    res = json.loads(out.read_text())
    sec = res["secure_sparse"]
    assert sec["moved"] > 1e-3 and sec["counted"] == SITES and sec["support"] > 0, sec
    assert not sec["aborted"]
    # the sites' training loss reaches Flower's Result, summed under the masks
    assert len(sec["train_loss"]) == 2 and all(0 < v < 10 for v in sec["train_loss"]), sec
    cdp = res["compressed_client_dp"]
    assert cdp["moved"] > 1e-3 and cdp["refused"] == {}, cdp
    sdp = res["server_dp_compressed"]
    assert [r["updated"] for r in sdp] == [True, True] and all(not r["rejected"] for r in sdp)
    dense_fp32 = 4 * sum(int(np.prod(t.shape)) for t in quickstart_app.Net().state_dict().values())
    assert all(r["bytes_up"] < 0.5 * SITES * dense_fp32 for r in sdp), sdp  # compressed upward
    acc = res["accountant"]
    assert acc["moved"] > 1e-3 and acc["releases"] == 2 and 0 < acc["epsilon"] < float("inf")


def test_secure_aggregation_without_the_client_mod_fails_before_any_round_with_the_fix(
        tmp_path: Path) -> None:
    from fedagg.config import load_config
    from fedagg.errors import ConfigError
    from server.inprocess import InProcessGrid
    from server.runner import run_server

    cfg = load_config(None, [f"run.sites={SITES}", "run.rounds=2", "strategy.name=secure",
                             "run.wait_for_sites=0", "run.checkpoint=false"])
    grid = InProcessGrid(quickstart_app.make_app(), SITES, seed=1)
    strategy = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=SITES))
    with pytest.raises(ConfigError, match=r"clients\.fedagg_mod"):
        run_server(grid, cfg, tmp_path, model_fn=quickstart_app.Net, strategy=strategy,
                   train_config=ConfigRecord({"lr": 0.05}))
    assert not (tmp_path / "metrics.json").exists() or json.loads(
        (tmp_path / "metrics.json").read_text())[-1]["round"] == 0
