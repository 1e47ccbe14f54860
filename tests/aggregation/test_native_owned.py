"""Native code only from places the user owns: another local user cannot plant a fold kernel.

The attacker is a real second uid (65534, ``nobody``): its part runs under ``setpriv``. It
pre-creates the kernel's temp fallback directory (mode 0777) with a library whose constructor
writes a marker file; the victim (this uid, in a fresh process) must not load it, must fold on
the NumPy path with the same results, and must say so in one warning naming the directory and
the fix. Variants: a directory of another owner, a group-writable kernel file, a symbolic
link, a directory that is itself a link, another owner's file in the user's own directory.
The normal case still builds and loads, into a directory created with mode 0700.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedagg.accumulate import native

NOBODY = 65534
ROOT = Path(__file__).resolve().parents[2]

_PLANT = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("planted code ran", f); fclose(f); }
}
"""


def _as_nobody(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           *cmd], capture_output=True, text=True, timeout=60)


def _can_switch_uid() -> str:
    if os.getuid() != 0:
        return "switching to another uid needs root (CI runs these tests as root)"
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    if _as_nobody("true").returncode != 0:
        return "setpriv cannot switch to uid 65534 here (no CAP_SETUID in this container)"
    if shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None:
        return "no C compiler to build the planted library"
    return ""


_SKIP = _can_switch_uid()
pytestmark = pytest.mark.skipif(bool(_SKIP), reason=_SKIP or "-")


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory like /tmp (mode 1777) that the other uid can reach."""
    d = Path(tempfile.mkdtemp(prefix="fedagg-owned-", dir="/tmp"))
    d.chmod(0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _planted_library(shared: Path, marker: Path) -> Path:
    """A library whose constructor writes ``marker``, built where the attacker can read it."""
    src = shared / "plant.c"
    src.write_text(_PLANT % marker)
    out = shared / "plant.so"
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", str(out), str(src)],
                   check=True, capture_output=True)
    out.chmod(0o755)
    return out


_VICTIM = r"""
import json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
import numpy as np
from fedagg.accumulate import Accumulator, TensorSpec, native
ok = native.available()
x = np.random.default_rng(0).normal(size=4097).astype(np.float32)
out = []
for off in (False, True):
    acc = Accumulator([TensorSpec((x.size,), "float32", 0)], block=256, native=not off)
    for w in (1.0, 3.0, 0.5):
        acc.fold([x], w)
    out.append(acc.mean()[0])
