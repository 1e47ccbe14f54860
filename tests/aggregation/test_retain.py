"""What a streamed round keeps aside for the whole-round guards' corrections.

:class:`fedagg.accumulate.Retainer` (slot files written over in place) and
:meth:`fedagg.accumulate.RoundStatistics.settled` (an update no decision can touch any more is
not kept), checked against the list-based guards on every possible end of the round.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from conftest import guarded_fedavg, train_reply
from flwr.app import ConfigRecord, Message
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagg.accumulate import Retainer, RoundStatistics, Sparse, median_floor
from fedagg.aggregate import MEDIAN_MIN_UPDATES, cap_weights, norm_outliers
from strategies.fedavg import FedAvg
from strategies.wire import arrays_to_record, record_to_arrays

FACTOR, RATIO = 10.0, 10.0


def _list_guards(weights: list[float], norms: list[float]) -> set[int]:
    """Positions the list-based round guards refuse or cap (the naive reference)."""
    refused = set(norm_outliers(norms, FACTOR))
    keep = [i for i in range(len(weights)) if i not in refused]
    _, over = cap_weights([weights[i] for i in keep], RATIO)
    return refused | {keep[i] for i in over}


_value = st.one_of(st.floats(1e-3, 1e3), st.sampled_from([0.0, float("inf"), float("nan")]))
_weight = st.floats(1e-3, 1e4)


@settings(max_examples=300, deadline=None)
@given(known=st.lists(st.tuples(_weight, _value), min_size=1, max_size=12),
       future=st.lists(st.tuples(_weight, _value), max_size=12), data=st.data())
def test_a_settled_update_is_never_refused_or_capped_whatever_comes(
        known: list[tuple[float, float]], future: list[tuple[float, float]],
        data: st.DataObject) -> None:
    """For a round of ``expected`` messages: every site settled on its arrival (with what had
    arrived so far) is left alone by the list-based guards for each way the round can end
    (any prefix of any future replies: sites may also fail)."""
    expected = len(known) + len(future)
    stats = RoundStatistics()
    settled = []
    for i, (w, n) in enumerate(known):
        stats.add(i, w, n)
        if stats.settled(i, norm_factor=FACTOR, weight_ratio=RATIO, expected=expected):
            settled.append(i)
    came = data.draw(st.integers(0, len(future)))
    weights = [w for w, _ in known] + [w for w, _ in future[:came]]
    norms = [n for _, n in known] + [n for _, n in future[:came]]
    assert not set(settled) & _list_guards(weights, norms)


@settings(max_examples=100, deadline=None)
@given(known=st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=10),
       future=st.lists(st.floats(-1e3, 1e3), max_size=10), data=st.data())
def test_median_floor_bounds_every_median(known: list[float], future: list[float],
                                          data: st.DataObject) -> None:
    floor = median_floor(known, len(future))
    came = data.draw(st.integers(0, len(future)))
    if floor is not None:
        assert float(np.median(known + future[:came])) >= floor


def test_honest_sites_settle_after_half_the_round() -> None:
    stats = RoundStatistics()
    got = []
    for i in range(10):
        stats.add(i, 100.0 + i, 1.0 + 0.01 * i)
        got.append(stats.settled(i, norm_factor=FACTOR, weight_ratio=RATIO, expected=10))
    assert got == [False] * 5 + [True] * 5
    # told fewer messages than recorded: never settled; a guard off counts as settled
    assert not stats.settled(9, norm_factor=FACTOR, weight_ratio=RATIO, expected=9)
    assert stats.settled(0, norm_factor=0, weight_ratio=0, expected=10)
    assert not stats.settled(9, norm_factor=FACTOR, weight_ratio=RATIO, expected=10,
                             exclude=["9"])
    assert MEDIAN_MIN_UPDATES > 2  # below it nothing is judged:
    small = RoundStatistics()
    small.add("a", 1e9, 1e9)
    assert small.settled("a", norm_factor=FACTOR, weight_ratio=RATIO, expected=2)


def test_retainer_reuses_its_slot_files_and_reads_back_every_kind_of_tensor() -> None:
    rng = np.random.default_rng(0)
    ups = {}
    with Retainer(2, spill_bytes=0) as r:
        for i in range(12):
            dense = rng.normal(size=(6, 5)).astype(np.float32)
            u = [dense.T,  # not C-contiguous
                 Sparse(np.array([1, 7, 9], np.int64), rng.normal(size=3).astype(np.float16)),
                 np.zeros((0, 3), np.float64), np.arange(4, dtype=np.int32)]
            ups[str(i)] = u
            r.offer(str(i), float(i), float(-i), u)  # weights rise, norms fall
        assert r.writes == 12 and r._dir is not None
        files = sorted(p.name for p in r._dir.iterdir())
        assert len(files) <= 4, files  # 2 by weight + 2 by norm, written over in place
        assert sorted(r._kept) == ["0", "1", "10", "11"]
        for key in r._kept:
            got, want = r.get(key), ups[key]
            assert got is not None
            np.testing.assert_array_equal(got[0], want[0])
            assert isinstance(got[1], Sparse)
            np.testing.assert_array_equal(got[1].indices, want[1].indices)
            np.testing.assert_array_equal(got[1].values, want[1].values)
            assert got[1].values.dtype == np.float16
            assert got[2].shape == (0, 3) and got[3].dtype == np.int32
            np.testing.assert_array_equal(got[3], want[3])
            assert not got[0].flags.writeable
        where = r._dir
    assert not where.exists()


class _Grid:
    def __init__(self, n: int) -> None:
        self.n = n

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.n + 1))


def _replies(updates: list[tuple[np.ndarray, float]]) -> Iterator[Message]:
    for i, (a, w) in enumerate(updates):
        yield train_reply(i + 1, [a], w)


def _run(updates: list[tuple[np.ndarray, float]], sent: int,
         monkeypatch: pytest.MonkeyPatch, **kw: float
         ) -> tuple[FedAvg, list[np.ndarray] | None, int]:
    """One streamed round after a configure_train to ``sent`` sites; also how many updates
    the round kept aside."""
    s = guarded_fedavg(min_available_nodes=1, **kw)
    s.configure_train(1, arrays_to_record([np.zeros(4000, np.float32)]), ConfigRecord(),
                      _Grid(sent))
    stores = []
    real = Retainer._store

    def store(self: Retainer, key: str, update: list[np.ndarray]) -> None:
        stores.append(key)
        real(self, key, update)

    with monkeypatch.context() as m:
        m.setattr(Retainer, "_store", store)
        out, _ = s.aggregate_train(1, _replies(updates))
    return s, None if out is None else record_to_arrays(out)[1], len(stores)


def test_a_streamed_round_keeps_fewer_updates_and_gives_the_same_bits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rising weights (the Retainer's worst case): told how many messages went out, the round
    stops keeping updates once they are settled; the result, the refusals and the caps are
    those of the round that kept every candidate."""
    rng = np.random.default_rng(3)
    updates = [(rng.normal(0, 0.1, 4000).astype(np.float32), 50.0 + i) for i in range(12)]
    updates[3] = (np.full(4000, 40.0, np.float32), 60.0)  # a norm bomb, early
    updates.append((rng.normal(0, 0.1, 4000).astype(np.float32), 1e6))  # a liar, last
    lean, got, lean_kept = _run(updates, len(updates), monkeypatch)
    full, want, full_kept = _run(updates, 10_000, monkeypatch)  # no useful bound: keeps all
    assert got is not None and want is not None and got[0].tobytes() == want[0].tobytes()
    assert lean.report.refused.keys() == full.report.refused.keys() == {"4"}
    assert lean.report.capped.keys() == full.report.capped.keys() == {"13"}
    assert lean_kept < full_kept == len(updates)
    assert lean_kept <= 8  # the first half (7), the liar


def test_more_updates_than_messages_refuse_the_round_rather_than_corrupt_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller that configured 6 messages and hands over 16 updates: the first 6 (norm 1)
    were settled for a round of 6, then 10 small ones pull the median norm down and make
    them outliers. The skipped ones cannot be corrected: the round is refused, named;
    told the truth, the same round is corrected exactly."""
    rng = np.random.default_rng(4)
    unit = rng.normal(size=4000).astype(np.float32)
    unit /= np.linalg.norm(unit)
    updates = [(unit, 50.0) for _ in range(6)] + [(unit * 0.01, 50.0) for _ in range(10)]
    s, got, _ = _run(updates, 6, monkeypatch, stream_retain=6)
    assert got is None
    assert "16 updates came for 6 messages sent" in s.report.refused["server"]
    assert all("norm_outlier_factor" in s.report.refused[str(n)] for n in range(1, 7))
    _, exact, _ = _run(updates, 16, monkeypatch, stream_retain=6)  # told the truth
    assert exact is not None
    np.testing.assert_allclose(exact[0], unit * 0.01, rtol=1e-6, atol=1e-10)
