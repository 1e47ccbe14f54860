"""End to end on Flower's simulation engine (Ray), through ``fedagg simulate``: 5 sites, 3
rounds, site 2 killed in round 2 after training and before its masked upload.

Oracle (independent of the secure path): a second run of plain FedAvg with the same seed in
which site 2 fails at "train" in round 2, i.e. the plaintext FedAvg of the survivors. It runs
in-process (:class:`server.inprocess.InProcessGrid`, the same ClientApp and serialisation, no
Ray start-up): sites train deterministically (seeded by run seed, round and partition), so it
sees the same site models as on the simulation engine (measured: its model equals a Ray run's
bit for bit); the secure model may differ only by the fixed-point error, which training in
later rounds carries along. To show the tolerance is meaningful, a third, in-process plain
FedAvg run in which site 2 is NOT dropped must differ from the oracle by far more.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clients.app import app
from fedagg.config import load_config
from server.inprocess import InProcessGrid
from server.runner import run_server

pytestmark = [pytest.mark.flower, pytest.mark.slow]

COMMON = ["run.sites=5", "run.rounds=3", "train.local_epochs=2", "secagg.weight_scale=2000",
          "faults.crash_site=2", "faults.crash_round=2"]
# Measured gaps: 2.8e-7 and 2.3e-4 (the fixed-point error of rounds 1 and 3 — stochastic
# rounding with fresh randomness — is carried and amplified by training in later rounds);
# keeping site 2 in round 2 moves the model by 3e-2, 30x this tolerance.
TOL = 1e-3


def _simulate(run_dir: Path, *overrides: str) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    args = [sys.executable, "-m", "fedagg.cli", "simulate", "--run-dir", str(run_dir), "--seed", "1"]
    for o in overrides:
        args += ["-c", o]
    env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    proc = subprocess.run(args, capture_output=True, text=True, cwd=run_dir.parent, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records: list[dict[str, Any]] = json.loads((run_dir / "metrics.json").read_text())
    with np.load(run_dir / "model.npz") as npz:
        return records, {k: npz[k] for k in npz.files}


def _inprocess(run_dir: Path, *overrides: str
               ) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """The same run in this process: 5 in-process SuperNodes running the real ClientApp."""
    cfg = load_config(None, [*overrides, "run.seed=1"])
    run_dir.mkdir()
    run_server(InProcessGrid(app, 5), cfg, run_dir)
    records: list[dict[str, Any]] = json.loads((run_dir / "metrics.json").read_text())
    with np.load(run_dir / "model.npz") as npz:
        return records, {k: npz[k] for k in npz.files}


def _diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)


def test_secure_run_with_a_site_killed_mid_round_matches_fedavg_of_survivors(tmp_path: Path
                                                                            ) -> None:
    secure, m_secure = _simulate(tmp_path / "secure", *COMMON, "strategy.name=secure",
                                 "faults.crash_stage=upload")
    plain, m_plain = _inprocess(tmp_path / "plain", *COMMON, "strategy.name=fedavg",
                                "faults.crash_stage=train")

    assert [r["round"] for r in secure] == [0, 1, 2, 3]
    for r in secure[1:]:
        assert r["model_updated"] is True
    r2 = secure[2]
    assert (r2["sites_replied"], r2["sites_failed"]) == (4, 1)
    assert (r2["secagg_counted"], r2["secagg_dropped"]) == (4, 1)
    assert r2["secagg_error_bound"] < 1e-4
    # key setup + round, round only, re-key (site 2 dropped before upload) + round
    assert [r["exchanges"] for r in secure[1:]] == [4, 2, 4]
    assert [r["sites_replied"] for r in plain[1:]] == [5, 4, 5]

    gap = _diff(m_secure, m_plain)
    assert gap <= TOL, f"secure model differs from FedAvg of the survivors by {gap}"

    # Sharpness of the oracle: keeping site 2 in round 2 changes the model far beyond TOL.
    _, m_all = _inprocess(tmp_path / "all", *COMMON[:4], "strategy.name=fedavg")
    assert _diff(m_all, m_plain) > 10 * TOL
    assert float(secure[-1]["accuracy"]) > float(secure[0]["accuracy"]) + 0.2
