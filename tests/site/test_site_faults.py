"""With ``site.elastic = false``, a worker that dies or hangs fails the site with a clear
WorkerError; nothing is left behind (the elastic default: tests/site/test_site_elastic.py).

Real worker processes (gloo on 127.0.0.1) and real threads; faults are injected through the
run config (``[faults] kill_worker / hang_worker``), i.e. the same path a drill would use.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from _site_helpers import child_pids, initial_weights, settings, train

from fedagg.errors import WorkerError


def _fault_settings(mode: str, kind: str, *, server_round: int = 1, timeout: float = 60.0):  # type: ignore[no-untyped-def]
    return settings(
        partition=1, server_round=server_round,
        site={"workers": 2 if mode == "process" else 3, "mode": mode, "worker_timeout": timeout,
              "elastic": False},
        faults={f"{kind}_worker": 1, "worker_fault_site": 1, "worker_fault_round": 1,
                "worker_fault_step": 2},
    )


@pytest.fixture
def job_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Worker job directories of this test only (must be empty after every round)."""
    monkeypatch.setenv("FEDAGG_SITE_TMPDIR", str(tmp_path))
    return tmp_path


@pytest.mark.slow
@pytest.mark.gloo
def test_killed_worker_process_fails_the_site_and_next_round_is_clean(job_root: Path) -> None:
    before = child_pids()
    s = _fault_settings("process", "kill")
    w0 = initial_weights(s)
    with pytest.raises(WorkerError) as info:
        train(s, w0)
    text = str(info.value)
    assert "site-1: worker 1 of 2" in text
    assert "killed by signal SIGKILL" in text and "round 1 (process mode)" in text
    assert "Fix:" in text
    assert child_pids() <= before, "worker processes left behind"
    assert list(job_root.iterdir()) == []
    # the next round (no fault there) starts fresh workers and succeeds
    up = train(_fault_settings("process", "kill", server_round=2), w0)
    assert up.metrics["workers"] == 2 and up.num_examples == 300
    assert child_pids() <= before


@pytest.mark.slow
@pytest.mark.gloo
def test_hung_worker_process_is_detected_within_the_timeout(job_root: Path) -> None:
    before = child_pids()
    s = _fault_settings("process", "hang", timeout=8.0)
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        train(s, initial_weights(s))
    text = str(info.value)
    assert "site-1: worker 1 of 2" in text and "hung: no progress for" in text
    assert "'compute' at step 2" in text  # the hung one, not its peer that waits for it
    assert time.monotonic() - t0 < 8.0 + 120.0 + 30.0  # timeout + startup allowance + margin
    assert child_pids() <= before
    assert list(job_root.iterdir()) == []


def test_failed_inprocess_worker_names_the_root_cause() -> None:
    s = _fault_settings("inprocess", "kill")
    with pytest.raises(WorkerError) as info:
        train(s, initial_weights(s))
    text = str(info.value)
    assert text.startswith("site-1: worker 1 of 3")
    assert "injected crash after 2 steps" in text
    assert "also: worker 0: raised CollectiveError" in text  # peers: consequences, not cause


def test_hung_inprocess_worker_is_detected() -> None:
    s = _fault_settings("inprocess", "hang", timeout=3.0)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"site-1: worker 1 of 3 .*hung: no progress"):
        train(s, initial_weights(s))
    assert time.monotonic() - t0 < 60
    # a fresh round afterwards is unaffected by the abandoned group
    up = train(_fault_settings("inprocess", "hang", server_round=2), initial_weights(s))
    assert up.metrics["workers"] == 3


def test_fault_in_another_site_or_round_does_nothing() -> None:
    s = _fault_settings("inprocess", "kill", server_round=3)
    assert train(s, initial_weights(s)).metrics["workers"] == 3
