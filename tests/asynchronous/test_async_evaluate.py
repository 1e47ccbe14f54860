"""Federated evaluation inside the asynchronous loop (server/async_evaluate.py).

On a DelayedGrid with a virtual clock, the deterministic ClientApp of ``_async_helpers``
reports ``eval_loss = sum |w| + site`` for the model it was sent, so the oracle of every
recorded ``federated_eval`` is the example-weighted mean over the sites that evaluated that
version. Evaluation must not change the training trajectory: the versions, times and bytes of
a run with it equal those of the same run without it when evaluations are answered at once
(and no site is ever sent a train job while it evaluates).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _async_helpers import KEYS, config, eval_loss, examples, fake_app, run, tiny_model
from flwr.app import Message, Metadata, RecordDict

from fedagg.aggregate import ServerOptimizer
from fedagg.asyncagg import AsyncServerState, SpeedModel, StalenessWeight, UpdateBuffer
from server.async_evaluate import idle_sample, route_reply
from server.asynchronous import run_async_server
from server.checkpoint import load_checkpoint
from server.delayed import DelayedGrid
from server.runner import model_digest
from strategies.wire import arrays_to_record

N = 5
SPEED = SpeedModel(seed=1, job_seconds=10.0, sigma=0.8, site_sigma=0.5)
TRAINING = ("round", "version", "model_digest", "model_updated", "time", "bytes_up",
            "bytes_down", "sites_sampled", "sites_replied", "updates", "staleness", "sites",
            "in_flight", "train_loss")


def _cfg(*extra: str):  # type: ignore[no-untyped-def]
    return config(N, "run.rounds=5", "asynchronous.mode='fedbuff'",
                  "asynchronous.buffer_size=2", "asynchronous.concurrency=3", *extra)


def _training(recs: list[dict]) -> list[tuple]:
    return [tuple(r.get(k) for k in TRAINING) for r in recs]


# -- routing by message type -----------------------------------------------------------------------
def _reply(reply_to: str, message_type: str, *, error: bool = False) -> Message:
    md = Metadata(run_id=1, message_id=uuid.uuid4().hex, src_node_id=7, dst_node_id=0,
                  reply_to_message_id=reply_to, group_id="1", created_at=time.time(),
                  ttl=3600.0, message_type=message_type)
    if error:
        from flwr.app import Error

        return Message(error=Error(code=2, reason="failed"), metadata=md)
    return Message(content=RecordDict(), metadata=md)


@pytest.mark.parametrize("reply_to, mtype, error, want", [
    ("t1", "train", False, "train"),
    ("t1", "train", True, "train"),  # an error reply to a train message is the job's failure
    ("e1", "evaluate", False, "evaluate"),
    ("e1", "evaluate", True, "evaluate"),
    ("t1", "evaluate", False, "mismatch"),  # never an update
    ("e1", "train", False, "mismatch"),  # never evaluation metrics
    ("t1", "query.warmup", False, "mismatch"),
    ("x9", "train", False, ""),  # not in flight (handled, expired or foreign)
])
def test_replies_are_routed_by_message_type(reply_to: str, mtype: str, error: bool,
                                            want: str) -> None:
    assert route_reply(_reply(reply_to, mtype, error=error), {"t1": 0}, {"e1": 0}) == want


# -- sampling of idle sites ----------------------------------------------------------------------
def _state(seed: int = 0) -> AsyncServerState:
    return AsyncServerState([np.zeros(2)], buffer=UpdateBuffer(2), staleness=StalenessWeight(),
                            max_staleness=None, optimizer=ServerOptimizer(), seed=seed)


def test_idle_sample_takes_a_seeded_choice_among_idle_sites_only() -> None:
    nodes, busy = list(range(10, 20)), {10, 11, 12, 13}
    st = _state()
    got, wanted = idle_sample(nodes, busy, 0.3, st.choose, "evaluate-4")
    assert wanted == 3 and len(got) == 3 and not set(got) & busy and set(got) <= set(nodes)
    assert idle_sample(nodes, busy, 0.3, st.choose, "evaluate-4")[0] == got  # deterministic
    picks = {tuple(idle_sample(nodes, busy, 0.3, _state(seed).choose, "evaluate-4")[0])
             for seed in range(20)}
    assert len(picks) > 1  # seeded, not always the first idle ones
    # fewer idle than wanted: all idle ones
    assert idle_sample(nodes, set(range(10, 18)), 1.0, st.choose, "t") == ([18, 19], 10)
    assert idle_sample(nodes, set(nodes), 1.0, st.choose, "t") == ([], 10)
    assert idle_sample(nodes, set(), 0.0, st.choose, "t") == ([], 0)
    assert idle_sample(nodes, set(), 0.01, st.choose, "t")[1] == 1  # at least one, as FedAvg


# -- the loop ------------------------------------------------------------------------------------------
class _WatchGrid(DelayedGrid):
    """A DelayedGrid that fails the run if a node is sent a message of one kind (train /
    evaluate) while one of the other kind is in flight to it, and counts the evaluations
    sent: Flower's simulation engine would run both and keep the later Context."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.kinds: dict[str, tuple[int, str]] = {}
        self.evaluations = 0

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        ids = list(super().push_messages(messages))
        for m, mid in zip(messages, ids, strict=True):
            node, kind = m.metadata.dst_node_id, str(m.metadata.message_type).split(".")[0]
            other = {k for n, k in self.kinds.values() if n == node} - {kind}
            assert not other, f"node {node}: {kind} sent while {other} is in flight"
            self.kinds[mid] = (node, kind)
            self.evaluations += kind == "evaluate"
        return ids

    def pull_due(self, message_ids: Iterable[str]) -> Iterable[Message]:
        out = list(super().pull_due(message_ids))
        for r in out:
            self.kinds.pop(r.metadata.reply_to_message_id, None)
        return out


