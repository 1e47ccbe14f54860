"""The shipped nginx file (``deploy/nginx/fedagg-fleet.conf``) rendered and run in a test.

``render_proxy_conf`` fills in its four placeholders; ``nginx_main_conf`` is a private
``nginx.conf`` (pid, logs and temp paths in the test's directory) that includes it, as Debian's
``/etc/nginx/nginx.conf`` includes ``conf.d/*.conf`` on a server.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "deploy" / "nginx" / "fedagg-fleet.conf"
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)
NO_NGINX = ("nginx not found: install it (Debian: apt-get install nginx-light; .ci/run does) to "
            "test deploy/nginx/fedagg-fleet.conf")


def render_proxy_conf(public_listen: str, superlink: str, cert_dir: Path,
                      upstream_name: str = "localhost") -> str:
    """``deploy/nginx/fedagg-fleet.conf`` with its four placeholders filled in."""
    text = CONF.read_text()
    for key, value in {"@PUBLIC_LISTEN@": public_listen, "@SUPERLINK@": superlink,
                       "@CERT_DIR@": str(cert_dir), "@UPSTREAM_NAME@": upstream_name}.items():
        assert key in text, f"{CONF.name} lost its placeholder {key}"
        text = text.replace(key, value)
    return text


def nginx_main_conf(run_dir: Path, include: Path) -> str:
    """A private nginx.conf (pid, logs, temp paths under ``run_dir``) including the site file."""
    user = "user root root;\n" if os.geteuid() == 0 else ""  # no switch to www-data in a test
    temp = "\n".join(f"  {k}_temp_path {run_dir / 'tmp' / k};"
                     for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return (f"{user}worker_processes 1;\npid {run_dir / 'nginx.pid'};\n"
            f"events {{ worker_connections 256; }}\n"
            f"http {{\n  access_log {run_dir / 'access.log'};\n{temp}\n"
            f"  include {include};\n}}\n")


def nginx_command(run_dir: Path, error_log: Path) -> list[str]:
    """The command that runs nginx in the foreground on ``run_dir/nginx.conf``."""
    assert NGINX is not None, NO_NGINX
    return [NGINX, "-p", str(run_dir), "-c", str(run_dir / "nginx.conf"), "-e", str(error_log),
            "-g", "daemon off;"]
