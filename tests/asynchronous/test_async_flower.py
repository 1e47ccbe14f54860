"""The asynchronous loop on Flower's real simulation engine (Ray), through ``fedagg simulate``.

No virtual clock here: the ServerApp's Grid is Flower's, the loop pushes and pulls with wall
time (``asynchronous.poll``), and the sites are Flower's virtual SuperNodes running the real
ClientApp in Ray actors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.flower, pytest.mark.slow]


def _simulate(tmp_path: Path, *overrides: str) -> list[dict[str, object]]:
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "fedagg.cli", "simulate", "--run-dir", str(run_dir), "--seed",
            "1", "--quiet"]
    for o in overrides:
        args += ["-c", o]
    env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    proc = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records: list[dict[str, object]] = json.loads((run_dir / "metrics.json").read_text())
    return records


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    """One plain FedBuff run with federated evaluation, read by the two tests below (one engine
    start, not two): 3 sites, 5 buffers of 2 with 3 in flight, idle sites evaluate every
    version (the sites whose replies filled a buffer are idle at that moment)."""
    # 5 buffers of 2 (which 2 of the 3 sites fill a buffer, and how stale they are, depends on
    # wall-clock arrival: 3 buffers were too few to clear the bar on a loaded machine). IID
    # partitions: with evaluation on, a buffer is often filled twice by the same fast site, and
    # under Dirichlet skew the last version's accuracy swung back to chance in one of 3 runs.
    return _simulate(tmp_path_factory.mktemp("fedbuff-plain"), "run.sites=3", "run.rounds=5",
                     "train.local_epochs=1", "asynchronous.mode=fedbuff",
                     "asynchronous.buffer_size=2", "asynchronous.concurrency=3",
                     "run.fraction_evaluate=1.0", "data.partitioner=iid")


def test_fedbuff_on_the_simulation_engine(plain_run: list[dict[str, object]]) -> None:
    records = plain_run
    assert [r["version"] for r in records] == list(range(6))
    assert float(records[-1]["accuracy"]) > float(records[0]["accuracy"]) + 0.1  # type: ignore[arg-type]
    for r in records[1:]:
        assert r["model_updated"] is True and r["updates"] == 2 and not r.get("rejected"), r
        assert sum(r["staleness"].values()) == r["updates"]  # type: ignore[union-attr]


def test_secure_fedbuff_on_the_simulation_engine(tmp_path: Path) -> None:
    """4 sites in cohorts of 4 closing at 3 uploads; site 3 sleeps 15 s in its first job, so
    cohort 1 closes without it; it carries that update into cohort 2 (the drop proof and the
    held update travel through Flower's records and the engine's Context.state)."""
    records = _simulate(tmp_path, "run.sites=4", "run.rounds=3", "train.local_epochs=1",
                        "asynchronous.mode=fedbuff", "strategy.name=secure",
                        "secagg.weight_scale=1000", "asynchronous.buffer_size=4",
                        "asynchronous.concurrency=4", "asynchronous.cohort_quorum=0.75",
                        "faults.slow_site=3", "faults.slow_round=1", "faults.slow_seconds=15")
    assert [r["version"] for r in records] == list(range(4))
    assert float(records[-1]["accuracy"]) > float(records[0]["accuracy"]) + 0.1  # type: ignore[arg-type]
    for r in records[1:]:
        assert r["model_updated"] is True and sum(r["staleness"].values()) == r["updates"], r  # type: ignore[union-attr]
        assert "federated_eval" not in r  # run.fraction_evaluate = 0 (the default)
    first = records[1]
    assert first["secagg_counted"] == 3 and first["secagg_dropped"] == 1, first
    [slow] = first["errors"]  # type: ignore[misc]
    assert "carries its update" in records[2]["rejected"][slow]  # type: ignore[index]
    assert slow in records[2]["cohort_carried"], records[2]  # type: ignore[operator]
    assert records[2]["secagg_counted"] >= 3  # at least the quorum


def test_federated_evaluation_on_the_simulation_engine(plain_run: list[dict[str, object]]
                                                       ) -> None:
    """Idle sites evaluate every version on their held-out split; the replies come back
    through Flower's Grid with the train replies and are recorded per version."""
    records = plain_run
    assert "federated_eval" not in records[0]
    for r in records[1:]:
        fed = r["federated_eval"]
        assert isinstance(fed, dict) and {"eval_loss", "eval_acc"} <= set(fed), r
        assert 0.0 <= float(fed["eval_acc"]) <= 1.0 and float(fed["eval_loss"]) > 0
        assert 1 <= int(r["federated_eval_sites"]) <= 3  # type: ignore[call-overload]
