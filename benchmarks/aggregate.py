"""Server-side aggregation alone: fedagg's FedAvg vs Flower's FedAvg on the same replies.

    python benchmarks/aggregate.py [--sites 50] [--dims 1000000 10000000] [--repeats 5]

N pre-built train replies (real Flower ``Message`` s, each from its own node, ``D`` float32
parameters, weights 10 + i) are aggregated by:

* ``flower``: ``flwr.serverapp.strategy.FedAvg().aggregate_train(1, replies)``;
* ``fedagg``: ``strategies.FedAvg().aggregate_train(1, replies)`` after ``configure_train``
  (the class's defaults: the protections that never change an honest result -- per-reply
  checks, finite values, shapes, exact order-independent sums);
* ``fedagg-guarded``: the same with ``fedagg simulate``'s run-config protections (weight cap and
  norm-bomb guard at 10 x the round's median, replies isolated);
* ``fedagg-stream``: ``FedAvg.aggregate_stream`` -- what fedagg's own round loop calls with the
  replies as they arrive (the engine without Flower's averaging around it).

The replies exist before the clock starts (neither side pays for building them); every repeat
runs the methods one after another, in a rotating order, so load changes hit all alike, and the
table shows medians. Each measured call starts with the harness's garbage collected and frozen.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import add_common, loadavg, own_garbage, write_json

METHODS = ("flower", "fedagg", "fedagg-guarded", "fedagg-stream")


def replies(n: int, dim: int) -> list[Any]:
    """``n`` train replies of ``dim`` float32 values (node ids 1..n, weights 10 + i)."""
    from flwr.app import ArrayRecord, Message, Metadata, MetricRecord, RecordDict

    from strategies.wire import arrays_to_record

    out = []
    for i in range(n):
        x = (np.random.default_rng(i).standard_normal(dim) * 0.01).astype(np.float32)
        rec: ArrayRecord = arrays_to_record([x])
        md = Metadata(run_id=1, message_id=f"m{i}", src_node_id=i + 1, dst_node_id=0,
                      reply_to_message_id=f"q{i}", group_id="1", created_at=time.time(),
                      ttl=3600.0, message_type="train")
        out.append(Message(content=RecordDict({"arrays": rec, "metrics": MetricRecord(
            {"num-examples": 10 + i})}), metadata=md))
    return out


class _Nodes:
    def __init__(self, n: int) -> None:
        self.n = n

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.n + 1))


def run(method: str, reps: list[Any], dim: int) -> tuple[float, np.ndarray]:
    """Seconds of one aggregation with ``method`` and the first values of its result."""
    from flwr.app import ConfigRecord
    from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

    from strategies import FedAvg
    from strategies.wire import arrays_to_record

    n = len(reps)
    if method == "flower":
        strategy: Any = FlowerFedAvg()
        call = strategy.aggregate_train
    else:
        kw: dict[str, Any] = ({"max_weight_ratio": 10.0, "norm_outlier_factor": 10.0,
                               "isolate_replies": True} if method == "fedagg-guarded" else {})
        strategy = FedAvg(min_available_nodes=1, min_train_nodes=1, **kw)
        strategy.configure_train(1, arrays_to_record([np.full(dim, 0.01, np.float32)]),
                                 ConfigRecord(), _Nodes(n))
        call = strategy.aggregate_stream if method == "fedagg-stream" else \
            strategy.aggregate_train
    with own_garbage():
        t0 = time.perf_counter()
        record, _ = call(1, iter(reps))
        seconds = time.perf_counter() - t0
    assert record is not None, getattr(strategy, "report", None)
    first = next(iter(record.values())).numpy()[:4].astype(np.float64)
    return seconds, first


def bench(n: int, dim: int, repeats: int, methods: tuple[str, ...]) -> dict[str, Any]:
    """Every method ``repeats`` times on the same replies; medians and ratios to Flower."""
    reps = replies(n, dim)
    for m in methods:  # warm-up: imports, the native kernel, first calls
        run(m, reps[:3], dim)
    times: dict[str, list[float]] = {m: [] for m in methods}
    firsts: dict[str, np.ndarray] = {}
    for k in range(repeats):
        order = methods[k % len(methods):] + methods[:k % len(methods)]
        for m in order:
            sec, first = run(m, reps, dim)
            times[m].append(sec)
            firsts[m] = first
    ref = firsts.get("flower")
    for m, first in firsts.items():  # every method computes the same weighted mean
        if ref is not None:
            assert np.allclose(first, ref, rtol=1e-5, atol=1e-7), (m, first, ref)
    med = {m: statistics.median(v) for m, v in times.items()}
    row: dict[str, Any] = {"sites": n, "dim": dim, "repeats": repeats,
                           "seconds": med, "runs": times}
    if "flower" in med:
        row["ratio_to_flower"] = {m: med[m] / med["flower"] for m in med if m != "flower"}
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of medians and ratios."""
    methods = [m for m in METHODS if any(m in r["seconds"] for r in rows)]
    head = "| N | D | " + " | ".join(f"{m} s" for m in methods) + " | " + " | ".join(
        f"{m} / flower" for m in methods if m != "flower") + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(methods) - 1)]
    for r in rows:
        secs = " | ".join(f"{r['seconds'][m]:.4f}" for m in methods)
        ratios = " | ".join(f"{r.get('ratio_to_flower', {}).get(m, float('nan')):.2f}x"
                            for m in methods if m != "flower")
        lines.append(f"| {r['sites']} | {r['dim']:,} | {secs} | {ratios} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sites", type=int, nargs="+", default=[50])
    p.add_argument("--dims", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    add_common(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.sites, args.dims, args.repeats = [4], [5000], 2
    logging.basicConfig(level=logging.WARNING)
    for name in ("flwr", "strategies", "fedagg"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    print(f"load average at start: {loadavg()}", flush=True)
    rows = []
    for n in args.sites:
        for dim in args.dims:
            rows.append(bench(n, dim, args.repeats, tuple(args.methods)))
            print(table(rows[-1:]), flush=True)
    print()
    print(table(rows))
    print(f"\nload average at end: {loadavg()}")
    write_json(args.json, rows, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
