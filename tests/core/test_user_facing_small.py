"""Small things a user meets: output permissions follow the umask, per-command help, "did you
mean" for typos, and strategies fedagg cannot run refused before anything starts."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedagg._registry import Registry
from fedagg.cli import main
from fedagg.compression import build_compressor
from fedagg.config import load_config
from fedagg.errors import ConfigError, RegistryError
from fedagg.report import atomic_write_bytes, current_umask, write_metrics, write_plot
from fedagg.viz.run_report import write_report


@pytest.fixture
def umask() -> Iterator[object]:
    """Set the umask for one test (restored afterwards)."""
    old = os.umask(0o022)
    os.umask(old)

    def set_mask(mask: int) -> None:
        os.umask(mask)

    yield set_mask
    os.umask(old)


def _perm(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077, 0o027], ids=oct)
def test_outputs_respect_the_umask(tmp_path: Path, umask: object, mask: int) -> None:
    umask(mask)  # type: ignore[operator]
    assert current_umask() == mask
    records = [{"round": 0, "accuracy": 0.1, "loss": 2.0}, {"round": 1, "accuracy": 0.5,
                                                               "loss": 1.0, "bytes_up": 10}]
    write_metrics(tmp_path, records)
    write_plot(tmp_path, records)
    report = write_report(tmp_path)
    for name in ("metrics.json", "metrics.csv", "metrics.png", report.name):
        assert _perm(tmp_path / name) == 0o666 & ~mask, (name, oct(_perm(tmp_path / name)))
    # what the user's own open() would give, for comparison
    (tmp_path / "plain").write_text("x")
    assert _perm(tmp_path / "metrics.json") == _perm(tmp_path / "plain")


def test_explicit_mode_still_wins(tmp_path: Path, umask: object) -> None:
    umask(0o000)  # type: ignore[operator]
    atomic_write_bytes(tmp_path / "key.pem", b"secret", mode=0o600)
    assert _perm(tmp_path / "key.pem") == 0o600
    atomic_write_bytes(tmp_path / "key.pem", b"secret again", mode=0o600)  # a rewrite too
    assert _perm(tmp_path / "key.pem") == 0o600


def test_viz_schedule_help_is_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["viz", "schedule", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fedagg viz schedule "), out[:200]
    for option in ("--algorithm", "--workers", "--size", "--benchmarks", "--out"):
        assert option in out
    with pytest.raises(SystemExit):
        main(["viz", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: fedagg viz ") and "schedule" in out


@pytest.mark.parametrize(("override", "field", "suggestion"), [
    ("train.lrr=0.1", "train.lrr", "train.lr"),
    ("run.round=3", "run.round", "run.rounds"),
    ("asynchronous.buffersize=3", "asynchronous.buffersize", "asynchronous.buffer_size"),
    ("trian.lr=0.1", "trian", "train"),
    ("site.worker=2", "site.worker", "site.workers"),
])
def test_typo_in_a_key_gets_did_you_mean(override: str, field: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    msg = str(exc.value)
    assert msg.startswith(f"{field} = "), msg
    assert f"did you mean {suggestion!r}" in msg and "Fix:" in msg, msg


def test_key_far_from_any_gets_no_guess(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["train.zzzzzz=1"])
    assert "is not a known setting" in str(exc.value) and "did you mean" not in str(exc.value)


def test_typo_in_a_toml_file_gets_did_you_mean(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text("[train]\nlocal_epoch = 2\n")
    with pytest.raises(ConfigError, match=r"did you mean 'train.local_epochs'\?"):
        load_config(tmp_path / "run.toml")


def test_typo_in_a_registered_name_gets_did_you_mean() -> None:
    reg: Registry[int] = Registry("widget")
    reg.register("median", 1)
    reg.register("trimmed-mean", 2)
    with pytest.raises(RegistryError, match=r"is not a known widget \(did you mean 'median'\?\)"):
        reg.get("medain")
    with pytest.raises(ConfigError, match=r"unknown stage 'topkk' \(did you mean 'topk'"):
        build_compressor("topkk:0.1+ef")


@pytest.mark.parametrize("name", ["flwr:FedXgbBagging", "flwr:FedXgbCyclic", "flwr:fedxgbbagging"])
def test_xgboost_strategies_refused_up_front(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, [f"strategy.name={json.dumps(name)}"])
    msg = str(exc.value)
    assert msg.startswith(f"strategy.name = {name!r}: is Flower's FedXgb"), msg
    assert "XGBoost models" in msg and "Fix:" in msg
    assert main(["config", "validate", "-c", f"strategy.name={json.dumps(name)}"]) == 2
    err = capsys.readouterr().err
    assert "XGBoost" in err and "Traceback" not in err


def test_xgboost_strategy_as_inner_of_a_wrapper_refused() -> None:
    with pytest.raises(ConfigError, match="XGBoost models"):
        load_config(None, ['strategy.name="flwr:DifferentialPrivacyServerSideFixedClipping"',
                           'strategy.options.strategy="flwr:FedXgbCyclic"'])
