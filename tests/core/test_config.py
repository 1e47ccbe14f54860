"""Config: unknown keys, out-of-range values, overrides, the generated reference page."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fedagg.config import RunConfig, apply_overrides, config_hash, load_config, reference_markdown
from fedagg.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_valid() -> None:
    cfg = load_config()
    assert cfg.run.sites == 10 and cfg.data.dataset == "digits" and cfg.data.partitioner == "dirichlet"


def test_unknown_key_names_field_value_rule_and_fix(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text("[train]\nlearning_rate = 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    assert "train.learning_rate" in msg and "0.1" in msg and "not a known setting" in msg and "Fix:" in msg


@pytest.mark.parametrize("override, field", [
    ("run.sites=0", "run.sites"), ("train.lr=-1", "train.lr"), ("data.dirichlet_alpha=0", "data.dirichlet_alpha"),
    ("model.name='vgg'", "model.name"), ("site.workers=0", "site.workers"),
    ("run.min_sites=20", "run.min_sites"), ("secagg.frac_bits=40", "secagg.frac_bits"),
])
def test_out_of_range_values(override: str, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert field.split(".")[-1] in str(e.value) and "Fix:" in str(e.value)


def test_overrides_and_bad_override_syntax() -> None:
    cfg = load_config(None, ["train.lr=0.05", "run.name='x'", "site.overlap=false"])
    assert cfg.train.lr == 0.05 and cfg.run.name == "x" and cfg.site.overlap is False
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        apply_overrides({}, ["trainlr"])
    with pytest.raises(ConfigError, match="section and a field"):
        apply_overrides({}, ["lr=1"])


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[run\nrounds=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_config_hash_ignores_rounds_but_not_lr() -> None:
    a = load_config(None, ["run.rounds=3"])
    assert config_hash(a) == config_hash(load_config(None, ["run.rounds=9"]))
    assert config_hash(a) != config_hash(load_config(None, ["train.lr=0.3"]))


def test_reference_page_in_sync() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page.strip() == reference_markdown().strip(), "regenerate: fedagg config reference > docs/configuration.md"


def test_cli_bad_config_exits_2_without_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "fedagg.cli", "config", "validate", "-c", "run.rounds=0"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "run.rounds" in proc.stderr and "Traceback" not in proc.stderr
    ok = subprocess.run([sys.executable, "-m", "fedagg.cli", "config", "show", "-c", "train.lr=0.5"],
                        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert ok.returncode == 0 and "lr = 0.5" in ok.stdout


def test_pyproject_run_config_is_valid() -> None:
    import tomllib

    from server.app import config_from_run_config

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    cfg = config_from_run_config(data["tool"]["flwr"]["app"]["config"])
    assert isinstance(cfg, RunConfig) and cfg.run.sites == 5


def test_pyproject_declares_every_run_config_key() -> None:
    """Flower refuses `flwr run --run-config` keys that pyproject does not declare."""
    import tomllib

    from fedagg.config import flatten

    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])
    expected = set(flatten(RunConfig().model_dump(mode="json"))) - {"strategy.options"}
    assert declared == expected, f"missing: {expected - declared}; unknown: {declared - expected}"