@pytest.mark.parametrize("extra", [
    ("run.fraction_evaluate=0.6",),
    ("asynchronous.concurrency=4", "run.fraction_evaluate=1.0"),
    ("run.rounds=4", "asynchronous.mode='deadline'", "asynchronous.deadline=12",
     "run.fraction_train=0.6", "run.fraction_evaluate=1.0"),
])
def test_no_site_is_sent_a_train_job_while_it_evaluates(extra: tuple[str, ...]) -> None:
    """With evaluate replies that take as long as a train job, a site evaluating is not
    dispatched (the fill waits for its reply); the run completes and evaluates."""
    slow = SpeedModel(seed=1, job_seconds=10.0, sigma=0.8, site_sigma=0.5, latency=4.0)
    recs, _, grid = run(_cfg(*extra), slow, grid_cls=_WatchGrid)
    assert isinstance(grid, _WatchGrid) and grid.evaluations >= 2
    assert len(recs) - 1 == 4 if "deadline" in " ".join(extra) else len(recs) - 1 == 5
    assert sum(1 for r in recs if r.get("federated_eval")) >= 2


def test_evaluation_is_recorded_and_does_not_change_the_versions(
        caplog: pytest.LogCaptureFixture) -> None:
    base, _, _ = run(_cfg(), SPEED)
    evaluated: list[tuple[int, int, list[np.ndarray]]] = []
    with caplog.at_level(logging.INFO, logger="server.asynchronous"):
        recs, _, _ = run(_cfg("run.fraction_evaluate=1.0", "run.evaluate_every=2"), SPEED,
                         app=fake_app(evaluated=evaluated), grid_cls=_WatchGrid)
    assert _training(recs) == _training(base)
    assert [r["round"] for r in recs if "federated_eval" in r] == [2, 4, 5]  # and the last
    assert not any("federated_eval" in r for r in base)
    for r in recs:
        if "federated_eval" not in r:
            continue
        mine = [(p, w) for p, v, w in evaluated if v == r["version"]]
        assert r["federated_eval_sites"] == len(mine) >= 1
        for _, w in mine:  # every site evaluated the version the record is about
            assert model_digest(arrays_to_record(w, KEYS)) == r["model_digest"]
        want = sum(examples(p) * eval_loss(w, p) for p, w in mine) / sum(
            examples(p) for p, _ in mine)
        assert r["federated_eval"]["eval_loss"] == pytest.approx(want, rel=1e-12)
    assert len(evaluated) < 3 * N  # C = 3 of 5 train: never all 5 idle at once
    assert "idle site(s) of the 5 wanted" in caplog.text


