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
"""

from __future__ import annotations

import json
import math
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
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, json.JSONDecodeError):
        return None
    return None


def _load(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    path = run_dir / "metrics.json"
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(explain("RUN_DIR", str(run_dir), "holds no metrics.json",
                                  "point fedagg report at a run directory written by "
                                  "fedagg simulate or flwr run")) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(explain("metrics.json", str(path),
                                  f"is unreadable ({type(exc).__name__})",
                                  "re-run, or restore the file")) from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ConfigError(explain("metrics.json", str(path), "must be a list of per-round records",
                                  "point fedagg report at a run directory written by fedagg"))
    config: dict[str, Any] = {}
    try:
        loaded = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        config = loaded if isinstance(loaded, dict) else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        config = {}
    return records, config


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
            if str(k).lstrip("-").isdigit():
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
        ``run_dir`` holds no readable ``metrics.json``.
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
