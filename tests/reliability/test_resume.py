"""Kill a run with SIGKILL at several points (mid-round, mid-checkpoint-write, at random),
resume it, and get exactly the global models of an uninterrupted run with the same seeds."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fedagg.errors import CheckpointError
from server.checkpoint import load_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("resume_driver.py")
ROUNDS = 4


def _run(
    run_dir: Path,
    *,
    resume: bool = False,
    env: dict[str, str] | None = None,
    kill_after: float | None = None,
) -> int:
    args = [sys.executable, str(DRIVER), str(run_dir), str(ROUNDS)] + (
        ["--resume"] if resume else []
    )
    proc = subprocess.Popen(
        args,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        if kill_after is not None:
            try:
                proc.wait(timeout=kill_after)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
        return proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _digests(run_dir: Path) -> list[str]:
    return [r["model_digest"] for r in json.loads((run_dir / "metrics.json").read_text())[1:]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    d = tmp_path_factory.mktemp("reference")
    assert _run(d) == 0
    digests = _digests(d)
    assert len(digests) == ROUNDS and len(set(digests)) == ROUNDS
    return digests


def _resume_until_done(run_dir: Path) -> None:
    assert _run(run_dir, resume=True) == 0


@pytest.mark.slow  # SIGKILLs and resumes a real run in a subprocess
@pytest.mark.parametrize("crash_round", [0, 2])
def test_kill_mid_checkpoint_write(tmp_path: Path, reference: list[str], crash_round: int) -> None:
    code = _run(tmp_path, env={"FEDAGG_TEST_KILL_IN_CHECKPOINT_ROUND": str(crash_round)})
    assert code == -signal.SIGKILL
    if crash_round == 0:
        assert not (tmp_path / "checkpoint.npz").exists()  # nothing complete yet
        assert _run(tmp_path, resume=True) != 0  # refuses: nothing to resume ...
        assert _run(tmp_path) == 0  # ... a fresh start is the fix
    else:
        assert load_checkpoint(tmp_path).round == crash_round - 1  # the previous one survived
        _resume_until_done(tmp_path)
    assert _digests(tmp_path) == reference


@pytest.mark.slow  # SIGKILLs and resumes a real run in a subprocess
def test_kill_mid_round_then_resume(tmp_path: Path, reference: list[str]) -> None:
    """Killed after the sites replied and the strategy aggregated, before the checkpoint."""
    assert _run(tmp_path, env={"FEDAGG_TEST_KILL_AT": "3:after-train"}) == -signal.SIGKILL
    assert load_checkpoint(tmp_path).round == 2
    _resume_until_done(tmp_path)
    assert _digests(tmp_path) == reference


def _kill_when(run_dir: Path, round_reached: int, extra_delay: float, resume: bool) -> int:
    """Start a run; SIGKILL it ``extra_delay`` s after metrics.json shows ``round_reached``."""
    args = [sys.executable, str(DRIVER), str(run_dir), str(ROUNDS)] + (
        ["--resume"] if resume else []
    )
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while proc.poll() is None and time.time() < deadline:
            try:
                last = json.loads((run_dir / "metrics.json").read_text())[-1]["round"]
            except (OSError, ValueError, IndexError, KeyError):
                last = -1
            if last >= round_reached:
                time.sleep(extra_delay)
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.05)
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # SIGKILLs and resumes a real run in a subprocess
def test_kill_at_random_points_then_resume(tmp_path: Path, reference: list[str]) -> None:
    rng = random.Random(int(os.environ.get("FEDAGG_TEST_SEED", "11")))
    run_dir = tmp_path / "run"
    first = rng.randint(1, ROUNDS - 2)
    for reached in (first, rng.randint(first + 1, ROUNDS - 1)):  # two kills, each resumed
        _kill_when(
            run_dir, reached, rng.uniform(0.0, 0.4), resume=(run_dir / "checkpoint.npz").exists()
        )
    _resume_until_done(run_dir)
    assert _digests(run_dir) == reference


def test_resume_with_another_config_is_refused(tmp_path: Path) -> None:
    from fedagg.config import load_config

    cfg = load_config(None, ["train.lr=0.1"])
    save_checkpoint(
        tmp_path,
        round=1,
        cfg=cfg,
        keys=["w"],
        arrays=[np.zeros(2, np.float32)],
        records=[],
        strategy_state={"optimizer": {"m": [np.ones(2)], "t": 1, "kind": "none"}},
    )
    ck = load_checkpoint(tmp_path)
    assert ck.round == 1 and ck.strategy_state is not None
    np.testing.assert_array_equal(ck.strategy_state["optimizer"]["m"][0], np.ones(2))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedagg.cli",
            "simulate",
            "--resume",
            str(tmp_path),
            "--config",
            os.devnull,
            "-c",
            "train.lr=0.3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "train.lr: 0.1 -> 0.3" in proc.stderr and "Traceback" not in proc.stderr


def test_truncated_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "checkpoint.npz").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        load_checkpoint(tmp_path / "missing")
