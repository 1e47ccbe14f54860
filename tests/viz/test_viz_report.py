"""``fedagg report``: what the page plots, read from a run directory (no browser here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _viz_runs import PARAMS, make_run

from fedagg.errors import ConfigError
from fedagg.viz.run_report import count_parameters, render_report, report_data, write_report


def test_series_equal_metrics_json(tmp_path: Path) -> None:
    records = make_run(tmp_path)
    d = report_data(tmp_path)
    assert d["rounds"] == [0, 1, 2, 3]
    assert d["accuracy"] == [r["accuracy"] for r in records]
    assert d["loss"] == [r["loss"] for r in records]
    # times per round from round 1 (round 0 is the untrained model, not a round)
    assert d["time_rounds"] == [1, 2, 3]
    assert d["seconds"] == [r["seconds"] for r in records[1:]]
    assert d["phases"]["seconds_train"] == [3.0, 1.0, 0.75]
    t = d["traffic"]
    assert t["bytes_up"] == [0, 2100, 2800, 2800] and t["cum_up"] == [0, 2100, 4900, 7700]
    assert t["cum_down"] == [0, 12300, 24600, 36900]


def test_ratio_against_dense_fp32(tmp_path: Path) -> None:
    make_run(tmp_path)
    assert count_parameters(tmp_path) == PARAMS
    t = report_data(tmp_path)["traffic"]
    dense = PARAMS * 4
    assert t["dense_bytes_per_message"] == dense
    assert t["dense_up"] == [0, 3 * dense, 2 * dense, 3 * dense]  # per replying site
    assert t["ratio_up"][1] == pytest.approx(2100 / (3 * dense))
    assert t["ratio_down"][2] == pytest.approx(12300 / (3 * dense))  # per sampled site
    assert t["ratio_up_total"] == pytest.approx(7700 / (8 * dense))
    (tmp_path / "model.npz").unlink()
    assert report_data(tmp_path)["traffic"]["ratio_up"] is None


def test_heatmap_participation_and_rejections(tmp_path: Path) -> None:
    make_run(tmp_path)
    hm = report_data(tmp_path)["heatmap"]
    assert hm["rows"] == ["site 0", "site 1", "site 2", "node 98765"]
    assert hm["rounds"] == [1, 2, 3]
    cell = {(c["row"], c["round"]): c for c in hm["cells"]}
    assert cell["site 1", 1]["state"] == "absent" and cell["site 2", 1]["state"] == "accepted"
    assert cell["site 2", 2]["state"] == "absent" and cell["site 1", 3]["state"] == "accepted"
    assert cell["node 98765", 1]["state"] == "rejected"
    assert "exceeds max_update_norm" in cell["node 98765", 1]["title"]
    assert cell["node 98765", 2]["state"] == "none"
    assert "failed 1" in cell["site 2", 2]["title"]
    assert hm["sampled"] == [3, 3, 3] and hm["failed"] == [0, 1, 0] and hm["rejected"] == [1, 0, 0]


def test_site_metrics_in_both_key_spellings(tmp_path: Path) -> None:
    make_run(tmp_path)
    sites = {s["site"]: s for s in report_data(tmp_path)["sites"]}
    assert set(sites) == {"0", "2"}
    s0, s2 = sites["0"], sites["2"]
    assert s0["rounds"] == 2 and s0["workers"] == 2
    assert s0["compute_seconds"] == 2.0 and s0["comm_wait_seconds"] == pytest.approx(0.5)
    assert s0["bytes_allreduced"] == 8.0e6 and s0["num_examples"] == 200
    assert s2["compute_seconds"] == 2.0 and s2["comm_wait_seconds"] == 0.25  # underscores
    # bus bandwidth = bytes / time in all-reduce x 2 (K-1) / K
    assert s2["busbw_gb_s"] == pytest.approx(8.0e6 / 1.0 * 2 * 3 / 4 / 1e9)
    # the all-reduce algorithms that ran (flags set to 1), and S(K) ~ compute / (compute +
    # exposed comm); no algorithm and no estimate without the flags / with one worker
    assert s0["algorithms"] == ["native", "ring"] and s2["algorithms"] == []
    assert s0["scaling_est"] == pytest.approx(2.0 / 2.5)


def test_secagg_dropouts(tmp_path: Path) -> None:
    make_run(tmp_path)
    sa = report_data(tmp_path)["secagg"]
    assert sa["keys"] == ["secagg_counted", "secagg_dropped"]
    assert sa["values"]["secagg_dropped"] == [1, 0, 0]
    assert sa["values"]["secagg_counted"] == [2, 2, 3]


def test_page_embeds_the_data_safely(tmp_path: Path) -> None:
    make_run(tmp_path)
    text = render_report(tmp_path)
    assert "</script><b>" not in text  # the config's string cannot end the data element
    m = re.search(r'<script type="application/json" id="fedagg-data">(.*?)</script>', text, re.S)
    assert m is not None
    assert json.loads(m.group(1))["config"]["note"] == "</script><b>x</b>"
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
    out = write_report(tmp_path)
    assert out == tmp_path / "report.html" and out.read_text() == text


def test_missing_or_bad_metrics_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"holds no metrics\.json"):
        report_data(tmp_path)
    (tmp_path / "metrics.json").write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        report_data(tmp_path)
    (tmp_path / "metrics.json").write_text('{"round": 1}')
    with pytest.raises(ConfigError, match="list of per-round records"):
        report_data(tmp_path)


def test_nan_loss_is_a_gap_not_invalid_json(tmp_path: Path) -> None:
    records = make_run(tmp_path)
    records[3]["loss"] = float("nan")
    (tmp_path / "metrics.json").write_text(json.dumps(records))
    text = render_report(tmp_path)
    m = re.search(r'id="fedagg-data">(.*?)</script>', text, re.S)
    assert m is not None and json.loads(m.group(1))["loss"][3] is None
