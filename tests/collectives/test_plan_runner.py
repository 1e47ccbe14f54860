"""The C++ plan runner's switch and its fallback (the runner itself: test_collectives_gloo.py).

The tests that build the runner are in the slow lane (a C++ compile, about a minute on 2
cores the first time); the switch and the fallback are tested with the build replaced.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedagg.collectives import InProcessGroup, all_reduce, last_stats, plan_runner
from fedagg.errors import ConfigError


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget any loaded module for the test (restored afterwards)."""
    monkeypatch.setattr(plan_runner, "_state", {})


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("", "auto"),
        ("auto", "auto"),
        ("0", "off"),
        ("OFF", "off"),
        ("1", "require"),
        ("require", "require"),
    ],
)
def test_mode_reads_the_environment(monkeypatch: pytest.MonkeyPatch, raw: str, want: str) -> None:
    monkeypatch.setenv(plan_runner.ENV, raw)
    assert plan_runner.mode() == want
    assert plan_runner.disabled() == (want == "off")


def test_bad_mode_names_the_variable_and_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plan_runner.ENV, "fast")
    with pytest.raises(ConfigError) as info:
        plan_runner.load()
    text = str(info.value)
    assert plan_runner.ENV in text and "fast" in text and "require" in text


def test_off_never_builds(monkeypatch: pytest.MonkeyPatch, fresh_state: None) -> None:
    def boom() -> tuple[None, str]:
        raise AssertionError("built although off")

    monkeypatch.setenv(plan_runner.ENV, "0")
    monkeypatch.setattr(plan_runner, "_build", boom)
    assert plan_runner.load() is None


def test_failed_build_falls_back_once_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, fresh_state: None, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []

    def failing() -> tuple[None, str]:
        calls.append(1)
        return None, "RuntimeError: no compiler"

    monkeypatch.setenv(plan_runner.ENV, "auto")
    monkeypatch.setattr(plan_runner, "_build", failing)
    with caplog.at_level(logging.WARNING, logger=plan_runner.__name__):
        assert plan_runner.load() is None
        assert plan_runner.load() is None
    assert calls == [1]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no compiler" in warnings[0].getMessage()


def test_require_raises_when_the_build_fails(
    monkeypatch: pytest.MonkeyPatch, fresh_state: None
) -> None:
    monkeypatch.setenv(plan_runner.ENV, "require")
    monkeypatch.setattr(plan_runner, "_build", lambda: (None, "RuntimeError: no compiler"))
    with pytest.raises(ConfigError) as info:
        plan_runner.load()
    assert "no compiler" in str(info.value) and "g++" in str(info.value)


@pytest.mark.slow  # compiles the C++ runner (about a minute, the first time)
def test_the_extension_builds_and_has_a_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plan_runner.ENV, "require")
    module = plan_runner.load()
    assert module is not None and hasattr(module, "PlanRunner")


@pytest.mark.slow  # compiles the C++ runner (about a minute, the first time)
def test_cli_builds_or_finds_it() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "fedagg.collectives.plan_runner"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "fedagg plan runner:" in out.stdout and ".so" in out.stdout


def test_in_process_groups_use_the_python_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only torch.distributed communicators have a process group for the C++ runner."""
    import threading

    monkeypatch.setenv(plan_runner.ENV, "require")
    comms = InProcessGroup(2).communicators()
    seen: list[str] = []

    def work(c: object) -> None:
        t = torch.ones(10)
        all_reduce(t, algorithm="ring", comm=c)  # type: ignore[arg-type]
        st = last_stats()
        seen.append(st.runner if st else "")

    threads = [threading.Thread(target=work, args=(c,)) for c in comms]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert seen == ["python", "python"]


_PROBE = (
    "import sys, torch\n"
    "from fedagg.collectives import plan_runner\n"
    "m = plan_runner.load()\n"
    "print(m is not None, 'torch.utils.cpp_extension' in sys.modules)\n"
)


def _probe(env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=600, env=env
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.slow  # compiles the C++ runner (about a minute, the first time)
def test_a_built_runner_loads_without_the_extension_builder(tmp_path: Path) -> None:
    """Second and later processes import the built module directly (site workers start often)."""
    monkeypatch_env = {plan_runner.ENV: "require"}
    built = plan_runner.load() if not plan_runner.disabled() else None
    assert built is not None
    env = {
        **os.environ,
        **monkeypatch_env,
        "XDG_CACHE_HOME": str(tmp_path),  # fedagg's pointer files go here (fresh) ...
        # ... while torch keeps finding the extension it built (its cache follows XDG too)
        "TORCH_EXTENSIONS_DIR": str(Path(built.__file__).parent.parent),
    }
    assert _probe(env) == "True True"  # no pointer yet: torch's loader, which writes one
    pointers = list((tmp_path / "fedagg").glob("plan_runner-*.path"))
    assert len(pointers) == 1
    assert _probe(env) == "True False"  # the pointer: no torch.utils.cpp_extension import
    pointers[0].write_text(str(tmp_path / "missing.so"))  # stale pointer: back to torch's loader
    assert _probe(env) == "True True"
    assert pointers[0].read_text().endswith(".so") and "missing" not in pointers[0].read_text()
