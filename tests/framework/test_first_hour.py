"""The README's test command, as a new user runs it on a fresh clone.

The README's command and CI (``.ci/run``) install the same Debian packages and end with plain
``pytest`` (not ``python -m pytest``, which hides import-path problems); a fresh ``git clone``
collects the whole suite and runs a fast part of it with plain ``pytest`` from its own root,
importing its own packages (``pythonpath = ["."]`` in pyproject), not an installed copy.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _readme_command() -> str:
    text = (ROOT / "README.md").read_text()
    return next(ln for ln in re.findall(r"```bash\n(.*?)```", text, re.S)[1].splitlines()
                if "pytest" in ln)


def _apt(line: str) -> set[str]:
    m = re.search(r"apt-get install -y (?:-qq )?([^&>]+)", line)
    assert m, line
    return set(m.group(1).split())


def test_readme_and_ci_install_the_same_packages_and_run_plain_pytest() -> None:
    readme = _readme_command()
    ci = (ROOT / ".ci" / "run").read_text()
    ci_apt = next(ln for ln in ci.splitlines() if "apt-get install" in ln)
    assert _apt(readme) == _apt(ci_apt)
    assert readme.rstrip().endswith("&& pytest")
    assert re.search(r"^pytest\b", ci, re.M) and "python -m pytest" not in ci


@pytest.mark.slow
def test_a_fresh_clone_runs_plain_pytest_from_its_own_root(tmp_path: Path) -> None:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.fail("this test needs the git checkout it belongs to")
    clone = tmp_path / "fedagg"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env.pop("PYTEST_XDIST_WORKER", None)
    collect = subprocess.run(["pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                             cwd=clone, capture_output=True, text=True, timeout=300, env=env)
    assert collect.returncode == 0, collect.stdout[-3000:] + collect.stderr[-2000:]
    assert re.search(r"\d+ tests collected", collect.stdout), collect.stdout[-500:]
    run = subprocess.run(["pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                          "tests/core/test_config.py", "tests/update"],
                         cwd=clone, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:]
