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
import math
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedagg.errors import ConfigError, explain
from fedagg.report import atomic_write_bytes
from fedagg.viz._page import page
from fedagg.viz._report_js import REPORT_BODY, REPORT_CSS, REPORT_JS

__all__ = ["REPORT_NAME", "count_parameters", "render_report", "report_data", "write_report"]

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


def count_parameters(run_dir: str | Path) -> int | None:
    """Number of model parameters of a run: from ``model.npz``, else the checkpoint; or None."""
    d = Path(run_dir)
    try:
        if (d / "model.npz").is_file():
            with np.load(d / "model.npz", allow_pickle=False) as npz:
                return int(sum(npz[k].size for k in npz.files))
        if (d / "checkpoint.npz").is_file():
            with np.load(d / "checkpoint.npz", allow_pickle=False) as npz:
                meta = json.loads(bytes(npz["meta"]).decode())
                return int(sum(npz[f"a{i}"].size for i in range(int(meta["num_model_arrays"]))))
    except (OSError, KeyError, ValueError, TypeError, zipfile.BadZipFile, RecursionError):
        return None
    return None


_NUMBER_KEYS = ("accuracy", "loss", "train_loss", "seconds")
_COUNT_KEYS = ("bytes_up", "bytes_down", "sites_sampled", "sites_replied", "sites_failed")
_NUMBER_PREFIXES = ("seconds_", "secagg_")
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
        for j, sid in enumerate(sites):
            _check_int(f"{at}.sites[{j}]", sid, 0, _MAX_SITE)
    rejected = rec.get("rejected")
    if rejected is not None:
        if not isinstance(rejected, dict):
            raise _Refused(f"{at}.rejected", rejected,
                           "must be an object {node id: reason}")
        for node, why in rejected.items():
            if not isinstance(why, str):
                raise _Refused(f"{at}.rejected[{_key(node)}]", why, "a reason must be a string")
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


def _site_ids(records: list[dict[str, Any]], config: dict[str, Any]) -> list[str]:
    ids: set[int] = set()
    sites = config.get("run", {}).get("sites") if isinstance(config.get("run"), dict) else None
    if isinstance(sites, int) and 0 < sites <= 10_000:
        ids.update(range(sites))
    for r in records:
        ids.update(int(s) for s in r.get("sites", []) or [] if isinstance(s, int | float))
        for k in (r.get("site_metrics") or {}):
            if re.fullmatch(r"-?[0-9]{1,12}", str(k)):
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
        metrics = {str(k): v for k, v in (r.get("site_metrics") or {}).items()}
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
        for sid, raw in (r.get("site_metrics") or {}).items():
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


def report_data(run_dir: str | Path) -> dict[str, Any]:
    """Everything the report plots, read from ``run_dir`` (JSON-ready).

    Raises
    ------
    ConfigError
        ``run_dir`` holds no ``metrics.json``, or one that is unreadable, not JSON, or has a
        malformed record (the message names the file, the record and field, and the rule).
    """
    d = Path(run_dir)
    records, config = _load(d)
    phases = sorted({k for r in records for k in r if str(k).startswith("seconds_")})
    return {
        "run": d.name,
        "title": str(config.get("run", {}).get("name", d.name)) if isinstance(
            config.get("run"), dict) else d.name,
        "rounds": [r.get("round") for r in records],
        "accuracy": _series(records, "accuracy"),
        "loss": _series(records, "loss"),
        "train_loss": _series(records, "train_loss"),
        "traffic": _traffic(records, count_parameters(d)),
        "seconds": _series(records, "seconds"),
        "phases": {k: _series(records, k) for k in phases},
        "heatmap": _heatmap(records, config),
        "sites": _sites(records),
        "secagg": _secagg(records),
        "config": config,
    }


def render_report(run_dir: str | Path) -> str:
    """The HTML of the report of ``run_dir``."""
    data = report_data(run_dir)
    return page(f"fedagg report: {data['run']}", REPORT_BODY, data, REPORT_JS, css=REPORT_CSS)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report (default ``run_dir/report.html``) atomically; returns its path."""
    path = Path(out) if out is not None else Path(run_dir) / REPORT_NAME
    atomic_write_bytes(path, render_report(run_dir).encode("utf-8"))
    return path
