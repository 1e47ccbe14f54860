"""The run report in headless Chromium: no console error, the plotted values are metrics.json.

One report from a hand-made run directory (every section filled), one from a real 3-round
``fedagg simulate`` on digits (Flower's simulation engine). Screenshots: ``report*.png`` in the
test's tmp dir; with ``FEDAGG_UPDATE_SCREENSHOTS=1`` the real run's is also copied to
``docs/img/report.png`` (the README's picture).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import _viz_browser
import pytest
from _viz_browser import console_errors, full_screenshot, open_page
from _viz_runs import make_run

from fedagg.viz.run_report import write_report

browser = _viz_browser.browser  # the fixture (not in a conftest: tests import the root conftest by name)

ROOT = Path(__file__).resolve().parents[2]


def plotted(driver: Any, chart: str, series: str) -> dict[int, float]:
    """``{round: value}`` of the points / bars the page drew for one series of one chart."""
    pts = driver.execute_script(
        "return [...document.querySelectorAll(`svg[data-chart='${arguments[0]}'] "
        "g[data-series='${arguments[1]}'] .pt`)].map(e => [e.dataset.round, e.dataset.value]);",
        chart, series)
    return {int(r): float(v) for r, v in pts}


def expected(records: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {int(r["round"]): float(r[key]) for r in records if r.get(key) is not None}


def check_plots(driver: Any, records: list[dict[str, Any]]) -> None:
    for chart, key in (("accuracy", "accuracy"), ("loss", "loss"), ("bytes", "bytes_up"),
                       ("bytes", "bytes_down")):
        got, want = plotted(driver, chart, key), expected(records, key)
        assert got == want, (chart, key, got, want)
    # time per round: rounds 1.. only; the engine's start-up (round 0) is shown apart
    assert plotted(driver, "phases", "seconds") == expected(records[1:], "seconds")
    for key, src in (("cum_up", "bytes_up"), ("cum_down", "bytes_down")):
        total, want = 0.0, {}
        for r in records:
            total += float(r.get(src) or 0)
            want[int(r["round"])] = total
        assert plotted(driver, "cumulative", key) == pytest.approx(want)
    phases = sorted({k for r in records for k in r if k.startswith("seconds_")} -
                    {"seconds_startup"})
    assert phases
    for k in phases:
        assert plotted(driver, "phases", k) == expected(records[1:], k), k
    assert plotted(driver, "phases", "seconds_startup") == {}


def heatmap(driver: Any) -> dict[tuple[str, int], tuple[str, str]]:
    cells = driver.execute_script(
        "return [...document.querySelectorAll(\"svg[data-chart='heatmap'] rect.cell\")]"
        ".map(e => [e.dataset.row, e.dataset.round, e.dataset.state, e.querySelector('title').textContent]);")
    return {(row, int(rnd)): (state, title) for row, rnd, state, title in cells}


def test_handmade_run_report(browser: Any, tmp_path: Path) -> None:
    records = make_run(tmp_path / "run")
    page = write_report(tmp_path / "run")
    logs = open_page(browser, page)
    assert console_errors(logs) == [], logs
    check_plots(browser, records)
    cells = heatmap(browser)
    assert cells["node 98765", 1][0] == "rejected"
    assert "update norm 1e9 exceeds max_update_norm 10" in cells["node 98765", 1][1]
    assert cells["site 1", 1][0] == "absent" and cells["site 1", 3][0] == "accepted"
    # intra-site: compute vs exposed communication, both spellings of the keys
    bars = browser.execute_script(
        "return [...document.querySelectorAll(\"svg[data-chart='site-time'] rect\")]"
        ".map(e => [e.dataset.site, e.dataset.series, e.dataset.value]);")
    got = {(s, k): float(v) for s, k, v in bars}
    assert got == {("0", "compute_seconds"): 2.0, ("0", "comm_wait_seconds"): pytest.approx(0.5),
                   ("2", "compute_seconds"): 2.0, ("2", "comm_wait_seconds"): 0.25}
    assert plotted(browser, "secagg", "secagg_dropped") == {1: 1.0, 2: 0.0, 3: 0.0}
    assert json.loads(browser.find_element("id", "config").text)["note"] == "</script><b>x</b>"
    full_screenshot(browser, tmp_path / "report_handmade.png")


@pytest.mark.flower
@pytest.mark.slow
def test_report_of_a_real_simulation(browser: Any, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "fedagg.cli", "simulate", "--run-dir", str(run_dir),
         "-c", "run.rounds=3", "-c", "run.sites=3", "-c", "train.local_epochs=1",
         "-c", "site.workers=2"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    report = run_dir / "report.html"
    assert f"report: {report}" in proc.stdout
    assert "starting Flower's simulation engine ..." in proc.stdout
    assert "DEPRECATED FEATURE" not in out and "Tip: In future versions of Ray" not in out
    for name in ("metrics.json", "metrics.csv", "metrics.png", "model.pt", "model.npz",
                 "config.json", "checkpoint.npz", "report.html"):
        assert (run_dir / name).is_file(), name
        assert f"  {name} " in proc.stdout, f"{name} not listed"
    records = json.loads((run_dir / "metrics.json").read_text())
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    logs = open_page(browser, report)
    assert console_errors(logs) == [], logs
    check_plots(browser, records)
    cells = heatmap(browser)
    for r in records[1:]:
        for sid in r["sites"]:
            assert cells[f"site {sid}", r["round"]][0] == "accepted"
    sites = browser.execute_script(
        "return [...document.querySelectorAll('#site-table tbody tr')].map(e => e.dataset.site);")
    # site_metrics is keyed by node id; the table shows each site by its partition-id label
    assert sorted(sites) == sorted({str(int(m["partition-id"])) for r in records[1:]
                                    for m in r["site_metrics"].values()})
    shot = full_screenshot(browser, tmp_path / "report.png")
    assert shot.stat().st_size > 20_000
    if os.environ.get("FEDAGG_UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(shot, ROOT / "docs" / "img" / "report.png")
