"""Elastic site workers: a worker that dies or hangs mid-round does not fail the site.

The survivors leave the broken group, form a new one and redo the round from the global
weights; worker k of K' takes the k-th slice of every global batch, so the update equals the
one-worker update with the same global batch (within 1e-5 relative). The lost worker is
replaced at the next round. Real gloo processes on 127.0.0.1 (killed by PID from outside, or
by the run config's fault injection, the path a drill uses) and real threads; every process
the pool ever started is checked to be gone at the end.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from _site_helpers import (
    delta_rel_diff,
    initial_weights,
    new_owner,
    run,
    settings,
    train_single,
    wait_gone,
)
from _site_tasks import raising_step

from clients.pools import PoolKey, close_pools, live_pools, task_identity
from fedagg.builtin import builtin_task
from fedagg.errors import WorkerError
from fedagg.task import Task

TOL = 1e-5
LONG_TOL = 1e-3  # 140 steps of float32 in another summation order (see below)


def _fault(kind: str, rank: int = 1, *, step: int = 2) -> dict[str, object]:
    return {f"{kind}_worker": rank, "worker_fault_site": 1, "worker_fault_round": 1,
            "worker_fault_step": step}


def _cpu_ticks(pid: int) -> int:
    """utime + stime of ``pid`` in clock ticks (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _pool(owner: tuple[int, int]):  # type: ignore[no-untyped-def]
    return live_pools()[PoolKey(*owner, task_identity(builtin_task(settings().cfg))[0])]


@pytest.mark.slow
@pytest.mark.gloo
def test_sigkill_one_of_three_workers_mid_round() -> None:
    """The issue's drill: SIGKILL (by PID, from outside) one of 3 worker processes mid-round."""
    owner = new_owner()
    site = {"workers": 3, "mode": "process", "worker_timeout": 60.0}
    long = {"local_epochs": 10}  # 140 steps: long enough to be hit in the middle
    # float32 summation order differs between 2 workers and 1 and the difference grows with the
    # steps (SGD with momentum is chaotic: 25 epochs here already differ by 2e-2); at 140 steps
    # it has been seen from 1e-6 up to 3e-4, so the redone round is held to LONG_TOL. A redo
    # that lost or double-counted the victim's shard trains on other examples (num_examples
    # below checks the count too) and differs far more.
    w = initial_weights(settings())
    run(settings(site=site), w, owner=owner)  # round 1: start the pool
    pool = _pool(owner)
    victim = pool.pids()[1]
    started: list[int] = list(pool.started_pids)
    out: dict[str, object] = {}

    def round2() -> None:
        try:
            out["res"] = run(settings(server_round=2, site=site, train=long), w, owner=owner)
        except BaseException as exc:  # reported below
            out["err"] = exc

    t = threading.Thread(target=round2)
    t0 = time.monotonic()
    cpu0 = _cpu_ticks(victim)
    t.start()
    while _cpu_ticks(victim) < cpu0 + 10 and t.is_alive():  # 0.1 s of its training
        time.sleep(0.005)
    assert t.is_alive(), "round 2 ended before the kill: make it longer"
    os.kill(victim, signal.SIGKILL)
    t.join(600)
    assert "err" not in out, out.get("err")
    res = out["res"]
    m = res.metrics  # type: ignore[attr-defined]
    assert m["workers"] == 2 and m["workers_lost"] == 1 and m["round_attempts"] == 2, m
    assert m["workers_configured"] == 3 and m["redo_seconds"] > 0
    one = train_single(settings(server_round=2, train=long), w)
    assert delta_rel_diff(res.weights, one.weights, w) < LONG_TOL  # type: ignore[attr-defined]
    assert res.num_examples == one.num_examples  # type: ignore[attr-defined]
    assert victim not in pool.pids() and len(pool.pids()) == 2
    # round 3 runs with 3 workers again: the lost one is replaced, the survivors kept
    survivors = pool.pids()
    r3 = run(settings(server_round=3, site=site), w, owner=owner)
    assert r3.metrics["workers"] == 3 and r3.metrics["workers_started"] == 1
    assert pool.pids()[:2] == survivors
    assert delta_rel_diff(r3.weights, train_single(settings(server_round=3), w).weights, w) < TOL
    started = list(pool.started_pids)
    assert len(started) == 4
    close_pools(owner[0])
    assert wait_gone(started) == [], "worker processes left at the end"
    assert time.monotonic() - t0 < 600


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("kind", ["kill", "hang"])
def test_injected_fault_in_a_process_worker_is_survived(kind: str) -> None:
    owner = new_owner(node=2)
    s = settings(partition=1, site={"workers": 3, "mode": "process", "worker_timeout": 5.0},
                 faults=_fault(kind))
    w = initial_weights(s)
    res = run(s, w, owner=owner)
    pool = _pool(owner)
    started = list(pool.started_pids)
    assert res.metrics["workers"] == 2 and res.metrics["workers_lost"] == 1
    assert delta_rel_diff(res.weights, train_single(s, w).weights, w) < TOL
    close_pools(owner[0])
    assert wait_gone(started) == []


@pytest.mark.parametrize("kind", ["kill", "hang"])
def test_injected_fault_in_a_thread_worker_is_survived(kind: str) -> None:
    owner = new_owner(node=2)
    site = {"workers": 3, "mode": "inprocess", "worker_timeout": 3.0}
    s = settings(partition=1, site=site, faults=_fault(kind, rank=2))
    w = initial_weights(s)
    res = run(s, w, owner=owner)
    assert res.metrics["workers"] == 2 and res.metrics["round_attempts"] == 2
    assert delta_rel_diff(res.weights, train_single(s, w).weights, w) < TOL
    s2 = settings(partition=1, server_round=2, site=site)
    again = run(s2, w, owner=owner)
    assert again.metrics["workers"] == 3 and again.metrics["workers_started"] == 1
    close_pools(owner[0])


def test_kept_optimizer_state_is_restored_for_the_redo() -> None:
    """keep_optimizer: the redone round starts from the round's optimizer state, not from
    the state the failed attempt left behind."""
    site = {"keep_optimizer": True}
    ref_owner, owner = new_owner(node=2), new_owner(node=2)
    w = initial_weights(settings())
    r1 = run(settings(partition=1, site={"workers": 1, **site}), w, owner=ref_owner)
    ref = run(settings(partition=1, server_round=2, site={"workers": 1, **site}), r1.weights,
              owner=ref_owner)
    k = {"workers": 3, "mode": "inprocess", "worker_timeout": 3.0, **site}
    run(settings(partition=1, site=k), w, owner=owner)
    fault = {**_fault("kill", rank=1, step=5), "worker_fault_round": 2}
    redone = run(settings(partition=1, server_round=2, site=k, faults=fault), r1.weights,
                 owner=owner)
    assert redone.metrics["round_attempts"] == 2 and redone.metrics["optimizer_rounds"] == 1
    assert delta_rel_diff(redone.weights, ref.weights, r1.weights) < TOL
    close_pools(ref_owner[0])
    close_pools(owner[0])


def test_a_raising_worker_still_fails_the_site() -> None:
    """A bug in the user's step is not a lost worker: redoing would raise again."""
    owner = new_owner()
    base = builtin_task(settings().cfg)
    task = Task(model=base.model, data=base.data, train_step=raising_step)
    s = settings(site={"workers": 3, "mode": "inprocess"})
    with pytest.raises(WorkerError, match=r"worker 1 of 3 .*ValueError: bug in the user's step"):
        run(s, initial_weights(s), owner=owner, task=task)
    assert not [k for k in live_pools() if k.run_id == owner[0]], "a failed pool is closed"


def test_too_few_survivors_fail_the_site() -> None:
    owner = new_owner(node=2)
    s = settings(partition=1, site={"workers": 3, "mode": "inprocess", "min_workers": 3},
                 faults=_fault("kill"))
    with pytest.raises(WorkerError, match=r"only 2 worker\(s\) survived, fewer than "
                                          r"site.min_workers = 3"):
        run(s, initial_weights(s), owner=owner)
