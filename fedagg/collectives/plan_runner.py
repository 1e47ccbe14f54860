"""The C++ plan runner: replays a compiled :class:`~fedagg.collectives.plan.Plan` over a
torch.distributed process group with the GIL released.

The Python replay (:func:`fedagg.collectives.executor._replay`) pays the interpreter on every
message: torch.distributed's wrappers, request objects, tensor views, and the consistency
header's build and check. On gloo each of those sits between a receive completing and the
next send, i.e. on the critical path of every rank; on the 2-core VM it was 0.2-0.6 ms per
call (docs/benchmarks.md), as much as a whole 1 MB all-reduce. The runner
(``_plan_runner.cpp``) makes the same ``ProcessGroup.send`` / ``recv`` calls, in the same
order, with the same message layout (header, then the step-0 data that rides with it), so a
rank on the runner and a rank on the Python replay interoperate; the Python replay stays the
reference and the path for other communicators (in-process, NCCL's grouped mode).
:func:`runner_for` and :func:`run` are what :func:`~fedagg.collectives.executor.execute`
calls; the rest of this module builds and loads the extension.

The extension is compiled on first use with :func:`torch.utils.cpp_extension.load` (about
a minute on 2 cores; a C++ compiler and ninja are needed) into torch's extension cache
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and loaded from there
afterwards. It is loaded only from files and folders no other local user can have written
(:func:`fedagg._owned.check_path`: the ``.so``, its build folder and fedagg's note of where
it is are owned by this user and writable by nobody else, and so is every folder above them,
or that folder is root's or sticky); otherwise the Python replay runs, with the warning below
naming the path and the fix. ``FEDAGG_PLAN_RUNNER`` controls it:

* ``auto`` (default): use it when it builds; otherwise log one warning and use the Python replay;
* ``0`` / ``off``: never use it;
* ``1`` / ``require``: use it, raise if it cannot be built.

Build it ahead of time (CI does, so that no test waits for the compiler) with
``python -m fedagg.collectives.plan_runner``.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

from fedagg._owned import NotOwned, check_path, fix, private_dir
from fedagg.collectives.communicator import Communicator
from fedagg.collectives.plan import HeaderExchange, Plan, scratch_buffer
from fedagg.errors import ConfigError, explain

__all__ = ["ENV", "disabled", "load", "mode", "run", "runner_for"]

_log = logging.getLogger(__name__)

ENV = "FEDAGG_PLAN_RUNNER"
"""Environment variable: ``auto`` (default), ``0`` / ``off``, ``1`` / ``require``."""

_SOURCE = Path(__file__).with_name("_plan_runner.cpp")
_NAME = "fedagg_plan_runner"
_lock = threading.Lock()
_state: dict[str, Any] = {}
_MODES = {
    "": "auto",
    "auto": "auto",
    "0": "off",
    "off": "off",
    "1": "require",
    "require": "require",
}


def mode() -> str:
    """``auto``, ``off`` or ``require``, from :data:`ENV`.

    Raises
    ------
    ConfigError
        If :data:`ENV` holds anything else.
    """
    given = os.environ.get(ENV, "")
    hit = _MODES.get(given)  # the common case, without normalising (called on every all-reduce)
    if hit is not None:
        return hit
    raw = given.strip().lower()
    if raw not in _MODES:
        raise ConfigError(
            explain(
                ENV,
                raw,
                "must be auto, 0 / off or 1 / require",
                f"unset {ENV} or set it to one of those",
            )
        )
    return _MODES[raw]


def disabled() -> bool:
    """Whether :data:`ENV` turns the runner off (checked on every call: tests flip it)."""
    return mode() == "off"


def load() -> Any | None:
    """The compiled extension module, building it on first use; ``None`` if unavailable.

    Thread-safe; a failed build is not retried in this process. With ``FEDAGG_PLAN_RUNNER=1``
    a failure raises instead.

    Raises
    ------
    ConfigError
        If the mode is ``require`` and the extension cannot be built or loaded.
    """
    want = mode()
    if want == "off":
        return None
    with _lock:
        if "module" not in _state:
            _state["module"], _state["error"] = _build()
            if _state["module"] is None:
                _log.warning(
                    "fedagg plan runner unavailable (%s); all-reduce schedules run on the "
                    "Python replay. Set %s=0 to silence this.",
                    _state["error"],
                    ENV,
                )
    if _state["module"] is None and want == "require":
        raise ConfigError(
            explain(
                ENV,
                os.environ.get(ENV),
                f"needs the C++ plan runner, which failed to build: {_state['error']}",
                "install a C++ compiler and ninja (apt-get install g++ ninja-build), "
                f"or set {ENV}=auto",
            )
        )
    return _state["module"]


_FLAGS = ["-O2"]


def _stamp() -> str:
    """What the built module depends on: the source, the flags, torch's and Python's builds."""
    import hashlib
    import sys

    digest = hashlib.sha256(_SOURCE.read_bytes())
    parts = [*_FLAGS, torch.__version__, str(torch.compiled_with_cxx11_abi())]
    parts += [sys.implementation.cache_tag or "", sys.abiflags, str(torch.version.cuda)]
    digest.update(" ".join(parts).encode())
    return digest.hexdigest()


def _pointer(stamp: str) -> Path:
    """Where the path of the module built for ``stamp`` is remembered (fedagg's own cache)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "fedagg" / f"plan_runner-{stamp[:32]}.path"


def _refused(exc: NotOwned, env: str) -> str:
    """The reason a build or a load was refused, with the fix (for :func:`load`'s warning)."""
    return f"not loaded: {exc}. Fix: {fix(exc, env)}"


def _import_built(stamp: str) -> Any | None:
    """The module already built for ``stamp``, imported directly, or ``None``.

    Skips importing ``torch.utils.cpp_extension`` and its up-to-date check (0.4-0.7 s per
    process on the 2-core VM, paid again by every worker process a site starts). The pointer
    file names the built ``.so``; a stamp file next to it must match too.
    """
    import importlib.util

    try:
        pointer = check_path(_pointer(stamp))
        so = check_path(Path(pointer.read_text().strip()))
        if check_path(so.parent / "fedagg.stamp").read_text() != stamp:
            return None
    except OSError:
        return None
    spec = importlib.util.spec_from_file_location(_NAME, so)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:  # e.g. a library it links against moved: let torch rebuild it
        return None
    return module


def _torch_build_dir(cpp_extension: Any) -> str:
    """torch's build folder for the runner (created by torch if missing)."""
    try:
        return str(cpp_extension._get_build_directory(_NAME, False))
    except Exception:  # a private torch helper: the documented root instead
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
        os.makedirs(root, exist_ok=True)
        return str(root)


def _stable_source(cpp_extension: Any) -> str:
    """A copy of the source at a path that does not depend on where fedagg is checked out.

    torch rebuilds when the build command changes, and the command names the source path:
    two checkouts (or a CI clone beside a working tree) would otherwise rebuild each other's
    module in turn. The copy lives in torch's build folder for this extension.
    """
    try:
        build_dir = Path(cpp_extension._get_build_directory(_NAME, False))
    except Exception:  # a private torch helper: fall back to the packaged file
        return str(_SOURCE)
    copy = build_dir / "src" / _SOURCE.name
    text = _SOURCE.read_bytes()
    if not copy.is_file() or copy.read_bytes() != text:
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(text)
    return str(copy)


def _build() -> tuple[Any | None, str]:
    try:
        stamp = _stamp()
        try:
            module = _import_built(stamp)
        except NotOwned as exc:  # the remembered path: torch's own cache is checked next
            _log.warning("fedagg plan runner: remembered build %s", _refused(exc, "XDG_CACHE_HOME"))
            module = None
        if module is None:
            from torch.utils import cpp_extension

            try:  # torch builds with ninja in this folder and loads the .so from it
                build_dir = check_path(_torch_build_dir(cpp_extension), directory=True)
                if (build_dir / f"{_NAME}.so").exists():
                    check_path(build_dir / f"{_NAME}.so")
            except NotOwned as exc:
                return None, _refused(exc, "TORCH_EXTENSIONS_DIR")
            module = cpp_extension.load(
                name=_NAME,
                sources=[_stable_source(cpp_extension)],
                extra_cflags=_FLAGS,
                verbose=False,
            )
            so = Path(getattr(module, "__file__", ""))
            if so.is_file():
                (so.parent / "fedagg.stamp").write_text(stamp)
                pointer = _pointer(stamp)
                try:
                    os.close(private_dir(pointer.parent))  # created 0700, or checked
                    pointer.write_text(str(so))
                except NotOwned as exc:  # not remembered: the next process asks torch again
                    _log.warning("fedagg plan runner: build not remembered: %s. Fix: %s",
                                 exc, fix(exc, "XDG_CACHE_HOME"))
    except Exception as exc:  # compiler missing, build error, ABI mismatch: fall back
        first = str(exc).strip().splitlines()
        return None, f"{type(exc).__name__}: {first[0][:200] if first else ''}"
    return module, ""


def runner_for(plan: Plan, comm: Communicator, header: HeaderExchange | None) -> Any | None:
    """The C++ runner of ``plan`` if ``comm`` can run one, else ``None``.

    Only a communicator with a ``run_plan`` method (torch.distributed, pipelined) runs it, and
    only with no header or the header round of :func:`fedagg.collectives.all_reduce` (a
    ``HeaderExchange`` with ``head``, ``cap`` and ``failed``), which the runner reproduces.
    """
    if not hasattr(comm, "run_plan"):
        return None
    if header is not None and not hasattr(header, "head"):
        return None
    runner = plan.native.get("runner")
    if runner is not None:  # built, so the module loaded: only the switch can say no now
        return None if disabled() else runner
    module = load()
    if module is None:
        return None
    runner = module.PlanRunner(
        list(plan.ride_out),
        list(plan.ride_in),
        list(plan.recvs),
        [(c, a, o, ln, b, list(r)) for c, a, o, ln, b, r in plan.ops],
        plan.slots,
        plan.readers,
    )
    plan.native["runner"] = runner
    return runner


def run(
    runner: Any,
    plan: Plan,
    comm: Communicator,
    work: torch.Tensor,
    wire: torch.dtype,
    header: HeaderExchange | None,
) -> None:
    """Run ``plan`` on the C++ runner, with the GIL released.

    The messages are those of :func:`fedagg.collectives.executor._replay`; a disagreeing header
    goes to the header round's ``failed`` (drain, then raise) as on the Python path.
    """
    scratch = scratch_buffer(plan.scratch, wire, work.device)
    run_plan = getattr(comm, "run_plan")  # noqa: B009 - checked by runner_for
    if header is None:
        run_plan(runner, work, scratch, None, None, None, 0)
        return
    n, rank = comm.world_size, comm.rank
    head: torch.Tensor = getattr(header, "head")  # noqa: B009
    cap: int = getattr(header, "cap")  # noqa: B009
    rbuf = scratch_buffer((n - 1) * cap, torch.uint8, work.device, "header-recv")
    size = (n - 1) * head.numel() + sum(ln for _, _, ln in plan.ride_out) * wire.itemsize
    sbuf = scratch_buffer(size, torch.uint8, work.device, "header-send")
    ok, posted, pending = run_plan(runner, work, scratch, head, rbuf, sbuf, cap)
    if not ok:
        peers = [p for p in range(n) if p != rank]
        regions = {p: rbuf[i * cap : (i + 1) * cap] for i, p in enumerate(peers)}
        getattr(header, "failed")(regions, posted, [(req, sbuf) for req in pending])  # noqa: B009


def main() -> None:
    """Build (or find) the extension and say where it is; exit 1 if it cannot be built."""
    import sys

    os.environ[ENV] = "require"
    try:
        module = load()
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(1) from exc
    print(f"fedagg plan runner: {getattr(module, '__file__', module)}")


if __name__ == "__main__":
    main()
