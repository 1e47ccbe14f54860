"""Distributed DP in secure rounds, over real Flower Messages and the real ClientApp.

Each site clips, rotates, rounds and noises its update in the secure aggregation ring
(``privacy.mode = "distributed"``); the server unmasks only the noisy sum, decodes the
unweighted mean of the clipped updates and counts every unmasked round with dp-accounting.
Oracles: the decoded mean against plain FedAvg of the same sites (equal weights, no clipping)
within the mechanism's noise; the epsilon in the records against a ledger composed here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from clients.app import app
from clients.protocol import MAX_EPSILON_KEY
from fedagg.config import RunConfig, load_config
from fedagg.data import load_dataset
from fedagg.errors import ConfigError
from fedagg.models import build_model
from fedagg.privacy import (
    DdgParams,
    PrivacyLedger,
    RoundCharge,
    ZcdpBound,
    ddg_round_charge,
    min_survivors,
    round_params,
)
from fedagg.viz.run_report import render_report, report_data
from server.inprocess import InProcessGrid, nodes_by_partition
from server.runner import client_config, run_server
from strategies.base import RoundResult
from strategies.loop import run_train_round
from strategies.registry import build_strategy
from strategies.wire import PRIVACY_KEY, arrays_to_record, record_to_arrays

BASE = ["run.sites=5", "train.local_epochs=1", "data.max_train_examples=200",
        "data.partitioner=iid", "run.rounds=3", "strategy.name=secure",
        "privacy.mode=distributed"]


def _cfg(*overrides: str) -> RunConfig:
    return load_config(None, [*BASE, *overrides])


def _initial(cfg: RunConfig) -> ArrayRecord:
    ds = load_dataset(cfg.data.dataset, test_fraction=cfg.data.test_fraction, seed=cfg.run.seed)
    model = build_model(cfg.model.name, ds.input_shape, ds.num_classes, seed=cfg.run.seed)
    sd = model.state_dict()
    return arrays_to_record([t.detach().numpy().copy() for t in sd.values()], list(sd))


def _round(strategy: Any, grid: InProcessGrid, rnd: int, arrays: ArrayRecord,
           cfg: RunConfig) -> RoundResult:
    return run_train_round(strategy, grid, rnd, arrays, client_config(cfg), 600.0)


def _flat(record: ArrayRecord) -> np.ndarray:
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in record_to_arrays(record)[1]])


def _params(cfg: RunConfig, dim: int, n: int = 5) -> Any:
    p = cfg.privacy
    return round_params(epsilon=p.epsilon, delta=p.delta, participations=cfg.run.rounds,
                        clip=p.clip, ring_bits=p.ring_bits, num_sites=n,
                        min_sites=min_survivors(n, p.dropout_fraction), dim=dim)


def _pair(cfg: RunConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray, RoundResult]:
    """One private secure round and one plain FedAvg round of the same 5 sites (iid: equal
    weights) from the same model: (start, private mean delta, plain mean delta, result)."""
    plain_cfg = load_config(None, ["run.sites=5", "train.local_epochs=1",
                                   "data.max_train_examples=200", "data.partitioner=iid",
                                   "strategy.name=fedavg"])
    arrays = _initial(cfg)
    start = _flat(arrays)
    rs = _round(build_strategy(cfg), InProcessGrid(app, 5, seed=3), 1, arrays, cfg)
    ra = _round(build_strategy(plain_cfg), InProcessGrid(app, 5, seed=3), 1, arrays, plain_cfg)
    assert rs.arrays is not None and ra.arrays is not None
    return start, _flat(rs.arrays) - start, _flat(ra.arrays) - start, rs


def test_without_noise_the_secure_round_undoes_rotation_and_scaling_exactly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The noiseless case through the real round (sites and server calibrated to sigma = 0,
    a clip no update reaches): the decoded mean is plain FedAvg's mean of the same sites up
    to the grid's rounding; the mean without one site is far outside that band."""
    def noiseless(**kw: Any) -> DdgParams:
        return DdgParams(clip=100.0, gamma=1e-6, sigma_site=0.0, ring_bits=32,
                         num_sites=kw["num_sites"], min_sites=kw["min_sites"], dim=kw["dim"])

    monkeypatch.setattr("strategies.secure_privacy.round_params", noiseless)
    monkeypatch.setattr("clients.protocol.round_params", noiseless)
    # no noise, no privacy: a nominal charge keeps the budget check out of the way
    monkeypatch.setattr("strategies.secure_privacy.ddg_round_charge",
                        lambda params: RoundCharge((ZcdpBound(1e-9),)))
    cfg = _cfg("privacy.ring_bits=32", "privacy.clip=100")
    start, private, plain, rs = _pair(cfg)
    assert rs.metrics is not None and rs.metrics["secagg-counted"] == 5
    assert rs.metrics["num-examples"] == 5
    band = 2e-6  # conditional rounding: < 1 grid step per coordinate of the mean, + float32
    assert np.abs(private - plain).max() <= band, np.abs(private - plain).max()
    assert np.abs(plain).max() > 1e3 * band
    plain_cfg = load_config(None, ["run.sites=5", "train.local_epochs=1",
                                   "data.max_train_examples=200", "data.partitioner=iid",
                                   "strategy.name=fedavg"])
    grid4 = InProcessGrid(app, 5, seed=3)
    grid4.drop = {nodes_by_partition(grid4)[4]}
    r4 = _round(build_strategy(plain_cfg), grid4, 1, _initial(cfg), plain_cfg)
    assert r4.arrays is not None
    assert np.abs(_flat(r4.arrays) - start - private).max() > 100 * band


