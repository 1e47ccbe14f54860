"""Compressed updates on Fashion-MNIST: accuracy vs upward bytes, all variants side by side.

Every variant trains the same model from the same initial weights on the same 20 Dirichlet(0.3)
partitions with the same seeds, for the same fixed number of rounds; rounds are interleaved
across variants (round 1 of every variant, then round 2, ...) so machine-load drift hits all
alike. Variants: dense FedAvg; TopK 10 % / 1 % with and without error feedback; int8; bf16;
the plaintext shared-support paths (seeded random support, top-k of the previous aggregate);
secure aggregation dense / sparse (both supports); and issue 21's secure sparse modes
(FetchSGD ``sketch``, secure index voting ``vote`` with hashed or block votes, ``shared-dgc``),
some in a narrower SecAgg+ ring (``secagg.ring_bits`` 16 or 12) at the same byte budget.

How it runs: **in-process**, on the real client code path. Each site is the real ClientApp
(``clients.app:app``: the site protocol, :mod:`clients.protocol`, and its train
handler) called with real Flower ``Message`` and ``Context`` objects; every message crosses a
real Flower serialization round trip (deflate -> inflate of all its objects, as the SuperLink
stores it), and bytes up / down are :func:`strategies.wire.message_nbytes` of the real
messages, measured by :func:`strategies.loop.run_train_round` exactly as in a Flower run.
The one thing left out is Ray: 20 sites x 12 variants x 30 rounds through Flower's simulation
engine does not fit the 2-core development machine in 15 minutes.

Usage::

    python benchmarks/compression.py --rounds 3 --variants dense,topk1-ef   # quick look
    # the documented run (docs/compression.md#results): 150 rounds on McMahan et al.'s 2NN,
    # variants split over processes, each writing its rounds to JSON, then merged
    python benchmarks/compression.py --rounds 150 --model 2nn --max-train 8000 \
        --variants dense --json dense.json       # ... one process per variant group
    python benchmarks/compression.py --merge dense.json topk1-ef.json ...
    python benchmarks/compression.py --smoke      # every variant, 4 sites, 2 rounds (CI)

``--json`` writes every variant's per-round figures (after every round) with the command, date,
machine and commit (``benchmarks/_common.py``). The exit status is 1 when a variant failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import _common  # noqa: E402
import numpy as np  # noqa: E402


@dataclass
class Variant:
    key: str
    label: str
    overrides: list[str]
    secure: bool = False


VARIANTS = [
    Variant("dense", "dense FedAvg (fp32)", ["strategy.name=fedavg"]),
    Variant("topk10", "TopK 10 %", ["strategy.name=compressed", "compression.up=topk:0.1"]),
    Variant("topk10-ef", "TopK 10 % + EF", ["strategy.name=compressed", "compression.up=topk:0.1+ef"]),
    Variant("topk1", "TopK 1 %", ["strategy.name=compressed", "compression.up=topk:0.01"]),
    Variant("topk1-ef", "TopK 1 % + EF", ["strategy.name=compressed", "compression.up=topk:0.01+ef"]),
    Variant("topk1-ef-fp16", "TopK 1 % + EF, fp16 values",
            ["strategy.name=compressed", "compression.up=topk:0.01+ef+fp16"]),
    Variant("int8", "int8 (dense, chunk 256)", ["strategy.name=compressed", "compression.up=int8"]),
    Variant("bf16", "bf16 (dense)", ["strategy.name=compressed", "compression.up=bf16"]),
    Variant("shared1", "shared random support 1 % (plaintext)",
            ["strategy.name=compressed", "compression.up=topk:0.01", "compression.support=random"]),
    Variant("aggtopk1-r50", "top-k of previous aggregate 1 %, half random (plaintext)",
            ["strategy.name=compressed", "compression.up=aggtopk:0.01,random=0.5"]),
    Variant("shared1-ef", "shared random support 1 % + EF (plaintext)",
            ["strategy.name=compressed", "compression.up=topk:0.01+ef", "compression.support=random"]),
    Variant("aggtopk1-ef", "top-k of previous aggregate 1 % + EF (plaintext)",
            ["strategy.name=compressed", "compression.up=topk:0.01+ef",
             "compression.support=topk-aggregate"]),
    Variant("aggtopk1-r50-ef", "top-k of previous aggregate 1 %, half random + EF (plaintext)",
            ["strategy.name=compressed", "compression.up=aggtopk:0.01,random=0.5+ef"]),
    Variant("secure-dense", "secure dense", ["strategy.name=secure"], secure=True),
    Variant("secure-random1", "secure sparse, random support 1 % + EF",
            ["strategy.name=secure", "compression.up=topk:0.01+ef", "compression.support=random"],
            secure=True),
    Variant("secure-aggtopk1", "secure sparse, top-k-of-aggregate 1 % + EF",
            ["strategy.name=secure", "compression.up=topk:0.01+ef",
             "compression.support=topk-aggregate"], secure=True),
    Variant("secure-aggtopk1-r50", "secure sparse, top-k-of-aggregate 1 %, half random + EF",
            ["strategy.name=secure", "compression.up=aggtopk:0.01,random=0.5+ef"], secure=True),
    # issue 21: secure sparse modes that let the data choose the coordinates through a sum
    Variant("secure-sketch-k1000", "secure FetchSGD sketch 3 x 750, k 1000",
            ["strategy.name=secure", "compression.up=sketch:k=1000,rows=3,cols=750"], secure=True),
    Variant("secure-sketch-k300", "secure FetchSGD sketch 3 x 750, k 300",
            ["strategy.name=secure", "compression.up=sketch:k=300,rows=3,cols=750"], secure=True),
    Variant("secure-vote-v25", "secure vote: support 0.75 %, vote 0.25 %, 2 x 2048 + EF",
            ["strategy.name=secure", "compression.up=vote:0.0075,vote=0.0025,rows=2,cols=2048+ef"],
            secure=True),
    Variant("secure-vote-v75", "secure vote: support 0.75 %, vote 0.75 %, 2 x 2048 + EF",
            ["strategy.name=secure", "compression.up=vote:0.0075,rows=2,cols=2048+ef"],
            secure=True),
    Variant("secure-vote-v25-r10", "secure vote: support 0.75 % (10 % random), vote 0.25 %, "
            "2 x 2048 + EF",
            ["strategy.name=secure",
             "compression.up=vote:0.0075,vote=0.0025,rows=2,cols=2048,random=0.1+ef"],
            secure=True),
    Variant("secure-dgc-m9", "secure shared-dgc, random support 1 %, momentum 0.9",
            ["strategy.name=secure", "compression.up=shared-dgc:0.01,momentum=0.9"], secure=True),
    Variant("secure-dgc-d95", "secure shared-dgc, random support 1 %, decay 0.95",
            ["strategy.name=secure", "compression.up=shared-dgc:0.01,momentum=0,decay=0.95"],
            secure=True),
    # the same byte budget in a 16-bit ring (secagg.ring_bits = 16, clip 1, weight bound 1,000)
    Variant("secure16-vote", "secure vote, 16-bit ring: support 1.55 %, vote 0.25 %, 2 x 2048 + EF",
            ["strategy.name=secure", "secagg.ring_bits=16", "secagg.clip=1", "secagg.weight_scale=1000",
             "compression.up=vote:0.0155,vote=0.0025,rows=2,cols=2048+ef"], secure=True),
    Variant("secure16-random", "secure sparse, 16-bit ring: random support 2.2 % + EF",
            ["strategy.name=secure", "secagg.ring_bits=16", "secagg.clip=1", "secagg.weight_scale=1000",
             "compression.up=topk:0.022+ef", "compression.support=random"], secure=True),
    Variant("secure12-vote", "secure vote, 12-bit ring: support 1.98 %, vote 0.25 %, 2 x 2048 + EF",
            ["strategy.name=secure", "secagg.ring_bits=12", "secagg.frac_bits=6", "secagg.clip=1",
             "secagg.weight_scale=1000",
             "compression.up=vote:0.0198,vote=0.0025,rows=2,cols=2048+ef"], secure=True),
    Variant("secure12-blockvote", "secure block vote, 12-bit ring: 69 blocks of 64 (2.2 %), "
            "vote 1 % (31 blocks) + EF",
            ["strategy.name=secure", "secagg.ring_bits=12", "secagg.frac_bits=6", "secagg.clip=1",
             "secagg.weight_scale=1000",
             "compression.up=vote:0.0222,vote=0.01,block=64+ef"], secure=True),
    # the MLP (109k parameters) has half the 2NN's budget at 50x, most of it SecAgg+'s fixed cost
    Variant("secure12-blockvote-b128", "secure block vote, 12-bit ring: 6 blocks of 128 (0.7 % of "
            "the MLP), vote 0.5 % + EF",
            ["strategy.name=secure", "secagg.ring_bits=12", "secagg.frac_bits=6", "secagg.clip=1",
             "secagg.weight_scale=1000",
             "compression.up=vote:0.0072,vote=0.005,block=128+ef"], secure=True),
    # the same block vote with a sparser SecAgg+ graph: 6 neighbours (t = 4) instead of 15
    # (t = 8) at 20 sites, i.e. fewer key shares per round (a weaker collusion bound)
    Variant("secure12-blockvote-k6", "secure block vote, 12-bit ring, 6 SecAgg+ neighbours: "
            "support 2.2 %, vote 1 % + EF",
            ["strategy.name=secure", "secagg.ring_bits=12", "secagg.frac_bits=6", "secagg.clip=1",
             "secagg.weight_scale=1000", "secagg.neighbours=6",
             "compression.up=vote:0.0222,vote=0.01,block=64+ef"], secure=True),
    Variant("secure12-random", "secure sparse, 12-bit ring: random support 3 % + EF",
            ["strategy.name=secure", "secagg.ring_bits=12", "secagg.frac_bits=6", "secagg.clip=1",
             "secagg.weight_scale=1000",
             "compression.up=topk:0.03+ef", "compression.support=random"], secure=True),
]


def _wire_copy(message: Any) -> Any:
    """The message as the receiver gets it: every object deflated and inflated again."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}
    return inflate_object_from_contents(message.object_id, contents)


