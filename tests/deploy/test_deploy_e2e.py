"""Flower's deployment engine, for real: TLS, SuperNode authentication, 3 sites on 127.0.0.1.

One federation serves the whole module: ``fedagg certs`` creates a CA, the SuperLink
certificate and 4 site keys; a ``flower-superlink`` starts with TLS and
``--enable-supernode-auth`` on a free port; 3 of the keys are registered with
``flwr supernode register``; 3 ``flower-supernode`` processes (own free ports, own FLWR_HOME)
join with partition ids 0..2. Then:

* a SuperNode with the 4th, unregistered key is refused;
* a SuperNode that trusts another CA, and a plain TLS client with the system trust store,
  cannot connect;
* ``flwr run . <connection>`` runs 2 rounds of each strategy in :data:`STRATEGIES` (FedAvg,
  secure aggregation of TopK-compressed updates on a public support, secure block voting,
  and secure FedBuff: 2 model versions of the asynchronous loop) and the global
  model improves on the held-out test split (``metrics.json`` under ``run.output_dir``), with
  exactly the 3 registered sites;
* 2 secure rounds with distributed differential privacy commit and report the epsilon spent.

Every process this module starts is stopped by PID, with the processes they started in turn
(Flower's SuperExec and ClientApp / ServerApp processes), also when a test fails.
Run: ``python -m pytest -q tests/deploy -m deploy``. Each message starts a fresh ClientApp
process and both sides poll every 3 s, so this takes minutes (see docs/benchmarks.md,
"Deployment"); ``FEDAGG_DEPLOY_TIMES=<file>`` appends each run's round times to a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Flower's console scripts next to this interpreter (a venv), else wherever PATH finds them.
BIN = (Path(sys.executable).parent if (Path(sys.executable).parent / "flower-superlink").exists()
       else Path(shutil.which("flower-superlink") or "flower-superlink").parent)
SITES = ["site-a", "site-b", "site-c"]
ROGUE = "rogue"  # has a key pair, never registered

# Strategies run in deployment, 2 rounds each: (name, extra --run-config entries). The secure
# run also compresses: TopK 10 % + error feedback on a public random support, masked (the
# sparse + secure path; its state — keys and residuals — lives in Context.state, which must
# survive the fresh ClientApp process Flower starts for every message). The plaintext
# compressed strategy is covered on the simulation engine (tests/compression_flower).
# secure-vote is issue 21's best secure sparse mode on the 2NN benchmark (docs/compression.md,
# Results): secure block voting in a 12-bit ring; round 2's support is the one the sites voted
# for in round 1 (the vote sum travels down in the train message), here with 10 % of the
# digits model per round (blocks of 16) instead of the benchmark's 2.2 %, so that 2 rounds
# train (+0.26 on InProcessGrid with this config). secure-fedbuff is the asynchronous loop
# (issue 18) over the deployment Grid: each version is one cohort of the 3 sites keyed when it
# is dispatched, its per-cohort SecAgg+ state in Context.state across fresh ClientApp processes.
STRATEGIES = [
    pytest.param("fedavg", "", id="fedavg"),
    pytest.param("secure", 'compression.up="topk:0.1+ef" compression.support="random"',
                 id="secure-sparse"),
    pytest.param("secure", 'compression.up="vote:0.1,vote=0.05,block=16+ef" '
                 "secagg.ring_bits=12 secagg.frac_bits=6 secagg.clip=1 secagg.weight_scale=1000",
                 id="secure-vote"),
    pytest.param("secure", 'asynchronous.mode="fedbuff" asynchronous.buffer_size=3 '
                 "asynchronous.concurrency=3 secagg.weight_scale=1000", id="secure-fedbuff"),
]

pytestmark = [pytest.mark.flower, pytest.mark.slow, pytest.mark.deploy]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(d.name))
    return out


def descendants(pid: int) -> list[int]:
    """``pid``'s children, grandchildren, ... (from /proc)."""
    tree = _children_map()
    todo, found = list(tree.get(pid, [])), []
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(tree.get(p, []))
    return found


