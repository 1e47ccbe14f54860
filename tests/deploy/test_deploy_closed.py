"""The closed deployment (``deploy/nginx/fedagg-fleet.conf``), for real, on loopback.

Flower 1.42 serves the Fleet, Control and Runtime APIs on one HTTPS port and its open-source
Control API authenticates nobody, so fedagg's deployment binds the SuperLink to 127.0.0.1 and
puts nginx on the address the sites dial, forwarding only ``/v1/fleet/*`` (and ``/health``).
This module starts exactly that, with the shipped nginx file rendered as it is:

* ``flower-superlink`` (TLS, ``--enable-supernode-auth``) on ``127.0.0.1:<port>``: the
  operator's ``flwr`` uses it there, on the server host;
* ``nginx`` on :data:`PUBLIC` (``127.0.0.2``, standing for the server host's network address),
  TLS with the SuperLink's certificate, re-encrypting to the SuperLink and checking it
  against the deployment's CA;
* 2 registered ``flower-supernode`` processes that dial ``127.0.0.2`` (the proxy) only.

An outsider holds everything a site holds except a registered key (the CA certificate
included) and dials the public address: listing nodes, registering a SuperNode key (through
the Control API, or as a SuperNode through the Fleet API) and starting a run are all refused,
and the SuperLink's own port is closed there. Every Control and Runtime route Flower defines
is probed through the proxy (404), path tricks are refused (400), while the same Control
request straight to the SuperLink succeeds. Then the sites train one round of fedagg's
default app through the proxy.

Raw HTTP probes come from a third loopback source address, :data:`OUTSIDER_SRC`. Note what
loopback cannot show: any process *on the server host* reaches 127.0.0.1 — that host is
the operator's (docs/deployment.md, "Closed by default").

Needs nginx (Debian: ``apt-get install nginx-light``; ``.ci/run`` installs it); skipped with
that fix when no ``nginx`` binary is found. Every process is stopped by PID (helpers of
``test_deploy_e2e``), also when a test fails. Run:
``python -m pytest -q -n 0 tests/deploy/test_deploy_closed.py``.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _nginx import NGINX, NO_NGINX, nginx_command, nginx_main_conf, render_proxy_conf
from flwr.proto.control_pb2 import ListNodesRequest, ListNodesResponse
from flwr.supercore.protobuf.constants import PROTOBUF_MEDIA_TYPE
from flwr.supercore.routers.runtime import responses_router
from flwr.supercore.routers.runtime.router import router as runtime_router
from flwr.superlink.routers.control import router as control_router
from flwr.superlink.routers.fleet.router import router as fleet_router
from test_deploy_e2e import (
    BIN,
    Federation,
    Procs,
    _env,
    _register_sites,
    _stop_run,
    _superlink_args,
    _supernode_args,
    _wait_for_tls,
    _wait_online,
    _write_connection,
    free_port,
)

pytestmark = [pytest.mark.flower, pytest.mark.slow, pytest.mark.deploy]

PUBLIC = "127.0.0.2"  # the server host's network address: the sites' (and outsiders') way in
OUTSIDER_SRC = "127.0.0.3"  # source address of the outsider's raw HTTP probes
SITES = ["site-a", "site-b"]
ROGUE = "rogue"  # a key pair that is never registered


@dataclass
class Closed:
    """The closed deployment: the operator's view, the outsider's, the proxy."""

    fed: Federation  # operator: flwr -> 127.0.0.1:<superlink port>
    outsider: Federation  # flwr -> PUBLIC:<proxy port>, with the CA, without registered key
    proxy_port: int
    access_log: Path


@pytest.fixture(scope="module")
def closed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Closed]:
    if NGINX is None:
        pytest.skip(NO_NGINX)
    tmp = tmp_path_factory.mktemp("deploy-closed")
    logs = tmp / "logs"
    logs.mkdir()
    procs = Procs(logs)
    try:
        certs = tmp / "certs"
        # The SuperLink certificate serves both doors: PUBLIC (sites, via nginx), 127.0.0.1
        # (the operator's flwr) and localhost (the name nginx checks it by).
        subprocess.run([str(BIN / "fedagg"), "certs", "--out", str(certs), "--san", "127.0.0.1",
                        "--san", PUBLIC, "--san", "localhost",
                        "--sites", ",".join([*SITES, ROGUE])],
                       check=True, capture_output=True, timeout=60)
        ca = certs / "ca" / "ca.crt"
        port, proxy_port = free_port(), free_port()
        home = tmp / "operator-home"
        env = _env(home)
        _write_connection(home, "fedagg", f"127.0.0.1:{port}", ca)
        # the database in a directory made as docs/deployment.md makes /var/lib/fedagg
        state = tmp / "var-lib-fedagg"
        subprocess.run(["install", "-d", "-m", "700", str(state)], check=True, timeout=30)
        superlink = procs.start("superlink", _superlink_args(certs, port, state / "superlink.db"),
                                _env(tmp / "superlink-home"))
        _wait_for_tls(port, ca, superlink, timeout=120)

        run_dir = tmp / "nginx"
        (run_dir / "tmp").mkdir(parents=True)
        site_conf = run_dir / "fedagg-fleet.conf"
        site_conf.write_text(render_proxy_conf(f"{PUBLIC}:{proxy_port}", f"127.0.0.1:{port}",
                                               certs / "superlink"))
        (run_dir / "nginx.conf").write_text(nginx_main_conf(run_dir, site_conf))
        nginx = procs.start("nginx", nginx_command(run_dir, logs / "nginx-error.log"),
                            _env(tmp / "nginx-home"))
        _wait_for_tls(proxy_port, ca, nginx, timeout=30, host=PUBLIC, name="nginx")

        fed = Federation(tmp, certs, port, home, env, procs, {})
        registered = _register_sites(fed, SITES)
        for i, site in enumerate(SITES):
            fed.nodes[site] = procs.start(
                site, _supernode_args(certs, site, proxy_port, i, host=PUBLIC,
                                      num_partitions=len(SITES)),
                _env(tmp / f"{site}-home"))
        _wait_online(fed, registered)

        out_home = tmp / "outsider-home"
        out_env = _env(out_home)
        _write_connection(out_home, "fedagg", f"{PUBLIC}:{proxy_port}", ca)
        outsider = Federation(tmp, certs, proxy_port, out_home, out_env, procs, {})
        yield Closed(fed, outsider, proxy_port, run_dir / "access.log")
    finally:
        procs.stop_all()


def _post(host: str, port: int, path: str, body: bytes, ca: Path, *,
          source: str | None = OUTSIDER_SRC, method: str = "POST") -> tuple[int, bytes]:
    """One HTTPS request (trusting ``ca``), from ``source``; (status, body)."""
    ctx = ssl.create_default_context(cafile=str(ca))
    conn = http.client.HTTPSConnection(host, port, context=ctx, timeout=30,
                                       source_address=(source, 0) if source else None)
    try:
        conn.request(method, path, body=body, headers={"content-type": PROTOBUF_MEDIA_TYPE,
                                                       "accept": PROTOBUF_MEDIA_TYPE})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _paths(router: object) -> list[str]:
    return sorted({route.path for route in router.routes})  # type: ignore[attr-defined]


def test_superlink_port_is_closed_on_the_public_address(closed: Closed) -> None:
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((PUBLIC, closed.fed.port), timeout=10).close()


def test_only_fleet_paths_pass_the_proxy(closed: Closed) -> None:
    ca = closed.fed.certs / "ca" / "ca.crt"
    body = ListNodesRequest().SerializeToString()
    # The request itself is fine: straight to the SuperLink (the operator's door) it lists the
    # 2 sites ...
    status, payload = _post("127.0.0.1", closed.fed.port, "/v1/control/list-nodes", body, ca,
                            source=None)
    assert status == 200, (status, payload[:300])
    assert len(ListNodesResponse.FromString(payload).nodes_info) == len(SITES)
    # ... but through the proxy every Control and Runtime route Flower 1.42 defines and the
    # API docs are answered by nginx (404), and path tricks that a decoder could read as
    # another route are refused by it (400; all of them: tests/deploy/test_deploy_proxy_paths.py).
    tricks = ["/v1/fleet/../control/list-nodes", "/v1/fleet/%2e%2e/control/list-nodes",
              "/v1/fleet/..%2fcontrol/list-nodes", "/v1/fleet/%2e%2e%2fcontrol/list-nodes",
              "/v1/fleet/pull-messages/../../control/list-nodes", "//v1/control/list-nodes",
              "/v1/fleet/get-run/../../control/list-nodes?x=1", "/v1/fleet/..;/control/list-nodes",
              "/v1/fleet/%252e%252e/control/list-nodes", "/v1/control/../fleet/pull-messages"]
    probes = [*_paths(control_router), *_paths(runtime_router), *_paths(responses_router),
              "/docs", "/openapi.json", "/redoc", "/", "/V1/CONTROL/LIST-NODES"]
    assert len(probes) > 60, probes
    expected = {**dict.fromkeys(probes, 404), **dict.fromkeys(tricks, 400)}
    answers = {path: _post(PUBLIC, closed.proxy_port, path, body, ca) for path in expected}
    # nginx's own error page: the request never reached the SuperLink.
    leaked = {path: (status, payload[:200]) for path, (status, payload) in answers.items()
              if status != expected[path] or b"<center>nginx</center>" not in payload}
    assert not leaked, leaked
    # The Fleet paths and /health do reach the SuperLink (its own errors, not nginx's 404).
    for path in _paths(fleet_router):
        status, payload = _post(PUBLIC, closed.proxy_port, path, b"", ca)
        assert status != 404 and b"nginx" not in payload, (path, status, payload[:300])
    assert _post(PUBLIC, closed.proxy_port, "/health", b"", ca, method="GET")[0] == 200


def _operator_nodes(closed: Closed) -> list[dict[str, object]]:
    res = closed.fed.flwr("supernode", "list", "fedagg", "--format", "json")
    assert res.returncode == 0, res.stdout + res.stderr
    nodes: list[dict[str, object]] = json.loads(res.stdout)["nodes"]
    return nodes


def _refused(res: subprocess.CompletedProcess[str], route: str) -> None:
    text = res.stdout + res.stderr
    assert "404 Not Found" in text and f"/v1/control/{route}" in text, text[-3000:]
    if "--format" in res.args:
        assert json.loads(res.stdout)["success"] is False, res.stdout


def test_outsider_cannot_list_nodes(closed: Closed) -> None:
    res = closed.outsider.flwr("supernode", "list", "fedagg", "--format", "json")
    _refused(res, "list-nodes")
    res = closed.outsider.flwr("supernode", "list", "fedagg")
    assert res.returncode != 0
    _refused(res, "list-nodes")


def test_outsider_cannot_register_a_supernode_key(closed: Closed) -> None:
    before = _operator_nodes(closed)
    rogue_pub = str(closed.fed.certs / "sites" / ROGUE / "auth.pub")
    # Through the Control API (flwr supernode register) ...
    res = closed.outsider.flwr("supernode", "register", rogue_pub, "fedagg", "--name", ROGUE)
    assert res.returncode != 0
    _refused(res, "register-node")
    # ... and as a SuperNode through the Fleet API the proxy does forward: node
    # authentication refuses the unregistered key.
    rogue = closed.fed.procs.start(ROGUE, _supernode_args(
        closed.fed.certs, ROGUE, closed.proxy_port, 0, host=PUBLIC, num_partitions=len(SITES)),
        _env(closed.fed.tmp / "rogue-home"))
    try:
        rc = rogue.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("a SuperNode with an unregistered key kept running behind the proxy:\n"
                    + closed.fed.procs.log(ROGUE))
    finally:
        closed.fed.procs.stop(rogue)
    text = closed.fed.procs.log(ROGUE)
    assert rc != 0 and "Failed to activate SuperNode" in text, text
    after = _operator_nodes(closed)
    assert sorted(str(n["node-id"]) for n in after) == sorted(str(n["node-id"]) for n in before)


def _runs(fed: Federation) -> set[str]:
    res = fed.flwr("list", "fedagg", "--format", "json")
    assert res.returncode == 0, res.stdout + res.stderr
    return {str(r["run-id"]) for r in json.loads(res.stdout)["runs"]}


def test_outsider_cannot_start_a_run(closed: Closed) -> None:
    before = _runs(closed.fed)
    out = closed.fed.tmp / "runs-outsider"
    res = closed.outsider.flwr("run", ".", "fedagg", "--run-config",
                               f'run.rounds=1 run.sites={len(SITES)} run.output_dir="{out}"')
    if res.returncode == 0:
        _stop_run(closed.outsider, res.stdout)
    assert res.returncode != 0
    _refused(res, "start-run")
    assert _runs(closed.fed) == before
    assert not out.exists()


def test_sites_train_through_the_proxy(closed: Closed) -> None:
    fed = closed.fed
    for site, node in fed.nodes.items():
        assert node.poll() is None, f"{site} exited:\n" + fed.procs.log(site)
    out = fed.tmp / "runs-operator"
    run_config = f'run.rounds=1 run.sites={len(SITES)} run.output_dir="{out}"'
    try:
        res = fed.flwr("run", ".", "fedagg", "--stream", "--run-config", run_config, timeout=300)
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
            if len(records) == 2:
                break
        time.sleep(1)
    assert [r["round"] for r in records] == [0, 1], (res.stdout[-4000:], fed.procs.log("superlink"))
    last = records[-1]
    assert last["sites_sampled"] == len(SITES) and last["sites_replied"] == len(SITES), last
    assert last["model_updated"] is True, last
    assert float(last["accuracy"]) > float(records[0]["accuracy"]) + 0.2, records  # type: ignore[arg-type]
    # The sites' traffic went through nginx: their pulls and pushes are in its access log.
    log = closed.access_log.read_text()
    for path in ("/v1/fleet/pull-messages", "/v1/fleet/push-messages", "/v1/fleet/get-fab"):
        assert f"POST {path} HTTP/1.1\" 200" in log, (path, log[-2000:])
