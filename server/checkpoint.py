"""Crash-safe checkpoints: everything a resume needs, written atomically after every round.

A checkpoint is one ``.npz`` file (no pickle: ``np.load(..., allow_pickle=False)``) holding

* ``meta``: UTF-8 JSON — format version, the last completed round, the config hash and the
  full effective config, the model's tensor names, the metrics records so far, the strategy
  state (with arrays replaced by references), numpy / python RNG states;
* ``a<i>``: the arrays: the global model, then every array inside the strategy state
  (server-optimizer moments, ...); ``numpy_rng_keys`` and ``torch_rng``: the RNG states;
* ``digest``: SHA-256 over every other member (name, dtype, shape, bytes, in name order).

It is written by :func:`fedagg.report.atomic_write_bytes` (temporary file, fsync, rename, fsync
of the directory), so after a crash at any point — even in the middle of the write — the file
on disk is either the previous complete checkpoint or the new complete one.

:func:`load_checkpoint` reads it without side effects and refuses anything damaged, truncated,
empty or tampered with :class:`~fedagg.errors.CheckpointError` naming the file and the field
(``fedagg simulate --resume`` exits with status 2, never a traceback): the digest must match,
and every value is validated (finite model of the config's tensor names, dtypes and shapes,
``round >= 0``, records, strategy state, well-formed RNG states). The RNG states are applied
only by :meth:`Checkpoint.restore_rng`, after the whole resume has been accepted. An
asynchronous run's state (``strategy_state["asynchronous"]``) is validated field by field by
:func:`check_async_state` before it is loaded (types, ranges, and its consistency with the
model, the records, the buffer's entries and the guard window).

Site-side state (error-feedback residuals, secure-aggregation keys) is not here: it lives on
the sites, in Flower's ``Context.state`` (see docs/reliability.md).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import os
import random
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedagg.config import RunConfig, config_hash, flatten
from fedagg.errors import CheckpointError, explain
from fedagg.report import atomic_write_bytes

__all__ = ["CHECKPOINT_NAME", "FORMAT_VERSION", "Checkpoint", "check_async_state", "config_diff",
           "load_checkpoint", "save_checkpoint"]

CHECKPOINT_NAME = "checkpoint.npz"
FORMAT_VERSION = 2
"""2: a ``digest`` member and validated values; 1 (before issue 17) is refused."""
# Test hook: SIGKILL this process half-way through writing the checkpoint of this round.
_CRASH_ENV = "FEDAGG_TEST_KILL_IN_CHECKPOINT_ROUND"
_FIX = "restore the run directory from a backup, or start a new run"


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` returns (validated; nothing applied yet)."""

    round: int
    config_hash: str
    config: dict[str, Any]
    keys: list[str]
    arrays: list[np.ndarray]
    records: list[dict[str, Any]]
    strategy_state: dict[str, Any] | None
    numpy_rng: tuple[Any, ...] | None = None
    python_rng: tuple[Any, ...] | None = None
    torch_rng: np.ndarray | None = field(default=None, repr=False)
    path: Path | None = None

    def check_model(self, keys: Sequence[str], arrays: Sequence[np.ndarray]) -> None:
        """CheckpointError unless the saved model has these tensor names, dtypes and shapes."""
        _same_model(_Reader(self.path or Path(CHECKPOINT_NAME)), self.keys, self.arrays,
                    (keys, arrays))

    def restore_rng(self) -> None:
        """Set numpy's, Python's and torch's global RNG states to the saved ones."""
        if self.numpy_rng is not None:
            np.random.set_state(self.numpy_rng)
        if self.python_rng is not None:
            random.setstate(self.python_rng)
        if self.torch_rng is not None:
            torch.set_rng_state(torch.from_numpy(self.torch_rng.copy()))


