"""A stock Flower ServerApp starting fedagg's wrappers with Flower's own ``Strategy.start()``."""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from fedagg_quickstart.task import Net
from strategies import Compressed, FedAvg, SecureAggregation

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Secure aggregation of TopK + error-feedback updates around fedagg's FedAvg."""
    rounds = int(context.run_config.get("num-server-rounds", 3))
    strategy = SecureAggregation(Compressed(FedAvg(fraction_evaluate=1.0, min_available_nodes=3),
                                            up="topk:0.1+ef", support="random"))
    config = ConfigRecord({"lr": float(context.run_config.get("lr", 0.05)),
                           "train.local_epochs": int(context.run_config.get("local-epochs", 1)),
                           "site.workers": int(context.run_config.get("site.workers", 2))})
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()),
                            num_rounds=rounds, train_config=config)
    last = max(result.evaluate_metrics_clientapp, default=None)
    if last is not None:
        print(f"round {last}: federated accuracy "
              f"{result.evaluate_metrics_clientapp[last]['eval_acc']:.3f}")
