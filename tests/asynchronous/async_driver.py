"""Run the asynchronous loop over the real ClientApp in one process (kill / resume tests).

``python tests/asynchronous/async_driver.py RUN_DIR ROUNDS MODE [--resume] [--evaluate]``: FedBuff
(``MODE = fedbuff``) or deadline rounds over :class:`server.delayed.DelayedGrid` (real
``clients.app:app``, real serialisation, lognormal site speeds on a virtual clock), so a run
starts in seconds and can be SIGKILLed at any point; ``--evaluate`` adds federated evaluation
(``run.fraction_evaluate = 1``) on the idle sites. Test hooks: ``FEDAGG_TEST_KILL_AT``
(``"arrival:<n>"``, ``"<round>:after-apply"``) and ``FEDAGG_TEST_KILL_IN_CHECKPOINT_ROUND``.
"""

from __future__ import annotations

import sys

from clients.app import app as client_app
from fedagg.config import load_config
from server.asynchronous import run_async_server
from server.delayed import DelayedGrid, speed_model


def main() -> None:
    import torch

    torch.set_num_threads(1)
    run_dir, rounds, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    overrides = [
        f"run.rounds={rounds}", "run.sites=5", "train.local_epochs=1", "run.seed=4",
        "data.max_train_examples=500", "strategy.server_optimizer='momentum'",
        "strategy.server_lr=0.7", f"asynchronous.mode='{mode}'", "asynchronous.buffer_size=3",
        "asynchronous.concurrency=4", "asynchronous.deadline=14", "asynchronous.sim_sigma=0.8",
        "asynchronous.sim_site_sigma=0.4", "asynchronous.max_staleness=3",
    ]
    if "--evaluate" in sys.argv:
        overrides.append("run.fraction_evaluate=1.0")
    if "--resume" in sys.argv:
        overrides.append(f"run.resume='{run_dir}'")
    cfg = load_config(None, overrides)
    grid = DelayedGrid(client_app, cfg.run.sites, speed=speed_model(cfg), seed=7)
    run_async_server(grid, cfg, run_dir)


if __name__ == "__main__":
    main()
