"""See it: self-contained HTML views of fedagg's schedules and runs, and the run console.

Flower-free (core). Every page is one HTML file with inline CSS, JavaScript and SVG and no
network reference, so it opens offline and in a sandboxed docs iframe.

* ``render_schedule_page`` / ``write_schedule_page`` (``fedagg.viz.schedule_page``):
  ``fedagg viz schedule``, the real all-reduce schedules of ``fedagg.collectives.schedule``
  animated step by step, with the cost model's predictions and measured figures;
* ``render_report`` / ``write_report`` / ``report_data`` / ``write_run_report``
  (``fedagg.viz.run_report``): ``fedagg report RUN_DIR``, the per-run report from
  ``metrics.json``, naming the run's own model, data and metrics;
* ``RoundProgress``, ``filter_known_warnings`` (``fedagg.viz.console``): what
  ``fedagg simulate`` shows while it runs, and how it stops on Ctrl-C.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "REPORT_NAME",
    "RoundProgress",
    "filter_known_warnings",
    "render_report",
    "render_schedule_page",
    "report_data",
    "write_report",
    "write_run_report",
    "write_schedule_page",
]

_WHERE = {
    "REPORT_NAME": "run_report",
    "render_report": "run_report",
    "report_data": "run_report",
    "write_report": "run_report",
    "write_run_report": "run_report",
    "render_schedule_page": "schedule_page",
    "write_schedule_page": "schedule_page",
    "RoundProgress": "console",
    "filter_known_warnings": "console",
}


def __getattr__(name: str) -> Any:
    # lazy: ``fedagg report`` need not import torch (the schedule page's cost model does)
    if name in _WHERE:
        return getattr(importlib.import_module(f"fedagg.viz.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
