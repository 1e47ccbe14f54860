"""Real runs for the report tests, in this process: fedagg's server loop over a real ClientApp
on an in-process grid (``server.inprocess.InProcessGrid``; no simulation engine).

* :func:`regression_run` -- a user's own Task: a linear regressor on synthetic data, MSE loss,
  fedagg's default site evaluation (sites report ``eval_loss``), and a central ``evaluate_fn``
  of the user's returning ``(MSE, R²)``;
* :func:`fedbuff_run` -- FedBuff (``asynchronous.mode = fedbuff``) on the built-in digits MLP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from clients import make_client_app
from clients.app import app as builtin_app
from fedagg.config import load_config
from fedagg.task import SiteData, SiteInfo, Task, set_weights
from server.inprocess import InProcessGrid
from server.runner import run_server
from strategies.wire import record_to_arrays

TRUE_W = np.array([1.5, -2.0, 0.5, 3.0], np.float32)


class Regressor(nn.Module):
    """y = x @ w + b (4 features)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _xy(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x @ TRUE_W + 0.7 + rng.normal(0, 0.1, n)).astype(np.float32)[:, None]
    return torch.from_numpy(x), torch.from_numpy(y)


def site_data(site: SiteInfo) -> SiteData:
    """Each site: 200 training and 50 held-out examples of the same linear law."""
    return SiteData(train=TensorDataset(*_xy(200, site.partition_id)),
                    eval=TensorDataset(*_xy(50, 100 + site.partition_id)))


TEST_X, TEST_Y = _xy(300, 999)


def mse_and_r2(arrays: Any) -> tuple[float, float]:
    """The user's central evaluation: (MSE, R²) on a test set only the server holds."""
    model = Regressor()
    set_weights(model, record_to_arrays(arrays)[1])
    with torch.no_grad():
        pred = model(TEST_X)
    mse = float(nn.functional.mse_loss(pred, TEST_Y))
    return mse, 1.0 - mse / float(TEST_Y.var(unbiased=False))


def regression_run(run_dir: Path) -> list[dict[str, Any]]:
    """3 rounds of FedAvg over 3 sites of a regression Task; returns the records."""
    task = Task(model=Regressor, data=site_data, loss=nn.functional.mse_loss)
    cfg = load_config(None, ["run.sites=3", "run.rounds=3", "run.fraction_evaluate=1.0",
                             "train.lr=0.05", "train.local_epochs=2", "run.name='regression'"])
    return run_server(InProcessGrid(make_client_app(task), 3, seed=0, wire=False), cfg,
                      run_dir, model_fn=Regressor, evaluate_fn=mse_and_r2)


def fedbuff_run(run_dir: Path) -> list[dict[str, Any]]:
    """FedBuff on digits: buffers of 2 of 3 sites training at a time, 4 versions."""
    from server.asynchronous import run_async_server

    cfg = load_config(None, ["run.sites=4", "run.rounds=4", "train.local_epochs=1",
                             "asynchronous.mode='fedbuff'", "asynchronous.concurrency=3",
                             "asynchronous.buffer_size=2", "run.name='fedbuff'"])
    return run_async_server(InProcessGrid(builtin_app, 4, seed=0, wire=False), cfg, run_dir)