@dataclass
class Procs:
    """Processes started by this module; :meth:`stop_all` ends them and their descendants."""

    logs: Path
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)
    seen: dict[int, bytes] = field(default_factory=dict)  # pid -> its command line

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        log.close()
        self.started.append(proc)
        return proc

    def remember_descendants(self) -> None:
        """Record the current descendants (Flower detaches some into their own sessions)."""
        for proc in self.started:
            for pid in [proc.pid, *descendants(proc.pid)]:
                self.seen.setdefault(pid, _cmdline(pid))

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 15) -> None:
        pids = [*descendants(proc.pid), proc.pid]
        for pid in pids:
            self.seen.setdefault(pid, _cmdline(pid))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def stop_all(self) -> None:
        """SIGTERM every process started here and their descendants at once; SIGKILL stragglers."""
        self.remember_descendants()
        # Only PIDs that still run the command we saw (a PID may have been reused since).
        pids = [pid for pid, cmd in self.seen.items() if _alive(pid) and _cmdline(pid) == cmd]
        for pid in pids:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        deadline = time.time() + 15
        while time.time() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        for pid in pids:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)

    def log(self, name: str, tail: int = 4000) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@dataclass
class Federation:
    """A running deployment on 127.0.0.1."""

    tmp: Path
    certs: Path
    port: int
    home: Path  # FLWR_HOME of the operator running `flwr`
    env: dict[str, str]
    procs: Procs
    nodes: dict[str, subprocess.Popen[bytes]]

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(BIN / "flwr"), *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=timeout)


def _env(home: Path) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",  # as the docs' recipe
            "PYTHONUNBUFFERED": "1"}


def _wait_for_tls(port: int, cafile: Path, proc: subprocess.Popen[bytes], timeout: float, *,
                  host: str = "127.0.0.1", name: str = "flower-superlink") -> None:
    ctx = ssl.create_default_context(cafile=str(cafile))
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"{name} exited during start-up"
        try:
            with socket.create_connection((host, port), timeout=2) as raw, \
                    ctx.wrap_socket(raw, server_hostname=host):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{name} not reachable over TLS on {host}:{port} in {timeout} s")


def _supernode_args(fed_certs: Path, site: str, port: int, partition: int, *, ca: Path | None = None,
                    extra: tuple[str, ...] = (), host: str = "127.0.0.1",
                    num_partitions: int = len(SITES)) -> list[str]:
    """``flower-supernode`` for ``site``, dialing ``host:port`` (the SuperLink, or a proxy)."""
    return [str(BIN / "flower-supernode"), "--superlink", f"{host}:{port}",
            "--root-certificates", str(ca or fed_certs / "sites" / site / "ca.crt"),
            "--auth-supernode-private-key", str(fed_certs / "sites" / site / "auth.key"),
            "--port", str(free_port()),
            "--node-config", f"partition-id={partition} num-partitions={num_partitions} "
                             f"site-name='{site}'", *extra]


def _superlink_args(certs: Path, port: int, database: Path | None = None) -> list[str]:
    """``flower-superlink`` with TLS and SuperNode authentication on ``127.0.0.1:port``
    (with ``database``: its state in that SQLite file, as docs/deployment.md runs it)."""
    sl = certs / "superlink"
    return [str(BIN / "flower-superlink"), "--ssl-certfile", str(sl / "server.crt"),
            "--ssl-keyfile", str(sl / "server.key"), "--ssl-ca-certfile", str(sl / "ca.crt"),
            "--enable-supernode-auth", "--host", "127.0.0.1", "--port", str(port),
            *(["--database", str(database)] if database is not None else []),
            "--disable-runtime-dependency-installation"]


def _write_connection(home: Path, name: str, address: str, ca: Path) -> None:
    """``$FLWR_HOME/config.toml`` with one default connection ``name`` -> ``address``."""
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\n'
        f'address = "{address}"\nroot-certificates = "{ca}"\n')


def _register_sites(fed: Federation, sites: list[str]) -> set[str]:
    """``flwr supernode register`` each site's public key; their node ids."""
    registered = set()
    for site in sites:
        res = fed.flwr("supernode", "register", str(fed.certs / "sites" / site / "auth.pub"),
                       "fedagg", "--name", site, "--format", "json")
        assert res.returncode == 0, res.stdout + res.stderr
        registered.add(str(json.loads(res.stdout)["node-id"]))
    return registered


