"""Server peak memory vs the number of replies: fedagg streaming / sharded vs Flower's FedAvg.

Every case aggregates the same N train replies (real Flower ``Message`` s, built one at a time
by a generator, so no method gets its replies for free) of a model shaped like
``model.name = "wide"`` on digits (``Linear(64, h)`` + ``Linear(h, 10)``, ``--params`` float32
parameters). Each case runs in a fresh process (so the kernel's peak RSS belongs to it) and
reports:

* ``peak / model``: the process's peak RSS above its baseline (after imports, the global
  model and, for sharded cases, the Ray actors were set up), in model sizes;
* ``fold GB/s``: N x model bytes / the seconds spent aggregating (reply construction, timed
  inside the generator, is subtracted);
* ``private / object store``: the same peak split into this process's private memory
  (RssAnon) and the Ray object-store pages it has mapped (RssShmem: shared memory owned by
  Ray's store, counted once per machine), sampled every 2 ms;
* for sharded cases each actor's peak RSS above its RSS at the start of the round.

Methods: ``flower`` = ``flwr.serverapp.strategy.FedAvg().aggregate_train(1, replies)`` (it
lists the valid replies, then sums them in float32); ``streaming`` = fedagg's
``strategies.FedAvg().aggregate_train(1, replies)`` (per-reply checks, the round guards on
with their defaults, each reply folded into one :class:`fedagg.accumulate.Accumulator` and
dropped); ``streaming-noguards`` the same without the round guards
(``max_weight_ratio = norm_outlier_factor = 0``: Flower's semantics, no delta norms, nothing
kept aside for a correction); ``sharded<S>`` = ``strategies.FedAvg(shards=S)``, the
accumulator on ``S`` Ray actors (:class:`strategies.sharded.ShardedAccumulator`); ``replies`` =
the harness alone
(replies built and dropped). Cases whose projected peak exceeds
``--budget-gib`` are skipped and listed (Flower's grows with N: ~N + 2 models).

Usage::

    python benchmarks/server_memory.py                      # 10M and 100M, N = 4, 16, 64
    python benchmarks/server_memory.py --params 1e7 --sites 4 16 --methods flower streaming
    python benchmarks/server_memory.py --smoke   # every method, 100k params, N = 3 (CI)

``--json PATH`` writes the table's rows (medians) and every run with the command, date,
machine and commit (``benchmarks/_common.py``). The exit status is 1 when a case failed (a
case skipped for ``--budget-gib`` is not a failure).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from _common import add_common, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHUNK = 1 << 16  # elements of the repeated block replies are made of


def shapes_of(params: int) -> list[tuple[int, ...]]:
    """The tensors of the 'wide' model on digits with at least ``params`` parameters."""
    from fedagg.models import wide_width

    h = wide_width((1, 8, 8), 10, params)
    return [(h, 64), (h,), (10, h), (10,)]


def _array(shape: tuple[int, ...], block: np.ndarray):  # type: ignore[no-untyped-def]
    """A Flower Array of ``block`` repeated over ``shape``: its bytes built in one allocation."""
    from flwr.app import Array

    from strategies.wire.arrays import _npy_header_bytes

    n = int(np.prod(shape))
    full, rest = divmod(n, block.size)
    parts = [_npy_header_bytes("<f4", shape)] + [block.data.cast("B")] * full
    if rest:
        parts.append(block[:rest].data.cast("B"))
    return Array(dtype="float32", shape=shape, stype="numpy.ndarray", data=b"".join(parts))


def _reply(shapes: list[tuple[int, ...]], i: int):  # type: ignore[no-untyped-def]
    from flwr.app import ArrayRecord, Message, Metadata, MetricRecord, RecordDict

    block = (np.random.default_rng(i).normal(size=CHUNK) * 0.01).astype(np.float32)
    rec = ArrayRecord({str(j): _array(s, block) for j, s in enumerate(shapes)})
    md = Metadata(run_id=1, message_id=f"m{i}", src_node_id=i + 1, dst_node_id=0,
                  reply_to_message_id=f"q{i}", group_id="1", created_at=time.time(),
                  ttl=3600.0, message_type="train")
    return Message(content=RecordDict({"arrays": rec, "metrics": MetricRecord(
        {"num-examples": 10 + i})}), metadata=md)


def replies(shapes: list[tuple[int, ...]], n: int, clock: list[float]) -> Iterator:  # type: ignore[type-arg]
    """N train replies, made one at a time (construction time added to ``clock[0]``); the
    generator keeps no reference to a reply it has handed out."""
    for i in range(n):
        t0 = time.perf_counter()
        built = [_reply(shapes, i)]
        clock[0] += time.perf_counter() - t0
        yield built.pop()


class AnonPeak:
    """Sampled peak of this process's private (RssAnon) and shared (RssShmem) resident memory:
    the kernel's VmHWM also counts the Ray object-store pages this process wrote or read."""

    def __init__(self, interval: float = 0.002) -> None:
        import threading

        self.peak = {"RssAnon": 0, "RssShmem": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self.base = self._read()
        self._thread.start()

    @staticmethod
    def _read() -> dict[str, int]:
        out = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key = line.split(":")[0]
            if key in ("RssAnon", "RssShmem"):
                out[key] = int(line.split()[1]) * 1024
        return out

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            for k, v in self._read().items():
                self.peak[k] = max(self.peak[k], v)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return {k: max(self.peak[k] - self.base.get(k, 0), 0) for k in self.peak}


def run_case(params: int, n: int, method: str) -> dict[str, object]:
    """One case in this process; returns its measurements."""
    from fedagg.memory import PeakMemory, current_rss

    shapes = shapes_of(params)
    model_bytes = 4 * sum(int(np.prod(s)) for s in shapes)
    reference = [np.zeros(s, np.float32) for s in shapes]  # the global model (baseline)
    for r in reference:
        r.reshape(-1)[:] = 0.01
    out: dict[str, object] = {"params": sum(int(np.prod(s)) for s in shapes), "sites": n,
                              "method": method, "model_bytes": model_bytes}
    strategy = None
    if method.startswith("sharded"):
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=max(3 * model_bytes, 200 * 2**20))
    if method.startswith("streaming") or method.startswith("sharded"):
        from flwr.supercore.task_identity import TaskIdentity

        from strategies.fedavg import FedAvg

        # Flower sets these when it starts a ServerApp; configure_train builds Messages
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1

        bare = method.endswith("-noguards")  # Flower's semantics: no round guards
        strategy = FedAvg(min_available_nodes=1, shards=int(method[7:].split("-")[0])
                          if method.startswith("sharded") else 0,
                          **({"max_weight_ratio": 0.0, "norm_outlier_factor": 0.0} if bare
                             else {}))
    tiny = [(8, 64), (8,), (10, 8), (10,)]
    tiny_ref = [np.full(t, 0.01, np.float32) for t in tiny]
    if strategy is not None:
        configure(strategy, tiny_ref, 3)
    aggregate(method, tiny, 3, tiny_ref, strategy,
              [0.0])  # warm-up: lazy imports, first calls (and the Ray actors) before the baseline
    if strategy is not None:  # the round's global model, as the ServerApp holds it: baseline
        configure(strategy, reference, n)
    clock = [0.0]
    mem = PeakMemory()
    mem.start()
    base = current_rss() or 0
    parts = AnonPeak()
    t0 = time.perf_counter()
    aggregate(method, shapes, n, reference, strategy, clock)
    seconds = time.perf_counter() - t0
    split = parts.stop()
    span = mem.stop()
    fold_s = max(seconds - clock[0], 1e-9)
    out.update(peak_above_base=span.peak - base, peak_models=(span.peak - base) / model_bytes,
               method_rss=span.method, seconds=seconds, build_seconds=clock[0],
               fold_gbps=(n * model_bytes / fold_s / 1e9) if method != "replies" else None,
               anon_peak_models=split["RssAnon"] / model_bytes,
               shmem_peak_models=split["RssShmem"] / model_bytes)
    sharded = getattr(strategy, "_sharded", None)
    if sharded is not None:
        actors = sharded.actor_memory()
        out["actors"] = actors
        out["actor_peak_models"] = max((a["peak"] or 0) - (a["base"] or 0)
                                       for a in actors) / model_bytes
        out["actor_accumulator_models"] = max((a["accumulator"] or 0)
                                              for a in actors) / model_bytes
        out["actor_private_models"] = max((a["anon"] or 0) for a in actors) / model_bytes
        sharded.close()
    return out