def test_no_federated_evaluation_with_fraction_zero() -> None:
    evaluated: list[Any] = []
    recs, _, _ = run(_cfg(), SPEED, app=fake_app(evaluated=evaluated))
    assert not evaluated and not any("federated_eval" in r for r in recs)


def test_deadline_rounds_and_secure_fedbuff_evaluate_without_changing_versions() -> None:
    deadline = ("run.rounds=4", "asynchronous.mode='deadline'", "asynchronous.deadline=12",
                "run.fraction_train=0.6")
    base, _, _ = run(config(N, *deadline), SPEED)
    recs, _, _ = run(config(N, *deadline, "run.fraction_evaluate=1.0"), SPEED)
    assert _training(recs) == _training(base)
    assert sum(1 for r in recs if r.get("federated_eval")) >= 3
    secure = ("run.rounds=3", "strategy.name='secure'", "asynchronous.mode='fedbuff'",
              "secagg.weight_scale=100", "asynchronous.buffer_size=3", "asynchronous.concurrency=3")
    speed = SpeedModel(seed=8, job_seconds=10.0, sigma=0.7, latency=0.2)
    base, m0, _ = run(config(6, *secure), speed)
    recs, m1, _ = run(config(6, *secure, "run.fraction_evaluate=0.5"), speed)
    # the masks are fresh randomness: the same versions up to the fixed-point error bound
    assert [t[:1] + t[3:] for t in _training(recs)] == [t[:1] + t[3:] for t in _training(base)]
    bound = max(r["secagg_error_bound"] for r in recs[1:]) * 2 * len(recs)
    assert all(np.allclose(a, b, rtol=0, atol=bound) for x, y in zip(m0, m1, strict=True)
               for a, b in zip(x, y, strict=True))
    assert all(r.get("federated_eval_sites") == 3 for r in recs[1:])  # the 3 idle of 6


class _FlipGrid(DelayedGrid):
    """A transport that turns the first train reply into an 'evaluate' one."""

    flipped = False

    def pull_due(self, message_ids: Iterable[str]) -> Iterable[Message]:
        out = list(super().pull_due(message_ids))
        for r in out:
            if not self.flipped and r.metadata.message_type == "train":
                r.metadata.message_type = "evaluate"
                self.flipped = True
        return out


def test_a_reply_of_the_wrong_type_is_never_an_update() -> None:
    grid = _FlipGrid(fake_app(), N, speed=SPEED, seed=3)
    recs = run_async_server(grid, _cfg(), None, model_fn=tiny_model,
                            evaluate_fn=lambda rec: (0.0, 0.0))
    assert grid.flipped
    rejected = {k: v for r in recs for k, v in r.get("rejected", {}).items()}
    assert len(rejected) == 1
    [why] = rejected.values()
    assert "reply of type 'evaluate' to a train message" in why
    assert sum(r["updates"] for r in recs[1:]) == 2 * 5 and recs[-1]["version"] == 5


class _SilentEvalGrid(DelayedGrid):
    """A transport on which no evaluate message is ever answered."""

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        msgs = list(messages)
        ids = list(super().push_messages(msgs))
        for m, mid in zip(msgs, ids, strict=True):
            if m.metadata.message_type == "evaluate":
                self._pending.pop(mid, None)
        return ids


