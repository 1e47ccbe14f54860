"""kill -9 during an asynchronous run, resume: the same model versions as an uninterrupted run.

The run (real ClientApp, DelayedGrid with lognormal site speeds on a virtual clock, FedBuff
with K = 3 of C = 4 concurrent sites out of 5, and deadline rounds) is SIGKILLed mid-buffer
(after an arrival that did not fill the buffer), right after a buffer was applied but before
its checkpoint, and half-way through writing a checkpoint. The resumed run sends the
in-flight dispatches again at their original (virtual) times, so it sees the same arrival
order; the digests and simulated times of every version must equal the reference run's. The
checkpoint holds the median-relative guards' window (the scalars of the last accepted
updates), and with federated evaluation on (``--evaluate``) the versions are still the
reference's, and an evaluation open at the kill is sent again, so every record gets the
metrics of the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from server.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow  # SIGKILLs and resumes real runs in subprocesses (~3 min)

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("async_driver.py")
ROUNDS = 6


def _run(run_dir: Path, mode: str, *, resume: bool = False, evaluate: bool = False,
         env: dict[str, str] | None = None) -> int:
    args = [sys.executable, str(DRIVER), str(run_dir), str(ROUNDS), mode]
    args += (["--resume"] if resume else []) + (["--evaluate"] if evaluate else [])
    proc = subprocess.run(args, cwd=ROOT,
                          env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, timeout=600)
    if proc.returncode not in (0, -signal.SIGKILL):
        print(proc.stderr.decode()[-3000:])
    return proc.returncode


def _versions(run_dir: Path) -> list[tuple[int, str, float, bool]]:
    recs = json.loads((run_dir / "metrics.json").read_text())
    return [(r["version"], r["model_digest"], round(r["time"], 9), r["model_updated"])
            for r in recs[1:]]


@pytest.fixture(scope="module", params=["fedbuff", "deadline"])
def reference(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[str, list[tuple[int, str, float, bool]]]:
    mode = request.param
    d = tmp_path_factory.mktemp(f"reference-{mode}")
    assert _run(d, mode) == 0
    versions = _versions(d)
    assert len(versions) == ROUNDS and len({v[1] for v in versions}) == ROUNDS
    return mode, versions


@pytest.mark.parametrize("kill", [
    {"FEDAGG_TEST_KILL_AT": "arrival:8"},
    {"FEDAGG_TEST_KILL_AT": "3:after-apply"},
    {"FEDAGG_TEST_KILL_IN_CHECKPOINT_ROUND": "2"},
], ids=["mid-buffer", "after-apply", "mid-checkpoint-write"])
def test_kill_then_resume_gives_the_same_versions(
        tmp_path: Path, reference: tuple[str, list], kill: dict[str, str]) -> None:
    mode, want = reference
    assert _run(tmp_path, mode, env=kill) == -signal.SIGKILL
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.round < ROUNDS
    state = (ckpt.strategy_state or {})["asynchronous"]
    assert state["jobs"], "the kill should leave dispatches in flight"
    assert state["guard_window"]["norms"], "the guards' window is part of the checkpoint"
    assert _run(tmp_path, mode, resume=True) == 0
    assert _versions(tmp_path) == want


def test_resume_twice(tmp_path: Path, reference: tuple[str, list]) -> None:
    mode, want = reference
    assert _run(tmp_path, mode, env={"FEDAGG_TEST_KILL_AT": "arrival:5"}) == -signal.SIGKILL
    assert _run(tmp_path, mode, resume=True,
                env={"FEDAGG_TEST_KILL_AT": "arrival:6"}) == -signal.SIGKILL
    assert _run(tmp_path, mode, resume=True) == 0
    assert _versions(tmp_path) == want


def _evals(run_dir: Path) -> list[object]:
    recs = json.loads((run_dir / "metrics.json").read_text())
    return [r.get("federated_eval") for r in recs]


def test_kill_then_resume_with_federated_evaluation(tmp_path: Path,
                                                    reference: tuple[str, list]) -> None:
    mode, want = reference
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert _run(full, mode, evaluate=True) == 0
    assert _versions(full) == want  # evaluating on idle sites does not change the versions
    evals = _evals(full)
    assert evals[0] is None and all(evals[1:])
    assert _run(killed, mode, evaluate=True,
                env={"FEDAGG_TEST_KILL_AT": "arrival:8"}) == -signal.SIGKILL
    state = (load_checkpoint(killed).strategy_state or {})["asynchronous"]
    assert state["evaluations"], "the kill should leave an evaluation open"
    assert _run(killed, mode, resume=True, evaluate=True) == 0
    assert _versions(killed) == want
    assert _evals(killed) == evals  # the open evaluation was sent again