class InProcessGrid:
    """A Flower Grid that delivers each message to the real ClientApp of its site, in process.

    Each site has its own ``Context`` (state kept across rounds, as Flower keeps it per node).
    A ClientApp exception becomes an error reply, as in Flower's runtime.
    """

    def __init__(self, client_app: Any, node_ids: list[int], num_partitions: int) -> None:
        from flwr.app import Context, RecordDict

        self.app = client_app
        self.contexts = {
            nid: Context(run_id=1, node_id=nid, node_config={"partition-id": i,
                                                             "num-partitions": num_partitions},
                         state=RecordDict(), run_config={})
            for i, nid in enumerate(node_ids)
        }
        self._pending: dict[str, Any] = {}

    # Grid API ---------------------------------------------------------------------------------
    def create_message(self, content: Any, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Any:
        from flwr.app import Message

        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Any]) -> list[str]:
        """Deliver each message now (in order); its reply waits for :meth:`pull_messages`."""
        ids = []
        for msg in messages:
            reply = self.send_and_receive([msg])[0]
            self._pending[msg.metadata.message_id] = reply
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Any]:
        return [self._pending.pop(mid) for mid in message_ids if mid in self._pending]

    def send_and_receive(self, messages: Iterable[Any], *, timeout: float | None = None) -> list[Any]:
        from flwr.app import Error, Message

        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            msg.metadata.__dict__["_run_id"] = 1
            delivered = _wire_copy(msg)
            delivered.metadata.__dict__["_message_id"] = msg.metadata.message_id
            ctx = self.contexts[delivered.metadata.dst_node_id]
            try:
                reply = self.app(delivered, ctx)
            except Exception as exc:  # Flower turns a ClientApp exception into an error reply
                reply = Message(Error(code=2, reason=f"{type(exc).__name__}: {exc}"),
                                reply_to=delivered)
            back = _wire_copy(reply)
            # ids are not part of the serialized objects; the SuperLink assigns / keeps them
            back.metadata.__dict__["_message_id"] = str(uuid.uuid4())
            back.metadata.__dict__["_reply_to_message_id"] = msg.metadata.message_id
            replies.append(back)
        return replies


