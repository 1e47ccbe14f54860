"""docs/deployment.md's recipe, read as an operator follows it on a fresh host.

* the SuperLink's database directory is created, with its owner, before the first command
  that passes ``--database`` in it (Flower does not create it: ``sqlite3.OperationalError:
  unable to open database file``), and that step works as written (run here on a temporary
  path, owned by this user);
* Flower's telemetry and update check are off in the environment of every Flower command
  of the recipe, in every systemd unit it shows and in ``deploy/demo.sh``.

The processes themselves are started by tests/deploy/test_deploy_closed.py (with
``--database`` in a directory made the same way).
"""

from __future__ import annotations

import getpass
import grp
import os
import re
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deployment.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
OFF = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
       "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
FLOWER = re.compile(r"^\s*(?:sudo -u \S+ env .*?)?(flower-superlink|flower-supernode|flwr)\b", re.M)


def _blocks(lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(DOC.read_text()) if kind == lang]


def test_database_directory_is_made_with_its_owner_before_it_is_used() -> None:
    text = DOC.read_text()
    first_use = text.index("--database /var/lib/fedagg/")
    made = re.search(r"install -d -o fedagg -g fedagg -m 700 /var/lib/fedagg\b", text)
    assert made is not None and made.start() < first_use, \
        "docs/deployment.md uses --database /var/lib/fedagg/... before it creates the directory"
    assert text.index("useradd --system") < made.start()  # the owner exists first


def test_database_directory_step_works_as_written(tmp_path: Path) -> None:
    block = next(b for b in _blocks("bash") if "install -d -o fedagg" in b)
    line = next(ln for ln in block.splitlines() if "install -d -o fedagg" in ln)
    me, group = getpass.getuser(), grp.getgrgid(os.getgid()).gr_name
    cmd = (line.removeprefix("sudo ").replace("/var/lib/fedagg", str(tmp_path / "var-lib-fedagg"))
           .replace("-o fedagg", f"-o {me}").replace("-g fedagg", f"-g {group}"))
    subprocess.run(cmd, shell=True, check=True, timeout=30)
    for d in (tmp_path / "var-lib-fedagg", tmp_path / "var-lib-fedagg" / "runs"):
        st = d.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid(), d


def test_every_flower_command_runs_with_telemetry_and_update_check_off() -> None:
    exported: dict[str, str] = {}
    checked = 0
    for block in _blocks("bash"):
        for name, value in re.findall(r"\b(FLWR_[A-Z_]+)=(\S+)", block):
            if re.search(rf"^\s*export\b.*\b{name}=", block, re.M):
                exported[name] = value
        for match in FLOWER.finditer(block):
            line = block[match.start():block.find("\n", match.start())]
            inline = dict(re.findall(r"\b(FLWR_[A-Z_]+)=(\S+)", block[:match.end()]
                                     .rsplit("\n\n", 1)[-1]))
            env = {**exported, **inline}
            missing = {k: v for k, v in OFF.items() if env.get(k) != v}
            assert not missing, f"{line.strip()!r} runs without {missing}"
            checked += 1
    assert checked >= 5, checked


def test_every_systemd_unit_sets_them() -> None:
    units = [b for b in _blocks("ini") if "[Service]" in b]
    assert len(units) >= 2, units
    for unit in units:
        for name in ("FLWR_TELEMETRY_ENABLED", "FLWR_DISABLE_UPDATE_CHECK"):
            assert f"Environment={name}={OFF[name]}" in unit, (name, unit)
    superlink = next(u for u in units if "flower-superlink" in u)
    assert "StateDirectory=fedagg" in superlink and "--database /var/lib/fedagg/" in superlink


def test_the_doc_says_why() -> None:
    text = DOC.read_text()
    assert "telemetry.flower.ai" in text and "update" in text.lower()


def test_demo_script_turns_them_off_and_makes_its_database_directory() -> None:
    demo = (ROOT / "deploy" / "demo.sh").read_text()
    export = next(ln for ln in demo.splitlines() if ln.startswith("export FLWR_DISABLE_RUNTIME"))
    for name, value in OFF.items():
        assert f"{name}={value}" in export, name
    assert demo.index('install -d -m 700 "$WORK/state"') < demo.index('--database "$WORK/state/')
