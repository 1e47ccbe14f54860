"""FedAvg round time: fedagg's FedAvg vs Flower's FedAvg, side by side in one simulation.

Both strategies drive the same ClientApp (``clients.app:app``) on the same virtual SuperNodes
in Flower's simulation engine; rounds alternate between the two strategies (A, B, B, A, ...)
so drift in machine load hits both alike. Reported: median seconds per round (configure +
send/receive + aggregate) and the ratio fedagg / Flower. A second table times aggregate_train
alone on synthetic replies (10 sites, 1M float32 parameters), the server-side cost.

Usage::

    python benchmarks/fedavg_round.py --sites 5 --rounds 12
    python benchmarks/fedavg_round.py --smoke    # 3 x 10k aggregate, 2 sites x 1 round (CI)

``--json PATH`` writes both tables' rows with the command, date, machine and commit
(``benchmarks/_common.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import numpy as np
from _common import add_common, write_json


def _round(strategy, grid, rnd, arrays, config):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    msgs = list(strategy.configure_train(rnd, arrays, config, grid))
    replies = list(grid.send_and_receive(msgs, timeout=600))
    new, _ = strategy.aggregate_train(rnd, replies)
    return time.perf_counter() - t0, new


def simulate(sites: int, rounds: int) -> dict[str, list[float]]:
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
    from flwr.simulation import run_simulation

    from clients.app import app as client_app
    from fedagg.config import load_config
    from fedagg.data import load_dataset
    from fedagg.models import build_model
    from server.runner import client_config
    from strategies.fedavg import FedAvg
    from strategies.wire import arrays_to_record

    cfg = load_config(None, [f"run.sites={sites}", "train.local_epochs=1"])
    times: dict[str, list[float]] = {"fedagg": [], "flower": []}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        ds = load_dataset("digits")
        model = build_model("mlp", ds.input_shape, ds.num_classes, seed=0)
        sd = model.state_dict()
        arrays = arrays_to_record([t.numpy().copy() for t in sd.values()], list(sd.keys()))
        strategies = {"fedagg": FedAvg(min_available_nodes=sites),
                      "flower": FlowerFedAvg(fraction_evaluate=0.0, min_available_nodes=sites)}
        _round(strategies["flower"], grid, 0, arrays, client_config(cfg))  # warm-up (actors, imports)
        order = ["fedagg", "flower"]
        for rnd in range(1, rounds + 1):
            for name in order if rnd % 2 else order[::-1]:
                sec, _ = _round(strategies[name], grid, rnd, arrays, client_config(cfg))
                times[name].append(sec)

    run_simulation(server_app=server, client_app=client_app, num_supernodes=sites,
                   backend_config={"client_resources": {"num_cpus": 1},
                                   "init_args": {"log_to_driver": False}})
    return times


def aggregate_only(sites: int = 10, params: int = 1_000_000, repeats: int = 7) -> dict[str, list[float]]:
    from conftest import train_reply  # real Message / Metadata objects
    from flwr.app import ConfigRecord
    from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

    from strategies.fedavg import FedAvg
    from strategies.wire import arrays_to_record

    rng = np.random.default_rng(0)
    shapes = [(params // 2,), (params // 4,), (params // 4,)]
    glob = [np.zeros(s, np.float32) for s in shapes]
    replies = [train_reply(i + 1, [rng.normal(size=s).astype(np.float32) for s in shapes], 100 + i)
               for i in range(sites)]

    class G:
        def get_node_ids(self) -> list[int]:
            return list(range(1, sites + 1))

    out: dict[str, list[float]] = {"fedagg": [], "flower": []}
    for rep in range(repeats):
        for name in (["fedagg", "flower"] if rep % 2 else ["flower", "fedagg"]):
            s = FedAvg() if name == "fedagg" else FlowerFedAvg()
            s.configure_train(1, arrays_to_record(glob), ConfigRecord(), G())  # type: ignore[arg-type]
            t0 = time.perf_counter()
            s.aggregate_train(1, replies)
            out[name].append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sites", type=int, default=5)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--skip-simulation", action="store_true")
    add_common(p)
    a = p.parse_args(argv)
    agg_sites, agg_params, agg_repeats = 10, 1_000_000, 7
    if a.smoke:
        a.sites, a.rounds = 2, 1
        agg_sites, agg_params, agg_repeats = 3, 10_000, 2
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    rows: list[dict[str, object]] = []
    agg = aggregate_only(agg_sites, agg_params, agg_repeats)
    print(f"| server aggregate_train, {agg_sites} sites x {agg_params:,} params | median s | "
          "ratio fedagg/Flower |")
    print("|---|---|---|")
    mf, mw = statistics.median(agg["flower"]), statistics.median(agg["fedagg"])
    print(f"| Flower FedAvg | {mf:.3f} | |")
    print(f"| fedagg FedAvg (checks + float64) | {mw:.3f} | {mw / mf:.2f}x |")
    rows.append({"table": "aggregate_train", "sites": agg_sites, "params": agg_params,
                 "flower_s": mf, "fedagg_s": mw, "fedagg_over_flower": mw / mf,
                 "times": agg})
    if not a.skip_simulation:
        t = simulate(a.sites, a.rounds)
        mf, mw = statistics.median(t["flower"]), statistics.median(t["fedagg"])
        print()
        print(f"| full round, simulation, {a.sites} sites, digits MLP, {a.rounds} rounds each | median s | ratio |")
        print("|---|---|---|")
        print(f"| Flower FedAvg | {mf:.3f} | |")
        print(f"| fedagg FedAvg | {mw:.3f} | {mw / mf:.2f}x |")
        rows.append({"table": "simulation round", "sites": a.sites, "rounds": a.rounds,
                     "flower_s": mf, "fedagg_s": mw, "fedagg_over_flower": mw / mf, "times": t})
    write_json(a.json, rows, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
