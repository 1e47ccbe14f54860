"""The examples run as written (examples/README.md), on Flower's simulation engine."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.flower
@pytest.mark.slow
def test_quickstart_pytorch_example(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    from flwr.simulation import run_simulation

    monkeypatch.syspath_prepend(str(ROOT / "examples" / "quickstart-pytorch"))
    pkg = importlib.import_module("fedagg_quickstart")
    client = importlib.import_module("fedagg_quickstart.client_app")
    server = importlib.import_module("fedagg_quickstart.server_app")
    cloudpickle.register_pickle_by_value(pkg)  # Ray's actors get the example by value
    run_simulation(server_app=server.app, client_app=client.app, num_supernodes=3,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"log_to_driver": False}})
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "federated accuracy" in ln)
    assert float(line.rsplit(" ", 1)[1]) > 0.2, out[-2000:]  # 10 classes: chance is 0.1


@pytest.mark.flower
@pytest.mark.slow
def test_digits_example_is_fedagg_simulates_default_through_the_public_api() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "digits" / "simulate.py"),
                           "-c", "run.rounds=2", "-c", "run.sites=3", "-c", "site.workers=2"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    accs = [float(ln.rsplit(" ", 1)[1]) for ln in proc.stdout.splitlines()
            if ln.startswith("round ")]
    assert len(accs) == 3 and accs[-1] > accs[0] + 0.2, proc.stdout
