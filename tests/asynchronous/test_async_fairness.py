"""Fair FedBuff buffers against one site that answers 50x faster than the rest.

The attack, against the real asynchronous loop on a DelayedGrid (real ClientApp, real
serialisation, simulated site speeds): site 0 skips training and answers in 1/50 of the other
sites' time, so without fairness it takes most slots of most buffers, the versions race
ahead (the honest sites' updates are refused as too stale) and its stream of updates walks the
median-relative guards up (each update just under 10 x the median of a window it fills itself:
the committed model blows up). With fair buffers it gets one job, hence one slot, per buffer;
the guards judge it against the other sites' latest updates, one value per site.

Each run is deterministic (the seed and the arrival order); :func:`_run` keeps its outcome for
the tests of this module.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from _async_helpers import config, examples, fake_app, run, tiny_model, train
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients.protocol import fedagg_mod
from fedagg.aggregate import ServerOptimizer
from fedagg.asyncagg import AsyncServerState, GuardWindow, SpeedModel, StalenessWeight, UpdateBuffer
from fedagg.errors import UpdateRejected
from server.asynchronous import run_async_server
from server.delayed import DelayedGrid
from strategies.wire import arrays_to_record, record_to_arrays

N, K, VERSIONS, MAX_STALENESS = 16, 8, 60, 4
FAST = 0  # the attacker's partition
GROWTH = 1.15  # its ratchet: x1.15 per update, below 10 x the median of a window it fills
RATIO = 10.0  # strategy.max_weight_ratio and norm_outlier_factor (the defaults)


def _speed(fast: bool) -> SpeedModel:
    """Lognormal site speeds around 1; site 0 at 0.02 (50x faster) or 1."""
    return SpeedModel(seed=1, job_seconds=10.0, sigma=0.5, site_sigma=0.5,
                      factors=(0.02 if fast else 1.0,))


def hostile_app(kind: str) -> ClientApp:
    """The test's sites; partition 0 skips training and sends ``w + 0.1 g`` (all ones ``g``):

    * ``"ratchet"``: norm and weight x1.15 per job (the norm ratchet and the weight lie);
    * ``"weight"``: an honest-sized delta, its weight x1.15 per job (up to 1e300).
    """
    app = ClientApp(mods=[fedagg_mod])

    @app.train()
    def handle(msg: Message, ctx: Context) -> Message:
        keys, w = record_to_arrays(msg.content.array_records["arrays"])
        rnd = int(msg.content.config_records["config"]["server-round"])  # type: ignore[arg-type]
        part = int(ctx.node_config["partition-id"])  # type: ignore[arg-type]
        out, n = train(w, part, rnd), float(examples(part))
        if part == FAST:
            grow = min(GROWTH ** rnd, 1e30)
            push = grow if kind == "ratchet" else 1.0
            out = [(a + np.float32(0.1 * push)).astype(np.float32) for a in w]
            n = min(n * GROWTH ** rnd, 1e300)
        metrics: dict[str, Any] = {"num-examples": n, "partition-id": part, "server-round": rnd,
                                   "train_loss": 0.0}
        return Message(RecordDict({"arrays": arrays_to_record(out, keys),
                                   "metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


@dataclass(frozen=True)
class Outcome:
    records: list[dict[str, Any]]
    models: list[list[np.ndarray]]
    fast_node: str
    refusals: list[str]  # every "refused update" warning, in order

    def stale_refused(self, *, honest: bool = True) -> int:
        """Updates refused as too stale (of the honest sites, or of site 0)."""
        return sum(1 for m in self.refusals if ".staleness" in m
                   and (f"node {self.fast_node}." not in m) == honest)

    def max_abs(self) -> float:
        """The largest absolute weight of any committed model."""
        return max(float(np.abs(a).max()) for m in self.models for a in m)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("refused update:"):
            self.messages.append(record.getMessage())


@functools.cache
def _run(kind: str, fast: bool) -> Outcome:
    """One FedBuff run (``kind``: "honest", "ratchet", "weight"; ``fast``: site 0 50x faster)."""
    cfg = config(N, f"run.rounds={VERSIONS}", "asynchronous.mode='fedbuff'",
                 f"asynchronous.buffer_size={K}", f"asynchronous.max_staleness={MAX_STALENESS}")
    app = fake_app() if kind == "honest" else hostile_app(kind)
    grid = DelayedGrid(app, N, speed=_speed(fast), seed=3)
    models: list[list[np.ndarray]] = []

    def capture(rec: Any) -> tuple[float, float]:
        models.append(record_to_arrays(rec)[1])
        return 0.0, 0.0

    handler = _Collect()
    logger = logging.getLogger("server.asynchronous")
    logger.addHandler(handler)
    try:
        records = run_async_server(grid, cfg, None, model_fn=tiny_model, evaluate_fn=capture)
    finally:
        logger.removeHandler(handler)
    return Outcome(records, models, str(grid.node_ids[FAST]), handler.messages)


def _slots(out: Outcome) -> list[tuple[int, int]]:
    """(site 0's updates, updates) of every applied buffer."""
    return [(r["sites"].count(FAST), r["updates"]) for r in out.records[1:]]


def test_the_fast_site_takes_at_most_one_slot_per_buffer() -> None:
    for kind in ("ratchet", "weight"):
        out = _run(kind, True)
        assert len(out.records) == VERSIONS + 1
        slots = _slots(out)
        assert all(mine <= 1 and updates == K for mine, updates in slots), slots
        if kind == "weight":  # never refused: it lands in (nearly) every buffer, once
            assert sum(mine for mine, _ in slots) > VERSIONS * 3 // 4


def test_the_flood_adds_no_stale_refusals_of_honest_updates() -> None:
    """Honest updates refused as too stale: no more than with site 0 at the others' speed
    (its ratchet refused), and exactly as many as with an honest site as fast."""
    ratchet, without = _run("ratchet", True), _run("honest", False)
    assert without.stale_refused() > 0  # the bound matters in this run
    assert ratchet.stale_refused() <= without.stale_refused()
    # a fast site whose updates are accepted (the weight liar) is in every buffer, as an honest
    # site as fast would be: the flood of its other updates adds no staleness
    assert _run("weight", True).stale_refused() == _run("honest", True).stale_refused()


def test_the_norm_ratchet_is_refused_and_no_bad_model_is_committed() -> None:
    out, honest = _run("ratchet", True), _run("honest", False)
    assert all(r.get("model_updated") for r in out.records[1:])
    bombs = [m for m in out.refusals if f"node {out.fast_node}.delta_norm" in m]
    assert bombs and all("latest accepted updates of" in m and "other site(s)" in m
                         for m in bombs)
    assert out.max_abs() <= 2 * honest.max_abs()  # not 1e23: the window was not walked
    assert all(np.isfinite(a).all() for m in out.models for a in m)


def test_a_weight_ratchet_stays_capped_at_the_other_sites_median() -> None:
    out = _run("weight", True)
    caps = [r["weights_capped"][out.fast_node] for r in out.records[1:]
            if out.fast_node in r.get("weights_capped", {})]
    assert len(caps) >= VERSIONS // 4  # its later updates claim more than the cap
    honest_max = max(examples(p) for p in range(1, N))
    for note in caps:  # one note per buffer: it has one update in each
        m = re.search(r"capped to ([0-9.e+]+) \(strategy\.max_weight_ratio = 10 ", note)
        assert m, note
        assert float(m.group(1)) <= RATIO * honest_max  # never walked up by its own weights


# -- the rule itself ---------------------------------------------------------------------------------
def _state(k: int = 3) -> AsyncServerState:
    return AsyncServerState([np.zeros(3)], buffer=UpdateBuffer(k), staleness=StalenessWeight(),
                            max_staleness=None, optimizer=ServerOptimizer(),
                            guards=GuardWindow(4))


def test_a_second_update_of_a_site_in_the_open_buffer_is_refused() -> None:
    st = _state()
    st.fold([np.full(3, 0.1)], node=7, partition=0, job=1, version=0, weight=10.0)
    with pytest.raises(UpdateRejected, match=r"node 7\.update.*one update per site"):
        st.fold([np.full(3, 0.1)], node=7, partition=0, job=2, version=0, weight=10.0)
    assert st.in_buffer() == {7} and st.buffer.count == 1
    st.fold([np.full(3, 0.1)], node=8, partition=1, job=3, version=0, weight=10.0)
    st.waiting.update({7, 8, 9})
    st.fold([np.full(3, 0.1)], node=9, partition=2, job=4, version=0, weight=10.0)
    st.apply()
    assert not st.waiting and not st.in_buffer()  # a new buffer: every site may go again
    st.fold([np.full(3, 0.1)], node=7, partition=0, job=5, version=1, weight=10.0)


def test_waiting_sites_and_the_window_sites_round_trip_through_the_state_dict() -> None:
    st = _state()
    for i, node in enumerate((5, 6, 5, 7)):
        if node in st.in_buffer():
            st.apply()
        st.fold([np.full(3, 0.1 * (i + 1))], node=node, partition=node, job=i + 1,
                version=st.version, weight=10.0 + i)
        st.waiting.add(node)
    saved = st.state_dict()
    assert saved["waiting"] == sorted(st.waiting) and saved["guard_window"]["nodes"] == [6, 5, 7]
    other = _state()
    other.load_state_dict(saved)
    assert other.waiting == st.waiting and other.state_dict()["guard_window"] == \
        saved["guard_window"]
    old = {k: v for k, v in saved.items() if k != "waiting"}
    old["guard_window"] = {k: v for k, v in saved["guard_window"].items() if k != "nodes"}
    legacy = _state()
    legacy.load_state_dict(old)  # a checkpoint from before fair buffers
    assert not legacy.waiting and legacy.guards is not None and legacy.guards.nodes == [-1] * 3


# -- liveness: a buffer fewer than K sites can fill ------------------------------------------------------
@pytest.mark.parametrize("k, bad", [(4, 2), (6, None)], ids=["a-site-always-fails", "k-above-n"])
def test_a_buffer_fewer_than_k_sites_can_fill_is_applied_once_every_site_replied(
        k: int, bad: int | None) -> None:
    n, versions = 4, 5
    app = fake_app(bad=(lambda part, rnd: "raise" if part == bad else ""))
    cfg = config(n, f"run.rounds={versions}", "asynchronous.mode='fedbuff'",
                 f"asynchronous.buffer_size={k}")
    recs, _, _ = run(cfg, SpeedModel(seed=2, job_seconds=10.0, sigma=0.5), app=app)
    assert len(recs) == versions + 1 and all(r["model_updated"] for r in recs[1:])
    for r in recs[1:]:
        assert r["updates"] == (n - 1 if bad is not None else n)
        assert sorted(r["sites"]) == sorted(set(r["sites"]))
        assert "every connected site has replied since it opened" in r["summary"]
