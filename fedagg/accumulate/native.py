"""The accumulator's native fold kernel: one pass per block, bit-identical to the NumPy path.

A fold of a dense float32 tensor on the NumPy path (:meth:`fedagg.accumulate.Accumulator.fold`)
takes six passes over each block: scale to float64, round, min, max, cast to int64, add; the
round guards' delta norm (:func:`fedagg.accumulate.delta_norm`) reads the update once more.
The kernel (C source in :mod:`fedagg.accumulate._fold_c`) does all of it in one pass (read
``x`` and the reference, read-add-write the accumulator), ~3x faster on a 2-core VM
(docs/benchmarks.md, "Server memory"). It computes the same integers bit for bit — its
rounding argument is in the source's header — and the
same per-block bounds, and it hands any block the NumPy code treats specially (a non-finite
value, carries into the high limb, a refusal) back to that code, untouched. Only the delta
norm may differ in its last bits (another summation order).

The kernel is compiled on first use with the system's C compiler (``$CC``, else Python's
``CC``, else ``cc``; ~0.3 s) into ``$FEDAGG_CACHE_DIR`` (default ``$XDG_CACHE_HOME/fedagg``,
``~/.cache/fedagg``; where that cannot be created, ``$TMPDIR/fedagg-<uid>``), checked against
the NumPy path on a small update, and loaded with :mod:`ctypes` (the GIL is released during a
call). Without a compiler, or with ``FEDAGG_NATIVE=0``, every fold takes the NumPy path (same
results, slower); the reason is logged once at INFO.

The kernel is built into, and loaded only from, a directory owned by this user that nobody
else can write (created with mode 0700), from a regular file owned by this user that nobody
else can write, opened without following links and loaded through its descriptor
(:mod:`fedagg._owned`). A directory or file another local user could have written — the
temp fallback pre-created by someone else, a symbolic link, a group-writable file — is not
loaded: the folds take the NumPy path and one WARNING names the path and the fix.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import platform
import shlex
import subprocess
import sysconfig
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fedagg._owned import NotOwned, fd_path, fix, open_file, private_dir
from fedagg.accumulate._fold_c import SOURCE

__all__ = [
    "ENV",
    "PARALLEL_MIN",
    "THREADS_ENV",
    "available",
    "fold_f32",
    "fold_f32_parallel",
    "mean_into",
    "require",
    "sumsq_f32",
    "threads",
]

_log = logging.getLogger(__name__)

ENV = "FEDAGG_NATIVE"
"""``0`` / ``off``: never use the native kernel (default: use it when it builds)."""

THREADS_ENV = "FEDAGG_FOLD_THREADS"
"""Threads of one tensor's fold (default: the CPUs, at most 4; ``1``: serial)."""

PARALLEL_MIN = 1 << 20
"""Tensors of at least this many elements are folded in :func:`threads` threads."""

_FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC"]
_CLONES = ["-DFEDAGG_CLONES"]
"""Tried first on x86-64: the vector loop compiled for AVX-512, AVX2 and baseline x86-64,
picked at load time (needs GCC and ifunc support; without them the build is retried
without it: one portable loop)."""
_lock = threading.RLock()  # the checks fold through this module
_state: dict[str, Any] = {}
_checks: list[Callable[[], str]] = []
_P, _I = ctypes.c_void_p, ctypes.c_int64


def _disabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no")


