"""Every code block of docs/tutorial-own-model.md and docs/api/public.md runs.

The tutorial is a Flower App of the reader's own, run with ``flwr run`` as the page says. Its
blocks run in order in a fresh project directory: a block whose first line names a file
(``# my_project/task.py``, ``# pyproject.toml``) is written to that file (a second block for
the same file continues it); bash blocks run there (``bash -e``; the ``export``s of earlier
blocks hold, as in one terminal); the other Python blocks run there too, each run of them
between two bash blocks as one script. The output of every command must not carry a
deprecation warning (Flower's ``run_simulation`` and its ``options.`` connection fields are
what the page must not use). The local SuperLink that ``flwr run`` starts is the test's own:
a private ``FLWR_HOME`` and free ports, stopped by PID at the end, also when a block fails.

docs/api/public.md's Python blocks run in order as one script. TOML blocks are parsed and
their fedagg keys validated as a run config; the ``fedagg config`` commands of the bash
blocks run in the fast lane too.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib

from server.app import config_from_run_config

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorial-own-model.md"
PUBLIC = ROOT / "docs" / "api" / "public.md"
DOCS = [TUTORIAL, PUBLIC]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
FILE = re.compile(r"\A# ((?:[\w.-]+/)*[\w.-]+\.(?:py|toml))\n")
EXPORT = re.compile(r"^export ((?:\w+=\S+ ?)+)$", re.M)


def _blocks(path: Path, lang: str | None = None) -> list[tuple[str, str]]:
    return [(kind, body) for kind, body in FENCE.findall(path.read_text())
            if lang is None or kind == lang]


def _file_of(body: str) -> str | None:
    match = FILE.match(body)
    return match.group(1) if match else None


def test_every_block_is_python_toml_or_bash() -> None:
    for doc in DOCS:
        kinds = {kind for kind, _ in _blocks(doc)}
        assert kinds <= {"python", "toml", "bash"}, (doc, kinds)
        assert _blocks(doc, "python"), doc


def test_the_tutorial_runs_flower_as_flower_recommends() -> None:
    text = TUTORIAL.read_text()
    assert "flwr run ." in text
    assert "run_simulation(" not in text and "options.num-supernodes" not in text
    files = {_file_of(body) for _, body in _blocks(TUTORIAL)} - {None}
    assert {"pyproject.toml", "my_project/task.py", "my_project/client_app.py",
            "my_project/server_app.py", "regression/pyproject.toml",
            "regression/my_regression/apps.py"} <= files, files
    for needed in ('asynchronous.mode=\\"fedbuff\\"', "site.algorithm", "evaluate_fn(arrays",
                   "choose_algorithm", "mse_loss"):
        assert needed in text, needed


def test_project_files_compile() -> None:
    for _, body in _blocks(TUTORIAL, "python"):
        name = _file_of(body)
        if name:
            compile(body, name, "exec")


def test_toml_blocks_are_valid_fedagg_run_configs() -> None:
    for doc in DOCS:
        for _, body in _blocks(doc, "toml"):
            data = tomllib.loads(body)
            config = data.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})
            assert config, body
            config_from_run_config(config)  # raises ConfigError on a bad key or value


def test_fedagg_config_commands_in_bash_blocks_run() -> None:
    """The ``fedagg config`` lines (no engine): fast; the rest runs in the slow test."""
    ran = 0
    for doc in DOCS:
        for _, body in _blocks(doc, "bash"):
            for line in filter(None, (ln.strip() for ln in body.splitlines())):
                if doc == TUTORIAL and not line.startswith("fedagg config"):
                    continue
                proc = subprocess.run(line, shell=True, capture_output=True, text=True,
                                      timeout=120, cwd=ROOT)
                assert proc.returncode == 0, (line, proc.stderr[-1000:])
                ran += 1
    assert ran >= 3


@pytest.mark.flower
@pytest.mark.slow
def test_public_md_python_blocks_run_as_one_script(tmp_path: Path) -> None:
    script = tmp_path / "public.py"
    script.write_text("\n\n".join(body for _, body in _blocks(PUBLIC, "python")))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pids_using(text: str) -> list[int]:
    from conftest import process_cmdlines

    return [pid for pid, cmd in process_cmdlines().items()
            if text in cmd and "pytest" not in cmd]


def _stop(home: Path) -> None:
    """Stop the processes started under ``home`` (the local SuperLink and its children)."""
    for pid in _pids_using(str(home)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.time() + 20
    while _pids_using(str(home)) and time.time() < deadline:
        time.sleep(0.5)
    for pid in _pids_using(str(home)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _checked(proc: subprocess.CompletedProcess[str], what: str) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (what, out[-4000:])
    lines = [ln for ln in out.splitlines() if "deprecat" in ln.lower()]
    assert not lines, (what, lines)
    return out


@pytest.mark.flower
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_tutorial_runs_in_order(tmp_path: Path) -> None:
    project, home = tmp_path / "project", tmp_path / "flwr-home"
    project.mkdir()
    env = {**os.environ, "FLWR_HOME": str(home), "PYTHONPATH": str(project),
           # the local SuperLink of `flwr run`, on ports of its own (not 39091 / 39093)
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port())}
    script: list[str] = []
    outputs: list[str] = []

    def run_script() -> None:
        if script:
            path = tmp_path / f"segment{len(outputs)}.py"
            path.write_text("\n\n".join(script))
            script.clear()
            proc = subprocess.run([sys.executable, str(path)], cwd=project, env=env,
                                  capture_output=True, text=True, timeout=600)
            outputs.append(_checked(proc, path.read_text()[:300]))

    try:
        for kind, body in _blocks(TUTORIAL):
            name = _file_of(body)
            if name is not None:
                target = project / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with target.open("a") as fh:
                    fh.write(body if not target.stat().st_size else "\n\n" + body)
            elif kind == "python":
                script.append(body)
            elif kind == "bash":
                run_script()
                for match in EXPORT.finditer(body):
                    env.update(dict(kv.split("=", 1) for kv in shlex.split(match.group(1))))
                proc = subprocess.run(["bash", "-e", "-c", body], cwd=project, env=env,
                                      capture_output=True, text=True, timeout=900)
                outputs.append(_checked(proc, body))
        run_script()
    finally:
        _stop(home)
    assert not _pids_using(str(home))
    text = "\n".join(outputs)
    assert "fedagg round 4/4: accuracy" in text, text[-3000:]  # Flower's log, streamed
    assert "R² " in text and "the sites' all-reduce: ['algorithm_tree']" in text
    assert len(list((project / "runs").glob("spirals-*"))) == 2
    assert list((project / "regression" / "runs").glob("regression-*/report.html"))
