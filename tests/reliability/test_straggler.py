"""A site that sleeps past the deadline on Flower's real simulation engine: the round completes
without it, and its late reply never enters a later round."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.flower, pytest.mark.slow]


def test_straggler_excluded_and_late_reply_never_aggregated(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "fedagg.cli", "simulate", "--run-dir", str(run_dir),
            "-c", "run.sites=3", "-c", "run.rounds=3", "-c", "train.local_epochs=1",
            "-c", "run.first_round_timeout=240", "-c", "run.round_timeout=12",
            "-c", "faults.slow_site=1", "-c", "faults.slow_round=2", "-c", "faults.slow_seconds=20"]
    env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads((run_dir / "metrics.json").read_text())
    by_round = {r["round"]: r for r in records}
    assert by_round[1]["sites"] == [0, 1, 2]
    # round 2: the deadline passed without site 1; the round completed with the other two
    assert by_round[2]["sites"] == [0, 2] and by_round[2]["model_updated"] is True
    assert by_round[2]["sites_failed"] == 1
    assert by_round[2]["seconds_exchange"] < 20  # did not wait for the straggler
    # round 3: whatever arrives is a reply to round 3 (sites echo the round; a reply to round 2
    # would be refused); site 1's round-2 update is never part of any aggregate
    assert set(by_round[3]["sites"]) <= {0, 1, 2} and by_round[3]["model_updated"] is True
    assert all("earlier round" not in why for why in by_round[3].get("rejected", {}).values())
    assert by_round[3]["accuracy"] > by_round[0]["accuracy"]
