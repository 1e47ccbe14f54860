"""The virtual clock against real waits on a small case.

The same FedBuff run (K = 1, so stale updates are applied and the order of arrivals shows in
the models) over a DelayedGrid twice: once on a VirtualClock (no sleeping), once holding each
reply back in real time (WallClock, one real second per simulated second) with the loop
polling ``pull_messages`` like on a real Grid. Arrivals are at least 0.2 s apart, so real
scheduling noise cannot reorder them: the versions must be identical and the real run's times
must match the simulated ones.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from _async_helpers import config, fake_app, tiny_model

from fedagg.asyncagg import SpeedModel, WallClock
from server.asynchronous import run_async_server
from server.delayed import DelayedGrid

SPEED = SpeedModel(seed=0, job_seconds=1.0, sigma=0.0, factors=(1.0, 1.6))
CFG = ["run.rounds=6", "asynchronous.mode='fedbuff'", "asynchronous.buffer_size=1",
       "asynchronous.staleness='polynomial'", "asynchronous.poll=0.01"]


def _arrival_times(horizon: float) -> list[float]:
    out = []
    for part in (0, 1):
        t = 0.0
        for job in itertools.count(1):
            t += SPEED.duration(part, job)
            if t > horizon:
                break
            out.append(t)
    return sorted(out)


def test_precondition_arrivals_are_well_separated() -> None:
    times = _arrival_times(4.0)
    assert len(times) >= 6 and min(np.diff(times)) >= 0.2 - 1e-9


def test_virtual_clock_matches_real_waits() -> None:
    virtual_grid = DelayedGrid(fake_app(), 2, speed=SPEED, seed=3)
    virtual = run_async_server(virtual_grid, config(2, *CFG), None, model_fn=tiny_model)
    wall_grid = DelayedGrid(fake_app(), 2, speed=SPEED, seed=3, clock=WallClock())
    t0 = time.perf_counter()
    real = run_async_server(wall_grid, config(2, *CFG), None, model_fn=tiny_model)
    elapsed = time.perf_counter() - t0
    assert [r["model_digest"] for r in real] == [r["model_digest"] for r in virtual]
    assert [r["staleness"] for r in real[1:]] == [r["staleness"] for r in virtual[1:]]
    assert any(r["staleness"] != {"0": 1} for r in virtual[1:])  # the order matters
    for rv, rr in zip(virtual[1:], real[1:], strict=True):
        assert rr["time"] == pytest.approx(rv["time"], abs=0.15)
    assert virtual[-1]["time"] - 0.05 <= elapsed <= virtual[-1]["time"] + 3.0
    assert [t for t, *_ in virtual_grid.arrivals] == _arrival_times(virtual[-1]["time"])


def test_synchronous_rounds_on_a_delayed_grid_last_as_long_as_their_slowest_site() -> None:
    """A caller that only polls (the synchronous loop) moves the virtual clock by pulling."""
    from server.runner import run_server

    speed = SpeedModel(seed=0, job_seconds=2.0, sigma=0.5, factors=(1.0, 3.0, 1.5))
    grid = DelayedGrid(fake_app(), 3, speed=speed, seed=3)
    times: list[float] = []
    run_server(grid, config(3, "run.rounds=3"), None, model_fn=tiny_model,
               on_round=lambda rec: times.append(grid.clock.now()))
    want, t = [0.0], 0.0
    for rnd in (1, 2, 3):
        t += max(speed.duration(part, rnd) for part in range(3))
        want.append(t)
    assert times == pytest.approx(want)