def test_evaluations_in_flight_at_the_end_are_waited_for_then_dropped(
        caplog: pytest.LogCaptureFixture) -> None:
    """Evaluations that never reply: their sites get train jobs again only after the
    evaluation's run.round_timeout (a site never has both in flight), the run completes."""
    cfg = _cfg("run.fraction_evaluate=1.0", "run.round_timeout=30")
    base, _, _ = run(_cfg("run.round_timeout=30"), SPEED)
    grid = _SilentEvalGrid(fake_app(), N, speed=SPEED, seed=3)
    with caplog.at_level(logging.WARNING, logger="server.asynchronous"):
        recs = run_async_server(grid, cfg, None, model_fn=tiny_model,
                                evaluate_fn=lambda rec: (0.0, 0.0))
    assert len(recs) == len(base) and all(r["model_updated"] for r in recs[1:])
    assert recs[-1]["time"] > base[-1]["time"]  # the held sites waited for the timeouts
    assert not any("federated_eval" in r for r in recs)
    sent = [r for r in recs if "federated_eval_sites" in r]
    assert sent and all(r["federated_eval_sites"] == 0 for r in sent)
    assert "dropped at the end of the run" in caplog.text
    # waited until the newest evaluation's run.round_timeout, not longer
    assert grid.clock.now() == pytest.approx(max(r["time"] for r in sent) + 30)


def test_an_open_evaluation_is_sent_again_after_a_resume(tmp_path: Path) -> None:
    extra = ("run.fraction_evaluate=1.0", "run.checkpoint=true")
    want, _, _ = run(_cfg(*extra), SPEED)
    run(config(N, "run.rounds=3", "asynchronous.mode='fedbuff'", "asynchronous.buffer_size=2",
               "asynchronous.concurrency=3", *extra), SPEED, run_dir=tmp_path)
    state = (load_checkpoint(tmp_path).strategy_state or {})["asynchronous"]
    [open_eval] = state["evaluations"]  # written before the evaluation of version 3 replied
    assert open_eval["round"] == open_eval["version"] == state["version"] == 3
    recs, _, _ = run(_cfg(*extra, f"run.resume='{tmp_path}'"), SPEED, run_dir=tmp_path)
    assert _training(recs) == _training(want)
    assert [r.get("federated_eval") for r in recs] == [r.get("federated_eval") for r in want]
    assert recs[3].get("federated_eval")


@pytest.mark.parametrize("extra, replies", [(("asynchronous.concurrency=2",), 4),
                                            (("asynchronous.concurrency=5",), 2)],
                         ids=["4-replies", "2-replies"])
def test_an_evaluation_weight_of_1e300_is_capped_as_training_weights_are(
        extra: tuple[str, ...], replies: int) -> None:
    """Site 1 claims 1e300 examples with each evaluation: without a cap the example-weighted
    mean is its own eval_loss. Its weight is capped at max_weight_ratio x the median (of the
    evaluation's weights; with fewer than three replies, of them and the training weights of
    the guard window), named in federated_eval_capped, and the recorded mean is the weighted
    mean with the capped weight."""
    liar, ratio = 1, 10.0
    evaluated: list[tuple[int, int, list[np.ndarray]]] = []
    recs, _, grid = run(_cfg("run.fraction_evaluate=1.0", *extra), SPEED,
                        app=fake_app(evaluated=evaluated, eval_examples={liar: 1e300}))
    node = str(grid.node_ids[liar])
    lied = [r for r in recs if any(p == liar and v == r["version"] for p, v, _ in evaluated)
            and "federated_eval" in r]
    assert lied, "the liar should have evaluated some version"
    for r in lied:
        mine = [(p, w) for p, v, w in evaluated if v == r["version"]]
        assert len(mine) == replies  # C = 2: 4 sites idle; C = 5: the buffer's 2
        assert node in r.get("federated_eval_capped", {}), r
        note = r["federated_eval_capped"][node]
        cap = float(note.split(" capped to ")[1].split(" ")[0])
        honest = [examples(p) for p, _ in mine if p != liar]
        reference = honest if len(mine) >= 3 else [*honest, *(examples(p) for p in range(N))]
        assert cap <= ratio * max(reference)  # never the liar's 1e300
        weights = [cap if p == liar else examples(p) for p, _ in mine]
        want = sum(n * eval_loss(w, p) for n, (p, w) in zip(weights, mine, strict=True)) / sum(
            weights)
        assert r["federated_eval"]["eval_loss"] == pytest.approx(want, rel=1e-9)
        assert r["federated_eval"]["eval_loss"] != pytest.approx(
            eval_loss(next(w for p, w in mine if p == liar), liar), rel=1e-6)
