"""The shipped nginx file refuses ambiguous paths (400) before it forwards anything.

nginx chooses a location on the *normalised* path but forwards the *raw* one, so
``/v1/control/../fleet/pull-messages`` is a Fleet path to nginx and would reach the SuperLink
as written. The file refuses every path with a dot-segment, an empty segment, ``;`` or an
encoded dot / slash / backslash / percent sign. This runs the file as shipped (rendered by
``_nginx.render_proxy_conf``) in a real nginx on 127.0.0.1 in front of a small TLS upstream
that records every path reaching it (it stands for the SuperLink: same certificate, checked
by nginx against the deployment's CA). About a second; skipped without nginx.
"""

from __future__ import annotations

import http.client
import http.server
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _nginx import NGINX, NO_NGINX, nginx_command, nginx_main_conf, render_proxy_conf

from fedagg.certs import create_certs

REFUSED = [
    "/v1/fleet/..;/control/list-nodes",
    "/v1/fleet/..;x/control/list-nodes",
    "/v1/fleet/../control/list-nodes",
    "/v1/fleet/./pull-messages",
    "/v1/fleet/pull-messages/..",
    "/v1/control/../fleet/pull-messages",
    "/v1/control/..;/fleet/pull-messages",
    "/v1/fleet/%2e%2e/control/list-nodes",
    "/v1/fleet/%2E%2E/control/list-nodes",
    "/v1/fleet/.%2e/control/list-nodes",
    "/v1/fleet/%252e%252e/control/list-nodes",
    "/v1/fleet/%25252e%25252e/control/list-nodes",
    "/v1/fleet/..%2fcontrol/list-nodes",
    "/v1/fleet/pull-messages%2f..%2f..%2fcontrol%2flist-nodes",
    "/v1/fleet/%2F../control/list-nodes",
    "/v1/fleet/..%5ccontrol/list-nodes",
    "/v1/fleet/pull-messages;jsessionid=1",
    "//v1/fleet/pull-messages",
    "/v1/fleet//pull-messages",
    "/v1/fleet/pull-messages?next=/../control",
]
"""Paths a decoder or a router could read as another path: all refused with 400."""

FORWARDED = ["/v1/fleet/pull-messages", "/v1/fleet/push-messages", "/v1/fleet/create-node",
             "/v1/fleet/pull-object", "/v1/fleet/a.b-c_d", "/v1/fleet/..hidden-is-a-name"]
"""Plain Fleet paths (and names that merely contain dots): forwarded unchanged."""


@dataclass
class Proxy:
    port: int
    ca: Path
    seen: list[str] = field(default_factory=list)  # raw paths that reached the upstream


class _Upstream(http.server.BaseHTTPRequestHandler):
    seen: list[str]

    def do_POST(self) -> None:
        self.seen.append(self.path)
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        body = b"upstream"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST

    def log_message(self, *args: object) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    if NGINX is None:
        pytest.skip(NO_NGINX)
    tmp = tmp_path_factory.mktemp("proxy-paths")
    files = create_certs(tmp / "certs", ["127.0.0.1", "localhost"], ["site-a"])
    cert_dir = files.server_cert.parent
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert_dir / "server.crt", cert_dir / "server.key")
    seen: list[str] = []
    handler = type("Handler", (_Upstream,), {"seen": seen})
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    upstream.socket = ctx.wrap_socket(upstream.socket, server_side=True)
    thread = threading.Thread(target=upstream.serve_forever, daemon=True)
    thread.start()
    run_dir = tmp / "nginx"
    (run_dir / "tmp").mkdir(parents=True)
    port = _free_port()
    site = run_dir / "fedagg-fleet.conf"
    site.write_text(render_proxy_conf(f"127.0.0.1:{port}",
                                      f"127.0.0.1:{upstream.server_address[1]}", cert_dir))
    (run_dir / "nginx.conf").write_text(nginx_main_conf(run_dir, site))
    nginx = subprocess.Popen(nginx_command(run_dir, run_dir / "error.log"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert nginx.poll() is None, nginx.stderr.read() if nginx.stderr else b""
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "nginx did not start listening"
                time.sleep(0.05)
        yield Proxy(port, files.ca_cert, seen)
    finally:
        nginx.terminate()
        try:
            nginx.wait(timeout=10)
        except subprocess.TimeoutExpired:
            nginx.kill()
            nginx.wait()
        upstream.shutdown()
        upstream.server_close()


def _request(proxy: Proxy, path: str, method: str = "POST") -> tuple[int, bytes]:
    """One request with ``path`` sent byte for byte as written (http.client does not
    normalise it)."""
    ctx = ssl.create_default_context(cafile=str(proxy.ca))
    conn = http.client.HTTPSConnection("127.0.0.1", proxy.port, context=ctx, timeout=10)
    try:
        conn.request(method, path, body=b"x" if method == "POST" else None)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize("path", REFUSED)
def test_ambiguous_paths_are_refused_before_forwarding(proxy: Proxy, path: str) -> None:
    before = len(proxy.seen)
    status, body = _request(proxy, path)
    assert status == 400 and b"<center>nginx</center>" in body, (path, status, body[:200])
    assert proxy.seen[before:] == [], f"{path} reached the upstream as {proxy.seen[before:]}"


@pytest.mark.parametrize("path", FORWARDED)
def test_plain_fleet_paths_are_forwarded_unchanged(proxy: Proxy, path: str) -> None:
    before = len(proxy.seen)
    status, body = _request(proxy, path)
    assert (status, body) == (200, b"upstream"), (path, status, body[:200])
    assert proxy.seen[before:] == [path]


def test_other_paths_and_methods_stay_closed(proxy: Proxy) -> None:
    before = len(proxy.seen)
    assert _request(proxy, "/v1/control/list-nodes")[0] == 404
    assert _request(proxy, "/docs", method="GET")[0] == 404
    assert _request(proxy, "/v1/fleet/pull-messages", method="GET")[0] == 403
    assert proxy.seen[before:] == []
    assert _request(proxy, "/health", method="GET") == (200, b"upstream")
