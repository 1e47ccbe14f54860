"""The site worker service: a deployed site's persistent workers (``fedagg site-workers``).

In deployment Flower starts a fresh ClientApp process for every message, so a pool kept in
that process would die with it. An operator therefore starts the site's workers once, next to
the SuperNode and as the same user::

    fedagg site-workers --socket /run/fedagg/site-a/workers.sock --workers 4
    flower-supernode ... --node-config "site-name='site-a' worker-service='/run/fedagg/site-a/workers.sock'"

The service (:class:`WorkerService`) keeps one :class:`~clients.pool.WorkerPool` of K
``python -m clients.pool_worker`` processes per (run, node, task) -- the registry of
:mod:`clients.pool` -- for as long as the run sends rounds (closed after
``site.pool_idle_timeout`` idle seconds, or when the service stops). Each train message's
ClientApp process connects (:class:`ServiceClient`), sends the task (pickled), its import
path (the app bundle) and the round's job -- global weights and settings -- and gets the
site's update and metrics back.

Access. The protocol carries pickles, so whoever can connect can run code as the service's
user. Three locks: the socket's directory must be the user's own and closed to everyone else
(mode 0700; created so if missing, refused otherwise), the socket is 0600, and every
connection must answer an HMAC challenge with the service's token (``multiprocessing``'s
connection authentication; 32 random bytes in ``<socket>.token``, 0600, unless
``--token-file`` names one) before anything is unpickled; on Linux the peer's uid
(``SO_PEERCRED``) must also be the service's. Nothing listens on the network.

Stopping: SIGTERM or SIGINT closes every pool (workers asked to exit, then killed by PID and
reaped) and removes the socket and a generated token; the workers also exit by themselves if
the service dies (their connection closes, their parent is gone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import secrets
import signal
import socket
import stat
import struct
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from clients.pools import PoolKey, live_pools, pool_for, task_identity
from clients.site_round import SiteResult, default_device, site_result, with_site
from clients.worker import WorkerJob
from fedagg.config import SiteConfig
from fedagg.errors import ConfigError, WorkerError, explain

__all__ = ["PROTOCOL", "ServiceClient", "WorkerService", "private_dir", "token_path"]

_log = logging.getLogger(__name__)

PROTOCOL = 1
"""Version of the request format (ClientApp and service must run the same fedagg)."""


def token_path(socket_path: str | Path) -> Path:
    """The default token file of a service socket: ``<socket>.token``."""
    return Path(str(socket_path) + ".token")


def private_dir(path: Path) -> None:
    """Create ``path`` (mode 0700) or check it is this user's and closed to others.

    Raises
    ------
    ConfigError
        The directory belongs to another user or is open to group / others.
    """
    if not path.exists():
        path.mkdir(mode=0o700, parents=True)
        os.chmod(path, 0o700)
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(explain("--socket", str(path), "its parent must be a directory",
                                  "put the socket in a private directory"))
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(explain(
            "--socket directory", f"{path} (owner uid {st.st_uid}, mode {oct(st.st_mode & 0o777)})",
            "must belong to this user and be closed to group and others (0700): anyone who "
            "can connect can run code as this user",
            f"chmod 700 {path} (as its owner), or pick a directory of your own"))


def _peer_uid(conn: Connection) -> int | None:
    """The connected peer's uid (Linux ``SO_PEERCRED``), None where unavailable."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    finally:
        sock.close()
    return int(struct.unpack("3i", creds)[1])


