"""The report of a user's own run, in headless Chromium: a regression Task and a FedBuff run.

Both runs are real (fedagg's server loop and ClientApp on an in-process grid, a few seconds;
tests/viz/_viz_task_runs.py). The page must describe *that* run: the user's model and data
(never the built-in ones of the config it did not use), the metrics under the names the user
gave (R² and MSE are not "accuracy"; the sites' evaluation has no accuracy at all), the mode
with its versions and staleness for FedBuff, the wall time, and the engine start-up apart
from the round times.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _viz_browser
import pytest
from _viz_browser import console_errors, full_screenshot, open_page
from _viz_task_runs import Regressor, fedbuff_run, regression_run, site_data
from test_viz_report_browser import check_plots, plotted

from fedagg.viz.run_report import write_report

browser = _viz_browser.browser  # the fixture


def _text(driver: Any, element_id: str) -> str:
    return str(driver.find_element("id", element_id).text)


def _summary(driver: Any) -> dict[str, str]:
    items = driver.execute_script(
        "return [...document.querySelectorAll('#summary > div')].map(e => "
        "[e.dataset.key, e.querySelector('b').textContent, e.title]);")
    return {k: v for k, v, _ in items}


def _chart_titles(driver: Any) -> list[str]:
    return list(driver.execute_script(
        "return [...document.querySelectorAll('.chart h3')].map(e => e.textContent);"))


@pytest.fixture(scope="module")
def regression(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    run_dir = tmp_path_factory.mktemp("regression")
    return run_dir, regression_run(run_dir)


def test_regression_report_names_the_users_model_data_and_metrics(
        browser: Any, regression: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    run_dir, records = regression
    page = write_report(run_dir, tmp_path / "named.html", model=Regressor, data=site_data,
                        metrics={"loss": "MSE", "accuracy": "R²"})
    logs = open_page(browser, page)
    assert console_errors(logs) == [], logs
    subtitle = _text(browser, "subtitle")
    assert "model Regressor (5 parameters in 2 tensors)" in subtitle, subtitle
    assert "data site_data" in subtitle and "synchronous rounds" in subtitle, subtitle
    assert "mlp" not in subtitle and "digits" not in subtitle, subtitle
    titles = _chart_titles(browser)
    assert "R² (central evaluation)" in titles and "MSE (central evaluation)" in titles, titles
    assert not any("ccuracy" in t for t in titles), titles
    summary = _summary(browser)
    assert float(summary["final R²"]) == pytest.approx(records[-1]["accuracy"], abs=1e-4)
    assert float(summary["final MSE"]) == pytest.approx(records[-1]["loss"], abs=1e-4)
    assert records[-1]["accuracy"] > 0.9  # it learnt the linear law
    check_plots(browser, records)  # the R² and MSE points are metrics.json's values
    # the sites' own evaluation, under the names they report: a loss, no accuracy
    fed = {k for r in records[1:] for k in r.get("federated_eval", {})}
    assert "eval_loss" in fed and "eval_acc" not in fed, fed
    assert plotted(browser, "federated", "eval_loss") == {
        r["round"]: r["federated_eval"]["eval_loss"] for r in records[1:]}
    assert plotted(browser, "federated", "eval_acc") == {}
    assert "accuracy" not in _text(browser, "federated-box").lower()
    assert not browser.find_element("id", "async-box").is_displayed()
    full_screenshot(browser, tmp_path / "report_regression.png")


def test_unnamed_regression_report_says_what_it_cannot_know(
        browser: Any, regression: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    run_dir, _ = regression
    logs = open_page(browser, write_report(run_dir, tmp_path / "plain.html"))
    assert console_errors(logs) == [], logs
    subtitle = _text(browser, "subtitle")
    assert "model a model of the user's (5 parameters in 2 tensors)" in subtitle, subtitle
    assert "data the sites' own" in subtitle, subtitle
    assert "mlp" not in subtitle and "digits" not in subtitle, subtitle  # config.json's defaults
    assert "not those of the built-in 'mlp'" in _text(browser, "provenance")
    titles = _chart_titles(browser)
    assert "Score: evaluate_fn's 2nd value (central evaluation)" in titles, titles
    assert not any(t.startswith("Accuracy") for t in titles), titles


def test_fedbuff_report_shows_mode_versions_staleness_and_times(browser: Any,
                                                                 tmp_path: Path) -> None:
    run_dir = tmp_path / "fedbuff"
    records = fedbuff_run(run_dir)
    logs = open_page(browser, write_report(run_dir))
    assert console_errors(logs) == [], logs
    subtitle = _text(browser, "subtitle")
    assert "FedBuff: buffer of 2 updates, 3 sites training at a time" in subtitle, subtitle
    assert "model mlp (17,226 parameters in 6 tensors)" in subtitle, subtitle  # built-in: used
    assert "data digits (dirichlet, alpha 0.5)" in subtitle, subtitle
    summary = _summary(browser)
    assert summary["mode"] == "FedBuff"
    versions = [r["version"] for r in records[1:]]
    assert summary["records / model versions"] == f"{len(records) - 1} / {max(versions)}"
    stale = [r["staleness_mean"] for r in records[1:]]
    assert summary["staleness mean / max"].startswith(f"{sum(stale) / len(stale):.2f} / ")
    wall = sum(r.get("wall_seconds", 0.0) for r in records)  # round 0 has none
    assert float(summary["wall time"].split()[0]) == pytest.approx(wall, abs=0.06)
    assert browser.find_element("id", "async-box").is_displayed()
    assert plotted(browser, "staleness", "staleness_mean") == {
        r["round"]: r["staleness_mean"] for r in records[1:]}
    assert plotted(browser, "staleness", "updates") == {r["round"]: r["updates"] for r in records[1:]}
    assert plotted(browser, "versions", "version") == {r["round"]: r["version"] for r in records[1:]}
    check_plots(browser, records)
    full_screenshot(browser, tmp_path / "report_fedbuff.png")


def test_startup_is_shown_apart_from_the_rounds(browser: Any, tmp_path: Path) -> None:
    run_dir = tmp_path / "fedbuff"
    records = fedbuff_run(run_dir)
    records[0]["seconds_startup"] = 13.7  # as the simulation engine's warm-up records it
    (run_dir / "metrics.json").write_text(json.dumps(records))
    logs = open_page(browser, write_report(run_dir))
    assert console_errors(logs) == [], logs
    assert _summary(browser)["engine start-up"] == "13.7 s"
    assert "start-up (13.7 s, before round 1) is not a round" in _text(browser, "time-note")
    assert plotted(browser, "phases", "seconds_startup") == {}
    assert 0 not in plotted(browser, "phases", "seconds")  # the chart starts at round 1
