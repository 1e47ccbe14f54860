"""Multi-worker sites end to end on Flower's real simulation engine (Ray), via `fedagg simulate`.

Two runs (each ~1 minute of Ray start-up plus training):
* process mode, 3 sites x 2 worker processes x 2 rounds, and in round 2 worker 1 of site 1 is
  SIGKILLed mid-round: that site replies with an error, the round goes on with the other two
  sites, accuracy still improves, and no worker process outlives the run;
* in-process mode, 3 sites x 2 workers x 2 rounds, every site replies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import process_cmdlines

# Process mode starts 2 fresh worker processes per site and round (each imports torch): ~1-2
# minutes on an idle 2-core machine, ~4 minutes at load average 20.
pytestmark = [pytest.mark.flower, pytest.mark.slow, pytest.mark.timeout(900)]

COMMON = ("run.sites=3", "run.rounds=2", "run.seed=1", "data.max_train_examples=900",
          "data.partitioner=iid", "train.local_epochs=1", "site.workers=2")


def _simulate(tmp_path: Path, *overrides: str) -> tuple[list[dict[str, object]], str]:
    run_dir = tmp_path / "run"
    work_tmp = tmp_path / "tmp"  # worker job dirs land here: the orphan check looks for them
    work_tmp.mkdir()
    args = [sys.executable, "-m", "fedagg.cli", "simulate", "--run-dir", str(run_dir)]
    for o in (*COMMON, *overrides):
        args += ["-c", o]
    env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FEDAGG_SITE_TMPDIR": str(work_tmp)}
    proc = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=850, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records: list[dict[str, object]] = json.loads((run_dir / "metrics.json").read_text())
    return records, proc.stdout + proc.stderr


def _workers_of(path: Path) -> list[str]:
    """Command lines of live processes that mention ``path`` (site workers of this run)."""
    return [f"{pid}: {cmd}" for pid, cmd in process_cmdlines().items()
            if "clients.worker" in cmd and str(path) in cmd]


def test_process_mode_sites_with_a_killed_worker(tmp_path: Path) -> None:
    records, _ = _simulate(
        tmp_path, "site.mode=process", "faults.kill_worker=1", "faults.worker_fault_site=1",
        "faults.worker_fault_round=2", "faults.worker_fault_step=3")
    assert [r["round"] for r in records] == [0, 1, 2]
    r1, r2 = records[1], records[2]
    assert r1["sites_replied"] == 3 and r1["sites_failed"] == 0
    # round 2: site 1's worker died -> that site replied with an error, the round went on
    assert r2["sites_replied"] == 2 and r2["sites_failed"] == 1 and r2["model_updated"] is True
    assert float(r2["accuracy"]) > float(records[0]["accuracy"]) + 0.2  # type: ignore[arg-type]
    assert _workers_of(tmp_path) == []
    assert list((tmp_path / "tmp").glob("fedagg-site-*")) == []


def test_inprocess_mode_sites(tmp_path: Path) -> None:
    records, _ = _simulate(tmp_path, "site.mode=inprocess")
    assert [r["round"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["sites_replied"] == 3 and r["sites_failed"] == 0
    assert float(records[-1]["accuracy"]) > float(records[0]["accuracy"]) + 0.2  # type: ignore[arg-type]
