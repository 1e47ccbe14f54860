"""Headless Chromium for the viz tests (Debian's ``chromium`` + ``chromium-driver``, selenium).

The browser runs with a fresh profile and every network feature off (this machine's network
is closed; the pages must not need one). Console messages are captured through the
``goog:loggingPrefs`` capability; :func:`console_errors` returns the severe ones.

Without Chromium the browser tests are skipped, except under CI (``CI`` set), where that is a
failure: .ci/run installs the browser.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
)


def _find(*names: str) -> str | None:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium per test module (selenium WebDriver)."""
    chromium = _find("chromium", "chromium-browser")
    driver_bin = _find("chromedriver", "chromium-driver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        chromium = None
    if chromium is None or driver_bin is None:
        msg = "needs Debian's chromium + chromium-driver and selenium (the test extra)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    profile = tempfile.mkdtemp(prefix="fedagg-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={profile}")
    opts.add_argument("--window-size=1400,1000")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_bin), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def open_page(driver: Any, path: Path) -> list[dict[str, Any]]:
    """Load ``path``, wait for the page's script to finish; returns the console log so far."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get_log("browser")  # drop what earlier pages logged
    driver.get(path.resolve().as_uri())
    logs: list[dict[str, Any]] = []

    def settled(d: Any) -> bool:
        logs.extend(d.get_log("browser"))
        ready = d.execute_script("return document.body && document.body.dataset.ready === '1'")
        return bool(ready) or bool(console_errors(logs))

    WebDriverWait(driver, 20, poll_frequency=0.05).until(settled)
    logs.extend(driver.get_log("browser"))
    return logs


def console_errors(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The error entries of a console log (uncaught exceptions, console.error, CSP blocks)."""
    return [e for e in logs if e.get("level") in ("SEVERE", "ERROR")]


def full_screenshot(driver: Any, path: Path) -> Path:
    """A screenshot of the whole page (the window grown to the document's height)."""
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    driver.set_window_size(1400, min(max(height + 140, 600), 6000))
    driver.save_screenshot(str(path))
    driver.set_window_size(1400, 1000)
    return path
