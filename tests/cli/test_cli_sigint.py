"""One Ctrl-C stops ``fedagg simulate`` cleanly: exit 130 within 10 s, a resume hint, no
traceback, no process left behind; ``--resume`` then says where it picks up.

The run is started in its own process group and session, and SIGINT goes to the whole group,
as a terminal's Ctrl-C does (Ray's processes get it too). Only processes this test started
(that group's session) are looked at, and only those are killed if anything is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.flower, pytest.mark.slow]


def _procs() -> dict[int, tuple[int, int, str, str]]:
    """pid -> (ppid, session id, state, start time) of every process (Linux /proc)."""
    out: dict[int, tuple[int, int, str, str]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        f = stat[stat.rfind(")") + 2:].split()
        out[int(d.name)] = (int(f[1]), int(f[3]), f[0], f[19])
    return out


def _tree(root: int) -> dict[int, str]:
    """The processes ``root`` started: its descendants and its session; pid -> start time."""
    procs = _procs()
    found = {p: v[3] for p, v in procs.items() if v[1] == root}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for p, v in procs.items():
            if v[0] == parent and p not in found:
                found[p] = v[3]
                frontier.append(p)
    found.pop(root, None)
    return found


def _alive(snapshot: dict[int, str]) -> list[int]:
    procs = _procs()
    return [p for p, start in snapshot.items()
            if p in procs and procs[p][3] == start and procs[p][2] not in ("Z", "X")]


def _env() -> dict[str, str]:
    return {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_ctrl_c_stops_cleanly_then_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "fedagg.cli", "simulate", "--run-dir", str(run_dir),
           "-c", "run.rounds=500", "-c", "run.sites=3", "-c", "train.local_epochs=1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tmp_path, env=_env(), start_new_session=True)
    lines: list[str] = []
    round1 = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("round   1/500"):
                round1.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    seen: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 300
        while not round1.is_set() and proc.poll() is None and time.monotonic() < deadline:
            seen.update(_tree(proc.pid))
            time.sleep(0.2)
        assert round1.is_set(), "".join(lines)[-3000:]
        seen.update(_tree(proc.pid))
        assert any(_procs().get(p, (0, 0, "", ""))[0] == proc.pid for p in seen)  # Ray is up
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=10)
        elapsed = time.monotonic() - t0
        reader.join(timeout=5)
        out = "".join(lines)
        assert rc == 130, out[-3000:]
        assert elapsed < 10
        assert f"resume with: fedagg simulate --resume {run_dir}" in out
        assert "Traceback" not in out, out[-3000:]
        # nothing this run started is left (a re-parented zombie may take a moment to be reaped)
        left = _alive(seen)
        t1 = time.monotonic()
        while left and time.monotonic() - t1 < 2:
            time.sleep(0.1)
            left = _alive(seen)
        assert left == [], {p: (Path(f"/proc/{p}/cmdline").read_bytes()[:80]) for p in left}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in _alive(seen):
            os.kill(p, signal.SIGKILL)

    import numpy as np

    with np.load(run_dir / "checkpoint.npz", allow_pickle=False) as npz:  # the resume point
        done = int(json.loads(bytes(npz["meta"]).decode())["round"])
    assert done >= 1
    resumed = subprocess.run(
        [sys.executable, "-m", "fedagg.cli", "simulate", "--resume", str(run_dir),
         "-c", f"run.rounds={done + 1}"],
        capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=600)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert (f"resuming from round {done + 1} (checkpoint after round {done}) in {run_dir}"
            in resumed.stdout)
    # the replayed rounds are not printed again; the new one is
    rounds = [ln.split()[1] for ln in resumed.stdout.splitlines() if ln.startswith("round ")]
    assert rounds == [f"{done + 1}/{done + 1}"], resumed.stdout
