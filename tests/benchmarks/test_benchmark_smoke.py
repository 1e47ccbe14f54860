"""Every benchmark script runs at its ``--smoke`` size: exit 0, a markdown table, ``--json``.

The scripts are discovered (every ``benchmarks/*.py`` not starting with ``_``), so a new
script is covered without touching this file, and one without ``--smoke`` fails here. Each
runs as a user runs it, ``python benchmarks/<script> --smoke --json <file>`` from the
repository root in a fresh process, on the real code path (real Flower objects, Flower's
simulation engine or Ray, real gloo processes where the script uses them): a refactor that
breaks a benchmark fails CI instead of being found when someone next wants a figure.
Timings are not checked here (speed targets live in the benchmarks, never in tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")
                 if not p.name.startswith("_"))

# Grouping marks (tests/conftest.py): scripts that start a Ray cluster (Flower's simulation
# engine, or Ray directly for the sharded accumulator) and scripts that spawn gloo processes.
FLOWER = {"fedavg_round.py", "server_memory.py"}
GLOO = {"allreduce.py", "site.py", "site_ddp.py"}
TIMEOUT_S = 420  # a smoke run takes 10-60 s on the 2-core VM; generous for a loaded machine

pytestmark = pytest.mark.slow


def _param(script: str) -> object:
    marks = [m for names, m in ((FLOWER, pytest.mark.flower), (GLOO, pytest.mark.gloo))
             if script in names]
    return pytest.param(script, marks=marks, id=script)


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def test_scripts_are_found_and_the_mark_lists_name_real_scripts() -> None:
    assert "secagg.py" in SCRIPTS
    stale = (FLOWER | GLOO) - set(SCRIPTS)
    assert not stale, f"{sorted(stale)} listed in FLOWER / GLOO but not in benchmarks/"


@pytest.mark.parametrize("script", [_param(s) for s in SCRIPTS])
def test_benchmark_runs_at_smoke_size(script: str, tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    # this checkout first on the path, as pytest's own pythonpath = ["."]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "PYTHONPATH": path}
    cmd = [sys.executable, f"benchmarks/{script}", "--smoke", "--json", str(out)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script} --smoke ran past {TIMEOUT_S} s; stdout:\n"
                    f"{_tail(str(exc.stdout or ''))}")
    assert proc.returncode == 0, (
        f"{script} --smoke exited {proc.returncode}\nstdout:\n{_tail(proc.stdout)}\n"
        f"stderr:\n{_tail(proc.stderr)}")
    assert any(line.startswith("|") for line in proc.stdout.splitlines()), (
        f"{script} --smoke printed no markdown table\nstdout:\n{_tail(proc.stdout)}")
    assert out.exists(), f"{script} --smoke --json {out} wrote nothing"
    data = json.loads(out.read_text())
    assert data.get("results"), f"{script}: no results in {sorted(data)}"
    assert "--smoke" in data["command"]
