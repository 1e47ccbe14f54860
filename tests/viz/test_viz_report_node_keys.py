"""The report reads site records keyed by node id (the id the transport authenticates), each
labelled with its site's partition id, and rounds whose accepted sites include -1 (a secure
round's one aggregate, or a label withheld because two nodes claimed it)."""

from __future__ import annotations

import json
from pathlib import Path

from fedagg.viz.run_report import render_report, report_data


def _write(run: Path, records: list[dict[str, object]]) -> None:
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps(records))
    (run / "config.json").write_text(json.dumps({"run": {"sites": 2, "rounds": 1}}))


def test_site_metrics_keyed_by_node_id_are_shown_under_their_partition(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write(run, [{"round": 0, "accuracy": 0.1, "loss": 2.0},
                 {"round": 1, "accuracy": 0.5, "loss": 1.0, "sites": [0, 1],
                  "site_metrics": {"8123456789": {"partition-id": 0, "num-examples": 30.0},
                                   "9123456789": {"partition-id": 1, "num-examples": 40.0}}}])
    data = report_data(run)
    rows = data["heatmap"]["rows"]
    assert "site 0" in rows and "site 1" in rows
    assert not any("8123456789" in r for r in rows)
    assert {s["site"] for s in data["sites"]} == {"0", "1"}


def test_a_round_with_an_unknown_site_label_is_reported(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write(run, [{"round": 0, "accuracy": 0.1, "loss": 2.0},
                 {"round": 1, "accuracy": 0.5, "loss": 1.0, "sites": [-1],
                  "secagg_counted": 2}])
    assert "fedagg report" in render_report(run)
