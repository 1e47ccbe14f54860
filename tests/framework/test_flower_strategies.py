"""fedagg's ClientApp under Flower's own strategies, started by Flower's ``Strategy.start()``.

Real ClientApp (``clients.make_client_app``: the built-in task on digits), real Flower
messages serialised as Flower ships them (``server.inprocess.InProcessGrid``), stock Flower
strategies: FedProx (``proximal_mu`` reaches the site's step), FedAdam, client-side DP fixed
clipping (Flower's ``fixedclipping_mod`` added to fedagg's app), and a stock FedAvg sending
only ``lr`` (Flower's quickstart config). Every site replies without error and the model
changes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.clientapp.mod import fixedclipping_mod
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    FedAdam,
    FedAvg,
    FedProx,
)

from clients import SiteSettings, make_client_app
from fedagg.builtin import builtin_task
from fedagg.config import load_config
from fedagg.models import get_weights
from fedagg.task import Task, TrainSettings, default_optimizer
from server.inprocess import InProcessGrid
from server.runner import client_config
from strategies.wire import arrays_to_record

SITES = 3
CFG = load_config(None, [f"run.sites={SITES}", "train.local_epochs=1",
                         "data.max_train_examples=450"])


def _initial() -> ArrayRecord:
    torch.manual_seed(0)  # the same initial model in every run
    model = builtin_task(CFG).model()
    return arrays_to_record(get_weights(model), list(model.state_dict()))


def _config(**extra: Any) -> ConfigRecord:
    rec = client_config(CFG)
    for k, v in extra.items():
        rec[k] = v
    return rec


def _start(strategy: Any, grid: InProcessGrid, config: ConfigRecord, rounds: int = 2) -> Any:
    errors: list[str] = []
    original = grid.send_and_receive

    def watched(messages: Any, *, timeout: float | None = None) -> Any:
        out = list(original(messages, timeout=timeout))
        errors.extend(r.error.reason for r in out if r.has_error())
        return out

    grid.send_and_receive = watched  # type: ignore[method-assign]
    initial = _initial()
    result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds,
                            train_config=config, timeout=300)
    assert errors == [], errors[:2]
    moved = max(float(np.abs(a.numpy() - b.numpy()).max())
                for a, b in zip(result.arrays.values(), initial.values(), strict=True))
    return result, moved


def test_fedprox_proximal_mu_reaches_the_step_and_pulls_towards_the_global_model() -> None:
    moves = {}
    for mu in (0.0, 10.0):
        grid = InProcessGrid(make_client_app(), SITES, seed=1)
        _, moves[mu] = _start(FedProx(proximal_mu=mu, fraction_evaluate=0.0,
                                      min_available_nodes=SITES), grid, _config(), rounds=1)
    assert moves[0.0] > 1e-3 and moves[10.0] > 0
    assert moves[10.0] < 0.8 * moves[0.0]  # the proximal term is applied at the sites


def test_fedadam_and_federated_evaluation_on_the_held_out_split() -> None:
    grid = InProcessGrid(make_client_app(), SITES, seed=2)
    result, moved = _start(FedAdam(eta=0.01, min_available_nodes=SITES), grid, _config())
    assert moved > 1e-3
    evals = result.evaluate_metrics_clientapp
    assert set(evals) == {1, 2} and all(0.0 <= m["eval_acc"] <= 1.0 for m in evals.values())


def test_client_side_dp_fixed_clipping_with_flowers_own_mod() -> None:
    grid = InProcessGrid(make_client_app(mods=[fixedclipping_mod]), SITES, seed=3)
    dp = DifferentialPrivacyClientSideFixedClipping(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=SITES), noise_multiplier=0.0,
        clipping_norm=0.05, num_sampled_clients=SITES)
    result, moved = _start(dp, grid, _config(), rounds=1)
    assert moved > 0
    delta = np.sqrt(sum(float(np.sum((a.numpy().astype(np.float64) - b.numpy()) ** 2))
                        for a, b in zip(result.arrays.values(), _initial().values(),
                                        strict=True)))
    assert delta <= 0.05 + 1e-6  # every site's update was clipped to the norm, at the site


def test_stock_config_lr_and_unknown_keys_reach_the_users_code() -> None:
    seen: list[tuple[float, Any]] = []

    def recording_optimizer(params: Any, settings: TrainSettings) -> Any:
        seen.append((settings.lr, settings.config.get("my-key")))
        return default_optimizer(params, settings)

    def task(settings: SiteSettings) -> Task:
        base = builtin_task(settings.cfg)
        return Task(model=base.model, data=base.data, optimizer=recording_optimizer)

    grid = InProcessGrid(make_client_app(task), SITES, seed=4)
    cfg = ConfigRecord({"lr": 0.037, "my-key": "hello"})  # what a stock Flower server sends
    _, moved = _start(FedAvg(fraction_evaluate=0.0, min_available_nodes=SITES), grid, cfg,
                      rounds=1)
    assert moved > 0 and len(seen) == SITES
    assert all(lr == pytest.approx(0.037) and key == "hello" for lr, key in seen)