def test_the_private_mean_carries_the_calibrated_noise() -> None:
    """With the calibrated noise (epsilon 8 over 3 rounds, no clipping at this clip): the
    difference to plain FedAvg's mean has, over the model's 17,226 coordinates, the standard
    deviation the parameters predict for 5 survivors (within 10 %), and mean ~ 0."""
    cfg = _cfg("privacy.clip=100", "privacy.ring_bits=24")
    start, private, plain, rs = _pair(cfg)
    p = _params(cfg, start.size)
    diff = private - plain
    expected = p.mean_noise_std(5)
    assert abs(float(diff.std()) / expected - 1) < 0.1, (float(diff.std()), expected)
    assert abs(float(diff.mean())) < 5 * expected / np.sqrt(diff.size)
    assert rs.metrics is not None
    assert rs.metrics["privacy-noise-std"] == pytest.approx(p.mean_noise_std(p.min_sites))


def test_epsilon_per_round_is_the_ledger_of_the_rounds_and_the_budget_stops_the_run(
        tmp_path: Path) -> None:
    """fedagg simulate's loop: metrics.json carries the epsilon spent after every round (the
    same as a ledger of that many round charges composed here, <= privacy.epsilon after
    run.rounds); with privacy.target_epsilon below three rounds' worth the run stops before
    the round that would exceed it, with the model of its last round saved."""
    cfg = _cfg("run.rounds=3")
    records = run_server(InProcessGrid(app, 5), cfg, tmp_path)
    rounds = [r for r in records if r["round"] >= 1]
    assert [r["model_updated"] for r in rounds] == [True, True, True]
    dim = int(_flat(_initial(cfg)).size)
    charge = ddg_round_charge(_params(cfg, dim))
    ledger = PrivacyLedger(cfg.privacy.delta)
    spent = []
    for _ in rounds:
        ledger.record(charge)
        spent.append(ledger.epsilon())
    assert [r["privacy_epsilon"] for r in rounds] == pytest.approx(spent, rel=1e-9)
    assert spent == sorted(spent) and spent[-1] <= cfg.privacy.epsilon * (1 + 1e-9)
    on_disk = json.loads((tmp_path / "metrics.json").read_text())
    assert [r.get("privacy_epsilon") for r in on_disk if r["round"] >= 1] == pytest.approx(spent)

    stop_dir = tmp_path / "stop"
    target = (spent[1] + spent[2]) / 2  # two rounds fit, the third would exceed it
    cfg_stop = _cfg("run.rounds=3", f"privacy.target_epsilon={target}")
    records = run_server(InProcessGrid(app, 5), cfg_stop, stop_dir)
    rounds = [r for r in records if r["round"] >= 1]
    assert len(rounds) == 2 and all(r["model_updated"] for r in rounds)
    assert "round 3 would take the epsilon spent" in rounds[-1]["stopped"]
    assert rounds[-1]["privacy_epsilon"] <= target
    assert (stop_dir / "model.npz").exists()
    data = report_data(stop_dir)  # the HTML report shows the epsilon per round and the stop
    assert data["privacy"]["rounds"] == [1, 2]
    assert data["privacy"]["epsilon"] == pytest.approx(spent[:2])
    assert "round 3 would take" in data["privacy"]["stopped"]
    assert "Epsilon spent so far" in render_report(stop_dir)


