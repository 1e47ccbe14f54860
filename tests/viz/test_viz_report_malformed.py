"""``fedagg report`` on a malformed metrics.json: exit status 2 and one clear message, never a
traceback. The message names the file, the record and field, and what was wrong."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _viz_runs import make_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedagg.cli import main

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"round": 1, "accuracy": 0.5, "loss": 1.0, "bytes_up": 10, "bytes_down": 20,
        "sites_sampled": 2, "sites_replied": 2, "seconds": 1.0, "sites": [0, 1]}


def _records(**changes: Any) -> str:
    rec = {**GOOD, **changes}
    return json.dumps([{"round": 0, "accuracy": 0.1, "loss": 2.0}, rec])


def _without(key: str) -> str:
    rec = {k: v for k, v in GOOD.items() if k != key}
    return json.dumps([rec])


def _deep(n: int) -> Any:
    out: Any = 0
    for _ in range(n):
        out = [out]
    return out


# (kind, file content, what the message must say besides the file name)
CASES: list[tuple[str, str | bytes, list[str]]] = [
    ("not JSON", "{not json", ["not valid JSON", "line 1"]),
    ("empty file", "", ["empty"]),
    ("truncated", _records()[:40], ["not valid JSON"]),
    ("not UTF-8", b"\xff\xfe[{]", ["UTF-8"]),
    ("an object, not a list", '{"round": 1}', ["list of per-round records"]),
    ("a list of non-objects", "[1, \"two\", null]", ["record 0", "object"]),
    ("a list with one non-object", json.dumps([GOOD, [1, 2]]), ["record 1", "object"]),
    ("missing round", _without("round"), ["record 0", "round", "missing"]),
    ("round a string", _records(round="1"), ["record 1", "round", "integer"]),
    ("round a bool", _records(round=True), ["record 1", "round", "integer"]),
    ("round negative", _records(round=-3), ["record 1", "round", ">= 0"]),
    ("round huge", _records(round=10**30), ["record 1", "round"]),
    ("round a float", _records(round=1.5), ["record 1", "round", "integer"]),
    ("accuracy a NaN string", _records(accuracy="NaN"), ["record 1", "accuracy", "number"]),
    ("loss an Infinity string", _records(loss="Infinity"), ["record 1", "loss", "number"]),
    ("bytes_up 1e999 (inf)", _records().replace('"bytes_up": 10', '"bytes_up": 1e999'),
     ["record 1", "bytes_up", "finite"]),
    ("bytes_up beyond float", _records(bytes_up=10**400), ["record 1", "bytes_up", "finite"]),
    ("an integer of 5000 digits", '[{"round": 1, "loss": ' + "9" * 5000 + "}]",
     ["not valid JSON", "digits"]),
    ("bytes_down negative", _records(bytes_down=-5), ["record 1", "bytes_down", ">= 0"]),
    ("sites_replied a list", _records(sites_replied=[1]), ["record 1", "sites_replied"]),
    ("seconds_train an object", _records(seconds_train={"a": 1}), ["record 1", "seconds_train"]),
    ("secagg_dropped a string", _records(secagg_dropped="x"), ["record 1", "secagg_dropped"]),
    ("sites a string", _records(sites="0,1"), ["record 1", "sites", "list"]),
    ("sites with a string", _records(sites=[0, "x"]), ["record 1", "sites[1]", "integer"]),
    ("sites with inf", _records().replace('"sites": [0, 1]', '"sites": [0, Infinity]'),
     ["record 1", "sites[1]"]),
    ("sites with a huge id", _records(sites=[10**40]), ["record 1", "sites[0]"]),
    ("rejected a list", _records(rejected=["node 1"]), ["record 1", "rejected", "object"]),
    ("rejected reason an object", _records(rejected={"5": {"a": [1]}}),
     ["record 1", "rejected['5']", "string"]),
    ("site_metrics a list", _records(site_metrics=[1, 2]), ["record 1", "site_metrics", "object"]),
    ("site_metrics of a site a number", _records(site_metrics={"0": 3}),
     ["record 1", "site_metrics['0']", "object"]),
    ("site metric a string", _records(site_metrics={"0": {"workers": "two"}}),
     ["record 1", "site_metrics['0'].workers", "number"]),
    ("site metric nested garbage", _records(site_metrics={"0": {"comm-seconds": [[{}]]}}),
     ["record 1", "site_metrics['0'].comm-seconds", "number"]),
    ("nested garbage 100000 deep", "[" * 100_000 + "]" * 100_000, ["nested"]),
    ("a record nested 500 deep", json.dumps([{**GOOD, "federated_eval": _deep(500)}]),
     ["record 0", "nested"]),
]


def _run_report(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(["report", str(run_dir)])
    err = capsys.readouterr().err
    return rc, err


def test_at_least_8_kinds_of_malformed_file() -> None:
    assert len(CASES) >= 8 and len({k for k, _, _ in CASES}) == len(CASES)


@pytest.mark.parametrize(("kind", "content", "words"), CASES, ids=[c[0] for c in CASES])
def test_malformed_metrics_exit_2_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, content: str | bytes,
    words: list[str]
) -> None:
    make_run(tmp_path)
    path = tmp_path / "metrics.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    rc, err = _run_report(tmp_path, capsys)
    assert rc == 2, (kind, err)
    assert err.startswith("fedagg: error: ") and err.count("\n") == 1, err
    assert str(path) in err, err
    assert "Fix:" in err
    for w in words:
        assert w in err, (kind, w, err)
    assert len(err) < 1200  # a hostile value is shown shortened
    assert not (tmp_path / "report.html").exists()


def test_a_well_formed_run_still_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    make_run(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report.html").is_file()
    # bare NaN (Python's json writes it for a NaN loss) is a gap, not an error
    records = json.loads((tmp_path / "metrics.json").read_text())
    records[1]["loss"] = math.nan
    (tmp_path / "metrics.json").write_text(json.dumps(records))
    assert main(["report", str(tmp_path)]) == 0


def test_no_traceback_from_the_real_command(tmp_path: Path) -> None:
    """The installed entry point, as a user runs it: exit 2, one line, no traceback."""
    make_run(tmp_path)
    (tmp_path / "metrics.json").write_text("[" * 100_000)
    p = subprocess.run([sys.executable, "-m", "fedagg.cli", "report", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert str(tmp_path / "metrics.json") in p.stderr


def test_an_unwritable_output_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    make_run(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc = main(["report", str(tmp_path), "-o", str(blocker / "sub" / "report.html")])
    err = capsys.readouterr().err
    assert rc == 2 and "--out" in err and "Fix:" in err


# --- hypothesis: any record fields ----------------------------------------------------------

_JSON_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(10**400), 10**400),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", ""]),
)
_JSON = st.recursive(_JSON_LEAF, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)), max_leaves=12)
_KEYS = st.sampled_from([
    "round", "accuracy", "loss", "train_loss", "seconds", "seconds_train", "bytes_up",
    "bytes_down", "sites_sampled", "sites_replied", "sites_failed", "secagg_counted", "sites",
    "rejected", "site_metrics", "summary", "errors", "federated_eval", "version", "mode",
])
_SITE = st.dictionaries(
    st.sampled_from(["workers", "num-examples", "num_examples", "compute_seconds",
                     "comm-wait-seconds", "algorithm_ring", "other"]), _JSON, max_size=4)
_FIELD_VALUE = st.one_of(
    _JSON,
    st.dictionaries(st.sampled_from(["0", "1", "-1", "x"]), st.one_of(_SITE, _JSON), max_size=3),
    st.lists(st.one_of(st.integers(-3, 10**12), _JSON_LEAF), max_size=4),
)
_RECORD = st.one_of(
    st.dictionaries(_KEYS, _FIELD_VALUE, max_size=6),
    st.fixed_dictionaries({"round": st.integers(0, 5)}, optional={k: _FIELD_VALUE for k in (
        "accuracy", "loss", "bytes_up", "sites", "rejected", "site_metrics", "seconds_x")}),
    _JSON,
)


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(records=st.lists(_RECORD, max_size=4), cut=st.one_of(st.none(), st.integers(0, 400)))
def test_fuzzed_record_fields_never_a_traceback(
    tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str],
    records: list[Any], cut: int | None
) -> None:
    """Any mix of record fields of any JSON type (huge ints, NaN / Infinity, strings, nesting),
    optionally truncated: the command exits 0 or 2, never raises, and a refusal names the file
    and what was wrong."""
    d = tmp_path_factory.mktemp("run")
    make_run(d)
    text = json.dumps(records)
    if cut is not None:
        text = text[:cut]
    (d / "metrics.json").write_text(text)
    rc, err = _run_report(d, capsys)
    assert rc in (0, 2)
    if rc == 2:
        assert str(d / "metrics.json") in err and "Fix:" in err and err.count("\n") == 1
    else:
        assert (d / "report.html").is_file()
