"""The fast lane stays fast: heavy tests carry the ``slow`` marker.

``pytest -m "not slow"`` (the README's fast lane) must not start Flower's simulation engine,
Ray, torch.distributed (gloo) process groups or a deployment. This reads every test module
(its syntax tree, nothing is imported or run) and fails for a test that does one of these
without being marked ``slow`` (itself, its class, or the module's ``pytestmark``):

* marked ``flower``, ``gloo`` or ``deploy``;
* calling ``run_simulation``, ``ray.init``, ``init_process_group`` or torch's ``spawn``, or
  naming ``flower-superlink`` / ``flower-supernode``, itself or through a helper function or
  fixture of its module (followed by name, transitively).

The second test checks the collected session itself: with the fast lane selected, no item
carrying one of those markers is left.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
HEAVY_MARKS = {"flower", "gloo", "deploy"}
HEAVY_CALLS = {"run_simulation", "init_process_group", "spawn", "start_processes"}
HEAVY_ATTR_CALLS = {("ray", "init")}
HEAVY_STRINGS = ("flower-superlink", "flower-supernode")


def _marks(nodes: list[ast.expr]) -> set[str]:
    """Names X of every ``pytest.mark.X`` (called or not) in ``nodes``."""
    out: set[str] = set()
    for node in nodes:
        for sub in ast.walk(node):
            if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute)
                    and sub.value.attr == "mark"):
                out.add(sub.attr)
    return out


def _module_marks(tree: ast.Module) -> set[str]:
    values = [n.value for n in tree.body if isinstance(n, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)]
    return _marks(list(values))


def _heavy_here(fn: ast.AST) -> str:
    """What in ``fn``'s own body starts something heavy ('' if nothing)."""
    compared = {id(c) for node in ast.walk(fn) if isinstance(node, ast.Compare)
                for c in (node.left, *node.comparators)}  # "flower-superlink" in text: no start
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in HEAVY_CALLS:
                return f"calls {f.id}()"
            if isinstance(f, ast.Attribute):
                if f.attr in HEAVY_CALLS:
                    return f"calls .{f.attr}()"
                if isinstance(f.value, ast.Name) and (f.value.id, f.attr) in HEAVY_ATTR_CALLS:
                    return f"calls {f.value.id}.{f.attr}()"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in compared:
            for s in HEAVY_STRINGS:
                if node.value == s or node.value.endswith("/" + s):
                    return f"starts {s}"
    return ""


def _names_used(fn: ast.AST) -> set[str]:
    used = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
        used |= {a.arg for a in fn.args.args + fn.args.kwonlyargs}  # fixtures by name
    return used


def _tests(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef,
                                              set[str]]]:
    """``(name, function, marks of its class)`` of every test function."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            yield node.name, node, set()
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef) \
                        and sub.name.startswith("test"):
                    yield f"{node.name}.{sub.name}", sub, _marks(node.decorator_list)


def unmarked_heavy_tests(path: Path, root: Path = TESTS.parent) -> list[str]:
    """The tests of one module that start something heavy without the ``slow`` marker."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_marks(tree)
    if "slow" in module:
        return []
    helpers = {n.name: n for n in ast.walk(tree)
               if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    heavy_cache: dict[str, str] = {}

    def heavy(name: str, seen: frozenset[str]) -> str:
        if name in heavy_cache:
            return heavy_cache[name]
        fn = helpers[name]
        why = _heavy_here(fn)
        if not why:
            for used in sorted(_names_used(fn) & set(helpers) - seen - {name}):
                inner = heavy(used, seen | {name})
                if inner:
                    why = f"{used}: {inner}"
                    break
        heavy_cache[name] = why
        return why

    bad = []
    for name, fn, class_marks in _tests(tree):
        marks = module | class_marks | _marks(fn.decorator_list)
        if "slow" in marks:
            continue
        why = ", ".join(f"marked {m}" for m in sorted(marks & HEAVY_MARKS))
        why = why or heavy(fn.name, frozenset())
        if why:
            bad.append(f"{path.relative_to(root)}::{name} ({why})")
    return bad


def test_tests_that_start_engines_processes_or_deployments_are_slow() -> None:
    modules = sorted(TESTS.rglob("test_*.py"))
    assert len(modules) > 100, modules
    bad = [b for path in modules for b in unmarked_heavy_tests(path)]
    assert not bad, ("mark these @pytest.mark.slow (or the module's pytestmark): they start "
                     "Flower's engine, Ray, gloo processes or a deployment:\n  " + "\n  ".join(bad))


def test_the_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    sample = tmp_path / "tests" / "test_sample.py"
    sample.parent.mkdir()
    sample.write_text(
        "import pytest\n"
        "from flwr.simulation import run_simulation\n\n"
        "def _go():\n    run_simulation(None, None, 1)\n\n"
        "@pytest.fixture\ndef engine():\n    _go()\n\n"
        "def test_uses_fixture(engine):\n    pass\n\n"
        "@pytest.mark.gloo\ndef test_gloo():\n    pass\n\n"
        "@pytest.mark.slow\n@pytest.mark.gloo\ndef test_gloo_slow():\n    pass\n\n"
        "def test_plain():\n    assert 1\n\n"
        "def test_ray():\n    import ray\n    ray.init()\n\n"
        "def test_superlink():\n    subprocess.Popen([BIN / 'flower-superlink', '--insecure'])\n\n"
        "def test_reads_docs():\n    assert 'flower-superlink' in DOC\n")
    try:
        found = {b.split("::")[1].split(" ")[0]
                 for b in unmarked_heavy_tests(sample, root=tmp_path)}
    finally:
        sample.unlink()
    assert found == {"test_uses_fixture", "test_gloo", "test_ray", "test_superlink"}, found


def test_no_selected_item_is_heavy_without_slow(request: pytest.FixtureRequest) -> None:
    """In this session's collection (the whole suite, or the fast lane), every item marked
    flower / gloo / deploy is also marked slow."""
    bad = [item.nodeid for item in request.session.items
           if any(item.get_closest_marker(m) for m in HEAVY_MARKS)
           and item.get_closest_marker("slow") is None]
    assert not bad, bad


def _conftest() -> object:
    spec = importlib.util.spec_from_file_location("_lanes_conftest", TESTS / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_plan_runner_is_built_before_the_first_gloo_test_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fedagg.collectives import plan_runner

    conftest = _conftest()
    builds: list[int] = []
    monkeypatch.setattr(plan_runner, "load", lambda: builds.append(1))
    monkeypatch.setattr(plan_runner, "disabled", lambda: False)

    class Item:
        def __init__(self, *marks: str) -> None:
            self.marks = set(marks)

        def get_closest_marker(self, name: str) -> object:
            return name if name in self.marks else None

    setup = conftest.pytest_runtest_setup  # type: ignore[attr-defined]
    setup(Item())
    setup(Item("slow", "flower"))
    assert builds == []
    setup(Item("slow", "gloo"))
    setup(Item("slow", "gloo"))
    assert builds == [1]  # once


def test_the_fast_lane_compiles_nothing_at_start(tmp_path: Path) -> None:
    """A fresh cache, the fast lane selected: pytest's start builds no C++ plan runner."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}
    target = f"{Path(__file__).relative_to(TESTS.parent)}::test_the_scan_finds_what_it_looks_for"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p",
                           "no:cacheprovider", "-m", "not slow", target],
                          cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    built = list((tmp_path / "torch_extensions").rglob("*plan*")) + list(
        (tmp_path / "cache").rglob("plan_runner*"))
    assert not built, built
