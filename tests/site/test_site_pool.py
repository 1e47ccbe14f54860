"""Persistent site workers: a site's pool lives for the whole run and gives the same updates.

The ClientApp names its site by Flower run id and node id (``owner``); with ``site.persistent``
(the default) the site's pool is kept in this process's registry. Checked here, with real
threads and real gloo processes on 127.0.0.1:

* 3 consecutive rounds on a persistent pool equal 3 rounds on fresh workers and 3 rounds of
  one worker with the same global batch (within 1e-5 relative), in both modes;
* from round 2 on no worker is started (``workers_started``; in process mode the same PIDs),
  the data is built once, the reducer's layout is kept (no rebuild, no probe);
* ``site.keep_optimizer``: K workers equal one worker round after round, and differ from the
  fresh-optimizer default (the documented, deliberate difference);
* two sites served by one process get separate pools; a changed site shape gets a new pool;
* shutdown: closing, the idle timeout, a killed controller and dead workers leave no process
  behind (checked by PID) and a dead pool is restarted at the next round.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from _site_helpers import (
    alive,
    delta_rel_diff,
    initial_weights,
    new_owner,
    run,
    settings,
    train_single,
    wait_gone,
)
from _site_tasks import DATA_CALLS, CountingData

from clients.pools import PoolKey, close_pools, live_pools, task_identity
from fedagg.builtin import builtin_task
from fedagg.task import Task

TOL = 1e-5


def _rounds(site: dict[str, object], rounds: int = 3, *, owner: tuple[int, int] | None,
            train: dict[str, object] | None = None, task: Task | None = None):  # type: ignore[no-untyped-def]
    """``rounds`` chained rounds (each starts from the previous round's update)."""
    w = initial_weights(settings())
    outs = []
    for rnd in range(1, rounds + 1):
        s = settings(server_round=rnd, site=site, train=train or {})
        res = run(s, w, owner=owner, task=task)
        outs.append((w, res))
        w = res.weights
    return outs


def _single(rounds: int = 3, train: dict[str, object] | None = None):  # type: ignore[no-untyped-def]
    w = initial_weights(settings())
    outs = []
    for rnd in range(1, rounds + 1):
        res = train_single(settings(server_round=rnd, train=train or {}), w)
        outs.append((w, res))
        w = res.weights
    return outs


def _pool(owner: tuple[int, int], s_task: Task):  # type: ignore[no-untyped-def]
    return live_pools()[PoolKey(*owner, task_identity(s_task)[0])]


def test_inprocess_pool_three_rounds_equal_fresh_and_single_worker() -> None:
    owner = new_owner()
    site = {"workers": 3, "mode": "inprocess", "bucket_mb": 0.02}
    counting = builtin_task(settings().cfg)
    counting = Task(model=counting.model, data=CountingData(counting.data))  # type: ignore[arg-type]
    DATA_CALLS.clear()
    kept = []
    w = initial_weights(settings())
    reducers = []
    for rnd in (1, 2, 3):
        res = run(settings(server_round=rnd, site=site), w, owner=owner, task=counting)
        pool = _pool(owner, counting)
        reducers.append([st._reducer for st in pool.states])  # type: ignore[attr-defined]
        kept.append((w, res))
        w = res.weights
    assert pool.layout is not None and pool.layout["rebuilt"] and pool.layout["world"] == 3
    assert reducers[0] == reducers[1] == reducers[2], "the reducers must be kept"
    fresh = _rounds({**site, "persistent": False}, owner=owner)
    single = _single()
    for (w0, k), (_, f), (_, one) in zip(kept, fresh, single, strict=True):
        assert delta_rel_diff(k.weights, one.weights, w0) < TOL
        assert delta_rel_diff(k.weights, f.weights, w0) < TOL
        assert delta_rel_diff(w0, one.weights, w0) == pytest.approx(1.0)  # a real update
    assert [r.metrics["workers_started"] for _, r in kept] == [3, 0, 0]
    assert [r.metrics["workers_started"] for _, r in fresh] == [3, 3, 3]
    assert DATA_CALLS == [0], "the site's data must be built once per pool, not per round"
    m1, m2 = kept[0][1].metrics, kept[1][1].metrics
    assert "probe_seconds" in m1 and "probe_seconds" not in m2  # auto decided once
    assert m1["auto_native"] == m2["auto_native"]
    assert close_pools(owner[0]) == 1


def test_metrics_say_what_ran() -> None:
    owner = new_owner()
    (_, res), = _rounds({"workers": 2, "mode": "inprocess", "algorithm": "ring",
                         "bucket_mb": 0.02}, 1, owner=owner)
    m = res.metrics
    assert m["algorithm_ring"] == 1.0 and "algorithm_native" not in m
    assert m["workers"] == m["workers_configured"] == 2 and m["workers_lost"] == 0
    assert m["round_attempts"] == 1
    for key in ("comm_wait_seconds", "comm_seconds", "hidden_buckets", "copied_params",
                "bytes_allreduced", "startup_seconds", "overhead_seconds", "train_seconds"):
        assert key in m and np.isfinite(m[key]), key
    assert m["copied_params"] == 0  # gradients are bucket views
    assert 0 <= m["hidden_buckets"] <= m["buckets"] * m["steps"]
    assert m["overhead_seconds"] == pytest.approx(m["site_seconds"] - m["train_seconds"])
    close_pools(owner[0])


def test_keep_optimizer_k_workers_equal_one_and_differ_from_fresh() -> None:
    train = {"momentum": 0.9}
    keep = {"keep_optimizer": True}
    owner1, owner2 = new_owner(), new_owner()
    one = _rounds({"workers": 1, **keep}, owner=owner1, train=train)
    two = _rounds({"workers": 2, "mode": "inprocess", **keep}, owner=owner2, train=train)
    fresh = _single(train=train)
    for (w0, a), (_, b) in zip(one, two, strict=True):
        assert delta_rel_diff(b.weights, a.weights, w0) < TOL
    assert [r.metrics["optimizer_rounds"] for _, r in two] == [0, 1, 2]
    assert [r.metrics["optimizer_rounds"] for _, r in fresh] == [0, 0, 0]
    # round 1 starts fresh in both; from round 2 the kept momentum makes a different update
    assert delta_rel_diff(one[0][1].weights, fresh[0][1].weights, one[0][0]) < TOL
    w2 = one[1][0]
    ref2 = train_single(settings(server_round=2, train=train), w2)
    assert delta_rel_diff(one[1][1].weights, ref2.weights, w2) > 1e-3
    close_pools(owner1[0])
    close_pools(owner2[0])


def test_two_sites_in_one_process_get_separate_pools() -> None:
    run_id = new_owner()[0]
    w = initial_weights(settings())
    site = {"workers": 2, "mode": "inprocess"}
    a = run(settings(partition=0, site=site), w, owner=(run_id, 1))
    b = run(settings(partition=1, site=site), w, owner=(run_id, 2))
    pools = [k for k in live_pools() if k.run_id == run_id]
    assert sorted(k.node_id for k in pools) == [1, 2]
    assert delta_rel_diff(a.weights, b.weights, w) > 1e-2  # each trained its own partition
    a2 = run(settings(partition=0, server_round=2, site=site), w, owner=(run_id, 1))
    assert a2.metrics["workers_started"] == 0
    assert delta_rel_diff(a2.weights, train_single(settings(partition=0, server_round=2), w)
                          .weights, w) < TOL
    assert close_pools(run_id) == 2


def test_a_changed_site_shape_gets_a_new_pool() -> None:
    owner = new_owner()
    w = initial_weights(settings())
    run(settings(site={"workers": 2, "mode": "inprocess"}), w, owner=owner)
    again = run(settings(server_round=2, site={"workers": 3, "mode": "inprocess"}), w,
                owner=owner)
    assert again.metrics["workers_started"] == 3 and again.metrics["workers"] == 3
    assert close_pools(owner[0]) == 1


@pytest.mark.slow
@pytest.mark.gloo
def test_process_pool_keeps_its_processes_and_equals_one_worker() -> None:
    owner = new_owner()
    task = builtin_task(settings().cfg)
    site = {"workers": 2, "mode": "process", "bucket_mb": 0.02}
    w = initial_weights(settings())
    pids = []
    for rnd in (1, 2, 3):
        res = run(settings(server_round=rnd, site=site), w, owner=owner)
        one = train_single(settings(server_round=rnd), w)
        assert delta_rel_diff(res.weights, one.weights, w) < TOL
        assert res.metrics["workers_started"] == (2 if rnd == 1 else 0)
        pids.append(_pool(owner, task).pids())
        w = res.weights
    assert pids[0] == pids[1] == pids[2] and len(set(pids[0])) == 2
    assert all(alive(p) for p in pids[0])
    assert close_pools(owner[0]) == 1
    assert wait_gone(pids[0]) == [], "worker processes left after close"


@pytest.mark.slow
@pytest.mark.gloo
def test_dead_pool_is_restarted_and_idle_pool_closed() -> None:
    owner = new_owner()
    task = builtin_task(settings().cfg)
    site = {"workers": 2, "mode": "process", "pool_idle_timeout": 3.0}
    w = initial_weights(settings())
    run(settings(site=site), w, owner=owner)
    first = _pool(owner, task).pids()
    for pid in first:
        os.kill(pid, signal.SIGKILL)  # the whole pool dies between rounds
    assert wait_gone(first) == []
    res = run(settings(server_round=2, site=site), w, owner=owner)
    assert res.metrics["workers"] == 2 and res.metrics["workers_started"] == 2
    second = _pool(owner, task).pids()
    assert not set(second) & set(first)
    assert delta_rel_diff(res.weights, train_single(settings(server_round=2), w).weights, w) < TOL
    # idle for pool_idle_timeout: the reaper closes the pool and its workers exit
    assert wait_gone(second, timeout=30.0) == []
    assert not [k for k in live_pools() if k.run_id == owner[0]]


@pytest.mark.slow
@pytest.mark.gloo
def test_pool_killed_as_the_round_starts_is_restarted_within_the_round() -> None:
    """All workers SIGKILLed and the round sent at once (their deaths not yet visible): the
    round finds no survivor, restarts the pool once and still gives the right update."""
    owner = new_owner()
    task = builtin_task(settings().cfg)
    site = {"workers": 2, "mode": "process"}
    w = initial_weights(settings())
    run(settings(site=site), w, owner=owner)
    first = _pool(owner, task).pids()
    for pid in first:
        os.kill(pid, signal.SIGKILL)
    res = run(settings(server_round=2, site=site), w, owner=owner)  # no wait
    assert res.metrics["workers"] == 2 and res.metrics["workers_started"] == 2
    assert delta_rel_diff(res.weights, train_single(settings(server_round=2), w).weights, w) < TOL
    second = _pool(owner, task).pids()
    close_pools(owner[0])
    assert wait_gone(first + second) == []


_CONTROLLER = textwrap.dedent("""
    import sys, time
    sys.path[:0] = [{site_dir!r}, {root!r}]
    from _site_helpers import initial_weights, run, settings
    from clients.pools import live_pools
    s = settings(site={{"workers": 2, "mode": "process"}})
    run(s, initial_weights(s), owner=(1, 1))
    (pool,) = live_pools().values()
    print("PIDS", *pool.pids(), flush=True)
    time.sleep(600)
""")


@pytest.mark.slow
@pytest.mark.gloo
def test_killed_controller_leaves_no_workers(tmp_path: Path) -> None:
    here = Path(__file__).resolve().parent
    script = tmp_path / "controller.py"
    script.write_text(_CONTROLLER.format(site_dir=str(here), root=str(here.parents[1])))
    pools = tmp_path / "pools"
    pools.mkdir()
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "FEDAGG_SITE_TMPDIR": str(pools)})
    try:
        assert proc.stdout is not None
        line = ""
        deadline = time.monotonic() + 300
        while not line.startswith("PIDS") and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert line.startswith("PIDS"), "controller did not start its pool"
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        proc.kill()  # SIGKILL: no atexit, no close -- the workers must notice by themselves
        proc.wait(30)
        assert wait_gone(pids, timeout=20.0) == [], "orphaned worker processes"
        assert list(pools.iterdir()) == [], "the pool's directory was left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _fake_pool_dir(root: Path, pid: int) -> Path:
    from clients.pool_proc import _start_time

    d = root / f"fedagg-site-0-pool-{pid}"
    d.mkdir()
    (d / "owner").write_text(f"{pid} {_start_time(pid)}")
    return d


def test_sweep_waits_for_the_controllers_it_was_told_of(tmp_path: Path) -> None:
    """``fedagg simulate`` sweeps after the engine stopped while Ray's actors may still be
    leaving: a directory whose controller is named in ``wait_for`` goes once it is gone;
    another live controller's directory is never touched; a dead one's goes at once."""
    from clients.pool_proc import sweep_stale_pools

    leaving = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    staying = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        d_leaving = _fake_pool_dir(tmp_path, leaving.pid)
        d_staying = _fake_pool_dir(tmp_path, staying.pid)
        d_dead = _fake_pool_dir(tmp_path, dead.pid)
        dead.wait(30)  # reaped: its start time no longer matches
        assert sweep_stale_pools(tmp_path) == 1  # no wait: only the dead controller's
        assert not d_dead.exists() and d_leaving.exists() and d_staying.exists()
        # the leaving controller exits but stays a zombie until reaped: it owns nothing
        t0 = time.monotonic()
        assert sweep_stale_pools(tmp_path, wait_for={leaving.pid}, wait_s=30.0) == 1
        assert time.monotonic() - t0 < 25.0
        assert not d_leaving.exists() and d_staying.exists()
    finally:
        for p in (leaving, staying, dead):
            p.kill()
            p.wait(30)
