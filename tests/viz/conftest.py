"""Fixtures of the viz tests: one headless Chromium per module (see _viz_browser.py)."""

from __future__ import annotations

from _viz_browser import browser

__all__ = ["browser"]