def aggregate(method: str, shapes: list[tuple[int, ...]], n: int,
              reference: list[np.ndarray], strategy, clock: list[float]) -> None:  # type: ignore[no-untyped-def]
    """Aggregate ``n`` replies with ``method`` (the measured part of a case)."""
    from flwr.serverapp.strategy import FedAvg

    if method == "flower":
        result, _ = FedAvg().aggregate_train(1, replies(shapes, n, clock))
        assert result is not None
        del result
        return
    if method == "replies":
        for msg in replies(shapes, n, clock):
            del msg
        return
    record, _ = strategy.aggregate_train(1, replies(shapes, n, clock))  # configured by run_case
    assert record is not None and not strategy.report.refused, strategy.report.refused
    del record


def configure(strategy, reference: list[np.ndarray], n: int) -> None:  # type: ignore[no-untyped-def]
    """``configure_train`` of round 1 to ``n`` sites with ``reference`` as the global model
    (the strategy keeps read-only views on the record, which the ServerApp holds anyway; it
    learns that at most ``n`` replies come, as from a real round)."""
    from flwr.app import ConfigRecord

    from strategies.wire import arrays_to_record

    keys = [str(j) for j in range(len(reference))]
    strategy.configure_train(1, arrays_to_record(reference, keys), ConfigRecord(), _Nodes(n))


