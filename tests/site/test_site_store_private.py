"""A process-mode site's workers are closed to other local users.

The attacker is a real second uid (65534, ``nobody``), run under ``setpriv`` from the test
(CI runs as root; skipped only where switching uid is impossible, with the reason). While a
process-mode site's pool is alive and grouped, the attacker tries every TCP port the site's
controller listens on with a TCPStore client (the store's own wire protocol, written here with
the standard library: the other user has no torch) -- set a key, check and read the key the
site put there -- and every file of the pool's directory (read, append, list). It can do
none of it; every listening TCP socket of the controller and the workers (gloo's included) is
bound to the loopback address; and the site trains on afterwards.

A control shows that the attacker's client is real: against a TCPStore on 127.0.0.1 (what the
workers' rendezvous used to be) it reads and writes keys.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _site_helpers import initial_weights, new_owner, run, settings

from clients.pools import PoolKey, close_pools, live_pools, task_identity
from fedagg.builtin import builtin_task

NOBODY = 65534
PROBE = "fedagg-probe-value"

# A TCPStore client in the standard library (torch's c10d wire format: a validation message,
# then <query type u8> and length-prefixed (u64) keys / values; the client prefixes keys '/').
_ATTACKER = r'''
import json, os, socket, struct, sys
VALIDATE, SET, GET, CHECK = 0, 1, 3, 5
MAGIC = 0x3C85F7CE

def s_str(b):
    return struct.pack("<Q", len(b)) + b

def recvn(s, n):
    out = b""
    while len(out) < n:
        c = s.recv(n - len(out))
        if not c:
            raise ConnectionError("closed by the store")
        out += c
    return out

def store(port):
    got = {"port": port, "connected": False, "wrote": False, "read": None, "error": ""}
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=3)
        got["connected"] = True
        s.sendall(struct.pack("<BI", VALIDATE, MAGIC))
        s.sendall(struct.pack("<B", SET) + s_str(b"/planted") + s_str(b"evil"))
        got["wrote"] = True  # sent; the victim checks whether it landed
        s.sendall(struct.pack("<B", CHECK) + struct.pack("<Q", 1) + s_str(b"/probe"))
        if struct.unpack("<B", recvn(s, 1))[0] == 0:
            s.sendall(struct.pack("<B", GET) + s_str(b"/probe"))
            n = struct.unpack("<Q", recvn(s, 8))[0]
            got["read"] = recvn(s, n).decode(errors="replace")
        s.close()
    except Exception as exc:
        got["error"] = f"{type(exc).__name__}: {exc}"
    return got

def path(p):
    got = {"path": p, "read": False, "wrote": False, "listed": False, "error": []}
    for what, fn in (("read", lambda: open(p, "rb").read(64)),
                     ("wrote", lambda: open(p, "ab").close()),
                     ("listed", lambda: os.listdir(p))):
        try:
            fn()
            got[what] = True
        except Exception as exc:
            got["error"].append(f"{what}: {type(exc).__name__}")
    return got

args = json.loads(sys.argv[1])
print(json.dumps({"stores": [store(p) for p in args["ports"]],
                  "paths": [path(p) for p in args["paths"]]}))
'''


def _setpriv(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           *cmd], capture_output=True, text=True, timeout=120, cwd="/")


def _attacker_python() -> tuple[str, str]:
    """(an interpreter uid 65534 can run, '') or ('', why the test is skipped)."""
    if os.getuid() != 0:
        return "", "switching to another uid needs root (CI runs these tests as root)"
    if shutil.which("setpriv") is None:
        return "", "setpriv (util-linux) is not installed"
    if _setpriv("true").returncode != 0:
        return "", "setpriv cannot switch to uid 65534 here (no CAP_SETUID in this container)"
    for exe in dict.fromkeys([sys.executable, "/usr/bin/python3", shutil.which("python3") or ""]):
        if exe and _setpriv(exe, "-c", "import json, socket, struct").returncode == 0:
            return exe, ""
    return "", "no Python interpreter that uid 65534 can run (this one is in a private home)"


_PY, _SKIP = _attacker_python()
pytestmark = pytest.mark.skipif(bool(_SKIP), reason=_SKIP or "-")


def _attack(ports: list[int], paths: list[str]) -> dict[str, list[dict[str, object]]]:
    p = _setpriv(_PY, "-c", _ATTACKER, json.dumps({"ports": ports, "paths": paths}))
    assert p.returncode == 0, p.stderr
    out: dict[str, list[dict[str, object]]] = json.loads(p.stdout)
    return out


def _address(hexaddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of /proc/net/tcp{,6} (each 32-bit word little-endian)."""
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(words)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def _listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket of process ``pid`` (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[9] in inodes and f[3] == "0A":  # TCP_LISTEN
                host, port = f[1].split(":")
                out.append((str(_address(host)), int(port, 16)))
    return out


def test_the_attackers_store_client_works_on_a_loopback_tcpstore() -> None:
    """Control: a TCPStore bound to 127.0.0.1 alone is still open to every local user."""
    from fedagg.collectives.backends.torch_dist import host_store

    store, port = host_store(10.0)
    store.set("probe", PROBE)
    assert [a for a, p in _listeners(os.getpid()) if p == port] == ["127.0.0.1"]
    got = _attack([port], [])["stores"][0]
    assert got["read"] == PROBE and store.get("planted") == b"evil", got


def _rendezvous(store: object) -> Any:
    """The controller's handle on the workers' store (a path to a file store, or a store)."""
    if isinstance(store, str | Path):
        from fedagg.collectives.backends.torch_dist import file_store

        return file_store(str(store))
    return store


@pytest.mark.slow
@pytest.mark.gloo
def test_another_uid_can_neither_read_nor_write_the_workers_store() -> None:
    owner = new_owner()
    site = {"workers": 2, "mode": "process"}
    w = initial_weights(settings())
    res = run(settings(site=site), w, owner=owner)
    pool = live_pools()[PoolKey(*owner, task_identity(builtin_task(settings().cfg))[0])]
    try:
        rendezvous = _rendezvous(pool._store)
        rendezvous.set("probe", PROBE)  # what the attacker must not read
        pids = [os.getpid(), *pool.pids()]
        listening = {pid: _listeners(pid) for pid in pids}
        pool_dir = pool._dir
        assert pool_dir is not None
        files = [str(p) for p in sorted(pool_dir.iterdir())]
        got = _attack([port for _, port in listening[os.getpid()]], [str(pool_dir), *files])
        for s in got["stores"]:
            assert s["read"] is None, f"the other uid read the store: {s}"
        assert not rendezvous.check(["planted"]), "the other uid wrote a key into the store"
        for p in got["paths"]:
            assert not (p["read"] or p["wrote"] or p["listed"]), f"the other uid reached {p}"
        assert any("store" in Path(f).name for f in files), files
        assert (pool_dir.stat().st_mode & 0o777) == 0o700

        outside = {pid: [a for a in ls if not ipaddress.ip_address(a[0]).is_loopback]
                   for pid, ls in listening.items()}
        assert not any(outside.values()), f"listening beyond loopback: {listening}"
        assert any(listening[p] for p in pool.pids()), "gloo's sockets were expected"

        again = run(settings(server_round=2, site=site), res.weights, owner=owner)
        assert again.metrics["workers_started"] == 0  # the same pool trains on
    finally:
        close_pools(owner[0])
