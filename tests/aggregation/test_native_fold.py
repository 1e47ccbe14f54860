"""The native fold kernel (fedagg/accumulate/_fold_c.py) against the NumPy path: same integers.

Oracle: the same accumulator folded with the kernel switched off (``native=False``), which is
the reference NumPy implementation of the grid scheme; and for the delta norm,
:func:`fedagg.accumulate.delta_norm`. The kernel is built by these tests if it is not yet (CI
builds it ahead with ``python -m fedagg.accumulate.native``); a machine without a C compiler
fails :func:`test_kernel_is_built`, the rest compare whatever path is in use.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagg.accumulate import Accumulator, Sparse, TensorSpec, delta_norm, native
from fedagg.accumulate.exact import _LO_MAX
from fedagg.errors import UpdateRejected


def _pair(specs: list[TensorSpec], block: int = 64) -> tuple[Accumulator, Accumulator]:
    fast, ref = Accumulator(specs, block=block), Accumulator(specs, block=block, native=False)
    return fast, ref


def _same(a: Accumulator, b: Accumulator) -> None:
    for j in range(len(a.specs)):
        np.testing.assert_array_equal(a._lo[j], b._lo[j])
        assert (a._hi[j] is None) == (b._hi[j] is None)
        if a._hi[j] is not None:
            np.testing.assert_array_equal(a._hi[j], b._hi[j])
    assert a._bound == b._bound and a.count == b.count and a.total_weight == b.total_weight
    if a.total_weight > 0:
        for x, y in zip(a.mean(), b.mean(), strict=True):
            np.testing.assert_array_equal(x, y)


def test_kernel_is_built() -> None:
    """CI installs a C compiler (gcc); without one the NumPy path runs and this fails."""
    assert shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    assert native.available(), native._state


def test_disabled_by_env(tmp_path) -> None:  # type: ignore[no-untyped-def]
    code = ("import os; from fedagg.accumulate import native; "
            "print(native.available())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, native.ENV: "0"}, check=True)
    assert out.stdout.strip() == "False"


def test_a_kernel_that_fails_a_check_is_never_used() -> None:
    """The accumulator's self-check gates the kernel: a failing check (here one registered
    beside it) leaves every fold on the NumPy path, with the same results."""
    code = ("import logging; logging.basicConfig(level=logging.INFO); "
            "import numpy as np; from fedagg.accumulate import Accumulator, TensorSpec, native; "
            "native.require(lambda: 'forced to disagree'); "
            "x = np.arange(3000, dtype=np.float32) / 7; "
            "s = [TensorSpec((x.size,), 'float32', -20)]; "
            "a, b = Accumulator(s, block=256), Accumulator(s, block=256, native=False); "
            "[acc.fold([x], 2.0) for acc in (a, b)]; "
            "print(native.available(), bool(np.array_equal(a.mean()[0], b.mean()[0])), "
            "float(np.abs(a.mean()[0] - x).max()) < 1e-5)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "True", "True"], out.stderr
    assert "forced to disagree" in out.stderr  # the reason is logged


def test_the_registered_self_check_passes_for_the_built_kernel() -> None:
    from fedagg.accumulate.exact import _kernel_agrees

    assert native.available()
    assert _kernel_agrees() == ""


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 700), block=st.integers(1, 130), seed=st.integers(0, 2**31),
       exponent=st.integers(-40, 20), weights=st.lists(
           st.one_of(st.integers(1, 2**28), st.floats(0.001, 1e6)), min_size=1, max_size=4),
       scale=st.sampled_from([1e-3, 1.0, 1e3, 1e6]))
def test_fold_matches_numpy_path(n: int, block: int, seed: int, exponent: int,
                                 weights: list[float], scale: float) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    x[: min(n, 6)] = np.float32(2.0 ** exponent) * np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5],
                                                            np.float32)[: min(n, 6)]
    spec = [TensorSpec((n,), "float32", exponent)]
    fast, ref = _pair(spec, block)
    for w in [*weights, -weights[0]]:  # the last one removes the first fold again: exact
        refused = []
        for acc in (fast, ref):
            try:
                acc.fold([x], w)
                refused.append(False)
            except UpdateRejected:
                refused.append(True)
        assert refused[0] == refused[1]
    _same(fast, ref)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**31), with_ref=st.booleans())
def test_fused_norm_equals_delta_norm(n: int, seed: int, with_ref: bool) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    r = rng.standard_normal(n).astype(np.float32)
    fast, ref = _pair([TensorSpec((n,), "float32", -20)], block=257)
    got = fast.fold([x], 3.0, norm=True, reference=[r] if with_ref else None)
    want = delta_norm([x], [r] if with_ref else None)
    assert got is not None and math.isclose(got, want, rel_tol=1e-12)
    assert ref.fold([x], 3.0) is None
    _same(fast, ref)


def test_nan_refused_and_leaves_no_trace() -> None:
    x = np.linspace(-1, 1, 5000, dtype=np.float32)
    spec = [TensorSpec((100,), "float32", -20), TensorSpec((5000,), "float32", -20)]
    fast, ref = _pair(spec, block=512)
    good = [np.ones(100, np.float32), x]
    for acc in (fast, ref):
        acc.fold(good, 2.0)
    bad = [np.ones(100, np.float32), x.copy()]
    bad[1][4321] = np.nan
    for acc in (fast, ref):
        with pytest.raises(UpdateRejected, match="non-finite"):
            acc.fold(bad, 5.0)
    _same(fast, ref)
    assert fast.count == 1


def test_huge_values_take_the_careful_pass_and_carries_match() -> None:
    """|q| >= 2**51 (the kernel's careful pass), and bounds that force carries into the high
    limb (the NumPy path's block, handed back by the kernel)."""
    n = 3000
    x = np.full(n, 3.0, np.float32)
    x[::7] = -1.0
    spec = [TensorSpec((n,), "float32", 0)]
    fast, ref = _pair(spec, block=256)
    for w in (2.0 ** 50, 2.0 ** 60, 2.0 ** 61, 3.0, 2.0 ** 61):
        for acc in (fast, ref):
            acc.fold([x], w)
    assert fast._hi[0] is not None  # carries happened
    _same(fast, ref)


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_parallel_fold_of_a_large_tensor(monkeypatch: pytest.MonkeyPatch, threads: str) -> None:
    monkeypatch.setenv(native.THREADS_ENV, threads)
    n = native.PARALLEL_MIN + 12345
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(n) * 0.01).astype(np.float32)
    r = (rng.standard_normal(n) * 0.01).astype(np.float32)
    spec = [TensorSpec((n,), "float32", -30), TensorSpec((3,), "float32", -30)]
    fast, ref = _pair(spec, block=1 << 16)
    small = np.ones(3, np.float32)
    calls: list[str] = []
    for name in ("fold_f32", "fold_f32_parallel"):
        real = getattr(native, name)

        def spy(*a, _real=real, _name=name, **k):  # type: ignore[no-untyped-def]
            out = _real(*a, **k)
            calls.append(_name if out is not None else "none")
            return out
        monkeypatch.setattr(native, name, spy)
    for w in (1.0, 17.0, 250.0):
        got = fast.fold([x, small], w, norm=True, reference=[r, small])
        ref.fold([x, small], w)
        assert got is not None and math.isclose(got, delta_norm([x, small], [r, small]),
                                                rel_tol=1e-12)
    _same(fast, ref)
    assert ("fold_f32_parallel" in calls) == (threads != "1") and "fold_f32" in calls
    bad = x.copy()
    bad[n - 5] = np.inf  # in the last part: the other parts' folds are undone
    for acc in (fast, ref):
        with pytest.raises(UpdateRejected):
            acc.fold([bad, small], 2.0)
    _same(fast, ref)


def test_parallel_budget_hands_back_to_the_serial_path() -> None:
    """A bound close to 2**62 leaves each part too little budget: nothing is folded in
    parallel, the serial path normalises and folds (same integers)."""
    n = native.PARALLEL_MIN
    x = np.full(n, 1.0, np.float32)
    spec = [TensorSpec((n,), "float32", 0)]
    fast, ref = _pair(spec, block=1 << 16)
    for acc in (fast, ref):
        acc._bound[0] = _LO_MAX - (1 << 20)
        acc.fold([x], float(1 << 21))
    _same(fast, ref)


def test_sparse_and_other_dtypes_use_the_numpy_path() -> None:
    spec = [TensorSpec((50,), "float32", -10), TensorSpec((40,), "float64", -10)]
    fast, ref = _pair(spec, block=16)
    upd = [Sparse(np.arange(0, 50, 5), np.linspace(0, 1, 10).astype(np.float32)),
           np.linspace(-1, 1, 40)]
    for acc in (fast, ref):
        acc.fold(upd, 4.0)
    _same(fast, ref)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("threads", ["1", "2"])
def test_native_mean_equals_the_numpy_mean(dtype: str, threads: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The mean from the limbs in C (threaded over large tensors) has the NumPy path's bits,
    with and without the high limb, for float32 and float64 tensors."""
    monkeypatch.setenv(native.THREADS_ENV, threads)
    rng = np.random.default_rng(7)
    n = native.PARALLEL_MIN + 12345
    x = (rng.normal(size=n) * 3).astype(np.float32)
    fast, ref = _pair([TensorSpec((n,), dtype, -20)], block=4096)
    for w in (1.0, 3.0, -1.0, 7.5):
        fast.fold([x], w)
        ref.fold([x], w)
    assert fast._hi[0] is None
    for a, b in zip(fast.mean(), ref.mean(), strict=True):
        assert a.dtype == b.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(a, b)
    big = np.full(5000, 2.0 ** 40, np.float32)
    big[::7] = -(2.0 ** 39)
    fast, ref = _pair([TensorSpec((5000,), dtype, 0)], block=1000)
    for _ in range(40):  # beyond 2**62: carries into the high limb
        fast.fold([big], 3e6)
        ref.fold([big], 3e6)
    assert fast._hi[0] is not None
    _same(fast, ref)


def test_kernel_builds_from_what_a_flower_app_bundle_carries(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A FAB (``flwr run``, deployment) keeps only the files Flower's built-in patterns allow
    (.py, .toml, .md, ...): a copy of the package with just those still builds the kernel."""
    from pathlib import Path

    import pathspec
    from flwr.common.constant import FAB_INCLUDE_PATTERNS

    root = Path(__file__).resolve().parents[2]
    spec = pathspec.PathSpec.from_lines("gitwildmatch", FAB_INCLUDE_PATTERNS)
    files = [p for p in (root / "fedagg").rglob("*") if p.is_file()
             and "__pycache__" not in p.parts
             and spec.match_file(str(p.relative_to(root)))]
    assert any(p.name == "_fold_c.py" for p in files)
    for p in files:
        dst = tmp_path / "app" / p.relative_to(root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dst)
    code = ("from fedagg.accumulate import native; import fedagg; "
            "print(native.available(), fedagg.__file__)")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "app"),
           "FEDAGG_CACHE_DIR": str(tmp_path / "cache")}
    env.pop(native.ENV, None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True, cwd=tmp_path)
    ok, where = out.stdout.split()
    assert where.startswith(str(tmp_path / "app")) and ok == "True", out.stderr
