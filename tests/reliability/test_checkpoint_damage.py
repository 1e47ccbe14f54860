"""Damaged, truncated, empty and tampered checkpoints (issue 17, item 4).

Every case is refused with a :class:`~fedagg.errors.CheckpointError` that names the file and
the field, ``fedagg simulate --resume`` exits with status 2 and prints no traceback, the run
directory stays byte-identical, and once the checkpoint is intact again the resume works.
Tampered files whose digest was recomputed (what a bit flip cannot do but an editor can) are
caught by the validation of every value: a NaN or int32 model, a negative round, ``round =
"abc"``, a bad torch RNG state, ...
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedagg.cli import main as cli_main
from fedagg.config import load_config
from fedagg.errors import CheckpointError
from server.checkpoint import CHECKPOINT_NAME, _write, load_checkpoint
from server.runner import check_resume

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ["run.rounds=2", "run.sites=3", "train.local_epochs=1", "run.seed=4",
             "strategy.server_optimizer='momentum'", "data.max_train_examples=300"]


def _cfg(*extra: str) -> Any:
    return load_config(None, [*OVERRIDES, *extra])


def _run(run_dir: Path, *extra: str) -> list[dict[str, Any]]:
    import torch

    from clients.app import app as client_app
    from server.inprocess import InProcessGrid
    from server.runner import run_server

    torch.set_num_threads(1)
    cfg = _cfg(*extra)
    return run_server(InProcessGrid(client_app, cfg.run.sites, seed=7), cfg, run_dir)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run directory after 2 rounds (momentum state, records, RNG states)."""
    d = tmp_path_factory.mktemp("run") / "run"
    _run(d)
    return d


