"""The site worker service (``fedagg site-workers``): persistent workers for deployment.

A real service process (the ``fedagg`` command) on a unix socket in a private directory; the
ClientApp (``clients.app:app``, real Flower Message / Context objects, a node config naming
the socket) is called once per round as a SuperNode's fresh ClientApp process would be. The
worker processes are the service's children: the same PIDs serve every round, and none is
left after SIGTERM. Access control: a group-readable directory is refused, a wrong token is
refused before anything is unpickled, the socket is 0600.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _site_helpers import delta_rel_diff, initial_weights, settings, train_single, wait_gone
from flwr.app import Context, Message, RecordDict

from clients.app import app
from clients.service import ServiceClient, token_path
from fedagg.config import RunConfig, validate_model
from fedagg.errors import WorkerError
from server.runner import client_config
from strategies.wire import arrays_to_record, record_to_arrays

pytestmark = [pytest.mark.slow, pytest.mark.gloo]


def _children(pid: int) -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.add(int(d.name))
    return out


def _start(sock: Path, *extra: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "fedagg.cli", "site-workers", "--socket",
                             str(sock), *extra], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not sock.exists():
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "the service did not start"
        time.sleep(0.1)
    return proc


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    run_dir = tmp_path / "svc"
    run_dir.mkdir(mode=0o700)
    sock = run_dir / "workers.sock"
    proc = _start(sock, "--workers", "2")
    try:
        yield sock, proc
    finally:
        if proc.poll() is None:
            kids = list(_children(proc.pid))
            proc.kill()
            proc.wait(30)
            wait_gone(kids)


def _message(cfg: RunConfig, weights: list[np.ndarray], rnd: int) -> Message:
    rec = client_config(cfg)
    rec["server-round"] = rnd
    keys = [f"w{i}" for i in range(len(weights))]
    return Message(RecordDict({"arrays": arrays_to_record(weights, keys), "config": rec}),
                   dst_node_id=7, message_type="train")


def test_the_clientapp_trains_on_the_services_persistent_workers(
        service: tuple[Path, subprocess.Popen[bytes]]) -> None:
    sock, proc = service
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(token_path(sock).stat().st_mode) == 0o600
    s = settings(partition=1)
    cfg = validate_model(RunConfig, {**s.cfg.model_dump(), "site": {"workers": 2}})
    node_config = {"partition-id": 1, "num-partitions": 2, "worker-service": str(sock)}
    w = initial_weights(s)
    seen: list[set[int]] = []
    for rnd in (1, 2, 3):
        ctx = Context(run_id=99, node_id=7, node_config=node_config, state=RecordDict(),
                      run_config={})
        reply = app(_message(cfg, w, rnd), ctx)
        assert not reply.has_error(), reply.error
        m = reply.content.metric_records["metrics"]
        assert m["workers"] == 2 and m["workers_started"] == (2 if rnd == 1 else 0)
        _, new = record_to_arrays(reply.content.array_records["arrays"])
        one = train_single(settings(partition=1, server_round=rnd), w)
        assert delta_rel_diff(new, one.weights, w) < 1e-5
        seen.append(_children(proc.pid))
        w = new
    assert seen[0] == seen[1] == seen[2] and len(seen[0]) == 2, seen
    (pool,) = ServiceClient(str(sock)).status()["pools"]
    assert set(pool["pids"]) == seen[0] and pool["rounds"] == 3
    assert (pool["run_id"], pool["node_id"]) == (99, 7)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert wait_gone(list(seen[0])) == [], "worker processes left after SIGTERM"
    assert not sock.exists() and not token_path(sock).exists()


def test_a_wrong_token_is_refused(service: tuple[Path, subprocess.Popen[bytes]],
                                  tmp_path: Path) -> None:
    sock, _ = service
    bad = tmp_path / "bad.token"
    bad.write_text("0" * 64)
    with pytest.raises(WorkerError, match="refused the token"):
        ServiceClient(str(sock), token_file=str(bad)).status()
    assert ServiceClient(str(sock)).status()["ok"]


def test_no_service_names_the_node_config_key_and_the_fix(tmp_path: Path) -> None:
    sock = tmp_path / "none.sock"
    token_path(sock).write_text("x" * 64)
    with pytest.raises(WorkerError, match=r"node_config.worker-service .*fedagg site-workers"):
        ServiceClient(str(sock)).status()


def test_an_open_directory_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    res = subprocess.run([sys.executable, "-m", "fedagg.cli", "site-workers", "--socket",
                          str(shared / "w.sock")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "closed to group and others (0700)" in res.stderr and "chmod 700" in res.stderr
    assert not (shared / "w.sock").exists()