print(json.dumps({"available": ok, "same": bool(np.array_equal(out[0], out[1]))}))
"""


def _victim(env: dict[str, str]) -> tuple[dict[str, bool], str]:
    full = {**os.environ, **env}
    full.pop(native.ENV, None)
    p = subprocess.run([sys.executable, "-c", _VICTIM], capture_output=True, text=True,
                       env=full, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def _name() -> str:
    return native._kernel_name(native._compiler())


def _assert_refused(env: dict[str, str], marker: Path, where: Path) -> None:
    got, err = _victim(env)
    assert not marker.exists(), "the planted library's constructor ran as the victim"
    assert got == {"available": False, "same": True}, (got, err)
    warnings = [ln for ln in err.splitlines() if ln.startswith("WARNING")]
    assert len(warnings) == 1, err
    assert str(where) in warnings[0] and "Fix:" in warnings[0] and "NumPy path" in warnings[0]


def _unusable_cache(shared: Path) -> str:
    blocker = shared / "not-a-dir"
    blocker.write_text("")
    return str(blocker / "cache")  # mkdir fails: the temp fallback is used


def test_planted_kernel_in_a_precreated_0777_fallback_is_not_loaded(shared_tmp: Path) -> None:
    """The attack: another uid creates $TMPDIR/fedagg-<uid> (0777) with a planted kernel of the
    victim's exact file name; the victim's cache directory cannot be created."""
    marker = shared_tmp / "marker"
    lib = _planted_library(shared_tmp, marker)
    fallback = shared_tmp / f"fedagg-{os.getuid()}"
    script = (f"mkdir -m 0777 {fallback} && cp {lib} {fallback}/{_name()} && "
              f"chmod 0777 {fallback}/{_name()}")
    r = _as_nobody("sh", "-c", script)
    assert r.returncode == 0, r.stderr
    assert fallback.stat().st_uid == NOBODY and (fallback / _name()).stat().st_uid == NOBODY
    shared_tmp.chmod(0o1777)
    _assert_refused({"FEDAGG_CACHE_DIR": _unusable_cache(shared_tmp), "TMPDIR": str(shared_tmp)},
                    marker, fallback)


def test_a_0700_directory_of_another_owner_is_not_loaded(shared_tmp: Path) -> None:
    marker = shared_tmp / "marker"
    lib = _planted_library(shared_tmp, marker)
    d = shared_tmp / "theirs"
    r = _as_nobody("sh", "-c", f"mkdir -m 0700 {d} && cp {lib} {d}/{_name()}")
    assert r.returncode == 0, r.stderr
    _assert_refused({"FEDAGG_CACHE_DIR": str(d)}, marker, d)  # root could read it: refused


def test_a_group_writable_kernel_file_is_not_loaded(shared_tmp: Path) -> None:
    marker = shared_tmp / "marker"
    lib = _planted_library(shared_tmp, marker)
    d = shared_tmp / "mine"
    d.mkdir(mode=0o700)
    shutil.copy(lib, d / _name())
    (d / _name()).chmod(0o775)
    _assert_refused({"FEDAGG_CACHE_DIR": str(d)}, marker, d / _name())


def test_another_owners_file_in_my_directory_is_not_loaded(shared_tmp: Path) -> None:
    marker = shared_tmp / "marker"
    lib = _planted_library(shared_tmp, marker)
    d = shared_tmp / "mine"
    d.mkdir(mode=0o700)
    shutil.copy(lib, d / _name())
    os.chown(d / _name(), NOBODY, NOBODY)
    (d / _name()).chmod(0o755)
    _assert_refused({"FEDAGG_CACHE_DIR": str(d)}, marker, d / _name())


def test_a_symlinked_kernel_file_is_not_followed(shared_tmp: Path) -> None:
    marker = shared_tmp / "marker"
    lib = _planted_library(shared_tmp, marker)
    theirs = shared_tmp / "theirs"
    r = _as_nobody("sh", "-c", f"mkdir -m 0755 {theirs} && cp {lib} {theirs}/k.so")
    assert r.returncode == 0, r.stderr
    d = shared_tmp / "mine"
    d.mkdir(mode=0o700)
    (d / _name()).symlink_to(theirs / "k.so")
    _assert_refused({"FEDAGG_CACHE_DIR": str(d)}, marker, d / _name())


def test_a_cache_directory_that_is_a_symlink_is_not_used(shared_tmp: Path) -> None:
    marker = shared_tmp / "marker"
    lib = _planted_library(shared_tmp, marker)
    theirs = shared_tmp / "theirs"
    r = _as_nobody("sh", "-c", f"mkdir -m 0777 {theirs} && cp {lib} {theirs}/{_name()}")
    assert r.returncode == 0, r.stderr
    fallback = shared_tmp / f"fedagg-{os.getuid()}"
    r = _as_nobody("ln", "-s", str(theirs), str(fallback))
    assert r.returncode == 0, r.stderr
    _assert_refused({"FEDAGG_CACHE_DIR": _unusable_cache(shared_tmp), "TMPDIR": str(shared_tmp)},
                    marker, fallback)


def test_a_world_writable_directory_of_mine_is_not_used(shared_tmp: Path) -> None:
    marker = shared_tmp / "marker"
    lib = _planted_library(shared_tmp, marker)
    d = shared_tmp / "mine"
    d.mkdir()
    d.chmod(0o777)
    shutil.copy(lib, d / _name())
    (d / _name()).chmod(0o755)
    _assert_refused({"FEDAGG_CACHE_DIR": str(d)}, marker, d)


def test_the_normal_case_builds_into_a_0700_directory_and_loads(shared_tmp: Path) -> None:
    d = shared_tmp / "cache" / "fedagg"
    got, err = _victim({"FEDAGG_CACHE_DIR": str(d)})
    assert got == {"available": True, "same": True}, (got, err)
    assert "WARNING" not in err
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and d.stat().st_uid == os.getuid()
    so = d / _name()
    st = so.lstat()
    assert stat.S_ISREG(st.st_mode) and not st.st_mode & 0o022 and st.st_uid == os.getuid()
    assert sorted(p.name for p in d.iterdir()) == [_name()]  # no temporary file left
    # and the fallback, when the cache cannot be created, is made the same way
    got, err = _victim({"FEDAGG_CACHE_DIR": _unusable_cache(shared_tmp),
                        "TMPDIR": str(shared_tmp)})
    fallback = shared_tmp / f"fedagg-{os.getuid()}"
    assert got["available"], err
    assert stat.S_IMODE(fallback.stat().st_mode) == 0o700


# --- the collectives' C++ plan runner --------------------------------------------------------

_RUNNER_VICTIM = r"""
import json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
from fedagg.collectives import plan_runner
m = plan_runner.load()
print(json.dumps({"loaded": None if m is None else m.__file__}))
"""


def _runner_victim(env: dict[str, str]) -> tuple[str | None, str]:
    full = {**os.environ, **env, "FEDAGG_PLAN_RUNNER": "auto"}
    p = subprocess.run([sys.executable, "-c", _RUNNER_VICTIM], capture_output=True, text=True,
                       env=full, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    loaded: str | None = json.loads(p.stdout.strip().splitlines()[-1])["loaded"]
    return loaded, p.stderr


def _real_runner() -> Path:
    from fedagg.collectives import plan_runner

    if plan_runner.disabled():
        pytest.skip("FEDAGG_PLAN_RUNNER=0 here")
    module = plan_runner.load()
    if module is None:
        pytest.skip("the plan runner does not build here (no C++ compiler / ninja)")
    return Path(module.__file__)


@pytest.mark.slow  # builds the collectives' C++ plan runner (a C++ compile)
def test_a_planted_plan_runner_pointer_is_not_followed(shared_tmp: Path) -> None:
    """Another uid made $XDG_CACHE_HOME/fedagg (0777) with fedagg's note of where the built
    runner is, naming its own library (and a matching stamp): not loaded; torch's own build
    (checked too) is used instead."""
    from fedagg.collectives import plan_runner

    real = _real_runner()
    marker = shared_tmp / "marker"
    lib = _planted_library(shared_tmp, marker)
    xdg, stamp = shared_tmp / "xdg", plan_runner._stamp()
    theirs = shared_tmp / "theirs"
    pointer = xdg / "fedagg" / plan_runner._pointer(stamp).name
    script = (f"mkdir -m 0777 -p {xdg}/fedagg {theirs} && cp {lib} {theirs}/{real.name} && "
              f"printf %s {stamp} > {theirs}/fedagg.stamp && "
              f"printf %s {theirs}/{real.name} > {pointer}")
    r = _as_nobody("sh", "-c", script)
    assert r.returncode == 0, r.stderr
    loaded, err = _runner_victim({"XDG_CACHE_HOME": str(xdg),
                                  "TORCH_EXTENSIONS_DIR": str(real.parent.parent)})
    assert not marker.exists(), "the planted runner's constructor ran as the victim"
    assert loaded == str(real), err
    assert str(pointer) in err and "Fix:" in err

    # the note in the user's own private cache, naming another user's library: refused too
    shutil.rmtree(xdg)
    mine = shared_tmp / "xdg2" / "fedagg"
    mine.mkdir(parents=True, mode=0o700)
    (mine / pointer.name).write_text(f"{theirs}/{real.name}")
    loaded, err = _runner_victim({"XDG_CACHE_HOME": str(mine.parent),
                                  "TORCH_EXTENSIONS_DIR": str(real.parent.parent)})
    assert not marker.exists() and loaded == str(real), err
    assert f"{theirs}/{real.name}" in err


@pytest.mark.slow  # builds the collectives' C++ plan runner (a C++ compile)
def test_a_torch_extensions_dir_of_another_user_is_not_used(shared_tmp: Path) -> None:
    """TORCH_EXTENSIONS_DIR pointing at a folder another uid made (0777) holding a planted
    build: the runner is neither built nor loaded there; the Python replay runs, with one
    warning naming the folder and the fix."""
    real = _real_runner()
    marker = shared_tmp / "marker"
    lib = _planted_library(shared_tmp, marker)
    ext = shared_tmp / "torch_extensions"
    build = ext / real.parent.name
    r = _as_nobody("sh", "-c", f"mkdir -m 0777 -p {build} && cp {lib} {build}/{real.name}")
    assert r.returncode == 0, r.stderr
    private = shared_tmp / "xdg"
    private.mkdir(mode=0o700)
    loaded, err = _runner_victim({"XDG_CACHE_HOME": str(private), "TORCH_EXTENSIONS_DIR": str(ext)})
    assert not marker.exists() and loaded is None, err
    warnings = [ln for ln in err.splitlines() if ln.startswith("WARNING")]
    assert len(warnings) == 1 and str(ext) in warnings[0] and "Fix:" in warnings[0], err
    assert "Python replay" in warnings[0]
