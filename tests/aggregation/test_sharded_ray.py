"""Sharded aggregation on real Ray actors equals the unsharded accumulator, bit for bit."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from conftest import guarded_fedavg

from fedagg.accumulate import Accumulator, ShardPlan, Sparse
from fedagg.errors import ConfigError, UpdateRejected
from strategies.wire import record_to_arrays

ray = pytest.importorskip("ray")
from strategies.sharded import ShardActor, ShardedAccumulator  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.flower]  # starts a Ray cluster (grouped with the simulation tests)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=300 * 1024 * 1024)
    yield
    if started:
        ray.shutdown()


def _alone(ref: list[np.ndarray], update: list, weight: int) -> list[np.ndarray]:
    acc = Accumulator.for_model(ref)
    acc.fold(update, weight)
    return acc.mean()


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(x.dtype == y.dtype and x.tobytes() == y.tobytes()
               for x, y in zip(a, b, strict=True))


def _round(seed: int) -> tuple[list[np.ndarray], list[list], list[int]]:
    rng = np.random.default_rng(seed)
    ref = [rng.normal(size=(300, 70)).astype(np.float32), np.zeros(13, np.float32),
           np.zeros((0, 4), np.float32), np.arange(5, dtype=np.int64),
           rng.normal(size=1001).astype(np.float32)]
    ups: list[list] = []
    for i in range(7):
        u: list = [(r + rng.normal(size=r.shape) * 10.0 ** rng.integers(-6, 2)).astype(r.dtype)
                   if r.dtype != np.int64 else r + i for r in ref]
        if i % 2:  # compressed replies: sparse first tensor, positions across shard cuts
            idx = np.sort(rng.choice(ref[0].size, 500, replace=False)).astype(np.int64)
            u[0] = Sparse(idx, rng.normal(size=500).astype(np.float32))
        ups.append(u)
    return ref, ups, [int(rng.integers(1, 5000)) for _ in ups]


@pytest.mark.parametrize("shards", [2, 4])
def test_ray_shards_equal_the_unsharded_mean_bit_for_bit(cluster: None, shards: int) -> None:
    ref, ups, ws = _round(shards)
    whole = Accumulator.for_model(ref)
    for u, w in zip(ups, ws, strict=True):
        whole.fold(u, w)
    with ShardedAccumulator(ShardPlan.for_model(ref, shards)) as sharded:
        for i in [3, 6, 0, 5, 1, 4, 2]:  # another arrival order
            sharded.fold(ups[i], ws[i])
        assert sharded.count == 7 and sharded.total_weight == float(sum(ws))
        assert _same(whole.mean(), sharded.mean())
        keys = [f"t{j}" for j in range(len(ref))]
        record = sharded.mean_record(keys)
        assert list(record.keys()) == keys
        assert _same(whole.mean(), record_to_arrays(record)[1])
        assert sum(sharded.nbytes_per_shard) <= whole.nbytes + shards * 16 * 2**18
        # a second round on the same actors, after a reset
        sharded.reset(ShardPlan.for_model(ref, shards))
        sharded.fold(ups[0], 1)
        assert _same(sharded.mean(), _alone(ref, ups[0], 1))


def test_a_refused_reply_is_undone_on_every_shard(cluster: None) -> None:
    ref, ups, ws = _round(9)
    with ShardedAccumulator(ShardPlan.for_model(ref, 3)) as sharded:
        sharded.fold(ups[0], ws[0])
        bad = list(ups[2])
        bad[4] = np.full(1001, 3e38, np.float32)  # only the last shard's range is exceeded
        with pytest.raises(UpdateRejected, match="update"):
            sharded.fold(bad, 2**20)
        assert sharded.count == 1
        assert _same(sharded.mean(), _alone(ref, ups[0], ws[0]))
        state = sharded.state_dict()
        sharded.fold(ups[1], ws[1])
        sharded.load_state_dict(state)
        assert _same(sharded.mean(), _alone(ref, ups[0], ws[0]))
        with pytest.raises(ConfigError, match="weight"):
            sharded.fold(ups[1], float("nan"))
        with pytest.raises(ConfigError, match="actors"):
            sharded.reset(ShardPlan.for_model(ref, 2))


def test_the_actor_class_refuses_use_before_reset() -> None:
    actor = ShardActor()
    with pytest.raises(ConfigError, match="reset"):
        actor.fold([], 1.0)
    with pytest.raises(ConfigError, match="reset"):
        actor.mean()
    assert actor.state_dict() is None


def test_sharded_fedavg_rounds_equal_unsharded_bit_for_bit(cluster: None) -> None:
    """strategies.guarded_fedavg(shards=S).aggregate_train on a generator, the round guards
    correcting a norm bomb and a capped liar on the shards, two rounds on the same actors."""
    from conftest import train_reply
    from flwr.app import ConfigRecord

    from strategies.wire import arrays_to_record

    class _Grid:
        def get_node_ids(self) -> list[int]:
            return list(range(1, 20))

    rng = np.random.default_rng(11)
    glob = [rng.normal(size=(60, 50)).astype(np.float32), np.zeros(50, np.float32)]
    ups = [([g + rng.normal(0, 0.01, g.shape).astype(np.float32) for g in glob],
            float(rng.integers(20, 80))) for _ in range(6)]
    ups.append(([g + 100.0 for g in glob], 50.0))  # norm bomb
    ups.append(([g + 0.01 for g in glob], 1e5))  # capped
    results = []
    plain, sharded = guarded_fedavg(min_available_nodes=1), guarded_fedavg(min_available_nodes=1, shards=3)
    for s in (plain, sharded):
        out = []
        for rnd, order in ((1, range(8)), (2, [7, 2, 5, 0, 6, 1, 4, 3])):
            s.configure_train(rnd, arrays_to_record(glob), ConfigRecord(), _Grid())
            rec, _ = s.aggregate_train(rnd, (train_reply(i + 1, *ups[i]) for i in order))
            assert rec is not None and "norm_outlier_factor" in s.report.refused["7"]
            assert "8" in s.report.capped
            out.append(record_to_arrays(rec)[1])
        results.append(out)
    try:
        for a, b in zip(results[0], results[1], strict=True):
            assert _same(a, b)
        assert _same(results[0][0], results[0][1])  # arrival order: the same bits too
    finally:
        sharded._sharded.close()
