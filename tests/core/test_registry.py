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
    with pytest.raises(RegistryError):
        build_strategy(load_config(None, ["strategy.name='fedmagic'"]))


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
