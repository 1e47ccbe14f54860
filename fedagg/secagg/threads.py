"""Worker threads for the byte-crunching parts of secure aggregation.

Two loops dominate a secure round at large ``D``: expanding ChaCha20 mask keystreams
(:mod:`fedagg.secagg.masking`) and unpacking / adding bit-packed uploads on the server
(:mod:`fedagg.secagg.packing`). Both run in C with the GIL released (OpenSSL's ChaCha20 inside
``cryptography``; numpy ufuncs on large arrays), so plain threads scale them over the cores of
a site or server. Work is split so the result is bit-identical to the serial loop: disjoint
ranges of the vector (keystreams seek to the range's ChaCha20 block counter), or private
``uint32`` accumulators summed at the end (addition mod ``2^b`` commutes).

``threads`` everywhere means: ``None`` or ``0`` = automatic, ``1`` = the serial path in the
calling thread (no pool is created), ``n > 1`` = at most ``n`` threads. Automatic is the
environment variable ``FEDAGG_SECAGG_THREADS`` when set (so an operator can cap a site's or
server's threads without touching the run config), else :func:`auto_threads`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from fedagg.errors import ConfigError, explain

__all__ = ["ENV_VAR", "MAX_THREADS", "auto_threads", "pool", "resolve_threads", "run_all"]

ENV_VAR = "FEDAGG_SECAGG_THREADS"
"""Environment variable read for automatic ``threads`` (an int in ``[1, MAX_THREADS]``)."""

MAX_THREADS = 16
"""Upper bound on ``threads`` (beyond it memory bandwidth, not cores, binds)."""

_AUTO_CAP = 4
_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}


def auto_threads() -> int:
    """Threads used by default: the CPUs this process may run on, at most 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(_AUTO_CAP, cores))


def resolve_threads(threads: int | None) -> int:
    """``threads`` as a count (``None`` / ``0`` -> :data:`ENV_VAR` if set, else
    :func:`auto_threads`).

    Raises
    ------
    ConfigError
        Not an int in ``[0, MAX_THREADS]`` (or :data:`ENV_VAR` not one in ``[1, MAX_THREADS]``).
    """
    if threads is None or (threads == 0 and not isinstance(threads, bool)):
        env = os.environ.get(ENV_VAR, "").strip()
        if not env:
            return auto_threads()
        if not env.isdigit() or not 1 <= int(env) <= MAX_THREADS:
            raise ConfigError(
                explain(
                    ENV_VAR,
                    env,
                    f"must be an int in [1, {MAX_THREADS}]",
                    f"unset it for automatic threads, or e.g. {ENV_VAR}=2",
                )
            )
        return int(env)
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise ConfigError(
            explain("threads", threads, f"must be an int in [0, {MAX_THREADS}] (0 = auto)",
                    "use 0 for one per CPU (at most 4), or 1 for no worker threads")
        )
    return threads


def pool(threads: int) -> ThreadPoolExecutor:
    """The process-wide pool with ``threads`` workers (created on first use, kept)."""
    with _lock:
        ex = _pools.get(threads)
        if ex is None:
            ex = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"fedagg-secagg{threads}")
            _pools[threads] = ex
        return ex


def run_all(tasks: Sequence[Callable[[], None]], threads: int) -> None:
    """Run ``tasks`` to completion: the first in the calling thread, the rest in :func:`pool`.

    Every task runs even if another fails; the first exception (in task order) is re-raised.
    """
    if not tasks:
        return
    futures: list[Future[None]] = []
    if len(tasks) > 1:
        ex = pool(max(1, threads - 1))
        futures = [ex.submit(task) for task in tasks[1:]]
    first: BaseException | None = None
    try:
        tasks[0]()
    except BaseException as exc:  # re-raised below, after the others finished
        first = exc
    for fut in futures:
        err = fut.exception()
        if first is None and err is not None:
            first = err
    if first is not None:
        raise first


def _forget_pools() -> None:  # a forked child has the dicts but not the threads
    global _lock
    _lock = threading.Lock()
    _pools.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)