def _encode(obj: Any, arrays: list[np.ndarray]) -> Any:
    """Nested state -> JSON-able structure; arrays appended to ``arrays`` and referenced."""
    if isinstance(obj, np.ndarray):
        arrays.append(obj)
        return {"__array__": len(arrays) - 1}
    if isinstance(obj, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, dict):
        return {"__dict__": [[_encode(k, arrays), _encode(v, arrays)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [_encode(v, arrays) for v in obj]
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise CheckpointError(
        explain(
            "strategy state",
            type(obj).__name__,
            "must hold only dicts, lists, arrays, bytes and scalars",
            "return plain data from state_dict()",
        )
    )


class _Reader:
    """Validation helpers that name the file and the field in every error."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, name: str, value: object, rule: str, fix: str = _FIX) -> CheckpointError:
        return CheckpointError(explain(f"{self.path}[{name}]", value, rule, fix))

    def int_in(self, name: str, value: object, lo: int, hi: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.fail(name, value, f"must be an int in [{lo}, {hi}]")
        return value

    def decode(self, obj: Any, arrays: dict[int, np.ndarray], name: str, depth: int = 0) -> Any:
        """Inverse of :func:`_encode`, refusing anything it never writes."""
        if depth > 64:
            raise self.fail(name, "...", "is nested too deeply")
        if isinstance(obj, dict):
            if set(obj) == {"__array__"}:
                i = self.int_in(f"{name}.__array__", obj["__array__"], 0, len(arrays) - 1)
                return arrays[i]
            if set(obj) == {"__bytes__"} and isinstance(obj["__bytes__"], str):
                try:
                    return base64.b64decode(obj["__bytes__"], validate=True)
                except (binascii.Error, ValueError):
                    raise self.fail(name, "__bytes__", "must be base64") from None
            if set(obj) == {"__dict__"} and isinstance(obj["__dict__"], list):
                out: dict[Any, Any] = {}
                for pair in obj["__dict__"]:
                    if not isinstance(pair, list) or len(pair) != 2:
                        raise self.fail(name, pair, "dict items must be [key, value] pairs")
                    key = self.decode(pair[0], arrays, name, depth + 1)
                    if not isinstance(key, str | int | float | bool | bytes) and key is not None:
                        raise self.fail(name, type(key).__name__, "dict keys must be scalars")
                    out[key] = self.decode(pair[1], arrays, f"{name}.{key!r}", depth + 1)
                return out
            raise self.fail(name, sorted(obj)[:3], "is not a value fedagg writes")
        if isinstance(obj, list):
            return [self.decode(v, arrays, name, depth + 1) for v in obj]
        if isinstance(obj, float) and not math.isfinite(obj):
            raise self.fail(name, obj, "must be finite")
        return obj

    def finite(self, name: str, a: np.ndarray) -> None:
        if a.dtype.kind not in "biuf":
            raise self.fail(name, str(a.dtype), "must be a numeric array")
        if a.dtype.kind == "f" and not bool(np.isfinite(a).all()):
            bad = int(a.size - np.count_nonzero(np.isfinite(a)))
            raise self.fail(name, f"{bad} non-finite values", "must be finite (no NaN / Inf)")


def _digest(members: dict[str, np.ndarray]) -> bytes:
    """SHA-256 over every member but ``digest``: name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256(b"fedagg-checkpoint/v2")
    for name in sorted(members):
        if name == "digest":
            continue
        a = np.ascontiguousarray(members[name])
        for part in (name, a.dtype.str, repr(tuple(a.shape))):
            h.update(part.encode())
            h.update(b"\0")
        h.update(a.tobytes())
    return h.digest()


def _write(path: Path, payload: dict[str, np.ndarray], *, crash_round: int | None = None
           ) -> Path:
    payload = {**payload, "digest": np.frombuffer(_digest(payload), dtype=np.uint8)}
    buf = io.BytesIO()
    np.savez(buf, **payload)  # type: ignore[arg-type]
    data = buf.getvalue()
    if crash_round is not None and os.environ.get(_CRASH_ENV) == str(crash_round):
        tmp = path.with_name(f".{path.name}.crash-test")
        with open(tmp, "wb") as fh:  # half a file on disk, then die before the rename
            fh.write(data[: len(data) // 2])
            fh.flush()
            os.fsync(fh.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    atomic_write_bytes(path, data)
    return path


def save_checkpoint(
    run_dir: str | Path,
    *,
    round: int,
    cfg: RunConfig,
    keys: list[str],
    arrays: list[np.ndarray],
    records: list[dict[str, Any]],
    strategy_state: dict[str, Any] | None,
) -> Path:
    """Write ``run_dir/checkpoint.npz`` atomically; returns its path."""
    extra: list[np.ndarray] = []
    state = _encode(strategy_state, extra) if strategy_state is not None else None
    np_state: Any = np.random.get_state()
    meta = {
        "version": FORMAT_VERSION,
        "round": round,
        "config_hash": config_hash(cfg),
        "config": cfg.model_dump(mode="json"),
        "keys": keys,
        "records": records,
        "strategy_state": state,
        "num_model_arrays": len(arrays),
        "num_state_arrays": len(extra),
        "numpy_rng": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python_rng": _encode(random.getstate(), extra),
    }
    payload: dict[str, np.ndarray] = {}
    for i, a in enumerate([*arrays, *extra]):
        payload[f"a{i}"] = np.asarray(a)
    payload["numpy_rng_keys"] = np.asarray(np_state[1])
    payload["torch_rng"] = torch.get_rng_state().numpy()
    payload["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    return _write(Path(run_dir) / CHECKPOINT_NAME, payload, crash_round=round)


def _read_members(path: Path, rd: _Reader) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise CheckpointError(
            explain(
                "--resume",
                str(path.parent),
                f"holds no {CHECKPOINT_NAME}",
                "point --resume at a run directory written by fedagg",
            )
        )
    if path.stat().st_size == 0:
        raise rd.fail("file", "0 bytes", "is empty")
    members: dict[str, np.ndarray] = {}
    name = "file"
    try:
        with np.load(path, allow_pickle=False) as npz:
            if not hasattr(npz, "files"):
                raise rd.fail("file", type(npz).__name__, "must be an .npz archive")
            for name in npz.files:
                members[name] = npz[name]
    except CheckpointError:
        raise
    except Exception as exc:  # a truncated or damaged archive fails in zipfile, zlib, numpy
        raise rd.fail(name, type(exc).__name__, "is unreadable (truncated or damaged)") from None
    return members


def load_checkpoint(
    run_dir: str | Path, *, model: tuple[Sequence[str], Sequence[np.ndarray]] | None = None
) -> Checkpoint:
    """Read and validate ``run_dir/checkpoint.npz`` (no side effects).

    Parameters
    ----------
    run_dir : path
        The run directory.
    model : (keys, arrays), optional
        The config's model: the checkpoint's tensor names, dtypes and shapes must equal it.

    Raises
    ------
    CheckpointError
        Missing, empty, truncated, damaged (digest), foreign or tampered file, naming the file
        and the field.
    """
    path = Path(run_dir) / CHECKPOINT_NAME
    rd = _Reader(path)
    members = _read_members(path, rd)
    digest = members.get("digest")
    if digest is None or digest.dtype != np.uint8 or digest.shape != (32,):
        raise rd.fail("digest", None if digest is None else str(digest.dtype),
                      "must be the 32-byte SHA-256 of the content (a fedagg >= 0.2 checkpoint)")
    if digest.tobytes() != _digest(members):
        raise rd.fail("digest", digest.tobytes().hex()[:16] + "...",
                      "does not match the content (damaged or modified)")
    raw = members.get("meta")
    try:
        if raw is None or raw.dtype != np.uint8 or raw.ndim != 1:
            raise ValueError
        meta = json.loads(raw.tobytes().decode())
        if not isinstance(meta, dict):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise rd.fail("meta", "...", "must be UTF-8 JSON of an object") from None
    if meta.get("version") != FORMAT_VERSION:
        raise rd.fail("meta.version", meta.get("version"), f"must be {FORMAT_VERSION}",
                      "resume with the fedagg version that wrote it")
    rnd = rd.int_in("meta.round", meta.get("round"), 0, 10**9)
    chash, config, keys = meta.get("config_hash"), meta.get("config"), meta.get("keys")
    if not isinstance(chash, str):
        raise rd.fail("meta.config_hash", chash, "must be a string")
    if not isinstance(config, dict):
        raise rd.fail("meta.config", type(config).__name__, "must be an object")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise rd.fail("meta.keys", type(keys).__name__, "must be a list of tensor names")
    records = _records(rd, meta.get("records"), rnd)
    n_model = rd.int_in("meta.num_model_arrays", meta.get("num_model_arrays"), 0, 10**6)
    n_state = rd.int_in("meta.num_state_arrays", meta.get("num_state_arrays"), 0, 10**6)
    if n_model != len(keys):
        raise rd.fail("meta.num_model_arrays", n_model, f"must equal len(keys) = {len(keys)}")
    arrays: list[np.ndarray] = []
    for i in range(n_model + n_state):
        if f"a{i}" not in members:
            raise rd.fail(f"a{i}", "missing", f"{n_model + n_state} arrays are announced")
        arrays.append(members[f"a{i}"])
    for i, a in enumerate(arrays):
        rd.finite(f"a{i}" + (f" (model tensor {keys[i]!r})" if i < n_model else " (state)"), a)
    model_arrays, state_arrays = arrays[:n_model], dict(enumerate(arrays[n_model:]))
    if model is not None:
        _same_model(rd, keys, model_arrays, model)
    state = meta.get("strategy_state")
    if state is not None:
        state = rd.decode(state, state_arrays, "meta.strategy_state")
        if not isinstance(state, dict):
            raise rd.fail("meta.strategy_state", type(state).__name__, "must be an object")
    return Checkpoint(
        round=rnd, config_hash=chash, config=config, keys=list(keys), arrays=model_arrays,
        records=records, strategy_state=state,
        numpy_rng=_numpy_rng(rd, meta.get("numpy_rng"), members.get("numpy_rng_keys")),
        python_rng=_python_rng(rd, rd.decode(meta.get("python_rng"), state_arrays,
                                             "meta.python_rng")),
        torch_rng=_torch_rng(rd, members.get("torch_rng")), path=path,
    )


def _records(rd: _Reader, records: Any, rnd: int) -> list[dict[str, Any]]:
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise rd.fail("meta.records", type(records).__name__, "must be a list of objects")
    last = -1
    for i, r in enumerate(records):
        got = r.get("round")
        if isinstance(got, bool) or not isinstance(got, int) or not last < got <= rnd:
            raise rd.fail(f"meta.records[{i}].round", got,
                          f"must be an int increasing from 0 to the checkpoint's round {rnd}")
        last = got
    return list(records)


def _same_model(rd: _Reader, keys: list[str], arrays: list[np.ndarray],
                model: tuple[Sequence[str], Sequence[np.ndarray]]) -> None:
    want_keys, want = list(model[0]), list(model[1])
    if keys != want_keys:
        raise rd.fail("meta.keys", keys[:3], f"must equal the config's model {want_keys[:3]}",
                      "resume with the run's own config (the same model)")
    for i, (a, b) in enumerate(zip(arrays, want, strict=True)):
        if a.dtype != np.asarray(b).dtype or a.shape != np.shape(b):
            raise rd.fail(f"a{i} (model tensor {keys[i]!r})", f"{a.dtype}{list(a.shape)}",
                          f"must be {np.asarray(b).dtype}{list(np.shape(b))} like the "
                          "config's model", "resume with the run's own config")


def _numpy_rng(rd: _Reader, meta: Any, keys: Any) -> tuple[Any, ...]:
    ok = (isinstance(meta, list) and len(meta) == 4 and meta[0] == "MT19937"
          and isinstance(keys, np.ndarray) and keys.dtype == np.uint32 and keys.shape == (624,)
          and not isinstance(meta[1], bool) and isinstance(meta[1], int) and 0 <= meta[1] <= 624
          and meta[2] in (0, 1) and not isinstance(meta[2], bool)
          and isinstance(meta[3], int | float) and math.isfinite(meta[3]))
    state: tuple[Any, ...] = ()
    if ok:
        state = ("MT19937", keys, *meta[1:])
        try:
            np.random.RandomState().set_state(state)  # a scratch generator: nothing applied
        except (TypeError, ValueError):
            ok = False
    if not ok:
        raise rd.fail("meta.numpy_rng", meta if isinstance(meta, list) else type(meta).__name__,
                      "must be a well-formed MT19937 state (624 uint32 keys)")
    return state


def _python_rng(rd: _Reader, value: Any) -> tuple[Any, ...]:
    state: tuple[Any, ...] = ()
    ok = isinstance(value, list) and len(value) == 3 and isinstance(value[1], list)
    if ok:
        state = (value[0], tuple(value[1]), value[2])
        try:
            random.Random().setstate(state)
        except (TypeError, ValueError, OverflowError):
            ok = False
    if not ok:
        raise rd.fail("meta.python_rng", type(value).__name__,
                      "must be a well-formed random.getstate()")
    return state


def _torch_rng(rd: _Reader, value: Any) -> np.ndarray:
    want = torch.get_rng_state()
    ok = (isinstance(value, np.ndarray) and value.dtype == np.uint8
          and value.shape == tuple(want.shape))
    if ok:
        try:
            torch.Generator().set_state(torch.from_numpy(value.copy()))
        except RuntimeError:
            ok = False
    if not ok:
        shown = f"{value.dtype}{list(value.shape)}" if isinstance(value, np.ndarray) else value
        raise rd.fail("torch_rng", shown,
                      f"must be a well-formed torch CPU RNG state (uint8[{want.numel()}])")
    return np.asarray(value)


def config_diff(saved: dict[str, Any], cfg: RunConfig) -> list[str]:
    """``key: saved -> now`` for every setting that differs (ignoring run.rounds and paths)."""
    ignore = {"run.rounds", "run.output_dir", "run.name", "run.resume"}
    a, b = flatten(saved), flatten(cfg.model_dump(mode="json"))
    return [
        f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if k not in ignore and a.get(k) != b.get(k)
    ]


# -- asynchronous runs ---------------------------------------------------------------------------

_A = "meta.strategy_state.asynchronous"
_NODE_MAX = 2**64 - 1  # Flower node ids are unsigned 64-bit
_COUNT_MAX = 10**12


def _number(rd: _Reader, name: str, value: object, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not (math.isfinite(value) and lo <= value <= hi):
        raise rd.fail(name, value, f"must be a finite number in [{lo:g}, {hi:g}]")
    return float(value)


def _fields(rd: _Reader, name: str, value: object, required: Sequence[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise rd.fail(name, type(value).__name__, "must be an object")
    missing = [k for k in required if k not in value]
    if missing:
        raise rd.fail(f"{name}.{missing[0]}", "missing", "is a field fedagg writes")
    return value


def _list(rd: _Reader, name: str, value: object) -> list[Any]:
    if not isinstance(value, list):
        raise rd.fail(name, type(value).__name__, "must be a list")
    return value


def _like(rd: _Reader, name: str, value: object, like: Sequence[np.ndarray],
          dtype: Any = None) -> list[np.ndarray]:
    """A list of arrays with ``like``'s shapes (and dtypes, or ``dtype``)."""
    arrays = _list(rd, name, value)
    if len(arrays) != len(like) or not all(isinstance(a, np.ndarray) for a in arrays):
        raise rd.fail(name, f"{len(arrays)} items", f"must be {len(like)} arrays like the model")
    for i, (a, b) in enumerate(zip(arrays, like, strict=True)):
        want = np.dtype(dtype) if dtype is not None else b.dtype
        if a.shape != b.shape or a.dtype != want:
            raise rd.fail(f"{name}[{i}]", f"{a.dtype}{list(a.shape)}",
                          f"must be {want}{list(b.shape)} like the model")
        rd.finite(f"{name}[{i}]", a)
    return arrays


def _is(value: object, want: int | str | None) -> bool:
    """``value == want`` for a JSON scalar of ``want``'s type (no bool for an int, no array)."""
    if want is None:
        return value is None
    if isinstance(want, str):
        return isinstance(value, str) and value == want
    return isinstance(value, int) and not isinstance(value, bool) and value == want


def _norm2(arrays: Sequence[np.ndarray]) -> float:
    return math.sqrt(sum(float(np.vdot(a, a)) for a in arrays))


def check_async_state(ckpt: Checkpoint, fresh: Any, *, mode: str, secure: bool,
                      max_weight: float | None = None, max_update_norm: float | None = None
                      ) -> dict[str, Any]:
    """Validate the asynchronous server state of a checkpoint before anything is loaded.

    Every field :meth:`fedagg.asyncagg.AsyncServerState.state_dict` writes is checked for its
    type, its range and its consistency with the rest of the checkpoint: the model equals the
    checkpoint's model; the records' versions count the committed buffers up to the state's
    version; every dispatch, cohort and evaluation references a kept model version, a known
    counter, a time no later than ``now``; the buffer has the run's size and weighting, and
    its entries the staleness, staleness weight, weight and count they were folded with
    (their weights and sites are the guard window's last ones); its normaliser is theirs; and
    its running sum is no longer than the entries' delta norms (the window's) allow -- a buffer
    sum of 1e30 never reaches the model. Fair buffers: the buffer holds at most one update per
    site, the guard window one entry per site (``nodes``), and the sites waiting for the open
    buffer (``waiting``) are distinct node ids of a plaintext FedBuff run. The optimizer's
    state must load into ``fresh``'s optimizer and fit the model.

    Parameters
    ----------
    ckpt : Checkpoint
        What :func:`load_checkpoint` returned (its model and records are validated already).
    fresh : AsyncServerState
        A state built from the run's configuration, as the run builds it (its buffer size,
        weighting, staleness weight, staleness bound, guard window and optimizer kind are the
        rules); nothing is loaded into it but a scratch copy of the optimizer.
    mode : {"fedbuff", "deadline"}
        The run's ``asynchronous.mode``.
    secure : bool
        Whether the run uses secure aggregation (only then are cohorts open).
    max_weight, max_update_norm : float, optional
        ``strategy.max_weight`` / ``strategy.max_update_norm``: bounds every folded entry had
        to meet.

    Returns
    -------
    dict
        The validated state (the ``"asynchronous"`` part).

    Raises
    ------
    CheckpointError
        The first field that breaks a rule, named with the file (``checkpoint.npz[meta.
        strategy_state.asynchronous.buffer.sum]``), the value and the rule.
    """
    import copy

    rd = _Reader(ckpt.path or Path(CHECKPOINT_NAME))
    top = _fields(rd, "meta.strategy_state", ckpt.strategy_state, ("asynchronous", "run_id"))
    run_id = top["run_id"]
    if not isinstance(run_id, bytes) or len(run_id) != 16:
        raise rd.fail("meta.strategy_state.run_id", type(run_id).__name__,
                      "must be the run's 16-byte id")
    st = _fields(rd, _A, top["asynchronous"], (
        "version", "model", "versions", "buffer", "optimizer", "jobs", "cohorts", "site_rounds",
        "next_job", "next_cohort", "round", "round_started", "now"))
    model = list(ckpt.arrays)
    version = rd.int_in(f"{_A}.version", st["version"], 0, 10**9)
    for i, (a, b) in enumerate(zip(_like(rd, f"{_A}.model", st["model"], model), model,
                                   strict=True)):
        if not np.array_equal(a, b):
            raise rd.fail(f"{_A}.model[{i}]", "differs", "must equal the checkpoint's model "
                          f"(a{i}): both are the model of version {version}")
    # the records: one per buffer taken, the committed ones counted by the version
    committed = 0
    for i, rec in enumerate(ckpt.records):
        if i and rec.get("model_updated") is True:
            committed += 1
        v = rec.get("version")
        if isinstance(v, bool) or v != committed:
            raise rd.fail(f"meta.records[{i}].version", v,
                          f"must be {committed}: the committed buffers up to that record")
        if rec.get("mode", mode) != mode:
            raise rd.fail(f"meta.records[{i}].mode", rec.get("mode"), f"must be {mode!r}")
    if version != committed:
        raise rd.fail(f"{_A}.version", version, f"must be {committed}, the committed buffers "
                      "the records count")
    now = _number(rd, f"{_A}.now", st["now"], 0.0, 1e15)
    last_time = ckpt.records[-1].get("time") if ckpt.records else None
    if isinstance(last_time, int | float) and not isinstance(last_time, bool) \
            and math.isfinite(last_time) and now < last_time:
        raise rd.fail(f"{_A}.now", now, f"must be >= the last record's time {last_time:g}")
    next_job = rd.int_in(f"{_A}.next_job", st["next_job"], 1, _COUNT_MAX)
    next_cohort = rd.int_in(f"{_A}.next_cohort", st["next_cohort"], 1, _COUNT_MAX)
    rnd = rd.int_in(f"{_A}.round", st["round"], 0, ckpt.round + 1 if mode == "deadline" else 0)
    _number(rd, f"{_A}.round_started", st["round_started"], 0.0, now)
    # kept model versions: exactly those a dispatch, a cohort or an evaluation references
    raw_versions = st["versions"]
    if not isinstance(raw_versions, dict):
        raise rd.fail(f"{_A}.versions", type(raw_versions).__name__, "must be an object")
    kept: set[int] = set()
    for key, arrays in raw_versions.items():
        name = f"{_A}.versions[{key!r}]"
        if not isinstance(key, str) or not key.isdigit() or len(key) > 10 \
                or not 0 <= int(key) < version:
            raise rd.fail(name, key, f"must be an older version number in [0, {version})")
        _like(rd, name, arrays, model)
        kept.add(int(key))
    kept_or_now = kept | {version}

    def referenced(name: str, v: object) -> int:
        got = rd.int_in(name, v, 0, version)
        if got not in kept_or_now:
            raise rd.fail(name, got, f"must be a kept model version {sorted(kept_or_now)}")
        return got

    cohorts: dict[int, Any] = {}
    for i, c in enumerate(_list(rd, f"{_A}.cohorts", st["cohorts"])):
        name = f"{_A}.cohorts[{i}]"
        c = _fields(rd, name, c, ("cohort", "version", "server_round", "members", "started_at",
                                  "attempt"))
        cid = rd.int_in(f"{name}.cohort", c["cohort"], 1, next_cohort - 1)
        if not secure:
            raise rd.fail(name, cid, "a plaintext run opens no secure cohort")
        if cid in cohorts:
            raise rd.fail(f"{name}.cohort", cid, "must be unique")
        referenced(f"{name}.version", c["version"])
        if not _is(c["server_round"], cid):
            raise rd.fail(f"{name}.server_round", c["server_round"],
                          f"must be the cohort's number {cid}")
        members = _list(rd, f"{name}.members", c["members"])
        for mi, m in enumerate(members):
            rd.int_in(f"{name}.members[{mi}]", m, 0, _NODE_MAX)
        if not members or members != sorted(set(members)):
            raise rd.fail(f"{name}.members", members[:4],
                          "must be a non-empty sorted list of distinct node ids")
        _number(rd, f"{name}.started_at", c["started_at"], 0.0, now)
        rd.int_in(f"{name}.attempt", c["attempt"], 0, 10**6)
        cohorts[cid] = c
    site_rounds = st["site_rounds"]
    if not isinstance(site_rounds, dict):
        raise rd.fail(f"{_A}.site_rounds", type(site_rounds).__name__, "must be an object")
    most = max(next_job - 1, next_cohort - 1, rnd)
    for key, n in site_rounds.items():
        if not isinstance(key, str) or not key.isdigit() or int(key) > _NODE_MAX:
            raise rd.fail(f"{_A}.site_rounds", key, "keys must be node ids")
        rd.int_in(f"{_A}.site_rounds[{key!r}]", n, 1, max(most, 1))
    jobs: dict[int, Any] = {}
    for i, j in enumerate(_list(rd, f"{_A}.jobs", st["jobs"])):
        name = f"{_A}.jobs[{i}]"
        j = _fields(rd, name, j, ("job", "node", "version", "server_round", "dispatched_at",
                                  "cohort"))
        jid = rd.int_in(f"{name}.job", j["job"], 1, next_job - 1)
        if jid in jobs or (jobs and jid < max(jobs)):
            raise rd.fail(f"{name}.job", jid, "must be unique and increasing")
        node = rd.int_in(f"{name}.node", j["node"], 0, _NODE_MAX)
        referenced(f"{name}.version", j["version"])
        srv = rd.int_in(f"{name}.server_round", j["server_round"], 1, 10**9)
        if site_rounds.get(str(node), 0) < srv:
            raise rd.fail(f"{name}.server_round", srv, f"must be <= site_rounds[{str(node)!r}]"
                          f" = {site_rounds.get(str(node))} (the node's dispatches)")
        _number(rd, f"{name}.dispatched_at", j["dispatched_at"], 0.0, now)
        cid = j["cohort"]
        if not _is(cid, -1):
            rd.int_in(f"{name}.cohort", cid, 1, next_cohort - 1)
            if cid not in cohorts or node not in cohorts[cid]["members"]:
                raise rd.fail(f"{name}.cohort", cid, "must be -1 or an open cohort of the node")
        jobs[jid] = j
    evaluations = st.get("evaluations")
    if evaluations is None:  # a state from before evaluations were checkpointed
        evaluations = []
    seen: set[int] = set()
    for i, e in enumerate(_list(rd, f"{_A}.evaluations", evaluations)):
        name = f"{_A}.evaluations[{i}]"
        e = _fields(rd, name, e, ("round", "version", "nodes", "sent_at"))
        er = rd.int_in(f"{name}.round", e["round"], 0, ckpt.round)
        if er in seen:
            raise rd.fail(f"{name}.round", er, "must be unique")
        seen.add(er)
        referenced(f"{name}.version", e["version"])
        nodes = _list(rd, f"{name}.nodes", e["nodes"])
        for k, n in enumerate(nodes):
            rd.int_in(f"{name}.nodes[{k}]", n, 0, _NODE_MAX)
        if nodes != sorted(set(nodes)):
            raise rd.fail(f"{name}.nodes", nodes[:4], "must be sorted distinct node ids")
        _number(rd, f"{name}.sent_at", e["sent_at"], 0.0, now)
    used = {j["version"] for j in jobs.values()} | {c["version"] for c in cohorts.values()}
    used |= {e["version"] for e in evaluations}
    for v in sorted(kept - used):
        raise rd.fail(f"{_A}.versions[{str(v)!r}]", v,
                      "is kept although no dispatch, cohort or evaluation references it")
    # the guard window, then the buffer (whose entries are the window's newest updates)
    guards = fresh.guards
    window = st.get("guard_window")
    norms: list[float] = []
    weights: list[float] = []
    wnodes: list[int] | None = None
    if window is not None:
        w = _fields(rd, f"{_A}.guard_window", window, ("size", "norms", "weights"))
        size = guards.size if guards is not None else None
        if not _is(w["size"], size):
            raise rd.fail(f"{_A}.guard_window.size", w["size"],
                          f"must be asynchronous.guard_window = {size}")
        for key, out in (("norms", norms), ("weights", weights)):
            values = _list(rd, f"{_A}.guard_window.{key}", w[key])
            for k, x in enumerate(values):
                out.append(_number(rd, f"{_A}.guard_window.{key}[{k}]", x, 0.0, 1e300))
        if len(norms) != len(weights) or len(norms) > w["size"]:
            raise rd.fail(f"{_A}.guard_window", f"{len(norms)} norms, {len(weights)} weights",
                          f"must be two lists of one length <= {w['size']}")
        if "nodes" in w:  # one entry per site (a checkpoint from before has no nodes)
            wnodes = [rd.int_in(f"{_A}.guard_window.nodes[{k}]", x, -1, _NODE_MAX)
                      for k, x in enumerate(_list(rd, f"{_A}.guard_window.nodes", w["nodes"]))]
            sites = [x for x in wnodes if x != -1]
            if len(wnodes) != len(norms) or len(set(sites)) != len(sites):
                raise rd.fail(f"{_A}.guard_window.nodes", wnodes[:4],
                              f"must be {len(norms)} node ids, one per entry, each site once "
                              "(the window keeps the latest update of each site)")
            if (secure and sites) or (not secure and len(sites) != len(wnodes)):
                raise rd.fail(f"{_A}.guard_window.nodes", wnodes[:4],
                              "must be -1 (a cohort's sum) under secure aggregation and site "
                              "node ids otherwise")
    waiting = st.get("waiting")
    if waiting is not None:  # plaintext FedBuff: the sites waiting for the open buffer
        queue = [rd.int_in(f"{_A}.waiting[{k}]", x, 0, _NODE_MAX)
                 for k, x in enumerate(_list(rd, f"{_A}.waiting", waiting))]
        if queue != sorted(set(queue)):
            raise rd.fail(f"{_A}.waiting", queue[:4], "must be sorted distinct node ids")
        if queue and (mode != "fedbuff" or secure):
            raise rd.fail(f"{_A}.waiting", queue[:4], "must be empty: only the sites of a "
                          "plaintext FedBuff run wait for the open buffer")
    buf = _fields(rd, f"{_A}.buffer", st["buffer"], ("size", "weighting", "sum", "norm",
                                                     "entries"))
    b = fresh.buffer
    if not _is(buf["size"], b.size):
        raise rd.fail(f"{_A}.buffer.size", buf["size"], f"must be the run's buffer size {b.size}")
    if not _is(buf["weighting"], b.weighting):
        raise rd.fail(f"{_A}.buffer.weighting", buf["weighting"],
                      f"must be asynchronous.weighting = {b.weighting!r}")
    entries = _list(rd, f"{_A}.buffer.entries", buf["entries"])
    total_count, normaliser, bound, bounded = 0, 0.0, 0.0, True
    newest = len(entries)
    folded: list[int] = []  # the sites with an update in the buffer, in order
    misplaced: tuple[str, int, int] | None = None  # an entry that is not the window's
    for i, e in enumerate(entries):
        name = f"{_A}.buffer.entries[{i}]"
        e = _fields(rd, name, e, ("node", "partition", "job", "version", "staleness", "scale",
                                  "weight", "count"))
        node = e["node"]
        cohort_entry = _is(node, -1)
        if not cohort_entry:
            rd.int_in(f"{name}.node", node, 0, _NODE_MAX)
        if cohort_entry and not secure:
            raise rd.fail(f"{name}.node", node, "a plaintext run folds no cohort (node -1)")
        rd.int_in(f"{name}.partition", e["partition"], -1, 2**31 - 1)
        rd.int_in(f"{name}.job", e["job"], 1, (next_cohort if cohort_entry else next_job) - 1)
        v = rd.int_in(f"{name}.version", e["version"], 0, version)
        s = rd.int_in(f"{name}.staleness", e["staleness"], 0, 10**9)
        if s != version - v:
            raise rd.fail(f"{name}.staleness", s, f"must be {version - v}: the buffer is folded "
                          f"at version {version}, the update came from version {v}")
        if fresh.max_staleness is not None and s > fresh.max_staleness:
            raise rd.fail(f"{name}.staleness", s,
                          f"must be <= asynchronous.max_staleness = {fresh.max_staleness}")
        scale = _number(rd, f"{name}.scale", e["scale"], 0.0, 1.0)
        want = float(fresh.staleness_weight(s))
        if not math.isclose(scale, want, rel_tol=1e-12, abs_tol=1e-15):
            raise rd.fail(f"{name}.scale", scale, f"must be the staleness weight w({s}) = {want}")
        weight = _number(rd, f"{name}.weight", e["weight"], 0.0, 1e300)
        if weight <= 0 or (max_weight is not None and weight > max_weight):
            raise rd.fail(f"{name}.weight", weight, "must be > 0" + (
                f" and <= strategy.max_weight = {max_weight:g}" if max_weight is not None else ""))
        count = rd.int_in(f"{name}.count", e["count"], 1, 10**6)
        if not cohort_entry and count != 1:
            raise rd.fail(f"{name}.count", count, "a site's update stands for 1 site")
        total_count += count
        n = weight if b.weighting == "examples" else float(count)
        normaliser += n
        k = len(weights) - (newest - i)  # this entry's place in the guard window
        if window is not None:
            if k < 0 and len(weights) < (guards.size if guards is not None else 0):
                raise rd.fail(f"{_A}.guard_window", f"{len(weights)} updates",
                              f"must hold the buffer's {newest} folded updates (each enters it)")
            if k >= 0 and not math.isclose(weights[k], weight, rel_tol=1e-12):
                raise rd.fail(f"{name}.weight", weight, f"must be the weight it was folded with "
                              f"(guard_window.weights[{k}] = {weights[k]:g})")
        if not cohort_entry:
            folded.append(int(node))
        if wnodes is not None and k >= 0 and wnodes[k] != int(node) and misplaced is None:
            misplaced = (f"{name}.node", int(node), wnodes[k])
        if window is not None and k >= 0:
            bound += scale * n * norms[k]
        elif max_update_norm is not None:
            bound += scale * n * max_update_norm
        else:
            bounded = False
    if b.size > 1 and total_count >= b.size:
        raise rd.fail(f"{_A}.buffer.entries", f"{total_count} site updates",
                      f"must be < asynchronous.buffer_size = {b.size}: a full buffer is applied "
                      "before the checkpoint")
    if mode == "deadline" and total_count > max(len(site_rounds), 1) * max(rnd, 1):
        raise rd.fail(f"{_A}.buffer.entries", f"{total_count} site updates",
                      "must be at most one per dispatched site and round")
    twice = sorted({x for x in folded if folded.count(x) > 1})
    if twice:
        raise rd.fail(f"{_A}.buffer.entries", f"node {twice[0]} {folded.count(twice[0])} times",
                      "must hold at most one update per site (fair buffers)")
    if misplaced is not None:
        raise rd.fail(misplaced[0], misplaced[1], f"must be the site of its guard window entry "
                      f"({misplaced[2]}): each folded update enters the window as its site's "
                      "newest")
    norm = _number(rd, f"{_A}.buffer.norm", buf["norm"], 0.0, 1e300)
    if not math.isclose(norm, normaliser, rel_tol=1e-9, abs_tol=1e-12):
        what = "weights" if b.weighting == "examples" else "counts"
        raise rd.fail(f"{_A}.buffer.norm", norm,
                      f"must be the sum of the entries' {what} = {normaliser:g}")
    if (buf["sum"] is None) != (not entries):
        raise rd.fail(f"{_A}.buffer.sum", "None" if buf["sum"] is None else "arrays",
                      "must be None exactly when the buffer has no entry")
    if buf["sum"] is not None:
        total = _like(rd, f"{_A}.buffer.sum", buf["sum"], model, np.float64)
        length = _norm2(total)
        if bounded and not length <= bound * (1 + 1e-6) + 1e-12:
            raise rd.fail(f"{_A}.buffer.sum", f"L2 norm {length:.6g}",
                          f"must be <= {bound:.6g}, what its entries can sum to (each update's "
                          "delta norm, from the guard window, x its weight x its staleness "
                          "weight)")
    # the optimizer: its own checks, on a scratch copy, and moments that fit the model
    opt = _fields(rd, f"{_A}.optimizer", st["optimizer"], ("kind", "t"))
    try:
        copy.deepcopy(fresh.optimizer).load_state_dict(opt)
    except Exception as exc:  # the optimizer's own checks (kind, step count, finite moments)
        raise rd.fail(f"{_A}.optimizer", type(exc).__name__, f"was refused: {exc}") from None
    for key in ("m", "v"):
        if opt.get(key) is not None:
            _like(rd, f"{_A}.optimizer.{key}", opt[key], model, np.float64)
    return st
