"""``fedagg report RUN_DIR``: one self-contained HTML page per run, from ``metrics.json``.

What the page shows, and where each figure comes from (all from the run directory):

* accuracy and loss per round (``accuracy``, ``loss``; rounds without evaluation are gaps);
* bytes up / down per round and cumulative (``bytes_up``, ``bytes_down``), and the ratio to
  dense float32 messages: ``parameters x 4`` bytes per replying site up and per sampled site
  down, the parameter count read from ``model.npz`` (or the checkpoint's model arrays);
* phase times: every ``seconds_*`` key, and ``seconds``;
* a site x round map: partition ids in ``sites`` were accepted; ``rejected`` (keyed by Flower
  node id, with the reason, shown on hover) and ``sites_sampled`` / ``sites_failed`` counts;
* intra-site training per site from ``site_metrics``: workers, compute vs exposed
  communication (``comm_wait_seconds``), time inside all-reduce, bytes all-reduced and the bus
  bandwidth ``bytes / comm_seconds x 2 (K-1) / K``, the all-reduce algorithms that ran
  (``algorithm_<name>`` flags: ``ring``, ``tree``, ``native``, ...) and an estimate of the
  site's scaling efficiency ``S(K) ~ compute / (compute + exposed communication)`` (what the
  exposed communication costs against a perfect split of the compute; a measured S(K) needs a
  one-worker run, ``benchmarks/site.py``); metric keys are read in both spellings
  (``comm-wait-seconds`` and ``comm_wait_seconds``);
* secure aggregation per round: every ``secagg_*`` key (``secagg_counted``,
  ``secagg_dropped``, ...);
* the effective configuration (``config.json``).

What the run was, in the header: the model and the data *the run used*, the name of each
plotted metric, the aggregation mode and the times. The model is the one the caller names
(``model=``: a name, or the user's model factory, e.g. ``make_app``'s ``model_fn``), else the
one round 0's record names (``task.model``), else the built-in ``model.name`` of
``config.json`` -- only when the run's final model (``model.npz`` / the checkpoint) has that
model's tensors; a run of a model of the user's is shown as such, with its size, and its
data as the sites' own unless named (``data=``, ``task.data``). The central evaluation's two
values are recorded as ``loss`` and ``accuracy``: they are named so for the built-in
evaluation only; for a user's ``evaluate_fn`` they are its first and second value unless
named (``metrics={"loss": "MSE", "accuracy": "R²"}``, ``task.metrics``). Federated
evaluation (``federated_eval``: the sites' own metric names) is plotted as recorded; an
``eval_acc`` that is 0 in every round (what a regression's sites reported before fedagg's
default evaluation stopped counting classes there) is left out, with a note.

Mode: ``mode`` of the records or ``asynchronous.mode`` of the config -- synchronous rounds,
FedBuff (buffer size, concurrency) or deadline rounds; for the asynchronous modes the model
versions and the staleness of the applied updates (``version``, ``updates``,
``staleness_mean``, ``staleness_max``) per record. Time: the engine's start-up
(``seconds_startup`` of round 0) is shown on its own, never in the per-round chart; the wall
time is the records' ``elapsed`` (wall seconds since the run started) where they carry it,
else the asynchronous records' ``wall_seconds`` summed, or for synchronous runs the time from
``config.json`` (written at the start) to the last ``metrics.json`` write (the file times),
or when those are not usable (a copied directory), the recorded times summed.

The values plotted are embedded as JSON (``#fedagg-data``); the page's script draws them and
tags every plotted point with its value (``data-value``), so a test can compare both with
``metrics.json``.

``metrics.json`` is checked before anything is drawn: a list of JSON objects, each with an
integer ``round`` >= 0, and every field the report reads of the type fedagg writes (numbers
finite, NaN or null; counts >= 0; ``sites`` a list of partition ids; ``rejected`` reasons
strings; ``site_metrics`` one object per site), nested at most 32 levels. Anything else is a
:class:`~fedagg.errors.ConfigError` naming the file, the record and field, and the rule
(``fedagg report`` exits with status 2). Keys the report does not read are not checked.
"""

from __future__ import annotations

import json
import logging
import math
import re
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedagg.errors import ConfigError, FedaggError, explain
from fedagg.report import atomic_write_bytes
from fedagg.viz._page import page
from fedagg.viz._report_js import REPORT_BODY, REPORT_CSS, REPORT_JS

__all__ = ["REPORT_NAME", "count_parameters", "render_report", "report_data", "write_report",
           "write_run_report"]

