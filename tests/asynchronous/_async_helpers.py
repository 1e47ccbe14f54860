"""Helpers of the asynchronous tests: a deterministic ClientApp and naive reference loops.

``fake_app`` is a real Flower ClientApp behind fedagg's client mod (so compression and secure
aggregation run the real site protocol), whose "training" is a fixed function of the model it
got, the site and the round: ``trained = decay * w + c(site, round)``; its evaluation reports
``eval_loss = sum |w| + site`` (:func:`eval_loss`). The naive references
re-implement FedBuff (Nguyen et al. 2022, Algorithm 1) and deadline rounds as a plain
discrete-event simulation over the same speed model, with lists and a heap, nothing shared
with the code under test but the site durations.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients.protocol import fedagg_mod
from fedagg.asyncagg import SpeedModel, StalenessWeight
from fedagg.config import RunConfig, load_config
from server.asynchronous import run_async_server
from server.delayed import DelayedGrid
from strategies.wire import arrays_to_record, record_to_arrays

DECAY = 0.9
KEYS = ["weight", "bias"]


def examples(part: int) -> int:
    """Training examples of partition ``part``."""
    return 10 + 7 * part


def step(part: int, rnd: int, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """The fixed 'training' offset of site ``part`` in its round ``rnd``."""
    rng = np.random.default_rng([part, rnd, 99])
    return [(0.1 * rng.standard_normal(s)).astype(np.float32) for s in shapes]


def train(w: Sequence[np.ndarray], part: int, rnd: int) -> list[np.ndarray]:
    """What site ``part`` returns in round ``rnd`` from model ``w`` (float32)."""
    return [(np.float32(DECAY) * np.asarray(a, np.float32) + c).astype(np.float32)
            for a, c in zip(w, step(part, rnd, [np.shape(a) for a in w]), strict=True)]


def fake_app(bad: Callable[[int, int], str] | None = None,
             evaluated: list[tuple[int, int, list[np.ndarray]]] | None = None,
             eval_examples: Mapping[int, float] | None = None) -> ClientApp:
    """The deterministic ClientApp (``bad(part, round)`` may return 'nan', 'shape', 'raise',
    'bomb': a delta 1000x the honest one, 'weight': num-examples = 1e6); every evaluation is
    appended to ``evaluated`` as ``(part, server-round, model)``; ``eval_examples`` replaces
    the num-examples the given partitions report with their evaluations."""
    app = ClientApp(mods=[fedagg_mod])

    @app.train()
    def handle(msg: Message, ctx: Context) -> Message:
        keys, w = record_to_arrays(msg.content.array_records["arrays"])
        rnd = int(msg.content.config_records["config"]["server-round"])  # type: ignore[arg-type]
        part = int(ctx.node_config["partition-id"])  # type: ignore[arg-type]
        out = train(w, part, rnd)
        how = bad(part, rnd) if bad is not None else ""
        if how == "nan":
            out[0] = out[0] * np.float32("nan")
        elif how == "shape":
            out[0] = np.zeros((1, 1), np.float32)
        elif how == "raise":
            raise RuntimeError(f"site {part} failed in round {rnd} (injected)")
        elif how == "bomb":
            out = [(a + np.float32(1000) * (o - a)).astype(np.float32)
                   for a, o in zip(w, out, strict=True)]
        metrics: dict[str, Any] = {"num-examples": 1e6 if how == "weight" else examples(part),
                                   "partition-id": part, "server-round": rnd,
                                   "train_loss": float(part)}
        return Message(RecordDict({"arrays": arrays_to_record(out, keys),
                                   "metrics": MetricRecord(metrics)}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, ctx: Context) -> Message:
        _, w = record_to_arrays(msg.content.array_records["arrays"])
        part = int(ctx.node_config["partition-id"])  # type: ignore[arg-type]
        if evaluated is not None:
            rnd = int(msg.content.config_records["config"]["server-round"])  # type: ignore[arg-type]
            evaluated.append((part, rnd, w))
        n = (eval_examples or {}).get(part, examples(part))
        metrics = {"num-examples": n, "eval_loss": eval_loss(w, part), "partition-id": part}
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


def eval_loss(w: Sequence[np.ndarray], part: int) -> float:
    """What site ``part`` reports as ``eval_loss`` of model ``w`` (a fixed function of both)."""
    return float(sum(np.abs(np.asarray(a, np.float64)).sum() for a in w) + part)


def tiny_model() -> torch.nn.Module:
    """The model of these tests: 3 -> 2 (keys weight, bias)."""
    return torch.nn.Linear(3, 2)


def initial() -> list[np.ndarray]:
    """Its initial weights as the server builds them (torch seeded with run.seed = 0)."""
    torch.manual_seed(0)
    return [t.detach().numpy().copy() for t in tiny_model().state_dict().values()]


def config(n: int, *overrides: str) -> RunConfig:
    return load_config(None, [f"run.sites={n}", "run.checkpoint=false",
                              "run.round_timeout=10000", *overrides])


def run(cfg: RunConfig, speed: SpeedModel, *, app: ClientApp | None = None,
        drop: Sequence[int] = (), run_dir: Any = None, grid_cls: type[DelayedGrid] = DelayedGrid
        ) -> tuple[list[dict[str, Any]], list[list[np.ndarray]], DelayedGrid]:
    """Run the asynchronous loop on a DelayedGrid; records and the model of every record."""
    grid = grid_cls(app or fake_app(), cfg.run.sites, speed=speed, seed=3)
    grid.drop = {grid.node_ids[i] for i in drop}  # node ids are sorted: partition i = index i
    models: list[list[np.ndarray]] = []

    def capture(rec: ArrayRecord) -> tuple[float, float]:
        models.append(record_to_arrays(rec)[1])
        return 0.0, 0.0

    records = run_async_server(grid, cfg, run_dir, model_fn=tiny_model, evaluate_fn=capture)
    return records, models, grid


def naive_fedbuff(w0: list[np.ndarray], n: int, speed: SpeedModel, *, k: int, versions: int,
                  weight: StalenessWeight, max_staleness: int | None, lr: float = 1.0,
                  never: Sequence[int] = (), refuse: Container[tuple[int, int]] = (),
                  weights: Mapping[tuple[int, int], float] | None = None
                  ) -> tuple[list[list[np.ndarray]], list[tuple]]:
    """FedBuff with C = N and fair buffers, as a discrete-event simulation (sites in ``never``
    never reply).

    Fair buffers: a site whose reply arrived while a buffer is open (folded or refused) is sent
    the newest model only once that buffer is applied (one job, hence at most one update, per
    site per buffer); when every site that replies is waiting, the buffer is applied with what
    it holds. The updates of ``(site, round)`` in ``refuse`` are dropped on arrival (as after a
    staleness refusal); ``weights`` replaces the example weight of the given ``(site, round)``
    updates.

    Returns the model of every version and the event log ``(time, part, staleness, refused)``.
    """
    models = [[np.asarray(a, np.float32) for a in w0]]
    rounds = dict.fromkeys(range(n), 0)
    heap: list[tuple[float, int, int, int, int]] = []
    seq = 0

    def send(part: int, t: float) -> None:
        nonlocal seq
        rounds[part] += 1
        seq += 1
        if part not in never:
            heapq.heappush(heap, (t + speed.duration(part, rounds[part]), seq, part,
                                  len(models) - 1, rounds[part]))

    for part in range(n):
        send(part, 0.0)
    buffer: list[tuple[float, float, list[np.ndarray]]] = []
    waiting: list[int] = []
    log = []

    def take(t: float) -> None:
        nonlocal buffer
        norm = sum(e[1] for e in buffer)
        mean = []
        for j in range(len(w0)):
            acc = None
            for sc, ex, d in buffer:
                term = sc * ex * d[j]
                acc = term if acc is None else acc + term
            mean.append(acc / norm)
        cur = models[-1]
        models.append([(x + (lr * m if lr != 1.0 else m)).astype(np.float32)
                       for x, m in zip(cur, mean, strict=True)])
        buffer = []
        release(t)

    def release(t: float) -> None:
        for p in sorted(waiting):
            send(p, t)
        waiting.clear()

    replying = [p for p in range(n) if p not in never]
    while len(models) - 1 < versions and heap:
        t, _, part, v, rnd = heapq.heappop(heap)
        s = len(models) - 1 - v
        refused = (max_staleness is not None and s > max_staleness) or (part, rnd) in refuse
        log.append((t, part, s, refused))
        waiting.append(part)
        if not refused:
            sent = models[v]
            delta = [np.asarray(a, np.float64) - np.asarray(b, np.float64)
                     for a, b in zip(train(sent, part, rnd), sent, strict=True)]
            n_ex = (weights or {}).get((part, rnd), float(examples(part)))
            buffer.append((weight(s), n_ex, delta))
            if len(buffer) == k:
                take(t)
                continue
        if set(replying) <= set(waiting):
            if buffer:
                take(t)
            else:
                release(t)
    return models, log


def naive_deadline(w0: list[np.ndarray], n: int, speed: SpeedModel, *, deadline: float,
                   rounds: int, weight: StalenessWeight, max_staleness: int | None
                   ) -> tuple[list[list[np.ndarray]], list[int]]:
    """Deadline rounds: round r dispatches to every free site, closes at its deadline or when
    all its sites replied, and applies everything that arrived (late ones with w(s)).

    Returns the model after every round and the number of updates applied per round.
    """
    models = [[np.asarray(a, np.float32) for a in w0]]
    inflight: list[tuple[float, int, int, int]] = []  # (arrival, part, version, round)
    counts = []
    t = 0.0
    busy: set[int] = set()
    for r in range(1, rounds + 1):
        start = t
        for part in range(n):
            if part not in busy:
                busy.add(part)
                inflight.append((start + speed.duration(part, r), part, len(models) - 1, r))
        mine = [e for e in inflight if e[3] == r]
        close = min(start + deadline, max(e[0] for e in mine)) if mine else start + deadline
        arrived = sorted(e for e in inflight if e[0] <= close)
        inflight = [e for e in inflight if e[0] > close]
        buf = []
        for _, part, v, rnd in arrived:
            busy.discard(part)
            s = len(models) - 1 - v
            if max_staleness is not None and s > max_staleness:
                continue
            sent = models[v]
            delta = [np.asarray(a, np.float64) - np.asarray(b, np.float64)
                     for a, b in zip(train(sent, part, rnd), sent, strict=True)]
            buf.append((weight(s), float(examples(part)), delta))
        counts.append(len(buf))
        if buf:
            norm = sum(e[1] for e in buf)
            mean = []
            for j in range(len(w0)):
                acc = None
                for sc, ex, d in buf:
                    term = sc * ex * d[j]
                    acc = term if acc is None else acc + term
                mean.append(acc / norm)
            models.append([(x + m).astype(np.float32) for x, m in zip(models[-1], mean,
                                                                       strict=True)])
        else:
            models.append(models[-1])
        t = close
    return models, counts
