"""Run the real server loop over a real ClientApp in one process (for kill / resume tests).

``python tests/reliability/resume_driver.py RUN_DIR ROUNDS [--resume]``: the same
``server.runner.run_server`` the ServerApp uses, with :class:`server.inprocess.InProcessGrid`
(real messages, serialised as Flower ships them, real ``clients.app:app``) instead of the
simulation engine, so a run starts in seconds and can be SIGKILLed at any point.
"""

from __future__ import annotations

import sys

from clients.app import app as client_app
from fedagg.config import load_config
from server.inprocess import InProcessGrid
from server.runner import run_server


def main() -> None:
    import torch

    torch.set_num_threads(1)  # tiny model: threads only add contention on a shared machine
    run_dir, rounds = sys.argv[1], int(sys.argv[2])
    overrides = [
        f"run.rounds={rounds}",
        "run.sites=3",
        "train.local_epochs=1",
        "run.seed=4",
        "strategy.server_optimizer='momentum'",
        "strategy.server_lr=0.7",
    ]
    if "--resume" in sys.argv:
        overrides.append(f"run.resume='{run_dir}'")
    cfg = load_config(None, overrides)
    grid = InProcessGrid(client_app, cfg.run.sites, seed=7)
    run_server(grid, cfg, run_dir)


if __name__ == "__main__":
    main()
