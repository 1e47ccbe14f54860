"""What ``fedagg simulate`` prints while it runs (fedagg.viz.console), and the small commands."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from fedagg.cli import main
from fedagg.viz.console import (
    ProcessWatch,
    RoundProgress,
    descendants,
    eta_seconds,
    filter_known_warnings,
    round_line,
    stop_processes,
)

ROOT = Path(__file__).resolve().parents[2]
REC = {"round": 2, "accuracy": 0.5, "loss": 1.25, "sites_sampled": 5, "sites_replied": 4,
       "bytes_up": 2_000_000, "bytes_down": 1_000_000, "seconds": 0.5}


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_mode_one_plain_line_per_round() -> None:
    out = io.StringIO()
    with RoundProgress(4, stream=out) as p:  # a StringIO is no terminal: plain lines
        assert p.mode == "lines"
        p.update({"round": 0, "accuracy": 0.1, "loss": 2.0, "seconds": 0.0})
        p.update({**REC, "round": 1, "seconds": 9.0})
        p.update(REC)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "\x1b" not in out.getvalue()
    assert lines[2].startswith("round   2/4  accuracy 0.5000  loss 1.2500  sites 4/5")
    assert "ETA 0:00:01" in lines[2]  # 2 rounds left x 0.5 s (round 1's start-up not counted)
    assert "ETA" not in lines[1]


def test_quiet_mode_prints_nothing() -> None:
    out = io.StringIO()
    with RoundProgress(3, mode="quiet", stream=out) as p:
        p.update(REC)
        p.message("hello")
    assert out.getvalue() == ""


def test_live_mode_on_a_terminal_shows_round_sites_accuracy_eta() -> None:
    out = _Tty()
    with RoundProgress(4, stream=out) as p:
        assert p.mode == "live"
        p.update({**REC, "round": 1, "seconds": 9.0})
        p.update(REC)
    text = out.getvalue()
    assert "round 2/4" in text and "sites 4/5" in text and "accuracy 0.5000" in text
    assert "ETA 0:00:01" in text


def test_resumed_run_replays_silently() -> None:
    out = io.StringIO()
    with RoundProgress(6, stream=out, resumed_after=3) as p:
        for r in range(4):
            p.update({**REC, "round": r})
        p.update({**REC, "round": 4, "seconds": 30.0})  # first round after the restart
        p.update({**REC, "round": 5, "seconds": 1.0})
    lines = out.getvalue().splitlines()
    assert [ln.split()[1] for ln in lines] == ["4/6", "5/6"]
    assert eta_seconds({4: 30.0, 5: 1.0}, 6, resumed_after=3) == 1.0


def test_eta_needs_a_steady_round() -> None:
    assert eta_seconds({}, 5) is None
    assert eta_seconds({0: 0.0, 1: 20.0}, 5) is None
    assert eta_seconds({1: 20.0, 2: 2.0, 3: 4.0}, 5) == pytest.approx(6.0)
    assert "ETA" not in round_line({**REC, "round": 5}, 5, 3.0)


def test_known_warnings_filtered_others_kept() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        filter_known_warnings()
        warnings.warn("Tip: In future versions of Ray, Ray will no longer override accelerator "
                      "visible devices env var", FutureWarning, stacklevel=1)
        warnings.warn("something else entirely", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["something else entirely"]


def test_known_flower_deprecation_log_dropped(caplog: pytest.LogCaptureFixture) -> None:
    filter_known_warnings()
    filter_known_warnings()  # idempotent
    flwr = logging.getLogger("flwr")
    assert sum(type(f).__name__ == "_DropKnown" for f in flwr.filters) == 1
    with caplog.at_level(logging.WARNING, logger="flwr"):
        flwr.propagate, before = True, flwr.propagate
        try:
            flwr.warning("DEPRECATED FEATURE: %s", "The `run_simulation` function is deprecated "
                         "and will be removed")
            flwr.warning("DEPRECATED FEATURE: %s", "some other feature")
        finally:
            flwr.propagate = before
    assert [r.getMessage() for r in caplog.records] == ["DEPRECATED FEATURE: some other feature"]


def test_process_watch_stops_children_and_grandchildren() -> None:
    """Children re-parented after their parent died are still stopped (snapshot first)."""
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(120)']); time.sleep(120)")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        watch = ProcessWatch()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(descendants(os.getpid())) < 2:
            time.sleep(0.05)
        watch.snapshot()
        mine = descendants(os.getpid())
        grandchild = [p for p in mine if p != child.pid]
        assert child.pid in mine and len(grandchild) == 1
        child.kill()  # the grandchild is re-parented: no longer our descendant
        child.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and grandchild[0] in descendants(os.getpid()):
            time.sleep(0.05)
        assert watch.stop(timeout=5.0) == grandchild
        assert _gone(grandchild[0])
        assert stop_processes(watch.known) == []  # nothing left to stop
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def _gone(pid: int, timeout: float = 5.0) -> bool:
    """The process has exited (no /proc entry, or a zombie waiting for its new parent)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "fedagg.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd or ROOT, env=env)


def test_version_is_the_project_version() -> None:
    proc = _cli("--version")
    m = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert m is not None
    version = m.group(1)
    assert proc.returncode == 0 and proc.stdout.strip() == f"fedagg {version}"


def test_viz_schedule_writes_a_page(tmp_path: Path) -> None:
    out = tmp_path / "sched.html"
    proc = _cli("viz", "schedule", "--algorithm", "tree", "--workers", "5", "--size", "4096",
                "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"wrote {out}"
    assert 'id="fedagg-data"' in out.read_text()


def test_viz_and_report_bad_input_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["viz", "schedule", "--workers", "1", "-o", str(tmp_path / "x.html")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"--workers = 1: must be an int in \[2, 64\]\. Fix:", err), err
    assert main(["report", str(tmp_path)]) == 2
    assert "holds no metrics.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["viz", "schedule", "--algorithm", "native", "-o", "x.html"])
    assert exc.value.code == 2


def test_report_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "metrics.json").write_text('[{"round": 0, "accuracy": 0.1, "loss": 2.0}]')
    assert main(["report", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == f"report: {tmp_path / 'report.html'}"
    assert (tmp_path / "report.html").is_file()


def test_server_app_round_logger_logs_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """`flwr run .`: the ServerApp's default on_round logs one INFO line through Flower's logger."""
    from server.app import _round_logger

    flwr = logging.getLogger("flwr")
    before = flwr.propagate
    flwr.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="flwr"):
            _round_logger(3)(REC)
    finally:
        flwr.propagate = before
    (rec,) = [r for r in caplog.records if r.name == "flwr.fedagg"]
    assert rec.levelno == logging.INFO
    assert rec.getMessage() == ("fedagg round 2/3: accuracy 0.5000, loss 1.2500, sites 4/5, "
                                "up 2.000 MB, down 1.000 MB, 0.50 s")