_log = logging.getLogger(__name__)

Named = str | Callable[..., Any] | type | None
"""A model or data set as the caller names it: a string, or the user's function / class."""

REPORT_NAME = "report.html"
"""File name of the report inside a run directory."""

_SITE_KEYS = ("workers", "num_examples", "train_loss", "compute_seconds", "comm_seconds",
              "comm_wait_seconds", "bytes_allreduced", "bytes_sent", "allreduce_calls",
              "train_seconds", "site_seconds", "startup_seconds")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _norm(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Metric keys with dashes read as underscores (``comm-wait-seconds`` = ``comm_wait_seconds``)."""
    return {str(k).replace("-", "_"): v for k, v in metrics.items()}


def _npz_shapes(path: Path) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every array of an ``.npz``, read from the headers (no data)."""
    out = []
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            if not info.filename.endswith(".npy"):
                continue
            with zf.open(info) as fh:
                version = np.lib.format.read_magic(fh)
                if version == (1, 0):
                    shape, _, _ = np.lib.format.read_array_header_1_0(fh)
                else:
                    shape, _, _ = np.lib.format.read_array_header_2_0(fh)
            out.append((info.filename[:-4], tuple(int(n) for n in shape)))
    return out


def model_shapes(run_dir: str | Path) -> list[tuple[str, tuple[int, ...]]] | None:
    """``(tensor name, shape)`` of the run's final model, in order: from ``model.npz``, else
    the checkpoint's model arrays (named ``a0``, ``a1``, ...); None when neither is readable."""
    d = Path(run_dir)
    try:
        if (d / "model.npz").is_file():
            return _npz_shapes(d / "model.npz")
        if (d / "checkpoint.npz").is_file():
            with np.load(d / "checkpoint.npz", allow_pickle=False) as npz:
                meta = json.loads(bytes(npz["meta"]).decode())
                n = int(meta["num_model_arrays"])
            shapes = dict(_npz_shapes(d / "checkpoint.npz"))
            return [(f"a{i}", shapes[f"a{i}"]) for i in range(n)]
    except (OSError, KeyError, ValueError, TypeError, zipfile.BadZipFile, RecursionError):
        return None
    return None


def count_parameters(run_dir: str | Path) -> int | None:
    """Number of model parameters of a run: from ``model.npz``, else the checkpoint; or None."""
    shapes = model_shapes(run_dir)
    return None if shapes is None else int(sum(math.prod(s) for _, s in shapes))


_NUMBER_KEYS = ("accuracy", "loss", "train_loss", "seconds", "wall_seconds", "time",
                "staleness_mean", "elapsed")
_COUNT_KEYS = ("bytes_up", "bytes_down", "sites_sampled", "sites_replied", "sites_failed",
               "version", "updates", "staleness_max", "in_flight")
_TEXT_MAX = 200
_NUMBER_PREFIXES = ("seconds_", "secagg_", "privacy_")
_SITE_NUMBER_KEYS = frozenset(_SITE_KEYS) | {k.replace("_", "-") for k in _SITE_KEYS}
_MAX_DEPTH = 32
"""Deepest nesting a metrics.json may have (fedagg writes 5 levels: list, record, site
metrics, one site, a value)."""
_MAX_ROUND = 10**9
_MAX_SITE = 2**31
_FIX = "restore metrics.json from the run (or a backup), or re-run; fedagg report reads files " \
       "written by fedagg simulate / flwr run"


class _Refused(Exception):
    """One malformed field: (where inside the file, value, rule)."""

    def __init__(self, where: str, value: object, rule: str) -> None:
        super().__init__(where)
        self.where, self.value, self.rule = where, value, rule


def _shown(value: object) -> object:
    """A value safe to put in a message (no int too long for repr, no deep nesting)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    if isinstance(value, list | dict):
        return f"a JSON {'array' if isinstance(value, list) else 'object'} of {len(value)} items"
    return value


def _key(key: str) -> str:
    """A key as it appears in a message: quoted, escaped and shortened."""
    return repr(key if len(key) <= 40 else key[:37] + "...")


def _name(key: str) -> str:
    """A field name: as is when it is a plain metric name, else quoted (:func:`_key`)."""
    return key if re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", key) else _key(key)


def _depth(obj: Any) -> int:
    """Nesting depth of a loaded JSON value, without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        item, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > _MAX_DEPTH:
            return deepest
        if isinstance(item, dict):
            stack.extend((v, d + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, d + 1) for v in item)
    return deepest


def _check_number(where: str, value: Any, *, count: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Refused(where, value, "must be a number or null")
    try:
        finite = math.isfinite(float(value))
    except OverflowError:
        finite = False
    if not finite and not (isinstance(value, float) and math.isnan(value)):
        raise _Refused(where, value, "must be a finite number (or NaN / null for a gap)")
    if count and value < 0:
        raise _Refused(where, value, "a count must be >= 0")


def _check_int(where: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Refused(where, value, "must be an integer")
    if not low <= value < high:
        raise _Refused(where, value, f"must be >= {low} and < {high}")


def _check_record(i: int, rec: Any) -> None:
    """Every field the report reads, in one record (other keys are not read)."""
    at = f"record {i}"
    if not isinstance(rec, dict):
        raise _Refused(at, rec, "must be a JSON object (one per round)")
    if _depth(rec) > _MAX_DEPTH - 1:
        raise _Refused(at, "deeper nesting",
                       f"must not be nested deeper than {_MAX_DEPTH - 1} levels")
    if "round" not in rec:
        raise _Refused(f"{at}.round", None, "is missing (every record names its round)")
    _check_int(f"{at}.round", rec["round"], 0, _MAX_ROUND)
    at = f"record {i} (round {rec['round']})"
    for key, value in rec.items():
        if key in _NUMBER_KEYS or key.startswith(_NUMBER_PREFIXES):
            _check_number(f"{at}.{_name(key)}", value)
        elif key in _COUNT_KEYS:
            _check_number(f"{at}.{key}", value, count=True)
    sites = rec.get("sites")
    if sites is not None:
        if not isinstance(sites, list):
            raise _Refused(f"{at}.sites", sites, "must be a list of partition ids (integers)")
        for j, sid in enumerate(sites):  # -1: a site whose label is unknown or withheld
            _check_int(f"{at}.sites[{j}]", sid, -1, _MAX_SITE)
    rejected = rec.get("rejected")
    if rejected is not None:
        if not isinstance(rejected, dict):
            raise _Refused(f"{at}.rejected", rejected,
                           "must be an object {node id: reason}")
        for node, why in rejected.items():
            if not isinstance(why, str):
                raise _Refused(f"{at}.rejected[{_key(node)}]", why, "a reason must be a string")
    if "mode" in rec and not isinstance(rec["mode"], str):
        raise _Refused(f"{at}.mode", rec["mode"], "must be a string (fedbuff, deadline)")
    fed = rec.get("federated_eval")
    if fed is not None:
        if not isinstance(fed, dict):
            raise _Refused(f"{at}.federated_eval", fed, "must be an object {metric: number}")
        for key, value in fed.items():
            _check_number(f"{at}.federated_eval.{_name(key)}", value)
    task = rec.get("task")
    if task is not None:
        if not isinstance(task, dict):
            raise _Refused(f"{at}.task", task, "must be an object (model, data, metrics)")
        for key in ("model", "data"):
            if key in task and not (isinstance(task[key], str) and len(task[key]) <= _TEXT_MAX):
                raise _Refused(f"{at}.task.{key}", task[key],
                               f"must be a name (a string of at most {_TEXT_MAX} characters)")
        names = task.get("metrics")
        if names is not None and not (isinstance(names, dict) and all(
                isinstance(v, str) and len(v) <= _TEXT_MAX for v in names.values())):
            raise _Refused(f"{at}.task.metrics", names,
                           "must be an object {recorded key: name} of strings")
    per_site = rec.get("site_metrics")
    if per_site is not None:
        if not isinstance(per_site, dict):
            raise _Refused(f"{at}.site_metrics", per_site,
                           "must be an object {partition id: metrics}")
        for sid, metrics in per_site.items():
            if not isinstance(metrics, dict):
                raise _Refused(f"{at}.site_metrics[{_key(sid)}]", metrics,
                               "must be an object of one site's metrics")
            for key, value in metrics.items():
                if key in _SITE_NUMBER_KEYS or key.startswith("algorithm_"):
                    _check_number(f"{at}.site_metrics[{_key(sid)}].{_name(key)}", value)


def _refuse(path: Path, where: str, value: object, rule: str) -> ConfigError:
    field = f"{path}: {where}" if where else str(path)
    return ConfigError(explain(field, _shown(value), rule, _FIX))


def _load(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """metrics.json, checked field by field, and config.json (ignored when unreadable).

    Raises
    ------
    ConfigError
        No metrics.json, or one that is not a list of well-formed records: the message names
        the file, the record and field, and what was wrong.
    """
    path = run_dir / "metrics.json"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(explain("RUN_DIR", str(run_dir), "holds no metrics.json",
                                  "point fedagg report at a run directory written by "
                                  "fedagg simulate or flwr run")) from None
    except OSError as exc:
        raise _refuse(path, "", exc.strerror or type(exc).__name__, "is unreadable") from None
    if not raw.strip():
        raise _refuse(path, "", f"{len(raw)} bytes", "is empty (the run wrote no record)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _refuse(path, f"byte {exc.start}", raw[exc.start:exc.start + 4],
                      "is not UTF-8 text") from None
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _refuse(path, f"line {exc.lineno}, column {exc.colno}", text[exc.pos:exc.pos + 20],
                      f"is unreadable: not valid JSON: {exc.msg} (is the file truncated?)"
                      ) from None
    except RecursionError:
        raise _refuse(path, "", "deeper nesting",
                      f"is unreadable: nested deeper than {_MAX_DEPTH} levels") from None
    except ValueError as exc:  # an integer literal beyond Python's digit limit
        raise _refuse(path, "", "an integer literal",
                      f"is unreadable: not valid JSON: {exc}"[:160]) from None
    if not isinstance(records, list):
        raise _refuse(path, "", records, "must be a list of per-round records "
                      "(point fedagg report at a run directory written by fedagg)")
    try:
        for i, rec in enumerate(records):
            _check_record(i, rec)
    except _Refused as bad:
        raise _refuse(path, bad.where, bad.value, bad.rule) from None
    return records, _load_config(run_dir)


def _load_config(run_dir: Path) -> dict[str, Any]:
    try:
        loaded = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, ValueError):
        return {}
    if not isinstance(loaded, dict) or _depth(loaded) > _MAX_DEPTH:
        return {}
    return loaded


def _series(records: list[dict[str, Any]], key: str) -> list[float | None]:
    return [_number(r.get(key)) for r in records]


def _cumulative(values: list[float | None]) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v or 0.0
        out.append(total)
    return out


def _traffic(records: list[dict[str, Any]], params: int | None) -> dict[str, Any]:
    up, down = _series(records, "bytes_up"), _series(records, "bytes_down")
    out: dict[str, Any] = {"bytes_up": up, "bytes_down": down,
                           "cum_up": _cumulative(up), "cum_down": _cumulative(down),
                           "params": params, "dense_bytes_per_message": None,
                           "dense_up": None, "dense_down": None, "ratio_up": None,
                           "ratio_down": None, "ratio_up_total": None, "ratio_down_total": None}
    if not params:
        return out
    dense = params * 4
    replied = [(_number(r.get("sites_replied")) or 0.0) if r.get("round", 0) else 0.0
               for r in records]
    sampled = [(_number(r.get("sites_sampled")) or 0.0) if r.get("round", 0) else 0.0
               for r in records]
    dense_up, dense_down = [dense * n for n in replied], [dense * n for n in sampled]

    def ratio(actual: list[float | None], ref: list[float]) -> list[float | None]:
        return [(a / d) if a and d else None for a, d in zip(actual, ref, strict=True)]

    out.update(dense_bytes_per_message=dense, dense_up=dense_up, dense_down=dense_down,
               ratio_up=ratio(up, dense_up), ratio_down=ratio(down, dense_down))
    tu, td = sum(v or 0.0 for v in up), sum(v or 0.0 for v in down)
    out["ratio_up_total"] = tu / sum(dense_up) if tu and sum(dense_up) else None
    out["ratio_down_total"] = td / sum(dense_down) if td and sum(dense_down) else None
    return out


def _label(key: object, metrics: object) -> str:
    """The site a ``site_metrics`` entry is about: its ``partition-id`` label (the records
    are keyed by the node id the transport authenticates), else its key."""
    if isinstance(metrics, Mapping):
        pid = metrics.get("partition-id", metrics.get("partition_id"))
        if isinstance(pid, int | float) and not isinstance(pid, bool) and pid >= 0:
            return str(int(pid))
    return str(key)


def _by_site(record: dict[str, Any]) -> dict[str, Any]:
    """A record's ``site_metrics`` keyed by site label (:func:`_label`)."""
    return {_label(k, v): v for k, v in (record.get("site_metrics") or {}).items()}


def _site_ids(records: list[dict[str, Any]], config: dict[str, Any]) -> list[str]:
    ids: set[int] = set()
    sites = config.get("run", {}).get("sites") if isinstance(config.get("run"), dict) else None
    if isinstance(sites, int) and 0 < sites <= 10_000:
        ids.update(range(sites))
    for r in records:
        ids.update(int(s) for s in r.get("sites", []) or []
                   if isinstance(s, int | float) and s >= 0)
        for k in _by_site(r):
            if re.fullmatch(r"[0-9]{1,12}", k):
                ids.add(int(k))
    return [str(i) for i in sorted(ids)]


def _heatmap(records: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    rounds = [r for r in records if r.get("round", 0)]
    site_ids = _site_ids(records, config)
    nodes = sorted({str(n) for r in rounds for n in (r.get("rejected") or {})})
    cells: list[dict[str, Any]] = []
    for r in rounds:
        rnd = r.get("round")
        rejected = {str(k): str(v) for k, v in (r.get("rejected") or {}).items()}
        summary = (f"sampled {r.get('sites_sampled', '?')}, replied {r.get('sites_replied', '?')}, "
                   f"failed {r.get('sites_failed', 0)}, rejected {len(rejected)}")
        accepted = r.get("sites")
        metrics = _by_site(r)
        for sid in site_ids:
            if accepted is None:
                state, why = "unknown", "this record lists no accepted sites"
            elif int(sid) in {int(s) for s in accepted}:
                m = _norm(metrics.get(sid, {}))
                state = "accepted"
                why = "accepted" + (f", {m['num_examples']:.0f} examples" if _number(
                    m.get("num_examples")) is not None else "")
            else:
                state = "absent"
                why = "not among the accepted sites (not sampled, failed or rejected)"
            cells.append({"row": f"site {sid}", "round": rnd, "state": state,
                          "title": f"round {rnd}, site {sid}: {why}; {summary}"})
        for node in nodes:
            if node in rejected:
                cells.append({"row": f"node {node}", "round": rnd, "state": "rejected",
                              "title": f"round {rnd}, Flower node {node}: rejected: {rejected[node]}"})
            else:
                cells.append({"row": f"node {node}", "round": rnd, "state": "none",
                              "title": f"round {rnd}, Flower node {node}: not rejected"})
    return {"rows": [f"site {s}" for s in site_ids] + [f"node {n}" for n in nodes],
            "rounds": [r.get("round") for r in rounds], "cells": cells,
            "sampled": [_number(r.get("sites_sampled")) for r in rounds],
            "replied": [_number(r.get("sites_replied")) for r in rounds],
            "failed": [_number(r.get("sites_failed")) for r in rounds],
            "rejected": [len(r.get("rejected") or {}) for r in rounds]}


def _sites(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    per: dict[str, dict[str, Any]] = {}
    for r in records:
        for sid, raw in _by_site(r).items():
            if not isinstance(raw, Mapping):
                continue
            m = _norm(raw)
            row = per.setdefault(str(sid), {"site": str(sid), "rounds": 0,
                                            **{k: 0.0 for k in _SITE_KEYS}})
            row["rounds"] += 1
            algs = row.setdefault("algorithms", [])
            for key, v in m.items():
                name = str(key)[len("algorithm_"):]
                if str(key).startswith("algorithm_") and _number(v) and name not in algs:
                    algs.append(name)
            for k in _SITE_KEYS:
                v = _number(m.get(k))
                if k == "workers":
                    row[k] = max(row[k], v or 0.0)
                elif v is not None:
                    row[k] += v
    out = []
    for sid in sorted(per, key=lambda s: (len(s), s)):
        row = per[sid]
        k = row["workers"]
        row["busbw_gb_s"] = (row["bytes_allreduced"] / row["comm_seconds"] * 2 * (k - 1) / k / 1e9
                             if row["comm_seconds"] > 0 and k >= 2 else None)
        busy = row["compute_seconds"] + row["comm_wait_seconds"]
        row["scaling_est"] = row["compute_seconds"] / busy if k >= 2 and busy > 0 else None
        row["algorithms"] = sorted(row.get("algorithms", []))
        out.append(row)
    return out


def _secagg(records: list[dict[str, Any]]) -> dict[str, Any]:
    keys = sorted({k for r in records for k in r if str(k).startswith("secagg_")})
    rounds = [r.get("round") for r in records if r.get("round", 0)]
    return {"keys": keys, "rounds": rounds,
            "values": {k: [_number(r.get(k)) for r in records if r.get("round", 0)] for k in keys}}


def _privacy(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Epsilon spent per round (``privacy_epsilon``), the run's delta, noise and ring."""
    rows = [r for r in records if r.get("round", 0) and _number(r.get("privacy_epsilon"))
            is not None]
    last = rows[-1] if rows else {}
    stopped = next((str(r["stopped"]) for r in records if isinstance(r.get("stopped"), str)),
                   "")
    return {"rounds": [r.get("round") for r in rows],
            "epsilon": [_number(r.get("privacy_epsilon")) for r in rows],
            "delta": _number(last.get("privacy_delta")),
            "noise_std": _number(last.get("privacy_noise_std")),
            "ring_bits": _number(last.get("privacy_ring_bits")), "stopped": stopped[:400]}


def _name_of(obj: Named) -> str | None:
    """A name for what the caller passed: the string, or a function's / class's name."""
    if obj is None:
        return None
    if isinstance(obj, str):
        return obj.strip()[:_TEXT_MAX] or None
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    return str(name)[:_TEXT_MAX] if name else type(obj).__name__


def _section(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = config.get(name)
    return value if isinstance(value, dict) else {}


def builtin_model_matches(run_dir: str | Path, config: Mapping[str, Any]) -> bool | None:
    """Whether the run's final model has exactly the tensors of the built-in model that
    ``config.json`` names (``model.name`` on ``data.dataset``): True / False, or None when that
    cannot be told (no model file, an unknown data set or model, no torch).

    The built-in model is built on torch's ``meta`` device (shapes only, no memory).
    """
    shapes = model_shapes(run_dir)
    name = _section(config, "model").get("name")
    dataset = _section(config, "data").get("dataset")
    if shapes is None or not isinstance(name, str) or not isinstance(dataset, str):
        return None
    from fedagg.data import dataset_shape

    dims = dataset_shape(dataset)
    if dims is None:
        return None
    try:
        import torch

        from fedagg.models import build_model

        params = _section(config, "model").get("params")
        with torch.device("meta"):
            net = build_model(name, dims[0], dims[1],
                              params=params if isinstance(params, int) else None)
        want = [(k, tuple(t.shape)) for k, t in net.state_dict().items()]
    except Exception:  # no torch, or a config the built-in models refuse: cannot tell
        return None
    if shapes and shapes[0][0] == "a0" and "a0" not in dict(want):  # a checkpoint: no names
        return [s for _, s in shapes] == [s for _, s in want]
    return shapes == want


def _fmt_count(n: int) -> str:
    return f"{n:,}"


def _describe(d: Path, records: list[dict[str, Any]], config: dict[str, Any], *,
              model: Named, data: Named, metrics: Mapping[str, str] | None) -> dict[str, Any]:
    """What the run was: model, data, the names of the plotted metrics, mode and times."""
    task: dict[str, Any] = next((r["task"] for r in records if isinstance(r.get("task"), dict)),
                                {})
    cfg_model, cfg_data = _section(config, "model"), _section(config, "data")
    params = count_parameters(d)
    shapes = model_shapes(d)
    size = (f"{_fmt_count(params)} parameters in {len(shapes)} tensors"
            if params is not None and shapes is not None else None)
    builtin = builtin_model_matches(d, config)
    model_name, model_note = _name_of(model), "named by the caller"
    if model_name is None and isinstance(task.get("model"), str):
        model_name, model_note = task["model"], "from the run record"
    if model_name is None:
        cfg_name = cfg_model.get("name")
        if builtin is False:
            model_name = "a model of the user's"
            model_note = (f"the final model's tensors are not those of the built-in "
                          f"{cfg_name!r} that config.json names")
        elif isinstance(cfg_name, str):
            model_name = cfg_name
            model_note = ("built-in (model.name; the final model has its tensors)" if builtin
                          else "model.name of config.json (no model file to check it by)")
    data_name, data_note = _name_of(data), "named by the caller"
    if data_name is None and isinstance(task.get("data"), str):
        data_name, data_note = task["data"], "from the run record"
    own = builtin is False or (builtin is None and (model is not None or "model" in task))
    if data_name is None:
        if own:
            data_name, data_note = "the sites' own", "not recorded in the run"
        elif isinstance(cfg_data.get("dataset"), str):
            parts = [str(cfg_data.get("partitioner", "?"))]
            if cfg_data.get("partitioner") == "dirichlet" and "dirichlet_alpha" in cfg_data:
                parts.append(f"alpha {cfg_data['dirichlet_alpha']}")
            data_name = f"{cfg_data['dataset']} ({', '.join(parts)})"
            data_note = "built-in (data.dataset of config.json)"
    recorded = task.get("metrics")
    names: dict[str, str] = {**(recorded if isinstance(recorded, dict) else {}),
                             **dict(metrics or {})}
    if own:
        labels = {"accuracy": names.get("accuracy", "score: evaluate_fn's 2nd value"),
                  "loss": names.get("loss", "loss: evaluate_fn's 1st value")}
        bounded = "accuracy" in names.get("accuracy", "").lower()
    else:
        labels = {"accuracy": names.get("accuracy", "accuracy"),
                  "loss": names.get("loss", "loss")}
        bounded = "accuracy" not in names or "accuracy" in names["accuracy"].lower()
    return {"model": model_name, "model_note": model_note, "model_size": size,
            "data": data_name, "data_note": data_note, "own_model": own,
            "metric_labels": labels, "accuracy_bounded": bounded,
            "mode": _mode(records, config), "time": _times(d, records)}


def _mode(records: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    """Synchronous rounds, FedBuff or deadline rounds, with what describes each."""
    asyn = _section(config, "asynchronous")
    mode = next((r["mode"] for r in records if isinstance(r.get("mode"), str)), None)
    mode = mode or (asyn.get("mode") if asyn.get("mode") not in (None, "off") else "sync")
    out: dict[str, Any] = {"name": mode}
    if mode == "sync":
        out["text"] = "synchronous rounds"
        return out
    later = [r for r in records if r.get("round", 0)]
    versions: list[int] = [r["version"] for r in later if isinstance(r.get("version"), int)]
    stale_mean = [_number(r.get("staleness_mean")) for r in later]
    stale_max = [_number(r.get("staleness_max")) for r in later]
    updates = [_number(r.get("updates")) for r in later]
    if mode == "fedbuff":
        text = (f"FedBuff: buffer of {asyn.get('buffer_size', '?')} updates, "
                f"{asyn.get('concurrency') or '?'} sites training at a time")
    elif mode == "deadline":
        text = f"deadline rounds of {asyn.get('deadline', '?')} s (late updates kept)"
    else:
        text = str(mode)
    weights = [_number(v) for v in stale_mean if v is not None]
    out.update(text=text, versions=max(versions) if versions else None,
               staleness=asyn.get("staleness"), xs=[r.get("round") for r in later],
               version=[r.get("version") for r in later], staleness_mean=stale_mean,
               staleness_max=stale_max, updates=updates,
               mean_staleness=(sum(v for v in weights if v is not None) / len(weights)
                               if weights else None),
               max_staleness=max((v for v in stale_max if v is not None), default=None))
    return out


def _times(d: Path, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Start-up apart from the rounds, and the wall time (how it was measured)."""
    startup = next((_number(r.get("seconds_startup")) for r in records
                    if r.get("round") == 0 and _number(r.get("seconds_startup")) is not None),
                   None)
    rounds = sum(v or 0.0 for r in records if r.get("round", 0)
                 for v in [_number(r.get("seconds"))])
    out: dict[str, Any] = {"startup": startup, "rounds_total": rounds}
    walls = [_number(r.get("wall_seconds")) for r in records]
    if any(v is not None for v in walls):  # the asynchronous loop records its wall time
        out["wall"] = sum(v or 0.0 for v in walls) + (startup or 0.0)
        out["wall_how"] = "the records' wall_seconds summed, with the start-up"
        clock = [_number(r.get("time")) for r in records]
        last = max((v for v in clock if v is not None), default=None)
        if last is not None and abs(last - out["wall"]) > 1.0 and not (
                0.5 * out["wall"] <= last <= 2.0 * out["wall"]):
            out["simulated"] = last  # a virtual clock (simulated site speeds)
        return out
    elapsed = [v for r in records for v in [_number(r.get("elapsed"))] if v is not None]
    if elapsed:  # each record's wall seconds since the run started, when the server writes it
        out["wall"], out["wall_how"] = max(elapsed), "the last record's elapsed"
        return out
    recorded = rounds + (startup or 0.0)
    try:
        span = (d / "metrics.json").stat().st_mtime - (d / "config.json").stat().st_mtime
    except OSError:
        span = -1.0
    if span >= recorded > 0 or (span > 0 and recorded == 0):
        out["wall"], out["wall_how"] = span, ("config.json (written at the start) to the last "
                                              "metrics.json write")
    else:
        out["wall"], out["wall_how"] = recorded, "the recorded round times and start-up, summed"
    return out


def _federated(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Federated evaluation per round, under the sites' own metric names."""
    later = [r for r in records if r.get("round", 0)]
    keys = sorted({str(k) for r in later for k in (r.get("federated_eval") or {})
                   if k not in ("num-examples", "num_examples")})
    series = {k: [_number((r.get("federated_eval") or {}).get(k)) for r in later] for k in keys}
    dropped = [k for k in keys if k in ("eval_acc", "eval-acc")
               and all(v == 0.0 for v in series[k] if v is not None)
               and any(v is not None for v in series[k])]
    for k in dropped:
        del series[k]
    return {"rounds": [r.get("round") for r in later], "series": series, "dropped": dropped}


def report_data(run_dir: str | Path, *, model: Named = None, data: Named = None,
                metrics: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Everything the report plots, read from ``run_dir`` (JSON-ready).

    Parameters
    ----------
    run_dir : path
        A run directory (``metrics.json``, optionally ``config.json``, ``model.npz``).
    model, data : str or callable, optional
        What the run trained, as the caller knows it: a name, or the user's model factory /
        data function (its name is shown). Default: what the run record names, else the
        built-in ones of ``config.json`` when the final model is that model.
    metrics : mapping, optional
        Names of the central evaluation's recorded values, e.g. ``{"loss": "MSE",
        "accuracy": "R²"}`` for a regression's ``evaluate_fn``.

    Raises
    ------
    ConfigError
        ``run_dir`` holds no ``metrics.json``, or one that is unreadable, not JSON, or has a
        malformed record (the message names the file, the record and field, and the rule).
    """
    d = Path(run_dir)
    records, config = _load(d)
    phases = sorted({k for r in records for k in r if str(k).startswith("seconds_")} -
                    {"seconds_startup"})
    later = [r for r in records if r.get("round", 0)]
    return {
        "run": d.name,
        "title": str(config.get("run", {}).get("name", d.name)) if isinstance(
            config.get("run"), dict) else d.name,
        "about": _describe(d, records, config, model=model, data=data, metrics=metrics),
        "rounds": [r.get("round") for r in records],
        "accuracy": _series(records, "accuracy"),
        "loss": _series(records, "loss"),
        "train_loss": _series(records, "train_loss"),
        "traffic": _traffic(records, count_parameters(d)),
        "time_rounds": [r.get("round") for r in later],
        "seconds": _series(later, "seconds"),
        "phases": {k: _series(later, k) for k in phases},
        "federated": _federated(records),
        "heatmap": _heatmap(records, config),
        "sites": _sites(records),
        "secagg": _secagg(records),
        "privacy": _privacy(records),
        "config": config,
    }


def render_report(run_dir: str | Path, *, model: Named = None, data: Named = None,
                  metrics: Mapping[str, str] | None = None) -> str:
    """The HTML of the report of ``run_dir`` (arguments: :func:`report_data`)."""
    data_ = report_data(run_dir, model=model, data=data, metrics=metrics)
    return page(f"fedagg report: {data_['run']}", REPORT_BODY, data_, REPORT_JS, css=REPORT_CSS)


def write_report(run_dir: str | Path, out: str | Path | None = None, *, model: Named = None,
                 data: Named = None, metrics: Mapping[str, str] | None = None) -> Path:
    """Write the report (default ``run_dir/report.html``) atomically; returns its path.

    ``model``, ``data``, ``metrics``: see :func:`report_data`.
    """
    path = Path(out) if out is not None else Path(run_dir) / REPORT_NAME
    html = render_report(run_dir, model=model, data=data, metrics=metrics)
    atomic_write_bytes(path, html.encode("utf-8"))
    return path


def write_run_report(run_dir: str | Path | None, *, model: Named = None, data: Named = None,
                     metrics: Mapping[str, str] | None = None) -> Path | None:
    """``run_dir/report.html`` at the end of a run, never raising: the path, or None (with
    one warning) when the run wrote no ``metrics.json`` or the report cannot be made.

    For the code that ran the run (``fedagg simulate``; a ServerApp built with
    ``server.app.make_app``, which passes its ``model_fn``), so that a failed report never
    fails the run.
    """
    if run_dir is None or not (Path(run_dir) / "metrics.json").is_file():
        return None
    try:
        return write_report(run_dir, model=model, data=data, metrics=metrics)
    except (FedaggError, OSError) as exc:
        _log.warning("no report.html: %s", exc)
        return None

