"""Deployment e2e: 2-worker sites trained by their worker services, for real.

A ``flower-superlink`` with TLS and SuperNode authentication, 2 registered
``flower-supernode``s on 127.0.0.1, and next to each one a ``fedagg site-workers --workers 2``
service on a unix socket in a private directory (the SuperNode's node config names it:
``worker-service='...'``). ``flwr run`` trains 2 rounds. Flower starts a fresh ClientApp
process for every message; the site's workers are the service's children, and a watcher
records every PID they ever had: exactly 2 per site over the whole run, i.e. the second round
started no worker process (the sites' metrics say so too: ``workers_started`` 2, then 0). At
the end SIGTERM stops each service and none of its workers is left.

The federation helpers are those of ``tests/deploy/test_deploy_e2e.py``.
Run: ``python -m pytest -n 0 -q tests/site/test_site_service_deploy.py``.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _site_helpers import wait_gone

pytestmark = [pytest.mark.flower, pytest.mark.slow, pytest.mark.deploy, pytest.mark.gloo,
              pytest.mark.timeout(1500)]

_spec = importlib.util.spec_from_file_location(
    "_deploy_e2e", Path(__file__).resolve().parents[1] / "deploy" / "test_deploy_e2e.py")
assert _spec is not None and _spec.loader is not None
e2e = importlib.util.module_from_spec(_spec)
sys.modules["_deploy_e2e"] = e2e
_spec.loader.exec_module(e2e)

SITES = ["site-a", "site-b"]


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


class _Watch(threading.Thread):
    """Every PID ever seen among the children of each service."""

    def __init__(self, services: dict[str, subprocess.Popen[bytes]]) -> None:
        super().__init__(daemon=True)
        self.services = services
        self.seen: dict[str, set[int]] = {s: set() for s in services}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            for site, proc in self.services.items():
                self.seen[site] |= _children(proc.pid)


def test_two_rounds_on_the_sites_worker_services(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = e2e.Procs(logs)
    watch: _Watch | None = None
    try:
        certs = tmp_path / "certs"
        subprocess.run([str(e2e.BIN / "fedagg"), "certs", "--out", str(certs), "--san",
                        "127.0.0.1", "--sites", ",".join(SITES)], check=True,
                       capture_output=True, timeout=60)
        port = e2e.free_port()
        home = tmp_path / "operator-home"
        env = e2e._env(home)
        e2e._write_connection(home, "fedagg", f"127.0.0.1:{port}", certs / "ca" / "ca.crt")
        superlink = procs.start("superlink", e2e._superlink_args(certs, port),
                                e2e._env(tmp_path / "superlink-home"))
        e2e._wait_for_tls(port, certs / "ca" / "ca.crt", superlink, timeout=120)
        fed = e2e.Federation(tmp_path, certs, port, home, env, procs, {})
        registered = e2e._register_sites(fed, SITES)
        services: dict[str, subprocess.Popen[bytes]] = {}
        for i, site in enumerate(SITES):
            run_dir = tmp_path / "run" / site
            run_dir.mkdir(mode=0o700, parents=True)
            sock = run_dir / "workers.sock"
            pools = tmp_path / "pools" / site
            pools.mkdir(parents=True)
            services[site] = procs.start(
                f"{site}-workers", [str(e2e.BIN / "fedagg"), "site-workers", "--socket",
                                    str(sock), "--workers", "2"],
                {**e2e._env(tmp_path / f"{site}-svc-home"), "FEDAGG_SITE_TMPDIR": str(pools)})
            deadline = time.monotonic() + 120
            while not sock.exists():
                assert services[site].poll() is None, procs.log(f"{site}-workers")
                assert time.monotonic() < deadline, procs.log(f"{site}-workers")
                time.sleep(0.2)
            args = e2e._supernode_args(certs, site, port, i, num_partitions=len(SITES))
            k = args.index("--node-config") + 1
            args[k] += f" worker-service='{sock}'"
            fed.nodes[site] = procs.start(site, args, e2e._env(tmp_path / f"{site}-home"))
        e2e._wait_online(fed, registered)
        watch = _Watch(services)
        watch.start()
        out = tmp_path / "runs"
        run_config = (f'run.rounds=2 run.sites={len(SITES)} run.output_dir="{out}" '
                      'site.workers=2 site.mode="process" strategy.name="fedavg"')
        res = fed.flwr("run", ".", "fedagg", "--stream", "--run-config", run_config, timeout=900)
        procs.remember_descendants()
        if res.returncode != 0:
            e2e._stop_run(fed, res.stdout)
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
        records: list[dict[str, object]] = []
        deadline = time.time() + 60
        while time.time() < deadline and len(records) < 3:
            files = sorted(out.glob("*/metrics.json"))
            if files:
                records = json.loads(files[0].read_text())
            time.sleep(1)
        assert [r["round"] for r in records] == [0, 1, 2], records
        watch.stop.set()
        watch.join(5)
        for r in records[1:]:
            assert r["sites_replied"] == len(SITES), r
            for m in r["site_metrics"].values():  # type: ignore[attr-defined]
                assert m["workers"] == 2, m
        started = [[m["workers_started"] for m in r["site_metrics"].values()]  # type: ignore[attr-defined]
                   for r in records[1:]]
        assert started == [[2, 2], [0, 0]], started
        assert float(records[-1]["accuracy"]) > float(records[0]["accuracy"]) + 0.2  # type: ignore[arg-type]
        for site, pids in watch.seen.items():
            assert len(pids) == 2, (site, pids)  # round 2 started no new worker process
        for site, proc in services.items():
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, procs.log(f"{site}-workers")
            assert wait_gone(list(watch.seen[site])) == [], f"{site}: workers left"
            assert list((tmp_path / "pools" / site).iterdir()) == []
    finally:
        if watch is not None:
            watch.stop.set()
        procs.stop_all()