class _Rewrite(InProcessGrid):
    """Changes the privacy record of every upload request with ``edit``."""

    def __init__(self, *args: Any, edit: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.edit = edit

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        out = []
        for m in messages:
            rec = m.content.config_records.get(PRIVACY_KEY)
            if rec is not None:
                content = RecordDict(dict(m.content.items()))
                content[PRIVACY_KEY] = ConfigRecord({**dict(rec), **self.edit(dict(rec))})
                m = Message(content=content, dst_node_id=m.metadata.dst_node_id,
                            message_type=m.metadata.message_type)
            out.append(m)
        return super().push_messages(out)


@pytest.mark.parametrize(("edit", "named"), [
    (lambda r: {"seed": bytes(32)}, "seed"),
    (lambda r: {"dim": r["dim"] + 1}, "dim"),
    (lambda r: {"num-sites": r["num-sites"] + 1}, "num-sites"),
])
def test_a_site_refuses_a_privacy_request_that_does_not_describe_its_round(
        edit: Any, named: str) -> None:
    """A server that sends another rotation seed, model size or number of sites (so that the
    sites would calibrate less noise or rotate predictably) gets refusals naming the field;
    no sum is unmasked and nothing is charged."""
    cfg = _cfg()
    secure = build_strategy(cfg)
    result = _round(secure, _Rewrite(app, 5, edit=edit), 1, _initial(cfg), cfg)
    assert result.arrays is None
    assert all(f"{PRIVACY_KEY}.{named}" in why for why in result.report.errors.values()), \
        result.report.errors
    assert secure.privacy.ledger.participations == 0  # type: ignore[attr-defined]


def test_a_site_refuses_a_budget_above_its_own_ceiling() -> None:
    """Node config fedagg-max-epsilon: a site asked for a larger epsilon (less noise on its
    update) refuses, naming its ceiling; the others take part."""
    cfg = _cfg("privacy.epsilon=8")
    grid = InProcessGrid(app, 5)
    strict = nodes_by_partition(grid)[2]
    grid.contexts[strict].node_config[MAX_EPSILON_KEY] = 4.0
    result = _round(build_strategy(cfg), grid, 1, _initial(cfg), cfg)
    assert MAX_EPSILON_KEY in result.report.errors[str(strict)]
    assert result.arrays is not None and result.metrics is not None
    assert result.metrics["secagg-counted"] == 4


@pytest.mark.parametrize(("overrides", "named"), [
    (["strategy.name=fedavg"], "needs secure aggregation"),
    (["compression.up=topk:0.1", "compression.support=random"], "compression.up"),
    (["asynchronous.mode=deadline"], "deadline"),
    (["secagg.ring_bits=24"], "secagg.ring_bits"),
])
def test_combinations_the_privacy_analysis_does_not_cover_are_refused(
        overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_config(None, [*BASE, *overrides])


def test_a_resumed_synchronous_run_goes_on_counting_from_its_checkpoint(tmp_path: Path) -> None:
    """2 rounds at epsilon 8 spend the budget; resumed with run.rounds = 3 (smaller charges per
    round), the strategy's checkpointed ledger still holds what was spent: round 3 does not
    run (a fresh ledger would have let it)."""
    cfg = _cfg("run.rounds=2", "run.checkpoint=true")
    first = run_server(InProcessGrid(app, 5), cfg, tmp_path)
    spent = first[-1]["privacy_epsilon"]
    assert 7.0 < spent <= 8.0 * (1 + 1e-9)
    again = run_server(InProcessGrid(app, 5),
                       _cfg("run.rounds=3", "run.checkpoint=true", f"run.resume='{tmp_path}'"),
                       tmp_path)
    assert [r["round"] for r in again] == [0, 1, 2]
    assert "round 3 would take the epsilon spent from " + f"{spent:.4g}" in again[-1]["stopped"]