def _wait_online(fed: Federation, registered: set[str], timeout: float = 180) -> None:
    """Wait until exactly the ``registered`` node ids are online (``flwr supernode list``)."""
    # The ServerApp samples the sites connected when a round starts: wait for all of them.
    deadline = time.time() + timeout
    online: set[str] = set()
    while time.time() < deadline and online != registered:
        res = fed.flwr("supernode", "list", "fedagg", "--format", "json")
        if res.returncode == 0:
            online = {str(n["node-id"]) for n in json.loads(res.stdout)["nodes"]
                      if n["status"] == "online"}
        if online != registered:
            time.sleep(2)
    assert online == registered, (online, registered, fed.procs.log(next(iter(fed.nodes), "")))


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    tmp = tmp_path_factory.mktemp("deploy")
    logs = tmp / "logs"
    logs.mkdir()
    procs = Procs(logs)
    try:
        certs = tmp / "certs"
        subprocess.run([str(BIN / "fedagg"), "certs", "--out", str(certs), "--san", "127.0.0.1",
                        "--san", "localhost", "--sites", ",".join([*SITES, ROGUE])],
                       check=True, capture_output=True, timeout=60)
        port = free_port()
        home = tmp / "operator-home"
        env = _env(home)
        _write_connection(home, "fedagg", f"127.0.0.1:{port}", certs / "ca" / "ca.crt")
        superlink = procs.start("superlink", _superlink_args(certs, port),
                                _env(tmp / "superlink-home"))
        _wait_for_tls(port, certs / "ca" / "ca.crt", superlink, timeout=120)
        fed = Federation(tmp, certs, port, home, env, procs, {})
        registered = _register_sites(fed, SITES)
        for i, site in enumerate(SITES):
            fed.nodes[site] = procs.start(site, _supernode_args(certs, site, port, i),
                                          _env(tmp / f"{site}-home"))
        _wait_online(fed, registered)
        yield fed
    finally:
        procs.stop_all()


def test_unregistered_supernode_is_refused(federation: Federation) -> None:
    fed = federation
    rogue = fed.procs.start(ROGUE, _supernode_args(fed.certs, ROGUE, fed.port, 0),
                            _env(fed.tmp / "rogue-home"))
    try:
        rc = rogue.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("a SuperNode with an unregistered key kept running:\n" + fed.procs.log(ROGUE))
    finally:
        fed.procs.stop(rogue)
    text = fed.procs.log(ROGUE)
    assert rc != 0, text
    assert "Failed to activate SuperNode" in text, text