def _cache_dir() -> Path:
    root = os.environ.get("FEDAGG_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "fedagg")
    return Path(root)


def _compiler() -> list[str]:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(str(cc))[:1] or ["cc"]


def _compile(cc: list[str], src: str, out: str) -> None:
    """Compile ``src`` into ``out`` (with the x86-64 clones where the compiler makes them)."""
    tries = [_CLONES, []] if platform.machine().lower() in ("x86_64", "amd64") else [[]]
    for k, extra in enumerate(tries):
        try:
            subprocess.run([*cc, *_FLAGS, *extra, "-o", out, src], check=True,
                           capture_output=True, timeout=120)
            return
        except subprocess.CalledProcessError:
            if k == len(tries) - 1:
                raise


def _kernel_name(cc: list[str]) -> str:
    """File name of the kernel built from this source with ``cc`` (a hash of both)."""
    tag = hashlib.sha256(SOURCE.encode() + " ".join(cc + _FLAGS).encode()).hexdigest()[:16]
    return f"fold-{tag}-{platform.machine()}.so"


def _candidates() -> list[Path]:
    """Where the kernel may live: the cache directory, else a per-user temp directory."""
    return [_cache_dir(), Path(tempfile.gettempdir()) / f"fedagg-{os.getuid()}"]


def _open_kernel(where: Path, name: str, cc: list[str]) -> int:
    """The kernel's file in ``where``, built there first if missing; a descriptor, checked.

    ``where`` is opened as a directory only this user can write (created 0700); the kernel is
    compiled into a temporary file inside it and renamed into place, then opened without
    following links and checked (:mod:`fedagg._owned`).

    Raises
    ------
    NotOwned
        ``where`` or the kernel's file could have been written by another local user.
    OSError, subprocess.SubprocessError
        The directory cannot be made, or the build failed.
    """
    dfd = private_dir(where)
    try:
        fd = open_file(dfd, name, where)
        if fd is None:
            src_fd, src = tempfile.mkstemp(dir=where, suffix=".c")
            with os.fdopen(src_fd, "wb") as f:
                f.write(SOURCE.encode())  # a Python string: in every copy of the package
            out_fd, tmp = tempfile.mkstemp(dir=where, suffix=".so")
            os.close(out_fd)
            try:
                _compile(cc, src, tmp)
                os.chmod(tmp, 0o700)
                # atomic, relative to the checked directory: concurrent builders race harmlessly
                os.replace(os.path.basename(tmp), name, src_dir_fd=dfd, dst_dir_fd=dfd)
            finally:
                for path in (tmp, src):
                    if os.path.exists(path):
                        os.unlink(path)
            fd = open_file(dfd, name, where)
            if fd is None:
                raise OSError(f"{where / name} vanished after it was built")
        return fd
    finally:
        os.close(dfd)


def _build() -> tuple[ctypes.CDLL | None, str]:
    cc = _compiler()
    name = _kernel_name(cc)
    why = "no cache directory"
    for where in _candidates():
        try:
            fd = _open_kernel(where, name, cc)
        except NotOwned as exc:
            _log.warning("fedagg: native fold kernel not loaded: %s; folds take the NumPy "
                         "path (same results, slower). Fix: %s", exc, fix(exc))
            return None, f"{exc} (not loaded)"
        except (OSError, subprocess.SubprocessError) as exc:
            err = getattr(exc, "stderr", b"") or b""
            why = f"{type(exc).__name__}: {exc} {err.decode(errors='replace')[-300:]}".strip()
            continue
        try:  # the very file checked above, not whatever the name points to by now
            lib = ctypes.CDLL(fd_path(fd) if os.path.isdir("/proc/self/fd")
                              else str(where / name))
        except OSError as exc:
            why = f"{type(exc).__name__}: {exc}"
            continue
        finally:
            os.close(fd)
        try:
            fn = lib.fedagg_fold_f32
            sq = lib.fedagg_sumsq_f32
            mean = lib.fedagg_mean
        except AttributeError as exc:
            why = f"{where / name} is not fedagg's fold kernel ({exc})"
            continue
        fn.restype = _I
        fn.argtypes = [_P, _I, _I, _P, ctypes.c_double, _P, _I, _I, _P, ctypes.c_int, _P]
        sq.restype = ctypes.c_double
        sq.argtypes = [_P, _P, _I]
        mean.restype = None
        mean.argtypes = [_P, _P, _I, ctypes.c_double, ctypes.c_double, _P, _P]
        return lib, ""
    return None, why


def _library() -> ctypes.CDLL | None:
    if _disabled():
        return None
    with _lock:
        if "lib" not in _state:
            _state["lib"], why = _build()
            if _state["lib"] is not None:
                # the checks fold through this module: they re-enter _library (RLock)
                why = next((w for w in (check() for check in _checks) if w), "")
                if why:
                    _state["lib"] = None
            if _state["lib"] is None:
                _log.info("fedagg: native fold kernel unavailable (%s); folds take the NumPy "
                          "path (same results, slower). Set %s=0 to skip the build.", why, ENV)
    lib: ctypes.CDLL | None = _state["lib"]
    return lib


def require(check: Callable[[], str]) -> None:
    """Run ``check`` once the kernel is built, before any fold uses it: ``''`` if the kernel
    may be used, else the reason it is not (the folds then take the NumPy path).

    The exact accumulator (:mod:`fedagg.accumulate.exact`) registers its self-check here: a
    tricky update folded with and without the kernel must give the same integers and mean.
    """
    _checks.append(check)


def available() -> bool:
    """Whether folds use the native kernel (builds it on first call)."""
    return _library() is not None


def sumsq_f32(x: npt.NDArray[Any], ref: npt.NDArray[Any] | None = None) -> float | None:
    """``sum((x - ref)**2)`` (``ref`` None: of ``x``) in float64, or None when the kernel does
    not apply (not built; not contiguous float32 of one size)."""
    lib = _library()
    if (lib is None or x.dtype != np.float32 or not x.flags.c_contiguous
            or (ref is not None and (ref.dtype != np.float32 or not ref.flags.c_contiguous
                                     or ref.size != x.size))):
        return None
    return float(lib.fedagg_sumsq_f32(x.ctypes.data, None if ref is None else ref.ctypes.data,
                                      x.size))


def mean_into(lo: npt.NDArray[np.int64], hi: npt.NDArray[np.int64] | None, scale: float,
              total: float, out: npt.NDArray[Any]) -> bool:
    """Write ``(hi * 2**31 + lo) * scale / total`` into ``out`` (float32 or float64), threaded
    over large tensors; False (nothing written) when the kernel does not apply."""
    lib = _library()
    if (lib is None or out.dtype not in (np.float32, np.float64) or not out.flags.c_contiguous
            or not out.flags.writeable or lo.dtype != np.int64 or not lo.flags.c_contiguous
            or lo.size != out.size or (hi is not None and (
                hi.dtype != np.int64 or not hi.flags.c_contiguous or hi.size != out.size))):
        return False
    f32 = out.dtype == np.float32
    n = out.size

    def run(a: int, b: int) -> None:
        o = out.ctypes.data + a * out.itemsize
        lib.fedagg_mean(lo.ctypes.data + 8 * a, None if hi is None else hi.ctypes.data + 8 * a,
                        b - a, scale, total, o if f32 else None, None if f32 else o)

    parts = threads() if n >= PARALLEL_MIN else 1
    cuts = [n * k // parts for k in range(parts + 1)]
    if parts > 1:
        futures = [_pool(parts - 1).submit(run, a, b)
                   for a, b in itertools.pairwise(cuts[1:])]
        run(cuts[0], cuts[1])
        for f in futures:
            f.result()
    else:
        run(0, n)
    return True


def threads() -> int:
    """Threads of a fold of a large tensor: ``$FEDAGG_FOLD_THREADS``, default the CPUs (at
    most 4)."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw.isdigit() and int(raw) >= 1:
        return int(raw)
    return max(1, min(4, os.cpu_count() or 1))


def _pool(workers: int) -> ThreadPoolExecutor:
    with _lock:  # a forked child gets a fresh pool (the parent's threads are not in it)
        pool = _state.get("pool")
        if pool is None or _state.get("pool_pid") != os.getpid() or \
                _state.get("pool_workers") != workers:
            pool = _state["pool"] = ThreadPoolExecutor(workers,
                                                       thread_name_prefix="fedagg-fold")
            _state["pool_pid"], _state["pool_workers"] = os.getpid(), workers
        return pool


def fold_f32_parallel(x: npt.NDArray[np.float32], lo: npt.NDArray[np.int64], c: float,
                      bound: int, block: int, lo_max: int,
                      ref: npt.NDArray[np.float32] | None = None, norm: int = 0,
                      parts: int = 2) -> tuple[int, int, float] | None:
    """Fold all of ``x * c`` into ``lo`` in ``parts`` threads, or nothing.

    The tensor is cut at block boundaries, so the blocks (and their bounds) are those of the
    serial fold; each part may add at most ``(lo_max - bound) // parts`` to the bound. If any
    part hands a block back, what the parts folded is subtracted again (exact) and ``None``
    returned: the caller then folds serially. Returns ``(x.size, bound, sumsq)`` on success.
    """
    n = x.size
    step = -(-(n // parts) // block) * block
    cuts = [min(k * step, n) for k in range(parts + 1)]
    spans = [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
    budget = (lo_max - bound) // len(spans)
    if len(spans) < 2 or budget <= 0:
        return None
    pool = _pool(len(spans) - 1)

    def run(span: tuple[int, int], scale: float, cap: int) -> tuple[int, int, float] | None:
        a, b = span
        return fold_f32(x[a:b], 0, lo[a:b], scale, 0, block, cap,
                        None if ref is None else ref[a:b], norm)

    futures = [pool.submit(run, sp, c, budget) for sp in spans[1:]]
    got = [run(spans[0], c, budget)] + [f.result() for f in futures]
    if all(g is not None and g[0] == b - a for g, (a, b) in zip(got, spans, strict=True)):
        return n, bound + sum(g[1] for g in got if g), sum(g[2] for g in got if g)
    for g, (a, _) in zip(got, spans, strict=True):  # undo: the same blocks pass again
        if g is not None and g[0] > 0:
            back = run((a, a + g[0]), -c, lo_max)
            assert back is not None and back[0] == g[0], "the undo of a fold is exact"
    return None


def fold_f32(x: npt.NDArray[np.float32], start: int, lo: npt.NDArray[np.int64], c: float,
             bound: int, block: int, lo_max: int,
             ref: npt.NDArray[np.float32] | None = None, norm: int = 0
             ) -> tuple[int, int, float] | None:
    """Fold ``x[start:] * c`` into ``lo`` block by block (see :mod:`fedagg.accumulate._fold_c`).

    Returns ``(stop, bound, sumsq)``: the start of the first block left to the NumPy path
    (``x.size`` when none), the new bound and the sum of squares of the folded blocks (``norm``
    1: of ``x``; 2: of ``x - ref``); ``None`` when the kernel does not apply (not built, other
    dtypes or layouts) — nothing was folded then.
    """
    lib = _library()
    if (lib is None or x.dtype != np.float32 or not x.flags.c_contiguous
            or not lo.flags.c_contiguous or lo.dtype != np.int64 or lo.size != x.size
            or not -(1 << 62) <= bound < (1 << 62)):
        return None
    if norm == 2 and (ref is None or ref.dtype != np.float32 or not ref.flags.c_contiguous
                      or ref.size != x.size):
        return None
    b = ctypes.c_int64(bound)
    ss = ctypes.c_double(0.0)
    stop = lib.fedagg_fold_f32(x.ctypes.data, x.size, start, lo.ctypes.data, c,
                               ctypes.byref(b), block, lo_max,
                               ref.ctypes.data if norm == 2 and ref is not None else None,
                               norm, ctypes.byref(ss))
    return int(stop), int(b.value), float(ss.value)
