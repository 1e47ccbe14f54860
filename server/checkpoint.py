"""Crash-safe checkpoints: everything a resume needs, written atomically after every round.

A checkpoint is one ``.npz`` file (no pickle: ``np.load(..., allow_pickle=False)``) holding

* ``meta``: UTF-8 JSON — format version, the last completed round, the config hash and the
  full effective config, the model's tensor names, the metrics records so far, the strategy
  state (with arrays replaced by references), numpy / python RNG states;
* ``a<i>``: the arrays: the global model, then every array inside the strategy state
  (server-optimizer moments, ...), then the torch RNG state.

It is written by :func:`fedagg.report.atomic_write_bytes` (temporary file, fsync, rename, fsync
of the directory), so after a crash at any point — even in the middle of the write — the file
on disk is either the previous complete checkpoint or the new complete one.

Site-side state (error-feedback residuals, secure-aggregation keys) is not here: it lives on
the sites, in Flower's ``Context.state`` (see docs/reliability.md).
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import signal
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedagg.config import RunConfig, config_hash, flatten
from fedagg.errors import CheckpointError, explain
from fedagg.report import atomic_write_bytes

__all__ = ["CHECKPOINT_NAME", "Checkpoint", "config_diff", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_NAME = "checkpoint.npz"
FORMAT_VERSION = 1
# Test hook: SIGKILL this process half-way through writing the checkpoint of this round.
_CRASH_ENV = "FEDAGG_TEST_KILL_IN_CHECKPOINT_ROUND"


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` returns."""

    round: int
    config_hash: str
    config: dict[str, Any]
    keys: list[str]
    arrays: list[np.ndarray]
    records: list[dict[str, Any]]
    strategy_state: dict[str, Any] | None


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


def _decode(obj: Any, arrays: dict[int, np.ndarray]) -> Any:
    if isinstance(obj, dict):
        if "__array__" in obj:
            return arrays[int(obj["__array__"])]
        if "__bytes__" in obj:
            return base64.b64decode(obj["__bytes__"])
        if "__dict__" in obj:
            return {_decode(k, arrays): _decode(v, arrays) for k, v in obj["__dict__"]}
    if isinstance(obj, list):
        return [_decode(v, arrays) for v in obj]
    return obj


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
    payload: dict[str, Any] = {}
    for i, a in enumerate([*arrays, *extra]):
        payload[f"a{i}"] = np.asarray(a)
    payload["numpy_rng_keys"] = np.asarray(np_state[1])
    payload["torch_rng"] = torch.get_rng_state().numpy()
    payload["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **payload)
    data = buf.getvalue()
    path = Path(run_dir) / CHECKPOINT_NAME
    if os.environ.get(_CRASH_ENV) == str(round):
        tmp = path.with_name(f".{path.name}.crash-test")
        with open(tmp, "wb") as fh:  # half a file on disk, then die before the rename
            fh.write(data[: len(data) // 2])
            fh.flush()
            os.fsync(fh.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    atomic_write_bytes(path, data)
    return path


def load_checkpoint(run_dir: str | Path) -> Checkpoint:
    """Read ``run_dir/checkpoint.npz``.

    Raises
    ------
    CheckpointError
        Missing, truncated or foreign file.
    """
    path = Path(run_dir) / CHECKPOINT_NAME
    if not path.is_file():
        raise CheckpointError(
            explain(
                "--resume",
                str(run_dir),
                f"holds no {CHECKPOINT_NAME}",
                "point --resume at a run directory written by fedagg",
            )
        )
    try:
        with np.load(path, allow_pickle=False) as npz:
            meta = json.loads(bytes(npz["meta"]).decode())
            n_model, n_state = int(meta["num_model_arrays"]), int(meta["num_state_arrays"])
            arrays = [npz[f"a{i}"] for i in range(n_model)]
            extra = {i: npz[f"a{n_model + i}"] for i in range(n_state)}
            np_keys = npz["numpy_rng_keys"]
            torch_rng = npz["torch_rng"]
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, json.JSONDecodeError) as exc:
        raise CheckpointError(
            explain(
                "checkpoint",
                str(path),
                f"is unreadable ({type(exc).__name__})",
                "restore it from a backup, or start a new run",
            )
        ) from None
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            explain(
                "checkpoint.version",
                meta.get("version"),
                f"must be {FORMAT_VERSION}",
                "resume with the fedagg version that wrote it",
            )
        )
    rng = meta["numpy_rng"]
    np.random.set_state((rng[0], np_keys, rng[1], rng[2], rng[3]))
    torch.set_rng_state(torch.from_numpy(torch_rng.copy()))
    py = _decode(meta["python_rng"], extra)
    random.setstate((py[0], tuple(py[1]), py[2]))
    state = _decode(meta["strategy_state"], extra) if meta["strategy_state"] is not None else None
    return Checkpoint(
        round=int(meta["round"]),
        config_hash=meta["config_hash"],
        config=meta["config"],
        keys=list(meta["keys"]),
        arrays=arrays,
        records=list(meta["records"]),
        strategy_state=state,
    )


def config_diff(saved: dict[str, Any], cfg: RunConfig) -> list[str]:
    """``key: saved -> now`` for every setting that differs (ignoring run.rounds and paths)."""
    ignore = {"run.rounds", "run.output_dir", "run.name", "run.resume"}
    a, b = flatten(saved), flatten(cfg.model_dump(mode="json"))
    return [
        f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if k not in ignore and a.get(k) != b.get(k)
    ]