class WorkerService:
    """Serve persistent site workers on a local unix socket (see the module docstring).

    Parameters
    ----------
    socket_path : path
        Where to listen (its directory must be private, see :func:`private_dir`).
    workers : int, optional
        Workers per pool; default: the run's ``site.workers``.
    device : str, optional
        ``"cpu"`` or ``"cuda"``; default: CUDA when at least K GPUs are visible.
    token_file : path, optional
        The token; default: 32 random bytes written to ``<socket>.token`` (0600).
    threads : int, optional
        torch threads per worker; default ``cpu_count // K``.
    """

    def __init__(self, socket_path: str | Path, *, workers: int | None = None,
                 device: str | None = None, token_file: str | Path | None = None,
                 threads: int | None = None) -> None:
        self.path = Path(socket_path).absolute()
        self.workers = workers
        self.device = device
        self.threads = threads
        private_dir(self.path.parent)
        self._own_token = token_file is None
        self.token_file = Path(token_file) if token_file is not None else token_path(self.path)
        self._stop = threading.Event()
        self._listener: Listener | None = None
        self._token = self._load_token()

    def _load_token(self) -> bytes:
        if not self._own_token:
            token = self.token_file.read_bytes().strip()
            if len(token) < 16:
                raise ConfigError(explain("--token-file", str(self.token_file),
                                          "must hold at least 16 bytes",
                                          "e.g. python -c 'import secrets; print(secrets.token_hex(32))' > FILE"))
            return token
        token = secrets.token_hex(32).encode()
        with contextlib.suppress(FileNotFoundError):
            self.token_file.unlink()
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(token)
        return token

    def _bind(self) -> Listener:
        if len(os.fsencode(self.path)) > 107:
            raise ConfigError(explain("--socket", str(self.path),
                                      "a unix socket path must be at most 107 bytes",
                                      "pick a shorter path, e.g. /run/fedagg/<site>/workers.sock"))
        if self.path.exists():
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                    probe.connect(str(self.path))
            except OSError:
                self.path.unlink()  # stale socket of a service that is gone
            else:
                raise ConfigError(explain("--socket", str(self.path),
                                          "another worker service is listening there",
                                          "stop it first, or pick another socket path"))
        old = os.umask(0o177)
        try:
            listener = Listener(str(self.path), family="AF_UNIX", authkey=self._token)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        return listener

    def serve_forever(self) -> int:
        """Accept ClientApp connections until SIGTERM / SIGINT (or :meth:`stop`); exit status."""
        self._listener = self._bind()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread (tests)
                signal.signal(sig, lambda *_: self._stop.set())
        threading.Thread(target=self._accept_loop, name="fedagg-service-accept",
                         daemon=True).start()
        _log.info("fedagg site-workers: listening on %s (workers %s, device %s, pid %d)",
                  self.path, self.workers or "from the run config", self.device or "auto",
                  os.getpid())
        try:
            while not self._stop.wait(0.5):
                pass
        finally:
            self.close()
        return 0

    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return."""
        self._stop.set()

    def close(self) -> None:
        """Stop listening, close every pool, remove the socket (and a generated token)."""
        from clients.pools import close_pools

        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
            self._listener = None
        n = close_pools()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        if self._own_token:
            with contextlib.suppress(FileNotFoundError):
                self.token_file.unlink()
        _log.info("fedagg site-workers: stopped (%d pool(s) closed)", n)

    def _accept_loop(self) -> None:
        while not self._stop.is_set() and self._listener is not None:
            try:
                conn = self._listener.accept()
            except OSError:
                return  # closed
            except Exception as exc:  # failed the token challenge
                _log.warning("refused a connection: %s", exc)
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True,
                             name="fedagg-service-conn").start()

    def _handle(self, conn: Connection) -> None:
        try:
            uid = _peer_uid(conn)
            if uid is not None and uid != os.getuid():
                _log.warning("refused a connection from uid %d", uid)
                return
            request = pickle.loads(conn.recv_bytes())
            reply = self._dispatch(request)
            conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        except (EOFError, OSError) as exc:
            _log.warning("connection closed early: %s", exc)
        finally:
            conn.close()

    def _dispatch(self, req: dict[str, Any]) -> dict[str, Any]:
        if req.get("version") != PROTOCOL:
            return {"ok": False, "type": "ProtocolError", "error": explain(
                "worker service request", f"version {req.get('version')}",
                f"this service speaks version {PROTOCOL}",
                "run the same fedagg version in the app and the service")}
        if req.get("op") == "status":
            return {"ok": True, "pid": os.getpid(), "pools": [
                {"run_id": k.run_id, "node_id": k.node_id, "task": k.task, "mode": p.mode,
                 "pids": getattr(p, "pids", lambda: [])(), "rounds": p.rounds,
                 "idle_seconds": time.monotonic() - p.last_used}
                for k, p in live_pools().items()]}
        if req.get("op") != "train":
            return {"ok": False, "type": "ProtocolError", "error": f"unknown op {req.get('op')!r}"}
        try:
            return {"ok": True, "result": self._train(req)}
        except (WorkerError, ConfigError) as exc:
            return {"ok": False, "type": type(exc).__name__, "error": str(exc)}
        except Exception as exc:  # reported to the site, logged here
            _log.exception("train request failed")
            return {"ok": False, "type": "WorkerError", "error": f"worker service: {exc!r}"}

    def _train(self, req: dict[str, Any]) -> SiteResult:
        t0 = time.perf_counter()
        site = SiteConfig.model_validate(req["site"])
        update: dict[str, Any] = {"mode": "process", "persistent": True}
        if self.workers is not None:
            update["workers"] = self.workers
        site = site.model_copy(update=update)
        job: WorkerJob = req["job"]
        if self.threads:
            job.threads = self.threads
        device = self.device or default_device(site)
        job = with_site(job, site, device)
        run_id, node_id = req["owner"]
        name = str(req.get("name", "site"))
        pool = pool_for(PoolKey(int(run_id), int(node_id), str(req["task_id"])), site, name=name,
                        device=device, task_blob=req["task"], sys_path=list(req["sys_path"]))
        results, info = pool.run(job, None, server_round=int(req.get("round", 0)))
        return site_result(results, info, time.perf_counter() - t0, site, name=name,
                           epochs=job.settings.epochs)


class ServiceClient:
    """A ClientApp's side of the worker service: send the round, get the site's update.

    Parameters
    ----------
    socket_path : str
        The service's socket (node config ``worker-service``).
    token_file : str, optional
        Its token (node config ``worker-service-token``; default ``<socket>.token``).
    """

    def __init__(self, socket_path: str, *, token_file: str | None = None) -> None:
        self.path = socket_path
        self.token_file = Path(token_file) if token_file else token_path(socket_path)

    def _connect(self) -> Connection:
        fix = (f"start the service as this SuperNode's user: fedagg site-workers --socket "
               f"{self.path} --workers K")
        try:
            token = self.token_file.read_bytes().strip()
        except OSError as exc:
            raise WorkerError(explain("node_config.worker-service-token", str(self.token_file),
                                      f"must be readable ({exc.strerror})", fix)) from None
        try:
            return Client(self.path, family="AF_UNIX", authkey=token)
        except (OSError, EOFError) as exc:
            raise WorkerError(explain("node_config.worker-service", self.path,
                                      f"no worker service answers there ({exc})", fix)) from None
        except Exception as exc:  # multiprocessing.AuthenticationError
            raise WorkerError(explain("node_config.worker-service-token", str(self.token_file),
                                      f"the service refused the token ({exc})",
                                      "point worker-service-token at the service's token file")
                              ) from None

    def request(self, req: dict[str, Any]) -> dict[str, Any]:
        """Send one request, wait for its reply."""
        conn = self._connect()
        try:
            conn.send_bytes(pickle.dumps({"version": PROTOCOL, **req},
                                         protocol=pickle.HIGHEST_PROTOCOL))
            reply: dict[str, Any] = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise WorkerError(explain("node_config.worker-service", self.path,
                                      f"the service closed the connection ({exc!r})",
                                      "see the service's log")) from None
        finally:
            conn.close()
        return reply

    def status(self) -> dict[str, Any]:
        """The service's pools (run, node, task, worker PIDs, rounds, idle seconds)."""
        return self.request({"op": "status"})

    def train(self, job: WorkerJob, site: SiteConfig, *, name: str, server_round: int,
              owner: tuple[int, int] | None) -> SiteResult:
        """Train the round on the service's persistent workers.

        Raises
        ------
        WorkerError
            No service, a refused token, or the site's workers failed (the service's text).
        ConfigError
            The task cannot be pickled (it must reach the worker processes).
        """
        from clients.pool_proc import worker_path

        t0 = time.perf_counter()
        identity, blob = task_identity(job.task)
        if blob is None:
            raise ConfigError(explain(
                "node_config.worker-service", self.path,
                "the Task must be picklable to reach the service's worker processes",
                "define the model, data, loss, optimizer and step functions at module level"))
        reply = self.request({
            "op": "train", "owner": owner or (0, 0), "task_id": identity, "task": blob,
            "sys_path": worker_path(), "site": site.model_dump(mode="json"), "name": name,
            "round": server_round, "job": dataclasses.replace(job, task=None)})  # type: ignore[arg-type]
        if not reply.get("ok"):
            cls = ConfigError if reply.get("type") == "ConfigError" else WorkerError
            raise cls(str(reply.get("error")))
        result: SiteResult = reply["result"]
        wall = time.perf_counter() - t0
        result.metrics["site_seconds"] = wall
        result.metrics["overhead_seconds"] = max(0.0, wall - result.metrics["train_seconds"])
        return result