class _Nodes:
    def __init__(self, n: int) -> None:
        self.n = n

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.n + 1))


def projected_gib(params: int, n: int, method: str) -> float:
    """A generous projection of a case's peak (to skip what cannot fit)."""
    model = 4 * params / 2**30
    if method == "flower":
        return (n + 3) * model
    if method.startswith("sharded"):
        return 6 * model  # server + actors + object store
    return 5 * model


def median_of(runs: list[dict[str, object]]) -> dict[str, object]:
    """One row of the table: the median of every measured number over a case's runs (the
    first run's other fields); a case with a failed or skipped run shows that run."""
    bad = [r for r in runs if "skipped" in r]
    if bad or not runs:
        return bad[0] if bad else {}
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool) and key not in (
                "params", "sites", "model_bytes", "repeat"):
            out[key] = float(np.median([float(r[key]) for r in runs  # type: ignore[arg-type]
                                        if isinstance(r.get(key), int | float)]))
    out["repeats"] = len(runs)
    out.pop("repeat", None)
    return out


def table(results: list[dict[str, object]]) -> str:
    rows = ["| params | N | method | server peak above baseline (models) | of which private "
            "/ object store (sampled) | fold GB/s | x Flower's GB/s | per actor: accumulator / "
            "peak above start (models) | seconds |", "|---|---|---|---|---|---|---|---|---|"]
    flower = {(r["params"], r["sites"]): r.get("fold_gbps") for r in results
              if r.get("method") == "flower" and "skipped" not in r}
    for r in results:
        if "skipped" in r:
            rows.append(f"| {r['params']:,} | {r['sites']} | {r['method']} | skipped: "
                        f"{r['skipped']} | | | | | |")
            continue
        gbps = f"{r['fold_gbps']:.2f}" if r.get("fold_gbps") else "-"
        actor = (f"{r['actor_accumulator_models']:.2f} / {r['actor_peak_models']:.2f}"
                 if "actor_peak_models" in r else "-")
        ref = flower.get((r["params"], r["sites"]))
        ratio = (f"{r['fold_gbps'] / ref:.2f}" if r.get("fold_gbps") and ref  # type: ignore[operator]
                 else "-")
        rows.append(f"| {r['params']:,} | {r['sites']} | {r['method']} | "
                    f"{r['peak_models']:.2f} | {r['anon_peak_models']:.2f} / "
                    f"{r['shmem_peak_models']:.2f} | {gbps} | {ratio} | {actor} | "
                    f"{r['seconds']:.1f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, nargs="+", default=[1e7, 1e8])
    p.add_argument("--sites", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--methods", nargs="+",
                   default=["replies", "flower", "streaming-noguards", "streaming", "sharded2",
                            "sharded4"])
    p.add_argument("--budget-gib", type=float, default=12.0,
                   help="skip cases projected above this peak (the machine is shared)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every case, interleaved; the table shows medians")
    p.add_argument("--case", nargs=3, metavar=("PARAMS", "N", "METHOD"), help=argparse.SUPPRESS)
    add_common(p)
    a = p.parse_args(argv)
    if a.case:
        print(json.dumps(run_case(int(float(a.case[0])), int(a.case[1]), a.case[2])))
        return 0
    if a.smoke:
        a.params, a.sites, a.repeats = [1e5], [3], 1
    failed: list[str] = []
    cases = [(int(x), n, m) for x in a.params for n in a.sites for m in a.methods]
    runs: dict[tuple[int, int, str], list[dict[str, object]]] = {c: [] for c in cases}
    for rep in range(a.repeats):  # interleaved: every case once per repeat
        for params, n, method in cases:
            need = projected_gib(params, n, method)
            if need > a.budget_gib:
                if rep == 0:
                    runs[(params, n, method)].append(
                        {"params": params, "sites": n, "method": method,
                         "skipped": f"projected {need:.1f} GiB > --budget-gib {a.budget_gib:g}"})
                continue
            proc = subprocess.run([sys.executable, __file__, "--case", str(params), str(n),
                                   method], capture_output=True, text=True,
                                  env={**os.environ, "RAY_DEDUP_LOGS": "0"}, check=False)
            line = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            if proc.returncode or not line:
                out: dict[str, object] = {
                    "params": params, "sites": n, "method": method,
                    "skipped": f"failed (exit {proc.returncode}): "
                               f"{proc.stderr.strip().splitlines()[-1:]}"}
                failed.append(f"{params} {n} {method}")
            else:
                out = json.loads(line[-1])
            out["repeat"] = rep
            runs[(params, n, method)].append(out)
            print(json.dumps(out), flush=True)
    results = [median_of(runs[c]) for c in cases]
    print(table(results))
    write_json(a.json, results, argv, runs=[r for c in cases for r in runs[c]])
    if failed:
        print(f"failed cases: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