@dataclass
class Track:
    variant: Variant
    cfg: Any = None
    strategy: Any = None
    grid: Any = None
    arrays: Any = None
    status: str = "ok"
    acc: list[float] = field(default_factory=list)
    up_per_site: list[float] = field(default_factory=list)
    down_per_site: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    rejected: int = 0
    first_rejection: str = ""


def run(args: argparse.Namespace) -> tuple[list[Track], dict[str, Any]]:
    import torch
    from flwr.supercore.task_identity import TaskIdentity

    from clients.app import app as client_app
    from fedagg.config import load_config
    from fedagg.data import load_dataset
    from fedagg.models import build_model, set_weights
    from fedagg.training import evaluate
    from server.runner import client_config
    from strategies.loop import run_train_round
    from strategies.registry import build_strategy
    from strategies.wire import arrays_to_record, record_to_arrays

    # Flower sets these when it starts a ServerApp / ClientApp; in process we set them once
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    torch.set_num_threads(args.threads)
    common = [f"run.sites={args.sites}", f"run.rounds={args.rounds}", f"run.seed={args.seed}",
              "data.dataset=fashion-mnist", "data.partitioner=dirichlet",
              f"data.dirichlet_alpha={args.alpha}", f"data.max_train_examples={args.max_train}",
              f"model.name={args.model}", f"train.local_epochs={args.local_epochs}",
              f"train.batch_size={args.batch_size}", f"train.lr={args.lr}", f"train.momentum={args.momentum}",
              "data.eval_fraction=0",  # every example trains, as in the recorded runs
              *args.common]
    wanted = set(args.variants.split(",")) if args.variants else None
    secure_exists = importlib.util.find_spec("strategies.secure") is not None
    base_cfg = load_config(None, common)
    ds = load_dataset("fashion-mnist", data_dir=base_cfg.data.data_dir)
    model = build_model(args.model, ds.input_shape, ds.num_classes, seed=args.seed)
    keys = list(model.state_dict().keys())
    init = [t.detach().numpy().copy() for t in model.state_dict().values()]
    node_ids = [1000 + 7919 * i for i in range(args.sites)]

    def accuracy(arrays: Any) -> float:
        set_weights(model, record_to_arrays(arrays)[1])
        return float(evaluate(model, ds.x_test, ds.y_test)[1])

    acc0 = accuracy(arrays_to_record(init, keys))
    tracks: list[Track] = []
    for v in VARIANTS:
        if wanted is not None and v.key not in wanted:
            continue
        t = Track(v)
        tracks.append(t)
        if v.secure and not secure_exists:
            t.status = "pending: secure strategy"
            continue
        try:
            t.cfg = load_config(None, [*common, *v.overrides])
            t.strategy = build_strategy(t.cfg)
        except Exception as exc:  # e.g. the secure strategy exists but rejects this config
            prefix = "pending: secure strategy" if v.secure else "failed to build"
            t.status = f"{prefix} ({type(exc).__name__}: {exc})"[:300]
            continue
        t.grid = InProcessGrid(client_app, node_ids, args.sites)
        t.arrays = arrays_to_record(init, keys)
        t.acc.append(acc0)

    t_start = time.perf_counter()

    def meta_of(done: int) -> dict[str, Any]:
        return {"wall_seconds": time.perf_counter() - t_start, "initial_accuracy": acc0,
                "params": int(sum(a.size for a in init)), "secure_strategy_found": secure_exists,
                "rounds_done": done, "args": vars(args)}

    for rnd in range(1, args.rounds + 1):
        live = [t for t in tracks if t.status == "ok"]
        order = live if rnd % 2 else live[::-1]
        for t in order:
            t0 = time.perf_counter()
            try:
                res = run_train_round(t.strategy, t.grid, rnd, t.arrays, client_config(t.cfg),
                                      t.cfg.run.round_timeout)
            except Exception as exc:
                t.status = f"failed in round {rnd}: {type(exc).__name__}: {exc}"[:300]
                continue
            t.seconds.append(time.perf_counter() - t0)
            if res.arrays is not None:
                t.arrays = res.arrays
            rep = res.report
            t.rejected += len(rep.refused) + rep.failures
            if rep.refused and not t.first_rejection:
                t.first_rejection = next(iter(rep.refused.values()))[:300]
            n = max(rep.replies, 1)
            t.up_per_site.append(rep.bytes_up / n)
            t.down_per_site.append(rep.bytes_down / max(rep.sampled, 1))
            t.acc.append(accuracy(t.arrays))
        print(f"round {rnd}/{args.rounds} done, {time.perf_counter() - t_start:.0f} s: "
              + ", ".join(f"{t.variant.key}={t.acc[-1]:.3f}" for t in live if t.acc), flush=True)
        if args.json:  # after every round, so an interrupted run keeps what it measured
            write_json(args.json, tracks, meta_of(rnd))
    return tracks, meta_of(args.rounds)


