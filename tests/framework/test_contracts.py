"""Contracts of the redesign: layers, wire versions, loud failures, checks before any engine.

* ``clients/`` imports nothing private from ``strategies/``; the core never imports Flower;
  the wrappers have no ``NotImplementedError`` left for Flower's own round loop.
* The wire changed (secure stages are train messages; the instruction carries a version): a
  fedagg 0.1 message is refused with a message that names both versions.
* A run in which no round aggregated anything fails loudly (``RunFailed``, exit 1) with each
  round's reasons; bad strategy names and options fail before any engine starts (exit 2).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from clients import make_client_app
from fedagg.config import load_config
from fedagg.errors import ProtocolError, RunFailed
from fedagg.secagg import SecAggParams
from server.inprocess import InProcessGrid
from server.runner import run_server
from strategies.wire import SECAGG_WIRE, Instruction, params_from_record, params_to_record

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


def test_clients_import_nothing_private_from_strategies() -> None:
    bad = []
    for path in sorted((ROOT / "clients").glob("*.py")):
        for module, names in _imports(path):
            if not module.startswith("strategies"):
                continue
            if any(part.startswith("_") for part in module.split(".")) or any(
                    n.startswith("_") for n in names):
                bad.append(f"{path.name}: from {module} import {names}")
    assert bad == []


def test_core_never_imports_flower_and_wrappers_have_no_unimplemented_paths() -> None:
    for path in sorted((ROOT / "fedagg").rglob("*.py")):
        if path.name == "cli.py":
            continue
        assert not [m for m, _ in _imports(path) if m.split(".")[0] == "flwr"], path
    for name in ("secure.py", "compressed.py", "wrapper.py"):
        assert "NotImplementedError" not in (ROOT / "strategies" / name).read_text()


def test_fedagg_0_1_wire_is_refused_with_both_versions_named() -> None:
    old_instruction = ConfigRecord({"up": "topk:0.1", "down": "none", "down-encoded": [],
                                    "run-seed": 0, "server-round": 1, "previous-round": -1,
                                    "namespace": ""})
    with pytest.raises(ProtocolError, match=r"wire = 1.*version 2"):
        Instruction.from_record(old_instruction)
    old_params = params_to_record(SecAggParams(threshold=2), 0)
    old_params["wire"] = 1
    with pytest.raises(ProtocolError, match=rf"wire = 1.*version {SECAGG_WIRE}"):
        params_from_record(old_params)
    # a 0.1 server's setup message (query.secagg_advertise) gets a clear error reply
    grid = InProcessGrid(make_client_app(), 1)
    msg = Message(RecordDict({"config": ConfigRecord({})}), grid.node_ids[0],
                  "query.secagg_advertise")
    reply = next(iter(grid.send_and_receive([msg])))
    assert reply.has_error() and "version 1" in reply.error.reason
    assert f"speaks version {SECAGG_WIRE}" in reply.error.reason


def test_a_run_that_aggregates_nothing_fails_loudly_with_each_rounds_reasons(
        tmp_path: Path) -> None:
    def broken(msg: Message, ctx: Context) -> Message:
        raise RuntimeError("the site's disk is full")

    cfg = load_config(None, ["run.sites=2", "run.rounds=2"])
    with pytest.raises(RunFailed) as info:
        run_server(InProcessGrid(broken, 2), cfg, tmp_path)
    text = str(info.value)
    assert "round 1: nothing aggregated (0 of 2 sites replied)" in text
    assert "disk is full" in text and "round 2" in text
    records = json.loads((tmp_path / "metrics.json").read_text())
    assert [r["model_updated"] for r in records[1:]] == [False, False]
    assert all("disk is full" in r["summary"] for r in records[1:])
    assert len(info.value.records) == 3


BAD_RUNS = [
    ("strategy.name=fedmagic", ["fedmagic", "known:", "fedavg", "flwr:FedAdam"]),
    ("strategy.name=flwr:FedAdamm", ["FedAdamm", "flwr:FedAdam"]),
    ("strategy.options.etaa=1", ["strategy.options", "takes no options"]),
    ("run.sites=500", ["run.sites = 500", "at most 143 sites"]),
]


@pytest.mark.parametrize(("override", "words"), BAD_RUNS)
def test_bad_names_and_options_are_refused_by_the_cli(override: str, words: list[str],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from fedagg.cli import main

    for args in (["config", "validate"], ["simulate", "--quiet"]):
        assert main([*args, "-c", override]) == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words), err[-500:]
        assert "Traceback" not in err


@pytest.mark.slow  # two fresh interpreters per case (torch, Flower): 15-30 s each on 2 cores
@pytest.mark.parametrize(("override", "words"), BAD_RUNS)
def test_bad_names_and_options_fail_before_any_engine(override: str, words: list[str]) -> None:
    for command in ("config", "simulate"):
        args = ["config", "validate"] if command == "config" else ["simulate", "--quiet"]
        proc = subprocess.run([sys.executable, "-m", "fedagg.cli", *args, "-c", override],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2, proc.stderr[-500:]
        assert all(w in proc.stderr for w in words), proc.stderr[-500:]
        assert "Traceback" not in proc.stderr and "ray" not in proc.stderr.lower()


@pytest.mark.slow  # two fresh interpreters (torch, Flower)
def test_flower_strategy_options_are_checked_against_the_signature() -> None:
    proc = subprocess.run([sys.executable, "-m", "fedagg.cli", "config", "validate", "-c",
                           "strategy.name=flwr:FedAdam", "-c", "strategy.options.etaa=0.1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "etaa" in proc.stderr and "eta_l" in proc.stderr
    ok = subprocess.run([sys.executable, "-m", "fedagg.cli", "config", "validate", "-c",
                         "strategy.name=flwr:FedAdam", "-c", "strategy.options.eta=0.1"],
                        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr[-500:]
    assert "fraction_evaluate is set to 0.0" not in ok.stderr


def _docs_trimmed_mean() -> type:
    """The worked plugin example of docs/plugins.md, as the page shows it."""
    import re as _re

    text = (ROOT / "docs" / "plugins.md").read_text()
    code = next(b for b in _re.findall(r"```python\n(.*?)```", text, _re.S)
                if "class TrimmedMean" in b)
    namespace: dict[str, object] = {}
    exec(compile(code, "docs/plugins.md", "exec"), namespace)  # our own docs
    return namespace["TrimmedMean"]  # type: ignore[return-value]


def test_the_docs_plugin_takes_compressed_updates_and_secure_refuses_it() -> None:
    import numpy as np

    from fedagg.builtin import builtin_task
    from fedagg.errors import ConfigError
    from fedagg.task import get_weights
    from server.runner import client_config
    from strategies import Compressed, SecureAggregation
    from strategies.wire import arrays_to_record, record_to_arrays

    trimmed_cls = _docs_trimmed_mean()
    inner = trimmed_cls(min_available_nodes=3, fraction_evaluate=0.0)
    inner.beta = 0.34  # 3 sites: trim one at each end, i.e. the coordinate-wise median
    strategy = Compressed(inner, up="topk:0.2")
    cfg = load_config(None, ["run.sites=3", "train.local_epochs=1",
                             "data.max_train_examples=300"])
    model = builtin_task(cfg).model()
    keys, w0 = list(model.state_dict()), get_weights(model)
    grid = InProcessGrid(make_client_app(), 3, seed=5)
    msgs = list(strategy.configure_train(1, arrays_to_record(w0, keys), client_config(cfg), grid))
    replies = list(grid.send_and_receive(msgs))
    decoded = [strategy.codec.decode(r).tensors for r in replies]
    out, _ = strategy.aggregate_train(1, replies)
    assert out is not None and strategy.report.refused == {}
    for j, got in enumerate(record_to_arrays(out)[1]):
        median = np.median(np.stack([w0[j] + d[j] for d in decoded]), axis=0)
        np.testing.assert_allclose(got, median, rtol=1e-6, atol=1e-7)
    with pytest.raises(ConfigError, match="overrides the aggregation"):
        SecureAggregation(trimmed_cls())


def test_the_serverapp_raises_when_nothing_was_aggregated(tmp_path: Path) -> None:
    """So ``flwr run`` reports a failed run (Flower marks a run whose ServerApp raised)."""
    from server.app import make_app

    def broken(msg: Message, ctx: Context) -> Message:
        raise RuntimeError("no data at this site")

    cfg = load_config(None, ["run.sites=2", "run.rounds=1", "run.wait_for_sites=0"])
    app = make_app(cfg, tmp_path)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(RunFailed, match="no data at this site"):
        app(InProcessGrid(broken, 2), context)


def test_fedavg_waits_for_min_available_nodes_like_flower() -> None:
    import time

    from strategies import FedAvg

    class Growing:
        def __init__(self) -> None:
            self.calls = 0

        def get_node_ids(self) -> list[int]:
            self.calls += 1
            return [1, 2, 3] if self.calls > 2 else [1]

    s = FedAvg(min_available_nodes=3, wait_timeout=30)
    t0 = time.monotonic()
    assert s.sample(Growing(), 1, 1.0, 2) == [1, 2, 3]  # type: ignore[arg-type]
    assert time.monotonic() - t0 >= 1.5  # it waited (polls every second)
    impatient = FedAvg(min_available_nodes=3, wait_timeout=0)
    assert impatient.sample(Growing(), 1, 1.0, 1) == [1]  # type: ignore[arg-type]


def test_identifiers_are_not_averaged_and_old_metric_names_are_aliases() -> None:
    from flwr.app import MetricRecord

    from strategies.metrics import site_metrics_mean

    contents = [RecordDict({"metrics": MetricRecord(m)}) for m in (
        {"train-loss": 1.0, "partition-id": 0, "server-round": 3, "num-examples": 10,
         "odd": [1, 2], "acc": [0.5, 1.0]},
        {"train_loss": 3.0, "partition-id": 1, "server-round": 3, "num-examples": 30,
         "odd": 4.0, "acc": [1.0, 0.0]})]
    out = site_metrics_mean(contents, "num-examples")
    # 'odd' is a list at one site: dropped this round; lists are averaged element by element
    assert dict(out) == {"train_loss": 2.5, "acc": [0.875, 0.25]}