def _members(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


def _meta(m: dict[str, np.ndarray]) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads(m["meta"].tobytes().decode())
    return meta


def _with_meta(m: dict[str, np.ndarray], **changes: Any) -> dict[str, np.ndarray]:
    meta = {**_meta(m), **changes}
    return {**m, "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)}


def _resealed(path: Path, members: dict[str, np.ndarray]) -> None:
    """Write ``members`` as a checkpoint with a *valid* digest (a deliberate tamper)."""
    _write(path, {k: v for k, v in members.items() if k != "digest"})


def _raw(path: Path, members: dict[str, np.ndarray]) -> None:
    """Write ``members`` as they are (the old digest stays: an accidental change)."""
    buf = io.BytesIO()
    np.savez(buf, **members)  # type: ignore[arg-type]
    path.write_bytes(buf.getvalue())


Damage = Callable[[Path], None]


def _bytes(fn: Callable[[bytes], bytes]) -> Damage:
    return lambda p: p.write_bytes(fn(p.read_bytes()))


def _members_edit(fn: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
                  *, reseal: bool = True) -> Damage:
    def apply(p: Path) -> None:
        m = fn(_members(p))
        (_resealed if reseal else _raw)(p, m)
    return apply


def _array(name: str, fn: Callable[[np.ndarray], np.ndarray]) -> Damage:
    return _members_edit(lambda m: {**m, name: fn(m[name])})


def _flip_bit(data: bytes) -> bytes:
    b = bytearray(data)
    b[len(b) // 2] ^= 0x10
    return bytes(b)


# (case, damage, field the message must name)
CASES: list[tuple[str, Damage, str]] = [
    ("empty", lambda p: p.write_bytes(b""), "[file]"),
    ("truncated-half", _bytes(lambda d: d[: len(d) // 2]), "[file]"),
    ("truncated-tail", _bytes(lambda d: d[:-7]), "["),
    ("truncated-header", _bytes(lambda d: d[:30]), "[file]"),
    ("garbage", lambda p: p.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4), "[file]"),
    ("bit-flip", _bytes(_flip_bit), "["),
    ("model-edited-keeping-the-old-digest",
     _members_edit(lambda m: {**m, "a0": m["a0"] + 1}, reseal=False), "[digest]"),
    ("no-digest (a version-1 file)",
     _members_edit(lambda m: {k: v for k, v in m.items() if k != "digest"}, reseal=False),
     "[digest]"),
    ("meta-missing", _members_edit(lambda m: {k: v for k, v in m.items() if k != "meta"}),
     "[meta]"),
    ("meta-not-json", _array("meta", lambda a: np.frombuffer(b"{not json", np.uint8)), "[meta]"),
    ("meta-a-list", _array("meta", lambda a: np.frombuffer(b"[1, 2]", np.uint8)), "[meta]"),
    ("version-1", _members_edit(lambda m: _with_meta(m, version=1)), "[meta.version]"),
    ("round-abc", _members_edit(lambda m: _with_meta(m, round="abc")), "[meta.round]"),
    ("round-negative", _members_edit(lambda m: _with_meta(m, round=-1)), "[meta.round]"),
    ("round-float", _members_edit(lambda m: _with_meta(m, round=1.5)), "[meta.round]"),
    ("round-bool", _members_edit(lambda m: _with_meta(m, round=True)), "[meta.round]"),
    ("config-hash-int", _members_edit(lambda m: _with_meta(m, config_hash=3)),
     "[meta.config_hash]"),
    ("config-a-string", _members_edit(lambda m: _with_meta(m, config="x")), "[meta.config]"),
    ("keys-not-strings", _members_edit(lambda m: _with_meta(m, keys=[1, 2])), "[meta.keys]"),
    ("records-not-a-list", _members_edit(lambda m: _with_meta(m, records={"a": 1})),
     "[meta.records]"),
    ("records-round-garbage", _members_edit(
        lambda m: _with_meta(m, records=[{"round": 0}, {"round": "x"}])), "[meta.records[1].round]"),
    ("records-beyond-the-round", _members_edit(
        lambda m: _with_meta(m, records=[{"round": 0}, {"round": 7}])), "[meta.records[1].round]"),
    ("model-array-missing", _members_edit(lambda m: {k: v for k, v in m.items() if k != "a1"}),
     "[a1]"),
    ("num-model-arrays-wrong", _members_edit(lambda m: _with_meta(m, num_model_arrays=1)),
     "[meta.num_model_arrays]"),
    ("model-nan", _array("a0", lambda a: np.full_like(a, np.nan)), "[a0 (model tensor"),
    ("model-inf", _array("a1", lambda a: a + np.inf), "[a1 (model tensor"),
    ("model-int32", _array("a0", lambda a: a.astype(np.int32)), "[a0 (model tensor"),
    ("model-float64", _array("a0", lambda a: a.astype(np.float64)), "[a0 (model tensor"),
    ("model-shape", _array("a0", lambda a: a.reshape(-1)), "[a0 (model tensor"),
    ("model-strings", _array("a0", lambda a: np.array(["x"] * a.size)), "[a0 (model tensor"),
    ("model-keys", _members_edit(lambda m: _with_meta(m, keys=["w" + k for k in _meta(m)["keys"]])),
     "[meta.keys]"),
    ("optimizer-moment-nan", None, "(state)"),  # filled in below: the first state array
    ("optimizer-t-negative", _members_edit(lambda m: _with_meta(
        m, strategy_state=_state_with(_meta(m)["strategy_state"], "t", -3))),
     "[meta.strategy_state]"),
    ("optimizer-kind-changed", _members_edit(lambda m: _with_meta(
        m, strategy_state=_state_with(_meta(m)["strategy_state"], "kind", "adam"))),
     "[meta.strategy_state]"),
    ("state-array-reference-out-of-range", _members_edit(lambda m: _with_meta(
        m, strategy_state={"__dict__": [["optimizer", {"__array__": 99}]]})),
     "[meta.strategy_state"),
    ("state-bad-base64", _members_edit(lambda m: _with_meta(
        m, strategy_state={"__dict__": [["x", {"__bytes__": "***"}]]})), "[meta.strategy_state"),
    ("state-unknown-tag", _members_edit(lambda m: _with_meta(m, strategy_state={"evil": 1})),
     "[meta.strategy_state]"),
    ("numpy-rng-keys-short", _array("numpy_rng_keys", lambda a: a[:10]), "[meta.numpy_rng]"),
    ("numpy-rng-pos-bad", _members_edit(lambda m: _with_meta(
        m, numpy_rng=["MT19937", 10**6, 0, 0.0])), "[meta.numpy_rng]"),
    ("numpy-rng-not-mt", _members_edit(lambda m: _with_meta(m, numpy_rng=["PCG64", 1, 0, 0.0])),
     "[meta.numpy_rng]"),
    ("python-rng-bad", _members_edit(lambda m: _with_meta(m, python_rng=[3, [1, 2], None])),
     "[meta.python_rng]"),
    ("torch-rng-zeros", _array("torch_rng", np.zeros_like), "[torch_rng]"),
    ("torch-rng-short", _array("torch_rng", lambda a: a[:100]), "[torch_rng]"),
    ("torch-rng-float", _array("torch_rng", lambda a: a.astype(np.float32)), "[torch_rng]"),
]


def _state_with(state: Any, key: str, value: Any) -> Any:
    """The encoded strategy state with ``optimizer[key] = value``."""
    pairs = {p[0]: p[1] for p in state["__dict__"]}
    opt = {p[0]: p[1] for p in pairs["optimizer"]["__dict__"]}
    opt[key] = value
    pairs["optimizer"] = {"__dict__": [[k, v] for k, v in opt.items()]}
    return {"__dict__": [[k, v] for k, v in pairs.items()]}


def _first_state_array_nan(p: Path) -> None:
    m = _members(p)
    meta = _meta(m)
    name = f"a{meta['num_model_arrays']}"
    m[name] = np.full_like(m[name], np.nan)
    _resealed(p, m)


CASES = [(c, _first_state_array_nan if d is None else d, f) for c, d, f in CASES]


def _snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def damaged(finished_run: Path, tmp_path: Path) -> Path:
    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    return d


@pytest.mark.parametrize(("case", "damage", "field"), CASES, ids=[c[0] for c in CASES])
def test_damaged_checkpoint_is_refused_naming_file_and_field(
        damaged: Path, case: str, damage: Damage, field: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = damaged / CHECKPOINT_NAME
    damage(path)
    with pytest.raises(CheckpointError) as info:  # what --resume and the ServerApp check
        check_resume(_cfg(f"run.resume='{damaged}'"))
    message = str(info.value)
    assert str(path) in message and field in message, message
    # fedagg simulate --resume: exit status 2, one line, no traceback, nothing written
    before = _snapshot(damaged)
    assert cli_main(["simulate", "--resume", str(damaged), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedagg: error: ") and "Traceback" not in err, err
    assert str(path) in err and field in err
    assert _snapshot(damaged) == before


def _model_of(run_dir: Path) -> tuple[list[str], list[np.ndarray]]:
    with np.load(run_dir / "model.npz") as npz:
        return list(npz.files), [npz[k] for k in npz.files]


def test_every_field_of_the_format_has_a_damage_case() -> None:
    fields = {f for _, _, f in CASES}
    for name in ("[file]", "[digest]", "[meta]", "[meta.version]", "[meta.round]",
                 "[meta.config_hash]", "[meta.config]", "[meta.keys]", "[meta.records]",
                 "[meta.num_model_arrays]", "[meta.strategy_state]", "[meta.numpy_rng]",
                 "[meta.python_rng]", "[torch_rng]"):
        assert name in fields, name


def test_a_refused_resume_writes_nothing_and_a_correct_resume_then_works(
        finished_run: Path, tmp_path: Path) -> None:
    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    good = (d / CHECKPOINT_NAME).read_bytes()
    _array("a0", lambda a: np.full_like(a, np.nan))(d / CHECKPOINT_NAME)
    before = _snapshot(d)
    with pytest.raises(CheckpointError, match=r"\[a0 \(model tensor"):
        _run(d, "run.rounds=3", f"run.resume='{d}'")
    assert _snapshot(d) == before  # not even config.json
    (d / CHECKPOINT_NAME).write_bytes(good)
    records = _run(d, "run.rounds=3", f"run.resume='{d}'")
    assert [r["round"] for r in records] == [0, 1, 2, 3] and records[3]["model_updated"]
    ck = load_checkpoint(d)
    assert ck.round == 3 and [r["round"] for r in ck.records] == [0, 1, 2, 3]


def test_a_resume_with_a_changed_setting_leaves_the_directory_byte_identical(
        finished_run: Path, tmp_path: Path) -> None:
    """The issue's case: a refused --resume used to overwrite config.json, after which every
    correct resume was refused too."""
    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    before = _snapshot(d)
    with pytest.raises(CheckpointError, match=r"train\.lr: 0\.1 -> 0\.3"):
        _run(d, "train.lr=0.3", f"run.resume='{d}'")
    assert cli_main(["simulate", "--resume", str(d), "-c", "train.lr=0.3", "--quiet"]) == 2
    assert _snapshot(d) == before
    records = _run(d, "run.rounds=3", f"run.resume='{d}'")  # the correct resume still works
    assert records[-1]["round"] == 3


def test_a_damaged_config_json_is_a_clear_error(finished_run: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    (d / "config.json").write_text("{truncated")
    before = _snapshot(d)
    assert cli_main(["simulate", "--resume", str(d), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "Traceback" not in err
    assert _snapshot(d) == before


def test_a_well_formed_checkpoint_loads_without_touching_the_rngs(finished_run: Path) -> None:
    import random

    import torch

    np.random.seed(123)
    random.seed(123)
    torch.manual_seed(123)
    states = (np.random.get_state()[1].copy(), random.getstate(), torch.get_rng_state().clone())
    ck = load_checkpoint(finished_run, model=_model_of(finished_run))
    assert ck.round == 2 and ck.strategy_state is not None
    assert (np.random.get_state()[1] == states[0]).all() and random.getstate() == states[1]
    assert torch.equal(torch.get_rng_state(), states[2])
    ck.restore_rng()  # applied only when the resume has been accepted
    assert ck.numpy_rng is not None and ck.torch_rng is not None
    assert (np.random.get_state()[1] == ck.numpy_rng[1]).all()
    assert not (np.random.get_state()[1] == states[0]).all()
    assert np.array_equal(torch.get_rng_state().numpy(), ck.torch_rng)


def test_the_cli_exits_2_in_a_fresh_process(finished_run: Path, tmp_path: Path) -> None:
    """The exit status as a shell sees it (the in-process cases above call main())."""
    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    (d / CHECKPOINT_NAME).write_bytes((d / CHECKPOINT_NAME).read_bytes()[:100])
    before = _snapshot(d)
    proc = subprocess.run([sys.executable, "-m", "fedagg.cli", "simulate", "--resume", str(d)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "checkpoint.npz[file]" in proc.stderr and "Traceback" not in proc.stderr
    assert _snapshot(d) == before
