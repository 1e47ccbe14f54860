"""Strategy registry: built-ins, unknown names list known ones, real entry-point plugins."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from fedagg._registry import Registry
from fedagg.config import load_config
from fedagg.errors import ConfigError, RegistryError
from strategies import STRATEGIES, FedAvg, build_strategy


def test_builtin_and_unknown_name_lists_known() -> None:
    assert STRATEGIES.get("fedavg") is FedAvg
    with pytest.raises(RegistryError) as e:
        STRATEGIES.get("fedmagic")
    assert "fedmagic" in str(e.value) and "fedavg" in str(e.value)
    with pytest.raises(ConfigError) as e:  # named before any engine starts, known ones listed
        build_strategy(load_config(None, ["strategy.name='fedmagic'"]))
    assert "fedmagic" in str(e.value) and "fedavg" in str(e.value) and "flwr:FedAdam" in str(e.value)


def test_duplicate_registration_refused() -> None:
    reg: Registry[int] = Registry("thing")
    reg.register("a", 1)
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("A", 2)


def test_entry_point_plugin_from_real_dist_info(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "median_plugin.py"
    pkg.write_text(textwrap.dedent('''
        from pydantic import BaseModel, ConfigDict
        from strategies import FedAvg

        class MedianConfig(BaseModel):
            model_config = ConfigDict(extra="forbid")
            trim: float = 0.1

        class MedianStrategy(FedAvg):
            Config = MedianConfig

            @classmethod
            def from_config(cls, options, cfg):
                s = cls(seed=cfg.run.seed)
                s.trim = options.trim
                return s
    '''))
    dist = tmp_path / "median_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: median-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fedagg.strategies]\nmedian = median_plugin:MedianStrategy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry[object] = Registry("strategy", group="fedagg.strategies")
    reg.discover()
    assert "median" in reg.names()
    assert "median-plugin" in reg.origin("median")
    STRATEGIES.discover(force=True)
    strat = build_strategy(load_config(None, ["strategy.name='median'", "strategy.options.trim=0.2"]))
    assert type(strat).__name__ == "MedianStrategy" and strat.trim == 0.2  # type: ignore[attr-defined]
    with pytest.raises(ConfigError) as e:
        build_strategy(load_config(None, ["strategy.name='median'", "strategy.options.trimm=0.2"]))
    assert "strategy.options.trimm" in str(e.value)
    sys.modules.pop("median_plugin", None)


def test_options_for_strategy_without_config_refused() -> None:
    with pytest.raises(ConfigError, match="takes no options"):
        build_strategy(load_config(None, ["strategy.options.x=1"]))


def test_plugins_doc_example_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worked example of docs/plugins.md, installed as a real distribution, aggregates."""
    import re

    import numpy as np
    from conftest import train_reply
    from flwr.app import ConfigRecord

    from strategies.wire import arrays_to_record, record_to_arrays

    doc = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
    code = re.search(r"```python\n# fedagg_trimmed/strategy.py\n(.*?)```", doc, re.S)
    assert code is not None
    pkg = tmp_path / "fedagg_trimmed"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "strategy.py").write_text(code.group(1))
    dist = tmp_path / "fedagg_trimmed-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fedagg-trimmed\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(
        "[fedagg.strategies]\ntrimmed-mean = fedagg_trimmed.strategy:TrimmedMean\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    STRATEGIES.discover(force=True)
    strat = build_strategy(load_config(None, ["strategy.name='trimmed-mean'", "strategy.options.beta=0.2"]))

    class _Grid:
        def get_node_ids(self) -> list[int]:
            return [1, 2, 3, 4, 5]

    strat.configure_train(1, arrays_to_record([np.zeros(2, np.float32)]), ConfigRecord(), _Grid())  # type: ignore[arg-type]
    vals = [1.0, 2.0, 3.0, 4.0, 100.0]
    out, _ = strat.aggregate_train(1, [train_reply(i + 1, [np.full(2, v, np.float32)], 1) for i, v in enumerate(vals)])
    assert out is not None
    np.testing.assert_allclose(record_to_arrays(out)[1][0], [3.0, 3.0])  # 1 and 100 trimmed
    with pytest.raises(ConfigError, match=r"strategy\.options\.beta"):
        build_strategy(load_config(None, ["strategy.name='trimmed-mean'", "strategy.options.beta=0.7"]))
    for mod in [m for m in sys.modules if m.startswith("fedagg_trimmed")]:
        sys.modules.pop(mod)
