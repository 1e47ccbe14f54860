"""Asynchronous (FedBuff / deadline) checkpoints: validated like synchronous ones, and resumable.

The checkpoints are real: the asynchronous loop over the real ClientApp on a DelayedGrid
(virtual clock), SIGKILLed mid-run, so they hold dispatches in flight, kept model versions, an
open federated evaluation (FedBuff), and updates kept in a deadline round's buffer. Each case
rewrites one field of the asynchronous state (or of the records) and *recomputes the digest*
(what an editor can do, not a bit flip): the resume is refused with a CheckpointError naming the
file and the field, ``fedagg simulate --resume`` exits with status 2 and no traceback, and the
run directory stays byte-identical -- never a KeyError / ValueError / TypeError, and never an
implausible value accepted (a buffer sum of 1e30 would commit a model of ~1e28). A hypothesis
fuzz rewrites any field with any value: 0 tracebacks.

An intact checkpoint resumes: through the real loop it continues the very sequence of model
versions of an uninterrupted run (digests, times), and ``fedagg simulate --resume`` -- which
used to exit 2 with ``KeyError: 'optimizer'`` -- accepts it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedagg.cli import main as cli_main
from fedagg.config import RunConfig, apply_overrides, validate_model
from fedagg.errors import CheckpointError, FedaggError
from server.asynchronous import check_async_resume
from server.checkpoint import CHECKPOINT_NAME, _encode, _write, load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("async_checkpoint_driver.py")
COMMON = ["run.sites=5", "train.local_epochs=1", "run.seed=4", "data.max_train_examples=500",
          "strategy.server_optimizer='momentum'", "asynchronous.sim_sigma=0.8"]
FEDBUFF = [*COMMON, "run.rounds=6", "strategy.server_lr=0.7", "asynchronous.mode='fedbuff'",
           "asynchronous.buffer_size=3", "asynchronous.concurrency=4",
           "asynchronous.sim_site_sigma=0.4", "asynchronous.max_staleness=3",
           "run.fraction_evaluate=1.0"]
DEADLINE = [*COMMON, "run.rounds=6", "asynchronous.mode='deadline'", "asynchronous.deadline=9",
            "run.min_sites=3"]
BASES = {"fedbuff": (FEDBUFF, "arrival:8"), "deadline": (DEADLINE, "4:after-apply")}


def _env() -> dict[str, str]:
    """This checkout first on the path of a child process (not another installed copy)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _drive(run_dir: Path, overrides: list[str], kill: str | None = None) -> int:
    env = _env()
    if kill is not None:
        env["FEDAGG_TEST_KILL_AT"] = kill
    p = subprocess.run([sys.executable, str(DRIVER), str(run_dir), *overrides], cwd=ROOT,
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
    if p.returncode not in (0, -signal.SIGKILL):
        print(p.stderr.decode()[-3000:])
    return p.returncode


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The killed runs: FedBuff after 8 arrivals, deadline rounds after round 4's record (its
    checkpoint is round 3's, with 2 updates kept in the buffer for the next round)."""
    out = {}
    for name, (overrides, kill) in BASES.items():
        d = tmp_path_factory.mktemp(f"base-{name}") / "run"
        assert _drive(d, overrides, kill) == -signal.SIGKILL
        out[name] = d
    state = load_checkpoint(out["deadline"]).strategy_state
    assert state is not None and len(state["asynchronous"]["buffer"]["entries"]) == 2
    fb = (load_checkpoint(out["fedbuff"]).strategy_state or {})["asynchronous"]
    assert fb["jobs"] and fb["versions"] and fb["evaluations"]
    return out


def _cfg(run_dir: Path) -> RunConfig:
    """The run's own config with ``run.resume`` (what ``fedagg simulate --resume`` reads)."""
    data = json.loads((run_dir / "config.json").read_text())
    cfg: RunConfig = validate_model(RunConfig, apply_overrides(
        data, [f"run.resume={json.dumps(str(run_dir))}"]))
    return cfg


def _members(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


State = dict[str, Any]
Edit = Callable[[State, dict[str, Any]], Any]


def _rewrite(run_dir: Path, edit: Edit) -> None:
    """Apply ``edit(strategy_state, meta)`` to the decoded checkpoint and write it back with a
    recomputed digest (a deliberate tamper). ``edit`` may return a new strategy state."""
    path = run_dir / CHECKPOINT_NAME
    m = _members(path)
    meta = json.loads(m["meta"].tobytes().decode())
    n_model = int(meta["num_model_arrays"])
    state = copy.deepcopy(load_checkpoint(run_dir).strategy_state)
    got = edit(state, meta)
    state = state if got is None else got
    extra: list[np.ndarray] = []
    meta["strategy_state"] = _encode(state, extra)
    meta["num_state_arrays"] = len(extra)
    out = {k: v for k, v in m.items() if k != "digest" and not (
        k.startswith("a") and k[1:].isdigit() and int(k[1:]) >= n_model)}
    for i, a in enumerate(extra):
        out[f"a{n_model + i}"] = np.asarray(a)
    out["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    _write(path, out)


def _a(fn: Callable[[State], Any]) -> Edit:
    """An edit of the asynchronous state itself (in place)."""
    def edit(state: State, meta: dict[str, Any]) -> None:
        fn(state["asynchronous"])
    return edit


def _set(*path: Any, value: Any) -> Edit:
    def edit(st: State) -> None:
        node: Any = st
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value
    return _a(edit)


def _entry(st: State, back: int = 1, **changes: Any) -> dict[str, Any]:
    """A buffer entry as the loop would have folded it (the guard window's ``back``-th newest:
    its site and weight)."""
    w = st["guard_window"]
    node = int(w["nodes"][-back]) if "nodes" in w else int(next(iter(st["site_rounds"])))
    e = {"node": node, "partition": 0, "job": 1, "version": st["version"], "staleness": 0,
         "scale": 1.0, "weight": float(w["weights"][-back]), "count": 1}
    e.update(changes)
    return e


def _with_entry(scale_sum: float | None, **changes: Any) -> Edit:
    """One folded update in the buffer whose running sum has L2 norm ``scale_sum`` (None: the
    largest the guard window allows, i.e. a plausible buffer)."""
    def edit(st: State) -> None:
        e = _entry(st, **changes)
        like = [np.asarray(a, np.float64) for a in st["model"]]
        unit = [np.ones_like(a) for a in like]
        length = float(np.sqrt(sum(float(np.vdot(u, u)) for u in unit)))
        target = scale_sum if scale_sum is not None else \
            0.5 * e["scale"] * e["weight"] * st["guard_window"]["norms"][-1]
        st["buffer"].update(entries=[e], norm=float(e["weight"]),
                            sum=[u * (target / length) for u in unit])
    return _a(edit)


def _meta_records(fn: Callable[[list[dict[str, Any]]], None]) -> Edit:
    def edit(state: State, meta: dict[str, Any]) -> None:
        fn(meta["records"])
    return edit


def _nodes_unsorted(st: State) -> None:
    ev = st["evaluations"][0]
    ev["nodes"] = list(reversed(ev["nodes"])) + ev["nodes"][:1]


def _dup_job(st: State) -> None:
    st["jobs"][1]["job"] = st["jobs"][0]["job"]


def _unreferenced_version(st: State) -> None:
    kept = {int(k) for k in st["versions"]}
    free = next(v for v in range(st["version"]) if v not in kept and v not in {
        j["version"] for j in st["jobs"]} and v not in {e["version"] for e in st["evaluations"]})
    st["versions"][str(free)] = [a.copy() for a in st["model"]]


def _unkept_job_version(st: State) -> None:
    kept = {int(k) for k in st["versions"]} | {st["version"]}
    st["jobs"][0]["version"] = next(v for v in range(st["version"]) if v not in kept)


def _full_buffer(st: State) -> None:
    """K = 3 updates, each as the window remembers it: a full buffer is never checkpointed."""
    entries = [_entry(st, 3 - i, job=i + 1) for i in range(3)]
    weights = [e["weight"] for e in entries]
    st["buffer"].update(entries=entries, norm=float(sum(weights)),
                        sum=[np.zeros(np.shape(a)) for a in st["model"]])


def _site_rounds_below(st: State) -> None:
    j = st["jobs"][0]
    st["site_rounds"][str(j["node"])] = j["server_round"] - 1 or 1
    j["server_round"] = max(j["server_round"], 2)


# (case, base run, edit, field the message must name)
CASES: list[tuple[str, str, Edit, str]] = [
    ("not-asynchronous", "fedbuff",
     lambda state, meta: {"optimizer": state["asynchronous"]["optimizer"]},
     "[meta.strategy_state]"),
    ("run-id-short", "fedbuff", lambda state, meta: state.update(run_id=b"x"), ".run_id]"),
    ("run-id-a-string", "fedbuff", lambda state, meta: state.update(run_id="abc"), ".run_id]"),
    ("version-a-string", "fedbuff", _set("version", value="2"), ".version]"),
    ("version-negative", "fedbuff", _set("version", value=-1), ".version]"),
    ("version-ahead-of-the-records", "fedbuff", _set("version", value=7), ".version]"),
    ("version-missing", "fedbuff", _a(lambda st: st.pop("version")), ".version]"),
    ("model-differs", "fedbuff", _set("model", 0, value=lambda a: a + 1), ".model[0]]"),
    ("model-float64", "fedbuff", _set("model", 0, value=lambda a: a.astype(np.float64)),
     ".model[0]]"),
    ("model-one-tensor-short", "fedbuff", _set("model", value=lambda m: m[:-1]), ".model]"),
    ("versions-key-garbage", "fedbuff", _a(lambda st: st["versions"].update(
        abc=st["model"])), ".versions['abc']]"),
    ("versions-kept-unreferenced", "fedbuff", _a(_unreferenced_version), ".versions["),
    ("versions-wrong-shape", "fedbuff", _a(lambda st: [v.__setitem__(0, v[0].reshape(-1))
                                                       for v in st["versions"].values()]),
     ".versions["),
    ("job-version-not-kept", "fedbuff", _a(_unkept_job_version), ".jobs[0].version]"),
    ("job-version-ahead", "fedbuff", _set("jobs", 0, "version", value=99), ".jobs[0].version]"),
    ("job-node-negative", "fedbuff", _set("jobs", 0, "node", value=-4), ".jobs[0].node]"),
    ("job-node-a-string", "fedbuff", _set("jobs", 0, "node", value="n1"), ".jobs[0].node]"),
    ("job-node-beyond-u64", "fedbuff", _set("jobs", 0, "node", value=2**70), ".jobs[0].node]"),
    ("job-dispatched-in-the-future", "fedbuff",
     _a(lambda st: st["jobs"][0].update(dispatched_at=st["now"] + 100)),
     ".jobs[0].dispatched_at]"),
    ("job-id-beyond-next-job", "fedbuff",
     _a(lambda st: st["jobs"][0].update(job=st["next_job"])), ".jobs[0].job]"),
    ("job-id-duplicate", "fedbuff", _a(_dup_job), ".jobs[1].job]"),
    ("job-cohort-unknown", "fedbuff", _set("jobs", 0, "cohort", value=5), ".jobs[0].cohort]"),
    ("job-field-missing", "fedbuff", _a(lambda st: st["jobs"][0].pop("node")),
     ".jobs[0].node]"),
    ("jobs-an-object", "fedbuff", _set("jobs", value={"a": 1}), ".jobs]"),
    ("job-server-round-beyond-site-rounds", "fedbuff", _a(_site_rounds_below),
     ".jobs[0].server_round]"),
    ("buffer-size-changed", "fedbuff", _set("buffer", "size", value=5), ".buffer.size]"),
    ("buffer-weighting-changed", "fedbuff", _set("buffer", "weighting", value="uniform"),
     ".buffer.weighting]"),
    ("buffer-sum-1e30", "fedbuff", _with_entry(1e30), ".buffer.sum]"),
    ("buffer-sum-of-another-shape", "fedbuff", _a(lambda st: _with_entry(None)(
        {"asynchronous": st}, {}) or st["buffer"]["sum"].__setitem__(
        0, st["buffer"]["sum"][0].reshape(-1))), ".buffer.sum[0]]"),
    ("buffer-norm-inconsistent", "fedbuff",
     _a(lambda st: _with_entry(None)({"asynchronous": st}, {}) or st["buffer"].update(
         norm=st["buffer"]["norm"] * 5)), ".buffer.norm]"),
    ("buffer-entry-staleness-inconsistent", "fedbuff", _with_entry(None, staleness=2),
     ".staleness]"),
    ("buffer-entry-scale-not-w(s)", "fedbuff", _with_entry(None, scale=0.5), ".scale]"),
    ("buffer-entry-weight-negative", "fedbuff", _with_entry(None, weight=-3.0), ".weight]"),
    ("buffer-entry-weight-not-the-windows", "fedbuff", _with_entry(None, weight=1e9),
     ".weight]"),
    ("buffer-entry-count-2", "fedbuff", _with_entry(None, count=2), ".count]"),
    ("buffer-entry-a-cohort-in-plaintext", "fedbuff", _with_entry(None, node=-1), ".node]"),
    ("buffer-entry-version-ahead", "fedbuff",
     _a(lambda st: _with_entry(None, version=st["version"] + 1)({"asynchronous": st}, {})),
     ".version]"),
    ("buffer-entries-without-sum", "fedbuff",
     _a(lambda st: _with_entry(None)({"asynchronous": st}, {}) or st["buffer"].update(
         sum=None)), ".buffer.sum]"),
    ("buffer-full", "fedbuff", _a(_full_buffer), ".buffer.entries]"),
    ("optimizer-kind-changed", "fedbuff", _set("optimizer", "kind", value="adam"),
     ".optimizer]"),
    ("optimizer-t-negative", "fedbuff", _set("optimizer", "t", value=-1), ".optimizer]"),
    ("optimizer-moment-wrong-shape", "fedbuff",
     _set("optimizer", "m", 0, value=lambda a: a.reshape(-1)), ".optimizer.m[0]]"),
    ("optimizer-moment-float32", "fedbuff",
     _set("optimizer", "m", 1, value=lambda a: a.astype(np.float32)), ".optimizer.m[1]]"),
    ("site-rounds-key-garbage", "fedbuff", _a(lambda st: st["site_rounds"].update(x=1)),
     ".site_rounds]"),
    ("site-rounds-zero", "fedbuff",
     _a(lambda st: st["site_rounds"].update({next(iter(st["site_rounds"])): 0})),
     ".site_rounds['"),
    ("next-job-zero", "fedbuff", _set("next_job", value=0), ".next_job]"),
    ("next-cohort-a-string", "fedbuff", _set("next_cohort", value="1"), ".next_cohort]"),
    ("round-in-fedbuff", "fedbuff", _set("round", value=3), ".round]"),
    ("round-started-after-now", "fedbuff",
     _a(lambda st: st.update(round_started=st["now"] + 1)), ".round_started]"),
    ("now-negative", "fedbuff", _set("now", value=-5.0), ".now]"),
    ("now-before-the-last-record", "fedbuff", _set("now", value=0.5), ".now]"),
    ("guard-window-size-changed", "fedbuff", _set("guard_window", "size", value=7),
     ".guard_window.size]"),
    ("guard-window-norm-negative", "fedbuff", _set("guard_window", "norms", 0, value=-1.0),
     ".guard_window.norms[0]]"),
    ("guard-window-norm-a-string", "fedbuff", _set("guard_window", "norms", 0, value="x"),
     ".guard_window.norms[0]]"),
    ("guard-window-lengths-differ", "fedbuff",
     _set("guard_window", "weights", value=lambda w: w[:-1]), ".guard_window]"),
    ("evaluation-version-not-kept", "fedbuff", _a(lambda st: st["evaluations"][0].update(
        version=next(v for v in range(st["version"]) if str(v) not in st["versions"]))),
     ".evaluations[0].version]"),
    ("evaluation-round-ahead", "fedbuff", _set("evaluations", 0, "round", value=40),
     ".evaluations[0].round]"),
    ("evaluation-nodes-unsorted", "fedbuff", _a(_nodes_unsorted), ".evaluations[0].nodes]"),
    ("cohort-in-a-plaintext-run", "fedbuff", _a(lambda st: st.update(
        next_cohort=2, cohorts=[{"cohort": 1, "version": st["version"], "server_round": 1,
                                 "members": [1], "started_at": 0.0, "attempt": 0}])),
     ".cohorts[0]]"),
    ("records-version-broken", "fedbuff",
     _meta_records(lambda r: r[-1].update(version=r[-1]["version"] + 3)), "[meta.records["),
    ("records-mode-changed", "fedbuff", _meta_records(lambda r: r[0].update(mode="deadline")),
     "[meta.records[0].mode]"),
    ("deadline-buffer-sum-1e30", "deadline", _a(lambda st: st["buffer"].update(
        sum=[np.asarray(s) * 1e30 for s in st["buffer"]["sum"]])), ".buffer.sum]"),
    ("deadline-entry-weight-not-the-windows", "deadline",
     _set("buffer", "entries", 0, "weight", value=lambda w: w * 7), ".weight]"),
    ("deadline-buffer-norm-changed", "deadline", _set("buffer", "norm", value=lambda n: n + 1),
     ".buffer.norm]"),
    ("deadline-entry-version-ahead", "deadline",
     _a(lambda st: st["buffer"]["entries"][0].update(version=st["version"] + 1)), ".version]"),
    ("deadline-round-far-ahead", "deadline", _set("round", value=9), ".round]"),
    ("waiting-a-string", "fedbuff", _set("waiting", value=["x"]), ".waiting[0]]"),
    ("waiting-unsorted", "fedbuff", _set("waiting", value=[5, 3]), ".waiting]"),
    ("waiting-in-deadline-rounds", "deadline", _set("waiting", value=[3]), ".waiting]"),
    ("guard-window-a-site-twice", "fedbuff",
     _set("guard_window", "nodes", value=lambda n: [n[-1]] * len(n)), ".guard_window.nodes]"),
    ("guard-window-nodes-short", "fedbuff",
     _set("guard_window", "nodes", value=lambda n: n[:-1]), ".guard_window.nodes]"),
    ("guard-window-a-cohort-in-plaintext", "fedbuff",
     _set("guard_window", "nodes", 0, value=-1), ".guard_window.nodes]"),
    ("deadline-buffer-two-updates-of-one-site", "deadline",
     _a(lambda st: st["buffer"]["entries"][1].update(node=st["buffer"]["entries"][0]["node"])),
     ".buffer.entries]"),
    ("deadline-entry-not-the-windows-site", "deadline",
     _a(lambda st: st["buffer"]["entries"][0].update(
         node=max(e["node"] for e in st["buffer"]["entries"]) + 1)), ".buffer.entries[0].node]"),
    ("deadline-guard-window-without-the-buffers-updates", "deadline",
     _set("guard_window", value=lambda w: {**w, "norms": w["norms"][:1],
                                           "weights": w["weights"][:1],
                                           "nodes": w["nodes"][:1]}), ".guard_window]"),
]


def test_at_least_25_kinds_of_rewritten_field() -> None:
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


def _snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("case", "base", "edit", "field"), CASES, ids=[c[0] for c in CASES])
def test_rewritten_field_is_refused_naming_file_and_field(
        bases: dict[str, Path], tmp_path: Path, case: str, base: str, edit: Edit, field: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "run"
    shutil.copytree(bases[base], d)
    _rewrite(d, edit)
    path = d / CHECKPOINT_NAME
    with pytest.raises(CheckpointError) as info:  # what --resume and the loop check
        check_async_resume(_cfg(d))
    message = str(info.value)
    assert str(path) in message and field in message, message
    before = _snapshot(d)
    assert cli_main(["simulate", "--resume", str(d), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedagg: error: ") and "Traceback" not in err, err
    assert str(path) in err and field in err, err
    assert _snapshot(d) == before


@pytest.mark.slow  # runs the asynchronous loop again in a subprocess (or fuzzes it), 10-35 s
def test_the_real_loop_refuses_a_buffer_sum_of_1e30(bases: dict[str, Path], tmp_path: Path
                                                    ) -> None:
    """The issue's attack through the loop itself: before, the resumed run folded one more
    update into the forged buffer and committed a model of ~1e28."""
    d = tmp_path / "run"
    shutil.copytree(bases["fedbuff"], d)
    _rewrite(d, _with_entry(1e30))
    before = _snapshot(d)
    try:
        p = subprocess.run([sys.executable, str(DRIVER), str(d), *FEDBUFF, f"run.resume='{d}'"],
                           cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("the resumed run accepted the forged buffer and went on (it committed a "
                    "model of ~1e25, then every update was non-finite and the run stalled)")
    assert p.returncode != 0 and "CheckpointError" in p.stderr, p.stderr[-2000:]
    assert ".buffer.sum]" in p.stderr
    assert _snapshot(d) == before  # no record, no model, no checkpoint written


def test_a_plausible_buffer_is_accepted(bases: dict[str, Path], tmp_path: Path) -> None:
    """The checks refuse what cannot have been folded, not a buffer the loop could write: one
    update within the guard window's norm, with its weight and staleness weight."""
    d = tmp_path / "run"
    shutil.copytree(bases["fedbuff"], d)
    _rewrite(d, _with_entry(None))
    assert check_async_resume(_cfg(d)).round == load_checkpoint(d).round


# --- an intact checkpoint resumes --------------------------------------------------------------

def _versions(run_dir: Path) -> list[tuple[int, str, float, bool]]:
    recs = json.loads((run_dir / "metrics.json").read_text())
    return [(r["version"], r["model_digest"], round(r["time"], 9), r["model_updated"])
            for r in recs[1:]]


@pytest.mark.slow  # runs the asynchronous loop again in a subprocess (or fuzzes it), 10-35 s
@pytest.mark.parametrize("base", sorted(BASES))
def test_an_intact_checkpoint_is_accepted_and_continues_the_same_versions(
        bases: dict[str, Path], tmp_path: Path, base: str) -> None:
    """The CLI's check (which handed the FedBuff state to a synchronous strategy: ``KeyError:
    'optimizer'``, exit 2) accepts the killed run, and the resumed loop continues the very
    versions of an uninterrupted run."""
    overrides, _ = BASES[base]
    d = tmp_path / "run"
    shutil.copytree(bases[base], d)
    ck = check_async_resume(_cfg(d))
    assert ck.round < 6
    ref = tmp_path / "reference"
    assert _drive(ref, overrides) == 0
    assert _drive(d, [*overrides, f"run.resume='{d}'"]) == 0
    assert _versions(d) == _versions(ref)


@pytest.mark.slow
@pytest.mark.flower
def test_fedagg_simulate_resumes_a_fedbuff_run(bases: dict[str, Path], tmp_path: Path) -> None:
    """``fedagg simulate --resume RUN_DIR`` on Flower's simulation engine: exit 0, the records
    go on from the checkpoint's version to run.rounds, one new version per committed buffer.
    A new engine gives the sites new node ids: the dispatches in flight at the kill are named
    in the next record's ``errors`` and the current model goes to the connected sites."""
    d = tmp_path / "run"
    shutil.copytree(bases["fedbuff"], d)
    done = load_checkpoint(d).round
    p = subprocess.run([sys.executable, "-m", "fedagg.cli", "simulate", "--resume", str(d),
                        "--quiet"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = json.loads((d / "metrics.json").read_text())
    assert [r["round"] for r in recs] == list(range(7))
    versions = [r["version"] for r in recs]
    assert versions[: done + 1] == list(range(done + 1))
    committed = 0
    for r in recs[1:]:
        committed += bool(r["model_updated"])
        assert r["version"] == committed
    assert committed > done
    assert any("not connected now" in str(r.get("errors")) for r in recs[done + 1:])


# --- hypothesis: any field, any value ----------------------------------------------------------

def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            out += _paths(v, (*prefix, i))
    return out


_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e30, -1e-300, 5e-324]),
    st.text(max_size=6), st.binary(max_size=20),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.sampled_from(["a", "node", "0", "version"]), st.integers(-2, 2),
                    max_size=2),
    st.sampled_from(["array-f32", "array-huge", "array-int", "array-empty", "delete"]),
)


def _value(raw: Any, old: Any) -> Any:
    if raw == "array-f32":
        return np.zeros((2, 3), np.float32)
    if raw == "array-huge" and isinstance(old, np.ndarray):
        return np.full(old.shape, 1e30, np.float64)
    if raw == "array-int":
        return np.arange(4)
    if raw == "array-empty":
        return np.zeros(0, np.float64)
    return raw


@pytest.fixture(scope="module")
def fuzz_bases(bases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
               ) -> dict[str, tuple[Path, list[tuple[Any, ...]]]]:
    out = {}
    for name, d in bases.items():
        state = load_checkpoint(d).strategy_state
        out[name] = (d, _paths(state))
    return out


@settings(max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(base=st.sampled_from(sorted(BASES)), pick=st.integers(0, 10**6), raw=_VALUES,
       second=st.one_of(st.none(), st.tuples(st.integers(0, 10**6), _VALUES)))
@pytest.mark.slow  # runs the asynchronous loop again in a subprocess (or fuzzes it), 10-35 s
def test_fuzzed_async_fields_never_a_traceback(
        fuzz_bases: dict[str, tuple[Path, list[tuple[Any, ...]]]],
        tmp_path_factory: pytest.TempPathFactory, base: str, pick: int, raw: Any,
        second: tuple[int, Any] | None) -> None:
    """One or two fields of the asynchronous state, anywhere, replaced by any value (or
    deleted), digest recomputed: the resume is accepted or refused with a FedaggError (a
    CheckpointError naming the file), never another exception."""
    src, paths = fuzz_bases[base]
    d = tmp_path_factory.mktemp("fuzz") / "run"
    shutil.copytree(src, d)
    edits = [(pick, raw)] + ([second] if second is not None else [])

    def edit(state: State, meta: dict[str, Any]) -> None:
        for k, value in edits:
            path = paths[k % len(paths)]
            node: Any = state
            try:
                for p in path[:-1]:
                    node = node[p]
                old = node[path[-1]]
            except (KeyError, IndexError, TypeError):
                continue  # an earlier edit replaced a parent
            try:
                if value == "delete":
                    del node[path[-1]]
                else:
                    node[path[-1]] = _value(value, old)
            except TypeError:
                continue  # an earlier edit made a parent immutable (a string, a number)

    _rewrite(d, edit)
    try:
        check_async_resume(_cfg(d))
    except CheckpointError as exc:
        assert str(d / CHECKPOINT_NAME) in str(exc)
    except FedaggError:
        pass


def test_the_cli_refuses_in_a_fresh_process(bases: dict[str, Path], tmp_path: Path) -> None:
    """The exit status as a shell sees it."""
    d = tmp_path / "run"
    shutil.copytree(bases["fedbuff"], d)
    _rewrite(d, _with_entry(1e30))
    p = subprocess.run([sys.executable, "-m", "fedagg.cli", "simulate", "--resume", str(d)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert ".buffer.sum]" in p.stderr

