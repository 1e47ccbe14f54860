"""What the report says the run was (no browser): model, data, metric names, mode, times."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from _viz_runs import make_run

from fedagg.errors import ConfigError
from fedagg.models import build_model
from fedagg.task import EvalContext, default_evaluate
from fedagg.viz.run_report import (
    builtin_model_matches,
    model_shapes,
    report_data,
    write_run_report,
)


def _builtin_npz(path: Path, name: str = "mlp", shape: tuple[int, int, int] = (1, 8, 8)) -> None:
    net = build_model(name, shape, 10, seed=0)
    np.savez(path / "model.npz", **{k: v.numpy() for k, v in net.state_dict().items()})


def test_the_built_in_model_is_named_only_when_the_run_used_it(tmp_path: Path) -> None:
    make_run(tmp_path)  # config.json names mlp on digits; model.npz is another model
    about = report_data(tmp_path)["about"]
    assert builtin_model_matches(tmp_path, json.loads((tmp_path / "config.json").read_text())) \
        is False
    assert about["model"] == "a model of the user's" and about["own_model"]
    assert about["data"] == "the sites' own" and "mlp" not in about["model"]
    assert about["metric_labels"] == {"accuracy": "score: evaluate_fn's 2nd value",
                                      "loss": "loss: evaluate_fn's 1st value"}
    _builtin_npz(tmp_path)
    about = report_data(tmp_path)["about"]
    assert about["model"] == "mlp" and not about["own_model"]
    assert about["data"] == "digits (iid)" and about["metric_labels"]["accuracy"] == "accuracy"
    assert about["accuracy_bounded"]


def test_a_checkpoint_alone_is_compared_by_shapes(tmp_path: Path) -> None:
    make_run(tmp_path)
    (tmp_path / "model.npz").unlink()
    net = build_model("mlp", (1, 8, 8), 10)
    arrays = {f"a{i}": t.numpy() for i, t in enumerate(net.state_dict().values())}
    np.savez(tmp_path / "checkpoint.npz", meta=np.frombuffer(
        json.dumps({"num_model_arrays": len(arrays)}).encode(), np.uint8), **arrays)
    assert [s for _, s in model_shapes(tmp_path) or []] == [tuple(t.shape) for t in
                                                            net.state_dict().values()]
    assert report_data(tmp_path)["about"]["model"] == "mlp"
    (tmp_path / "checkpoint.npz").unlink()
    about = report_data(tmp_path)["about"]  # nothing to check it by: config, said so
    assert about["model"] == "mlp" and "no model file" in about["model_note"]


def test_what_the_caller_names_wins(tmp_path: Path) -> None:
    make_run(tmp_path)

    class Net(torch.nn.Module):
        pass

    def load_site(site: object) -> None:
        return None

    about = report_data(tmp_path, model=Net, data=load_site,
                        metrics={"loss": "MSE", "accuracy": "R²"})["about"]
    assert about["model"].endswith("Net") and about["data"].endswith("load_site")
    assert about["metric_labels"] == {"accuracy": "R²", "loss": "MSE"}
    assert not about["accuracy_bounded"]  # R² can be negative: no 0..1 axis


def test_the_run_record_can_name_them(tmp_path: Path) -> None:
    records = make_run(tmp_path)
    records[0]["task"] = {"model": "Conv1D", "data": "sequences",
                          "metrics": {"accuracy": "AUC"}}
    (tmp_path / "metrics.json").write_text(json.dumps(records))
    about = report_data(tmp_path)["about"]
    assert (about["model"], about["data"]) == ("Conv1D", "sequences")
    assert about["metric_labels"]["accuracy"] == "AUC"
    records[0]["task"] = {"model": ["not", "a", "name"]}
    (tmp_path / "metrics.json").write_text(json.dumps(records))
    with pytest.raises(ConfigError, match=r"record 0 \(round 0\)\.task\.model = .*must be a name"):
        report_data(tmp_path)


def test_startup_apart_and_wall_time_from_the_files(tmp_path: Path) -> None:
    records = make_run(tmp_path)
    d = report_data(tmp_path)
    assert "seconds_startup" not in d["phases"] and d["time_rounds"] == [1, 2, 3]
    t = d["about"]["time"]
    assert t["startup"] == 13.7
    assert t["rounds_total"] == pytest.approx(sum(r["seconds"] for r in records[1:]))
    # files written 30 s apart: the wall time is that span
    start = os.stat(tmp_path / "config.json").st_mtime
    os.utime(tmp_path / "metrics.json", (start + 30.0, start + 30.0))
    t = report_data(tmp_path)["about"]["time"]
    assert t["wall"] == pytest.approx(30.0) and "config.json" in t["wall_how"]
    # a copied directory (same times): the recorded times, summed, said so
    os.utime(tmp_path / "metrics.json", (start, start))
    t = report_data(tmp_path)["about"]["time"]
    assert t["wall"] == pytest.approx(13.7 + t["rounds_total"]) and "summed" in t["wall_how"]
    # a record that says how long the run has taken wins
    for i, r in enumerate(records):
        r["elapsed"] = 14.0 + 2.5 * i
    (tmp_path / "metrics.json").write_text(json.dumps(records))
    t = report_data(tmp_path)["about"]["time"]
    assert t["wall"] == pytest.approx(14.0 + 7.5) and "elapsed" in t["wall_how"]


def test_asynchronous_records_give_mode_versions_and_staleness(tmp_path: Path) -> None:
    records = make_run(tmp_path)
    for i, r in enumerate(records):
        r.update(mode="fedbuff", version=i, wall_seconds=0.5, time=0.5 * i)
        if i:
            r.update(updates=2, staleness_mean=0.5 * i, staleness_max=i)
    (tmp_path / "metrics.json").write_text(json.dumps(records))
    m = report_data(tmp_path)["about"]["mode"]
    assert m["name"] == "fedbuff" and m["versions"] == 3
    assert m["staleness_mean"] == [0.5, 1.0, 1.5] and m["max_staleness"] == 3
    t = report_data(tmp_path)["about"]["time"]
    assert t["wall"] == pytest.approx(4 * 0.5 + 13.7) and "wall_seconds" in t["wall_how"]


def test_a_regressions_zero_accuracy_is_left_out(tmp_path: Path) -> None:
    records = make_run(tmp_path)
    for r in records[1:]:
        r["federated_eval"] = {"eval_loss": 0.5, "eval_acc": 0.0, "num-examples": 100.0}
    (tmp_path / "metrics.json").write_text(json.dumps(records))
    fed = report_data(tmp_path)["federated"]
    assert set(fed["series"]) == {"eval_loss"} and fed["dropped"] == ["eval_acc"]
    records[2]["federated_eval"]["eval_acc"] = 0.4  # a classifier: kept
    (tmp_path / "metrics.json").write_text(json.dumps(records))
    assert "eval_acc" in report_data(tmp_path)["federated"]["series"]


def test_default_site_evaluation_reports_accuracy_for_classification_only() -> None:
    ctx = EvalContext(config={})
    reg = default_evaluate(torch.nn.functional.mse_loss)(
        torch.nn.Linear(3, 1), [(torch.randn(8, 3), torch.randn(8, 1))], ctx)
    assert set(reg) == {"eval_loss", "num-examples"}
    cls = default_evaluate(torch.nn.functional.cross_entropy)(
        torch.nn.Linear(3, 4), [(torch.randn(8, 3), torch.randint(0, 4, (8,)))], ctx)
    assert set(cls) == {"eval_loss", "eval_acc", "num-examples"} and 0 <= cls["eval_acc"] <= 1


def test_write_run_report_never_fails_the_run(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    assert write_run_report(tmp_path) is None  # no metrics.json: nothing to report
    assert write_run_report(None) is None
    (tmp_path / "metrics.json").write_text("[{]")
    with caplog.at_level(logging.WARNING):
        assert write_run_report(tmp_path) is None
    assert "no report.html" in caplog.text and "not valid JSON" in caplog.text
    make_run(tmp_path)
    assert write_run_report(tmp_path, model="Net") == tmp_path / "report.html"
