"""Evaluation and metrics are inputs too: each attack against the real round loop.

Every test runs :func:`server.runner.run_server` over :class:`server.inprocess.InProcessGrid`
with a real ClientApp wrapped in :func:`clients.fedagg_mod` (every message and reply through
Flower's serialisation); one site lies, the others are honest, and the outcome is read from
the run's metrics.json records:

* an evaluate reply claiming 1e300 examples is capped like a training weight (also with only
  two evaluating sites, against the last training round's weights) and named in
  ``federated_eval_capped``; ``federated_eval`` is the capped mean, not the liar's value;
* a site reporting 100 metric keys of its own (and a 500-character key, a 5000-element list)
  lands at most ``strategy.max_metric_keys`` of them in metrics.json, the others named in
  ``metrics_dropped``; its update still counts;
* a site claiming another site's partition id is credited by its node id: ``site_metrics`` is
  keyed by node id, and the label both nodes claim is withheld from both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients import fedagg_mod
from fedagg.config import load_config
from server.inprocess import InProcessGrid, nodes_by_partition
from server.runner import run_server
from strategies.wire import arrays_to_record, record_to_arrays

HONEST_ACC, LIAR_ACC = 0.9, 0.0
EVAL_EXAMPLES = 50.0


def _app(*, liar: int = -1, eval_weight: float = EVAL_EXAMPLES, extra_keys: int = 0,
         claim: int | None = None) -> ClientApp:
    """Instant training (the global model plus seeded noise, ``20 + pid`` examples) and a
    fixed evaluation; site ``liar`` reports ``eval_weight`` evaluation examples with accuracy
    0, ``extra_keys`` metric keys of its own and, with ``claim``, that partition id."""
    app = ClientApp(mods=[fedagg_mod])

    def own(pid: int) -> dict[str, Any]:
        if pid != liar or not extra_keys:
            return {}
        out: dict[str, Any] = {f"own_{i:03d}": float(i) for i in range(extra_keys)}
        out["k" * 500] = 1.0
        out["a_long_list"] = [0.5] * 5000
        return out

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        keys, arrays = record_to_arrays(msg.content["arrays"])
        pid = int(ctx.node_config["partition-id"])
        rnd = int(msg.content["config"].get("server-round", 0))
        rng = np.random.default_rng([pid, rnd])
        out = [a + np.float32(0.01) * rng.standard_normal(a.shape).astype(a.dtype)
               for a in arrays]
        label = claim if pid == liar and claim is not None else pid
        metrics = {"num-examples": 20 + pid, "train_loss": 0.5 + 0.01 * pid,
                   "partition-id": label, "server-round": rnd, **own(pid)}
        return Message(RecordDict({"arrays": arrays_to_record(out, keys),
                                   "metrics": MetricRecord(metrics)}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, ctx: Context) -> Message:
        pid = int(ctx.node_config["partition-id"])
        lies = pid == liar
        metrics = {"num-examples": eval_weight if lies else EVAL_EXAMPLES,
                   "eval_acc": LIAR_ACC if lies else HONEST_ACC, "partition-id": pid,
                   **own(pid)}
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


def _run(tmp: Path, app: ClientApp, sites: int, *extra: str, rounds: int = 2
         ) -> tuple[list[dict[str, Any]], InProcessGrid]:
    cfg = load_config(None, [f"run.sites={sites}", f"run.rounds={rounds}", "run.checkpoint=false",
                             "run.wait_for_sites=0", "run.fraction_evaluate=1.0", *extra])
    grid = InProcessGrid(app, sites, seed=1)
    run_server(grid, cfg, tmp, model_fn=lambda: torch.nn.Linear(4, 3),
               evaluate_fn=lambda a: (0.0, 0.0))
    records: list[dict[str, Any]] = json.loads((tmp / "metrics.json").read_text())
    return records, grid


def test_an_evaluation_weight_of_1e300_is_capped_like_a_training_weight(tmp_path: Path) -> None:
    records, grid = _run(tmp_path, _app(liar=2, eval_weight=1e300), 5)
    liar = str(nodes_by_partition(grid)[2])
    ratio = 10.0  # strategy.max_weight_ratio, the run config's default
    cap = ratio * EVAL_EXAMPLES  # the median of the five evaluation weights is an honest one
    want = 4 * EVAL_EXAMPLES * HONEST_ACC / (4 * EVAL_EXAMPLES + cap)
    for rec in records[1:]:
        assert rec["federated_eval"]["eval_acc"] == _approx(want)  # not the liar's 0.0
        assert list(rec["federated_eval_capped"]) == [liar]
        assert "capped to 500" in rec["federated_eval_capped"][liar]
        assert "strategy.max_weight_ratio" in rec["federated_eval_capped"][liar]
        assert rec["model_updated"] is True


def test_with_two_evaluating_sites_the_cap_uses_the_training_weights(tmp_path: Path) -> None:
    """Two evaluation replies have no median of their own: the cap's median is taken with the
    last training round's weights (20 and 21 examples), so the liar is capped at 10 x 35.5
    instead of carrying the mean (before: eval_acc 4.5e-299, the liar's value)."""
    records, grid = _run(tmp_path, _app(liar=1, eval_weight=1e300), 2)
    liar = str(nodes_by_partition(grid)[1])
    cap = 10.0 * float(np.median([20, 21, EVAL_EXAMPLES, 1e300]))
    want = EVAL_EXAMPLES * HONEST_ACC / (EVAL_EXAMPLES + cap)
    for rec in records[1:]:
        assert rec["federated_eval"]["eval_acc"] == _approx(want)
        assert rec["federated_eval"]["eval_acc"] > 0.1  # the liar pulls at most r / (r + 1)
        assert "last training round" in rec["federated_eval_capped"][liar]


@pytest.mark.parametrize("up", ["none", "topk:0.5+ef"], ids=["plain", "compressed"])
def test_a_site_reporting_100_metric_keys_lands_at_most_the_bound(tmp_path: Path,
                                                                  up: str) -> None:
    records, grid = _run(tmp_path, _app(liar=1, extra_keys=100), 5, f"compression.up={up}")
    nodes = nodes_by_partition(grid)
    liar = str(nodes[1])
    for rec in records[1:]:
        assert rec["model_updated"] is True and 1 in rec["sites"]  # its update still counts
        mine = rec["site_metrics"][liar]
        assert len(mine) <= 64 and mine["num-examples"] == 21 and mine["partition-id"] == 1
        assert "k" * 500 not in mine and "a_long_list" not in mine
        sent = sorted(["num-examples", "train_loss", "partition-id", "server-round",
                       *(f"own_{i:03d}" for i in range(100))])
        others = [k for k in sent if k not in ("num-examples", "partition-id", "server-round")]
        assert set(mine) == {"num-examples", "partition-id", "server-round", *others[:61]}
        note = rec["metrics_dropped"][liar]
        rules = ["strategy.max_metric_keys = 64", "strategy.max_metric_key_length = 64",
                 "the reply still counts"]
        if up == "none":  # fedagg_mod's compressed replies carry scalar metrics only
            rules.append("strategy.max_metric_list_length = 1024")
        for rule in rules:
            assert rule in note, note
        assert set(rec["metrics_dropped"]) == {liar}  # the honest sites keep all they sent
        for node in nodes:
            if str(node) != liar:
                assert not any(k.startswith("own_") for k in rec["site_metrics"][str(node)])
        # its evaluation reply is bounded alike, and so is the round's mean
        assert liar in rec["federated_eval_metrics_dropped"]
        assert len(rec["federated_eval"]) <= 64 and "eval_acc" in rec["federated_eval"]


def test_a_site_claiming_another_partition_id_is_credited_by_its_node(tmp_path: Path) -> None:
    """Site 1 says it is partition 3. Before: site_metrics["3"] held one of the two sites'
    records (the other lost) and ``sites`` listed 3 twice. Now every record is keyed by the
    node id the transport authenticated, and the label both claim is withheld from both."""
    records, grid = _run(tmp_path, _app(liar=1, claim=3), 5)
    nodes = nodes_by_partition(grid)
    liar, honest3 = str(nodes[1]), str(nodes[3])
    for rec in records[1:]:
        per = rec["site_metrics"]
        assert set(per) == {str(n) for n in nodes}  # five records, one per node
        assert per[liar]["num-examples"] == 21 and per[honest3]["num-examples"] == 23
        assert "partition-id" not in per[liar] and "partition-id" not in per[honest3]
        assert sorted(rec["sites"]) == [-1, -1, 0, 2, 4]  # nobody is credited as partition 3
        for node in (liar, honest3):
            assert "partition-id 3 withheld" in rec["metrics_dropped"][node]
        assert rec["model_updated"] is True and rec["sites_rejected"] == 0


def _approx(value: float) -> Any:
    return pytest.approx(value, rel=1e-9)
