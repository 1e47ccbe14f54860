"""The schedule page in headless Chromium: no console error, one animation step per schedule step.

Screenshots land in the test's tmp dir (``schedule_all.png``); with
``FEDAGG_UPDATE_SCREENSHOTS=1`` the one of ``--algorithm all`` is also copied to
``docs/img/schedule_animation.png`` (the README's picture).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import _viz_browser
import pytest
from _viz_browser import console_errors, full_screenshot, open_page

from fedagg.collectives.schedule import get_schedule
from fedagg.viz.schedule_page import write_schedule_page

browser = _viz_browser.browser  # the fixture (not in a conftest: tests import the root conftest by name)

ROOT = Path(__file__).resolve().parents[2]
NBYTES = 1 << 20


def _panels(driver: Any) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, ".panel.sched"))


def _full_cells(driver: Any, panel: Any) -> tuple[int, int]:
    """(green chunk bars, all chunk bars) of a panel once its animation settled."""
    return tuple(driver.execute_script(  # type: ignore[return-value]
        "const rs = [...arguments[0].querySelectorAll('svg g rect[fill]')]"
        ".filter(r => ['#2b8a3e', '#f59f00'].includes(r.getAttribute('fill')));"
        "return [rs.filter(r => r.getAttribute('fill') === '#2b8a3e').length, rs.length];", panel))


@pytest.mark.parametrize("alg", ["ring", "tree", "hierarchical"])
def test_animation_steps_equal_schedule_steps(browser: Any, tmp_path: Path, alg: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    for n in range(2, 10):
        page = write_schedule_page(tmp_path / f"{alg}{n}.html", alg, n, NBYTES)
        logs = open_page(browser, page)
        assert console_errors(logs) == [], (alg, n, logs)
        expected = len(get_schedule(alg, n, NBYTES // 4).steps)
        (panel,) = _panels(browser)
        assert panel.get_attribute("data-algorithm") == alg
        assert int(panel.get_attribute("data-steps")) == expected, (alg, n)
        step = panel.find_element(By.CSS_SELECTOR, '[data-action="step"]')
        clicks = 0
        while panel.get_attribute("data-done") != "1":
            step.click()
            clicks += 1
            assert int(panel.get_attribute("data-current")) == clicks
            assert clicks <= expected, f"{alg} N={n}: more than {expected} steps"
        assert clicks == expected, (alg, n)
        step.click()  # past the end: stays at the last step
        assert int(panel.get_attribute("data-current")) == expected
        # the page's own replay ends with every copy of every chunk holding all N inputs
        WebDriverWait(browser, 5).until(lambda d, p=panel: len(set(_full_cells(d, p))) == 1)
        green, total = _full_cells(browser, panel)
        assert green == total == n * len(get_schedule(alg, n, NBYTES // 4).chunks)
        panel.find_element(By.CSS_SELECTOR, '[data-action="back"]').click()
        assert int(panel.get_attribute("data-current")) == expected - 1
        panel.find_element(By.CSS_SELECTOR, '[data-action="reset"]').click()
        assert int(panel.get_attribute("data-current")) == 0
        assert console_errors(browser.get_log("browser")) == []
    full_screenshot(browser, tmp_path / f"schedule_{alg}9.png")


def test_all_page_plays_three_panels_side_by_side(browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    bench = ROOT / "docs" / "benchmarks.md"
    page = write_schedule_page(tmp_path / "all.html", "all", 4, NBYTES,
                               benchmarks=bench if bench.is_file() else None)
    logs = open_page(browser, page)
    assert console_errors(logs) == [], logs
    panels = _panels(browser)
    assert [p.get_attribute("data-algorithm") for p in panels] == ["ring", "tree", "ps"]
    assert [int(p.get_attribute("data-steps")) for p in panels] == [
        len(get_schedule("ring", 4, NBYTES // 4).steps),
        len(get_schedule("tree", 4, NBYTES // 4).steps), 2]
    tops = [p.location["y"] for p in panels]
    assert max(tops) - min(tops) < 5, "panels side by side"
    rows = browser.find_elements(By.CSS_SELECTOR, "#cost tbody tr")
    assert [r.get_attribute("data-algorithm") for r in rows] == ["ring", "tree", "hierarchical", "ps"]
    # play all: every panel runs to its end on its own timer
    browser.find_element(By.CSS_SELECTOR, '[data-action="play-all"]').click()
    WebDriverWait(browser, 30).until(
        lambda d: all(p.get_attribute("data-done") == "1" for p in _panels(d)))
    browser.find_element(By.CSS_SELECTOR, '[data-action="reset-all"]').click()
    assert [p.get_attribute("data-current") for p in _panels(browser)] == ["0", "0", "0"]
    for _ in range(2):
        browser.find_element(By.CSS_SELECTOR, '[data-action="step-all"]').click()
    WebDriverWait(browser, 5).until(lambda d: not d.execute_script(
        "return document.querySelectorAll('svg circle').length"))  # moving chunks arrived
    assert console_errors(browser.get_log("browser")) == []
    shot = full_screenshot(browser, tmp_path / "schedule_all.png")
    assert shot.stat().st_size > 10_000
    if os.environ.get("FEDAGG_UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(shot, ROOT / "docs" / "img" / "schedule_animation.png")
