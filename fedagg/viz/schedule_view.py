"""The data behind ``fedagg viz schedule``: real schedules, their cost, measured figures.

Every step drawn on the page comes from :func:`fedagg.collectives.schedule.get_schedule`: the
transfers ``(src, dst, chunk, op)`` of each step, the bytes they move, and -- computed here by
replaying the steps with the schedule's own semantics (every transfer of a step reads the
value its source held at the start of the step) -- which ranks' inputs each rank's copy of
each chunk holds after every step. A correct all-reduce ends with every copy holding all
``N`` inputs; the page colours a chunk by that count.

The parameter server is not a fedagg schedule. It is drawn as what it is: ``N`` uploads of
the whole buffer into one server node, then ``N`` downloads, both through the server's one
link, so each phase costs about ``N D / B`` there (plus ``N`` message latencies); its
predicted time here is ``2 N (alpha + D beta) + (N - 1) D gamma`` with the same
:class:`~fedagg.collectives.cost.CostModel` as the schedules.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fedagg.collectives.cost import CostModel, get_default_cost_model, predict
from fedagg.collectives.schedule import SCHEDULED_ALGORITHMS, Schedule, get_schedule
from fedagg.collectives.transfer import Op
from fedagg.errors import ConfigError, explain
from fedagg.viz.benchmarks import measured_for

__all__ = [
    "ALGORITHMS",
    "MAX_WORKERS",
    "PANELS_OF",
    "ps_seconds",
    "ps_view",
    "schedule_view",
    "view_data",
]

ALGORITHMS: tuple[str, ...] = (*SCHEDULED_ALGORITHMS, "ps", "all")
"""What ``fedagg viz schedule --algorithm`` accepts."""

PANELS_OF: dict[str, tuple[str, ...]] = {
    "ring": ("ring",),
    "tree": ("tree",),
    "hierarchical": ("hierarchical",),
    "ps": ("ps",),
    "all": ("ring", "tree", "ps"),
}
"""The animated panels of each ``--algorithm`` choice (``all``: ring, tree and ps side by side)."""

MAX_WORKERS = 64
"""Largest ``N`` drawn (the page holds ``steps x N x chunks`` counts)."""

ITEMSIZE = 4
"""Bytes per element: the buffer is float32, as the site all-reduces gradients."""

_FORMULAS = {
    "ring": "2 (N-1) (α + D/(N B)) + (N-1)/N · D γ",
    "tree": "(2H + S - 1)(α + 2D/(S B)) + D γ, H = tree height, S = segments",
    "hierarchical": "(steps + S - 1)(α + 2D/(S B)) + D γ (chain in groups, tree across leaders)",
    "ps": "2 N (α + D/B) + (N-1) D γ: N uploads then N downloads at the server link",
}


def _check(workers: int, nbytes: int) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or not 2 <= workers <= MAX_WORKERS:
        raise ConfigError(explain("--workers", workers, f"must be an int in [2, {MAX_WORKERS}]",
                                  "pass the number of ranks to draw, e.g. --workers 4"))
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < ITEMSIZE:
        raise ConfigError(explain("--size", nbytes, f"must be an int >= {ITEMSIZE} (bytes)",
                                  "pass the all-reduced tensor size in bytes, e.g. --size 1048576"))


def ps_seconds(workers: int, nbytes: int, model: CostModel | None = None) -> float:
    """Predicted seconds of a parameter-server all-reduce under the alpha-beta-gamma model.

    ``N`` uploads of ``D`` bytes then ``N`` downloads, serialised on the server's link, and
    ``N - 1`` additions of ``D`` bytes at the server: ``2 N (alpha + D beta) + (N-1) D gamma``.
    """
    m = get_default_cost_model() if model is None else model
    d = float(nbytes)
    return 2 * workers * (m.alpha + d * m.beta) + (workers - 1) * d * m.gamma


def _replay(initial: list[list[set[int]]],
            steps: list[list[tuple[int, int, int, str]]]) -> list[list[list[int]]]:
    """Contributor counts per (node, chunk) before the first step and after every step."""
    state = [[set(c) for c in row] for row in initial]
    counts = [[[len(c) for c in row] for row in state]]
    for step in steps:
        snapshot = [set(state[src][chunk]) for src, _, chunk, _ in step]
        for (_, dst, chunk, op), payload in zip(step, snapshot, strict=True):
            if op == Op.REDUCE.value:
                state[dst][chunk] |= payload
            else:
                state[dst][chunk] = payload
        counts.append([[len(c) for c in row] for row in state])
    return counts


def _steps_of(schedule: Schedule) -> list[list[tuple[int, int, int, str]]]:
    return [[(t.src, t.dst, t.chunk, t.op.value) for t in step] for step in schedule.steps]


def _step_rows(steps: list[list[tuple[int, int, int, str]]], chunk_bytes: list[int],
               n_nodes: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for step in steps:
        sent = [0] * n_nodes
        for src, _, chunk, _ in step:
            sent[src] += chunk_bytes[chunk]
        rows.append({
            "transfers": [list(t) for t in step],
            "bytes": sum(chunk_bytes[c] for _, _, c, _ in step),
            "max_node_bytes": max(sent) if sent else 0,
        })
    return rows


def schedule_view(algorithm: str, workers: int, nbytes: int) -> dict[str, Any]:
    """One animated panel: the real schedule of ``algorithm`` over ``workers`` ranks.

    Parameters
    ----------
    algorithm : {"ring", "tree", "hierarchical"}
        A scheduled algorithm.
    workers : int
        Number of ranks ``N``.
    nbytes : int
        Size of the float32 buffer in bytes (``numel = nbytes // 4``).

    Returns
    -------
    dict
        JSON-ready: ``algorithm``, ``workers``, ``nodes`` (labels), ``numel``,
        ``chunks`` / ``chunk_bytes``, ``steps`` (transfers and bytes per step),
        ``num_steps`` (= ``len(schedule.steps)``), ``counts`` (contributors per node and
        chunk, before and after each step), ``groups`` and ``meta``.
    """
    _check(workers, nbytes)
    numel = nbytes // ITEMSIZE
    sched = get_schedule(algorithm, workers, numel)
    steps = _steps_of(sched)
    chunk_bytes = [ln * ITEMSIZE for _, ln in sched.chunks]
    initial = [[{r} for _ in sched.chunks] for r in range(workers)]
    groups = sched.meta.get("groups")
    return {
        "algorithm": algorithm,
        "workers": workers,
        "nodes": [f"r{r}" for r in range(workers)],
        "numel": numel,
        "chunks": [list(c) for c in sched.chunks],
        "chunk_bytes": chunk_bytes,
        "steps": _step_rows(steps, chunk_bytes, workers),
        "num_steps": sched.num_steps,
        "counts": _replay(initial, steps),
        "groups": [list(g) for g in groups] if isinstance(groups, tuple) else None,
        "source": f"fedagg.collectives.schedule.get_schedule({algorithm!r}, {workers}, {numel})",
    }


def ps_view(workers: int, nbytes: int) -> dict[str, Any]:
    """The parameter-server panel: ``N`` uploads (reduce) then ``N`` downloads (copy).

    Not a fedagg schedule: node ``N`` is the server, which starts with no input.
    """
    _check(workers, nbytes)
    numel = nbytes // ITEMSIZE
    server = workers
    steps = [
        [(r, server, 0, Op.REDUCE.value) for r in range(workers)],
        [(server, r, 0, Op.COPY.value) for r in range(workers)],
    ]
    chunk_bytes = [numel * ITEMSIZE]
    initial: list[list[set[int]]] = [[{r}] for r in range(workers)] + [[set()]]
    return {
        "algorithm": "ps",
        "workers": workers,
        "nodes": [*(f"r{r}" for r in range(workers)), "server"],
        "numel": numel,
        "chunks": [[0, numel]],
        "chunk_bytes": chunk_bytes,
        "steps": _step_rows(steps, chunk_bytes, workers + 1),
        "num_steps": len(steps),
        "counts": _replay(initial, steps),
        "groups": None,
        "source": "parameter server (not a fedagg schedule): N uploads + N downloads",
    }


def _cost_rows(workers: int, nbytes: int, model: CostModel) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for alg in (*SCHEDULED_ALGORITHMS, "ps"):
        if alg == "ps":
            seconds, steps = ps_seconds(workers, nbytes, model), 2
            per_rank = nbytes
            server = 2 * workers * nbytes
        else:
            sched = get_schedule(alg, workers, nbytes // ITEMSIZE)
            seconds, steps = predict(alg, workers, nbytes, model=model), sched.num_steps
            per_rank = max(sched.elements_sent(r) for r in range(workers)) * ITEMSIZE
            server = 0
        rows.append({"algorithm": alg, "predicted_s": seconds, "steps": steps,
                     "max_bytes_sent_per_rank": per_rank, "server_link_bytes": server,
                     "formula": _FORMULAS[alg]})
    return rows


def view_data(
    algorithm: str,
    workers: int,
    nbytes: int,
    *,
    model: CostModel | None = None,
    benchmarks: str | Path | None = None,
) -> dict[str, Any]:
    """Everything the schedule page shows, as one JSON-ready dict.

    Parameters
    ----------
    algorithm : {"ring", "tree", "hierarchical", "ps", "all"}
        Which panels to animate (:data:`PANELS_OF`).
    workers : int
        Number of ranks ``N``.
    nbytes : int
        Buffer size ``D`` in bytes.
    model : CostModel, optional
        The alpha-beta-gamma parameters; defaults to the process-wide default model.
    benchmarks : str or Path, optional
        ``docs/benchmarks.md``; its measured medians at ``N`` (nearest measured size) are
        shown beside the predictions.
    """
    if algorithm not in PANELS_OF:
        raise ConfigError(explain("--algorithm", algorithm, f"must be one of {list(ALGORITHMS)}",
                                  "pick one of those"))
    _check(workers, nbytes)
    m = get_default_cost_model() if model is None else model
    panels = [ps_view(workers, nbytes) if a == "ps" else schedule_view(a, workers, nbytes)
              for a in PANELS_OF[algorithm]]
    size, measured = measured_for(benchmarks, workers, nbytes)
    keep = {*SCHEDULED_ALGORITHMS, "native"}
    return {
        "algorithm": algorithm,
        "workers": workers,
        "bytes": nbytes,
        "panels": panels,
        "cost_model": {"alpha": m.alpha, "beta": m.beta, "gamma": m.gamma,
                       "segment_bytes": m.segment_bytes, "beta_node": m.beta_node,
                       "bandwidth_gb_s": (1.0 / m.beta / 1e9) if m.beta > 0 else math.inf},
        "cost": _cost_rows(workers, nbytes, m),
        "measured": {
            "bytes": size,
            "section": measured[0].section if measured else "",
            "rows": [{"algorithm": r.algorithm, "median_ms": r.median_ms}
                     for r in measured if r.algorithm in keep],
        },
    }
