"""Every code block of docs/tutorial-own-model.md and docs/api/public.md runs.

Python blocks run in order as one script (a real Flower simulation included); TOML blocks are
parsed and their fedagg keys validated as a run config; bash blocks run line by line.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from server.app import config_from_run_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "docs" / "tutorial-own-model.md", ROOT / "docs" / "api" / "public.md"]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def _blocks(path: Path, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(path.read_text()) if kind == lang]


def test_every_block_is_python_toml_or_bash() -> None:
    for doc in DOCS:
        kinds = {kind for kind, _ in FENCE.findall(doc.read_text())}
        assert kinds <= {"python", "toml", "bash"}, (doc, kinds)
        assert _blocks(doc, "python"), doc


@pytest.mark.flower
@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_python_blocks_run_as_one_script(doc: Path, tmp_path: Path) -> None:
    script = tmp_path / f"{doc.stem}.py"
    script.write_text("\n\n".join(_blocks(doc, "python")))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])


def test_toml_blocks_are_valid_fedagg_run_configs() -> None:
    for doc in DOCS:
        for body in _blocks(doc, "toml"):
            data = tomllib.loads(body)
            config = data.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})
            assert config, body
            config_from_run_config(config)  # raises ConfigError on a bad key or value


def test_bash_blocks_run() -> None:
    for doc in DOCS:
        for body in _blocks(doc, "bash"):
            for line in filter(None, (ln.strip() for ln in body.splitlines())):
                proc = subprocess.run(line, shell=True, capture_output=True, text=True,
                                      timeout=120, cwd=ROOT)
                assert proc.returncode == 0, (line, proc.stderr[-1000:])