def test_client_without_the_ca_cannot_connect(federation: Federation, tmp_path: Path) -> None:
    fed = federation
    # A plain TLS client that trusts only the system CAs: the handshake fails.
    with socket.create_connection(("127.0.0.1", fed.port), timeout=10) as raw, \
            pytest.raises(ssl.SSLCertVerificationError):
        ssl.create_default_context().wrap_socket(raw, server_hostname="127.0.0.1")
    # A registered site whose --root-certificates is another CA cannot connect either.
    other = tmp_path / "other-ca"
    subprocess.run([str(BIN / "fedagg"), "certs", "--out", str(other), "--san", "127.0.0.1",
                    "--sites", "x"], check=True, capture_output=True, timeout=60)
    name = "site-a-wrong-ca"
    node = fed.procs.start(name, _supernode_args(
        fed.certs, "site-a", fed.port, 0, ca=other / "ca" / "ca.crt",
        extra=("--max-retries", "2", "--max-wait-time", "20")), _env(tmp_path / "wrong-ca-home"))
    try:
        rc = node.wait(timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail("a SuperNode without our CA kept running:\n" + fed.procs.log(name))
    finally:
        fed.procs.stop(node)
    text = fed.procs.log(name)
    assert rc != 0, text
    assert "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text, text


def _stop_run(fed: Federation, stdout: str | bytes | None) -> None:
    """``flwr stop`` the run ``flwr run`` started, so it does not overlap the next one."""
    text = stdout.decode(errors="replace") if isinstance(stdout, bytes) else (stdout or "")
    match = re.search(r"Successfully started run (\d+)", text)
    if match:
        fed.flwr("stop", match.group(1), "fedagg", timeout=60)


def _run_two_rounds(fed: Federation, out: Path, run_config: str) -> list[dict[str, object]]:
    """``flwr run`` of a 2-round run into ``out`` (stopped by PID on failure); its records
    once metrics.json holds rounds 0-2 and the model is written."""
    try:
        res = fed.flwr("run", ".", "fedagg", "--stream", "--run-config", run_config, timeout=480)
    except subprocess.TimeoutExpired as exc:
        _stop_run(fed, exc.stdout)
        raise
    finally:
        fed.procs.remember_descendants()
    if res.returncode != 0:
        _stop_run(fed, res.stdout)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    records: list[dict[str, object]] = []
    deadline = time.time() + 60
    while time.time() < deadline:
        files = sorted(out.glob("*/metrics.json"))
        if files and (files[0].parent / "model.pt").exists():
            records = json.loads(files[0].read_text())
            if len(records) == 3:
                break
        time.sleep(1)
    assert [r["round"] for r in records] == [0, 1, 2], (res.stdout[-4000:],
                                                       fed.procs.log("superlink"))
    return records


@pytest.mark.parametrize(("strategy", "extra"), STRATEGIES)
def test_two_rounds_improve_the_model(federation: Federation, strategy: str, extra: str) -> None:
    fed = federation
    for site, node in fed.nodes.items():
        assert node.poll() is None, f"{site} exited:\n" + fed.procs.log(site)
    out = fed.tmp / f"runs-{strategy}-{zlib.crc32(extra.encode()):08x}"  # one dir per param
    run_config = (f'run.rounds=2 run.sites={len(SITES)} run.output_dir="{out}" '
                  f'strategy.name="{strategy}" {extra}').strip()
    t0 = time.perf_counter()
    records = _run_two_rounds(fed, out, run_config)
    wall = time.perf_counter() - t0
    assert [r["round"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["sites_sampled"] == len(SITES) and r["sites_replied"] == len(SITES), r
        assert r["model_updated"] is True, r
    first, last = records[0], records[-1]
    assert isinstance(first["accuracy"], float) and isinstance(last["accuracy"], float)
    # 2 rounds from a random model on digits; with 10 % of each partition held out for
    # client-side evaluation (data.eval_fraction) TopK 10 % + EF reaches +0.15 (InProcessGrid,
    # same config), dense FedAvg far more
    assert last["accuracy"] > first["accuracy"] + 0.1, records
    summary = {"strategy": strategy, "wall_seconds": round(wall, 1),
               "round_seconds": [round(float(r["seconds"]), 1) for r in records[1:]],  # type: ignore[arg-type]
               "exchanges": [r.get("exchanges") for r in records[1:]],
               "accuracy": [round(float(r["accuracy"]), 4) for r in records]}  # type: ignore[arg-type]
    print("DEPLOY-ROUND-TIMES", json.dumps(summary))
    summary_file = os.environ.get("FEDAGG_DEPLOY_TIMES")
    if summary_file:
        with open(summary_file, "a") as fh:
            fh.write(json.dumps(summary) + "\n")


def test_distributed_dp_over_the_deployment_reports_epsilon(federation: Federation) -> None:
    """Distributed DP in secure rounds over real SuperLink / SuperNodes with TLS: 2 rounds
    commit, and every record carries the epsilon spent so far, growing, within the budget
    (3 sites at epsilon 8 do not learn: the check is the mechanism and its accounting)."""
    fed = federation
    out = fed.tmp / "runs-private"
    run_config = (f'run.rounds=2 run.sites={len(SITES)} run.output_dir="{out}" '
                  'strategy.name="secure" privacy.mode="distributed" privacy.epsilon=8.0')
    records = _run_two_rounds(fed, out, run_config)
    spent = [r["privacy_epsilon"] for r in records[1:]]
    assert all(r["model_updated"] is True and r["secagg_counted"] == len(SITES)
               for r in records[1:]), records
    assert 0 < spent[0] < spent[1] <= 8.0 * (1 + 1e-9), spent  # type: ignore[operator]

