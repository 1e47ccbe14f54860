"""Compressed updates end to end on Flower's real simulation engine (Ray), via `fedagg simulate`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import train_reply

pytestmark = [pytest.mark.flower, pytest.mark.slow]


def _simulate(tmp_path: Path, *overrides: str) -> list[dict[str, object]]:
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "fedagg.cli", "simulate", "--run-dir", str(run_dir), "--seed", "1"]
    for o in overrides:
        args += ["-c", o]
    env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    proc = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records: list[dict[str, object]] = json.loads((run_dir / "metrics.json").read_text())
    return records


def _dense_reply_nbytes() -> int:
    """Serialized size of one dense float32 MLP reply (what a FedAvg site sends)."""
    from fedagg.data import load_dataset
    from fedagg.models import build_model
    from strategies.wire import message_nbytes

    ds = load_dataset("digits")
    sd = build_model("mlp", ds.input_shape, ds.num_classes, seed=0).state_dict()
    arrays = [t.numpy().copy() for t in sd.values()]
    return message_nbytes(train_reply(1, arrays, 100, list(sd.keys()), **{"partition-id": 0,
                                                                          "train-loss": 1.0}))


def test_topk_ef_bf16_down_in_simulation(tmp_path: Path) -> None:
    records = _simulate(tmp_path, "run.sites=3", "run.rounds=2", "strategy.name=compressed",
                        "compression.up=topk:0.1+ef", "compression.down=bf16")
    dense = _dense_reply_nbytes()
    assert float(records[-1]["accuracy"]) > float(records[0]["accuracy"]) + 0.2  # type: ignore[arg-type]
    for r in records[1:]:
        assert r["sites_replied"] == 3 and r["sites_rejected"] == 0 and r["model_updated"] is True
        assert 0 < int(r["bytes_up"]) < 0.3 * 3 * dense  # type: ignore[call-overload]
        assert int(r["bytes_down"]) < 0.6 * 3 * dense  # type: ignore[call-overload]


def test_topk_aggregate_support_keeps_state_across_rounds_in_simulation(tmp_path: Path) -> None:
    """Rounds 2-3 need each site's previous global model from Context.state (Ray actors)."""
    records = _simulate(tmp_path, "run.sites=3", "run.rounds=3", "strategy.name=compressed",
                        "compression.up=topk:0.1+ef", "compression.support=topk-aggregate")
    assert float(records[-1]["accuracy"]) > float(records[0]["accuracy"]) + 0.2  # type: ignore[arg-type]
    for r in records[1:]:
        assert r["sites_replied"] == 3 and r["sites_failed"] == 0, r
        assert r["sites_rejected"] == 0 and r["model_updated"] is True, r
    assert int(records[2]["bytes_up"]) < 0.3 * 3 * _dense_reply_nbytes()  # type: ignore[call-overload]