LAST = 10
"""The "last-10 mean" column: mean test accuracy over the last LAST rounds (less noisy than the
final round alone, which TopK + EF makes oscillate by about +-1 pp)."""


def _last_mean(t: Track) -> float:
    return float(np.mean(t.acc[1:][-LAST:]))


def table(tracks: list[Track], meta: dict[str, Any]) -> str:
    dense = next((t for t in tracks if t.variant.key == "dense" and t.status == "ok"), None)
    dense_up = statistics.median(dense.up_per_site) if dense and dense.up_per_site else None
    dense_final = dense.acc[-1] if dense and dense.acc else None
    lines = ["| variant | final acc | best acc | last-10 mean | Δ final vs dense (same round) "
             "| up bytes / site / round (median) | up ratio to dense fp32 "
             "| down bytes / site / round | median s / round | rejected |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for t in tracks:
        if t.status != "ok" or not t.up_per_site:
            lines.append(f"| {t.variant.label} | {t.status} | | | | | | | | |")
            continue
        up = statistics.median(t.up_per_site)
        ratio = f"{up / dense_up:.4f}x ({dense_up / up:.0f}x fewer)" if dense_up else "n/a"
        if dense is None or dense_final is None:
            delta = "n/a"
        elif len(t.acc) < len(dense.acc):  # stopped early: compare with dense at the same round
            delta = f"{100 * (t.acc[-1] - dense.acc[len(t.acc) - 1]):+.1f} pp (at round {len(t.acc) - 1})"
        else:
            delta = f"{100 * (t.acc[-1] - dense_final):+.1f} pp"
        lines.append(
            f"| {t.variant.label} | {t.acc[-1]:.4f} | {max(t.acc[1:]):.4f} | {_last_mean(t):.4f} "
            f"| {delta} | {up:,.0f} | {ratio} | {statistics.median(t.down_per_site):,.0f} | "
            f"{statistics.median(t.seconds):.2f} | {t.rejected} |")
    return "\n".join(lines)


def _gap(name: str, d: float, v: float) -> tuple[bool, str]:
    """Gap of ``v`` below dense ``d`` in percentage points and relative to dense."""
    pp, rel = 100 * (d - v), 100 * (d - v) / d
    return pp <= 2 and rel <= 2, f"{name} {v:.4f} vs {d:.4f}: {pp:+.2f} pp, {rel:+.2f} % relative"


def targets(tracks: list[Track]) -> list[str]:
    by = {t.variant.key: t for t in tracks}
    out = []
    dense, ef = by.get("dense"), by.get("topk1-ef")
    if (dense and ef and dense.status == ef.status == "ok" and ef.up_per_site
            and statistics.median(ef.up_per_site) > 0):
        fewer = statistics.median(dense.up_per_site) / statistics.median(ef.up_per_site)
        checks = [_gap("final", dense.acc[-1], ef.acc[-1]),
                  _gap("best", max(dense.acc[1:]), max(ef.acc[1:])),
                  _gap(f"last-{LAST} mean", _last_mean(dense), _last_mean(ef))]
        ok = all(c[0] for c in checks) and fewer >= 50
        out.append(f"TopK 1 % + EF within 2 % of dense accuracy at >= 50x fewer upward bytes: "
                   f"{'MET' if ok else 'NOT MET'} ({fewer:.1f}x fewer bytes; "
                   + "; ".join(c[1] for c in checks) + ")")
    # issue 21: a secure sparse mode within 2 % (relative, last-10 mean) of dense at >= 50x
    if dense and dense.status == "ok" and dense.up_per_site:
        d_up, d_last = statistics.median(dense.up_per_site), _last_mean(dense)
        for t in tracks:
            if not t.variant.secure or t.variant.key == "secure-dense" or t.status != "ok":
                continue
            if not t.up_per_site or len(t.acc) != len(dense.acc):
                continue
            fewer = d_up / statistics.median(t.up_per_site)
            rel = 100 * (d_last - _last_mean(t)) / d_last
            ok = fewer >= 50 and rel <= 2
            out.append(f"{t.variant.label}: within 2 % of dense (last-{LAST} mean) at >= 50x: "
                       f"{'MET' if ok else 'NOT MET'} ({fewer:.1f}x fewer bytes; "
                       f"{_last_mean(t):.4f} vs {d_last:.4f}, {rel:+.2f} % relative)")
    sec = [by[k] for k in ("secure-random1", "secure-aggtopk1", "secure-aggtopk1-r50") if k in by]
    for t in sec:
        if t.status != "ok":
            out.append(f"{t.variant.label} <= 0.02x dense bytes: {t.status}")
        elif dense and dense.up_per_site:
            r = statistics.median(t.up_per_site) / statistics.median(dense.up_per_site)
            out.append(f"{t.variant.label} <= 0.02x dense bytes: {'MET' if r <= 0.02 else 'NOT MET'}"
                       f" ({r:.4f}x)")
    return out


def write_json(path: Path, tracks: list[Track], meta: dict[str, Any]) -> None:
    """The raw per-round results (``--json``; read back by ``--merge``), written atomically."""
    tmp = path.with_name(path.name + ".tmp")
    _common.write_json(tmp, [{"key": t.variant.key, "label": t.variant.label,
                              "status": t.status, "accuracy": t.acc,
                              "up_per_site": t.up_per_site,
                              "down_per_site": t.down_per_site, "seconds": t.seconds,
                              "rejected": t.rejected} for t in tracks], meta=meta)
    tmp.replace(path)


def load_results(paths: list[str]) -> tuple[list[Track], dict[str, Any]]:
    """Tracks from one or more ``--json`` files (``--merge``), in VARIANTS order.

    Runs with the same arguments and seeds give the same per-variant results whether the
    variants ran in one process or were split over several (each variant only ever sees its
    own strategy, sites and data), so a split run can be merged into one table.
    """
    known = {v.key: v for v in VARIANTS}
    found: dict[str, Track] = {}
    metas = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        metas.append(data["meta"])
        done = data["meta"].get("rounds_done", data["meta"]["args"]["rounds"])
        for row in data.get("results", data.get("variants", [])):  # "variants": older files
            v = known[row["key"]]
            if done < data["meta"]["args"]["rounds"]:  # an interrupted run: say so in the row
                v = Variant(v.key, f"{v.label} (stopped after {done} rounds)", v.overrides,
                            v.secure)
            t = Track(v, status=row["status"], acc=row["accuracy"],
                      up_per_site=row["up_per_site"], down_per_site=row["down_per_site"],
                      seconds=row["seconds"], rejected=row["rejected"])
            found[row["key"]] = t
    keys = ("sites", "rounds", "alpha", "max_train", "model", "local_epochs", "batch_size", "lr",
            "momentum", "seed", "common")
    for m in metas[1:]:
        diff = [k for k in keys
                if m["args"].get(k, [] if k == "common" else None)
                != metas[0]["args"].get(k, [] if k == "common" else None)]
        if diff:
            raise SystemExit(f"--merge: runs differ in {diff}; merge only runs of one setup")
    meta = dict(metas[0])
    meta["wall_seconds"] = max(m["wall_seconds"] for m in metas)
    meta["merged_from"] = paths
    return [found[v.key] for v in VARIANTS if v.key in found], meta


def plot(tracks: list[Track], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    many = sum(t.status == "ok" for t in tracks) > 12
    fig, ax = plt.subplots(figsize=(8.5, 7.2) if many else (7.5, 5.4), dpi=90)
    shown = [t for t in tracks if t.status == "ok" and t.up_per_site]
    colours = plt.get_cmap("tab20")(np.arange(len(shown)) % 20)
    for t, colour in zip(shown, colours, strict=True):
        cum = np.concatenate([[0.0], np.cumsum(t.up_per_site)]) / 1e6
        ax.plot(np.maximum(cum, 1e-3), t.acc, marker=".", markersize=3, linewidth=1.2,
                label=t.variant.label, linestyle="--" if t.variant.secure else "-", color=colour)
    ax.set_xscale("log")
    ax.set_xlabel("cumulative upward MB per site (log scale)")
    ax.set_ylabel("test accuracy")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6 if many else 6.5, loc="upper center", bbox_to_anchor=(0.5, -0.12),
              ncol=2 if many else 3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sites", type=int, default=20)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--alpha", type=float, default=0.3)
    p.add_argument("--max-train", type=int, default=12000)
    p.add_argument("--model", default="mlp")
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--common", action="append", default=[],
                   help="extra config override applied to EVERY variant (repeatable), e.g. "
                   "strategy.server_optimizer=momentum")
    p.add_argument("--variants", default="", help="comma-separated keys (default: all)")
    p.add_argument("--plot", default=None,
                   help="where the plot goes (default docs/img/compression_accuracy_vs_bytes.png; "
                   "with --smoke a temporary file); '' for none")
    p.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="do not train: print the table / targets / plot of these --json files "
                   "(e.g. the same setup split over two processes)")
    _common.add_common(p)
    a = p.parse_args()
    if a.smoke:  # every variant, tiny: 4 sites, 2 rounds (round 2 uses round 1's state)
        a.sites, a.rounds, a.max_train = 4, 2, 800
    smoke_dir = tempfile.TemporaryDirectory(prefix="fedagg-compression-") if a.smoke else None
    if a.plot is None:
        a.plot = (str(Path(smoke_dir.name) / "plot.png") if smoke_dir is not None
                  else str(ROOT / "docs/img/compression_accuracy_vs_bytes.png"))
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    logging.getLogger("flwr").setLevel(logging.ERROR)
    logging.getLogger("strategies").setLevel(logging.ERROR)
    if a.merge:
        tracks, meta = load_results(a.merge)
        for k in ("sites", "rounds", "alpha", "model", "local_epochs", "seed"):
            setattr(a, k, meta["args"][k])
        a.json = None
    else:
        tracks, meta = run(a)
    title = (f"Fashion-MNIST {a.model}, {a.sites} sites, Dirichlet {a.alpha}, {a.rounds} rounds, "
             f"{a.local_epochs} local epoch(s), seed {a.seed}")
    if meta["args"].get("common"):
        title += ", " + ", ".join(meta["args"]["common"])
    print()
    print(f"{title}; {meta['params']:,} parameters; initial accuracy {meta['initial_accuracy']:.4f}; "
          f"wall {meta['wall_seconds']:.0f} s")
    print()
    print(table(tracks, meta))
    print()
    for line in targets(tracks):
        print("- " + line)
    for t in tracks:
        if t.first_rejection:
            print(f"- {t.variant.label}: first rejected update: {t.first_rejection}")
    if a.plot:
        plot(tracks, Path(a.plot), title)
        print(f"\nplot: {a.plot}" + (" (temporary)" if smoke_dir is not None else ""))
    if smoke_dir is not None:
        smoke_dir.cleanup()
    failed = [t.variant.key for t in tracks if t.status != "ok"]
    if failed and not a.merge:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
