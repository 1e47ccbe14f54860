"""Run the asynchronous loop over the real ClientApp on a DelayedGrid, with config overrides.

``python tests/reliability/async_checkpoint_driver.py RUN_DIR OVERRIDE...``: the run starts in
seconds on a virtual clock (lognormal site speeds) and can be SIGKILLed at any point with the
loop's test hooks (``FEDAGG_TEST_KILL_AT``, ``FEDAGG_TEST_KILL_IN_CHECKPOINT_ROUND``), so the
checkpoint tests get real FedBuff and deadline checkpoints: dispatches in flight, kept model
versions, a federated evaluation open, updates kept in a deadline round's buffer.
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
    run_dir, overrides = sys.argv[1], sys.argv[2:]
    cfg = load_config(None, overrides)
    grid = DelayedGrid(client_app, cfg.run.sites, speed=speed_model(cfg), seed=7)
    run_async_server(grid, cfg, run_dir)


if __name__ == "__main__":
    main()
