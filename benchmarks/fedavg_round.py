"""FedAvg round time: fedagg's round vs Flower's FedAvg round, side by side in one simulation.

Both drive the same ClientApp (``clients.app:app``, fedagg's built-in task) on the same virtual
SuperNodes of Flower's simulation engine: fedagg's round is what ``fedagg simulate`` runs
(:func:`strategies.run_train_round` with ``FedAvg.from_config``: seeded sampling, the replies
streamed into the exact engine, the run config's protections), Flower's is what
``Strategy.start()`` runs with ``flwr.serverapp.strategy.FedAvg`` (``configure_train`` ->
``send_and_receive`` -> ``aggregate_train``) sampling the same fraction. Rounds alternate
between the two (A, B, B, A, ...) so drift in machine load hits both alike. Reported: median
seconds per round and the ratio fedagg / Flower. (Aggregation alone: benchmarks/aggregate.py.)

Usage::

    python benchmarks/fedavg_round.py --sites 5 --rounds 12
    python benchmarks/fedavg_round.py --sites 1000 --fraction 0.05 --dataset fashion-mnist \\
        --model 2nn --rounds 6
    python benchmarks/fedavg_round.py --smoke    # 2 sites x 1 round (CI)

``--json PATH`` writes the rows with the command, date, machine and commit
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

from _common import add_common, write_json


def _flower_round(strategy, grid, rnd, arrays, config):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    msgs = list(strategy.configure_train(rnd, arrays, config, grid))
    replies = list(grid.send_and_receive(msgs, timeout=600))
    new, _ = strategy.aggregate_train(rnd, replies)
    assert new is not None
    return time.perf_counter() - t0


def simulate(sites: int, rounds: int, fraction: float, dataset: str, model: str
             ) -> dict[str, list[float]]:
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
    from flwr.simulation import run_simulation

    from clients.app import app as client_app
    from fedagg.config import load_config
    from fedagg.data import load_dataset
    from fedagg.models import build_model
    from server.runner import client_config
    from strategies import FedAvg, run_train_round
    from strategies.wire import arrays_to_record

    cfg = load_config(None, [f"run.sites={sites}", f"run.fraction_train={fraction}",
                             "train.local_epochs=1", f"data.dataset={dataset}",
                             f"model.name={model}", "run.wait_for_sites=600"])
    times: dict[str, list[float]] = {"fedagg": [], "flower": []}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        ds = load_dataset(dataset)
        net = build_model(model, ds.input_shape, ds.num_classes, seed=0)
        sd = net.state_dict()
        arrays = arrays_to_record([t.numpy().copy() for t in sd.values()], list(sd.keys()))
        k = max(int(sites * fraction), 1)
        flower = FlowerFedAvg(fraction_train=fraction, fraction_evaluate=0.0,
                              min_train_nodes=k, min_available_nodes=sites)
        ours = FedAvg.from_config(None, cfg)
        _flower_round(flower, grid, 0, arrays, client_config(cfg))  # warm-up (actors, imports)
        for rnd in range(1, rounds + 1):
            for name in (["fedagg", "flower"] if rnd % 2 else ["flower", "fedagg"]):
                if name == "flower":
                    times[name].append(_flower_round(flower, grid, rnd, arrays,
                                                     client_config(cfg)))
                else:
                    t0 = time.perf_counter()
                    res = run_train_round(ours, grid, rnd, arrays, client_config(cfg), 600.0)
                    assert res.arrays is not None, res.report
                    times[name].append(time.perf_counter() - t0)

    run_simulation(server_app=server, client_app=client_app, num_supernodes=sites,
                   backend_config={"client_resources": {"num_cpus": 1},
                                   "init_args": {"log_to_driver": False}})
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sites", type=int, default=5)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--fraction", type=float, default=1.0, help="sites sampled per round")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--model", default="mlp")
    add_common(p)
    a = p.parse_args(argv)
    if a.smoke:
        a.sites, a.rounds, a.fraction = 2, 1, 1.0
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    t = simulate(a.sites, a.rounds, a.fraction, a.dataset, a.model)
    mf, mw = statistics.median(t["flower"]), statistics.median(t["fedagg"])
    k = max(int(a.sites * a.fraction), 1)
    print(f"| round, simulation, {a.sites} sites ({k} per round), {a.dataset} {a.model}, "
          f"{a.rounds} rounds each | median s | ratio |")
    print("|---|---|---|")
    print(f"| Flower FedAvg (Strategy.start's round) | {mf:.3f} | |")
    print(f"| fedagg FedAvg (fedagg simulate's round) | {mw:.3f} | {mw / mf:.2f}x |")
    rows = [{"sites": a.sites, "per_round": k, "rounds": a.rounds, "dataset": a.dataset,
             "model": a.model, "flower_s": mf, "fedagg_s": mw, "fedagg_over_flower": mw / mf,
             "times": t}]
    write_json(a.json, rows, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
