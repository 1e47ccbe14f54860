"""The synthetic large model ('wide', model.params) and the per-round server peak memory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from clients.app import app as client_app
from fedagg.config import load_config
from fedagg.errors import ConfigError
from fedagg.memory import PeakMemory, current_rss, peak_rss, reset_peak
from fedagg.models import WIDE_DEFAULT_PARAMS, build_model, wide_width
from server.inprocess import InProcessGrid
from server.runner import run_server


def _count(model: object) -> int:
    return sum(p.numel() for p in model.parameters())  # type: ignore[attr-defined]


@pytest.mark.parametrize("shape, classes", [((1, 8, 8), 10), ((1, 28, 28), 10), ((3, 4, 4), 3)])
@pytest.mark.parametrize("params", [1, 1000, 123_457, 2_000_000])
def test_wide_has_at_least_the_asked_parameters(shape: tuple[int, int, int], classes: int,
                                                params: int) -> None:
    n = _count(build_model("wide", shape, classes, params=params))
    d = shape[0] * shape[1] * shape[2]
    assert params <= n < max(params, classes) + d + 1 + classes + classes
    assert n == wide_width(shape, classes, params) * (d + 1 + classes) + classes


def test_wide_100m_width_and_default() -> None:
    assert wide_width((1, 8, 8), 10, 100_000_000) == 1_333_334  # 100,000,060 parameters
    assert _count(build_model("wide", (1, 8, 8), 10)) >= WIDE_DEFAULT_PARAMS


def test_params_only_for_the_wide_model() -> None:
    with pytest.raises(ConfigError, match=r"model\.params"):
        build_model("mlp", (1, 8, 8), 10, params=1000)
    with pytest.raises(ConfigError, match=r"model\.params"):
        build_model("wide", (1, 8, 8), 10, params=0)
    with pytest.raises(ConfigError, match=r"model\.params"):
        load_config(None, ["model.params=1000"])
    cfg = load_config(None, ["model.name=wide", "model.params=5000000"])
    assert cfg.model.params == 5_000_000


def test_peak_memory_span_sees_an_allocation() -> None:
    mem = PeakMemory()
    mem.start()
    block = np.ones(25_000_000, np.float32)  # 100 MB, touched
    del block
    span = mem.stop()
    assert span.method in ("vmhwm", "sampled")
    if span.method == "vmhwm":
        assert span.above_start >= 90_000_000
    assert (current_rss() or 0) > 0 and (peak_rss() or 0) > 0
    assert isinstance(reset_peak(), bool)


def test_metrics_json_records_the_server_peak_memory_per_round(tmp_path: Path) -> None:
    cfg = load_config(None, ["run.sites=3", "run.rounds=2", "train.local_epochs=1",
                             "model.name=wide", "model.params=300000",
                             "data.max_train_examples=300"])
    records = run_server(InProcessGrid(client_app, 3, seed=0), cfg, tmp_path)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert [r["round"] for r in saved] == [0, 1, 2]
    for rec in saved[1:]:
        assert rec["model_updated"] is True
        assert rec["server_rss_peak"] >= rec["server_rss_start"] > 0
        assert rec["server_rss_method"] in ("vmhwm", "sampled")
    assert records[1]["server_rss_peak"] == saved[1]["server_rss_peak"]
    with np.load(tmp_path / "model.npz") as model:
        assert sum(model[k].size for k in model.files) >= 300_000
