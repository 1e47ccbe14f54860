"""`flwr run .` from the repository root (Flower's local simulation SuperLink)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import process_cmdlines

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.flower, pytest.mark.slow]


def _pids_using(marker: str) -> list[int]:
    """PIDs of processes whose command line mentions ``marker`` (our private FLWR_HOME)."""
    return [pid for pid, cmd in process_cmdlines().items() if marker in cmd]


def test_flwr_run_local_simulation(tmp_path: Path) -> None:
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n'
    )  # as docs/quickstart.md writes it: the federation's size is given to flwr run
    out_dir = tmp_path / "runs"
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    try:
        proc = subprocess.run(
            ["flwr", "run", ".", "local", "--stream", "--federation-config", "num-supernodes=3",
             "--run-config", f'run.rounds=2 run.sites=3 run.output_dir="{out_dir}"'],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=420,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        deprecated = [ln for ln in (proc.stdout + proc.stderr).splitlines()
                      if "deprecat" in ln.lower()]
        assert not deprecated, deprecated  # e.g. `options.` fields of the connection
        deadline = time.time() + 120
        files: list[Path] = []
        while time.time() < deadline:
            files = [p for p in out_dir.glob("*/metrics.json")]
            if files and len(json.loads(files[0].read_text())) == 3 and (files[0].parent / "model.pt").exists():
                break
            time.sleep(1)
        assert files, proc.stdout[-3000:]
        records = json.loads(files[0].read_text())
        assert [r["round"] for r in records] == [0, 1, 2]
        assert records[-1]["accuracy"] > records[0]["accuracy"]
    finally:
        # `flwr run` leaves a local SuperLink daemon (127.0.0.1:39091) behind: stop what we
        # started, identified by our private FLWR_HOME in its command line.
        for pid in _pids_using(str(home)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.time() + 20
        while _pids_using(str(home)) and time.time() < deadline:
            time.sleep(0.5)
        for pid in _pids_using(str(home)):
            os.kill(pid, signal.SIGKILL)
