"""The streaming accumulator: order-independent, shard-independent, exact on its grid."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagg.accumulate import (
    Accumulator,
    ShardPlan,
    Sparse,
    TensorSpec,
    grid_exponents,
    max_abs,
)
from fedagg.aggregate import weighted_mean
from fedagg.errors import ConfigError, UpdateRejected


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
               for x, y in zip(a, b, strict=True))


def _model(rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.normal(size=(17, 9)).astype(np.float32), np.zeros(5, np.float32),
            rng.normal(size=0).astype(np.float32), np.arange(4, dtype=np.int64),
            (rng.normal(size=11) * 1e-3).astype(np.float16)]


def _updates(rng: np.random.Generator, ref: list[np.ndarray], n: int,
             sparse_every: int = 0) -> list[list[np.ndarray | Sparse]]:
    out: list[list[np.ndarray | Sparse]] = []
    for i in range(n):
        u: list[np.ndarray | Sparse] = []
        for j, r in enumerate(ref):
            if np.issubdtype(r.dtype, np.integer):
                u.append(r + rng.integers(0, 5, size=r.shape))
                continue
            scale = 10.0 ** rng.integers(-9, 3)  # values over many orders of magnitude
            x = (r + rng.normal(size=r.shape) * scale).astype(r.dtype)
            if sparse_every and i % sparse_every == 0 and j == 0:
                idx = np.sort(rng.choice(r.size, size=max(r.size // 5, 1), replace=False))
                u.append(Sparse(idx.astype(np.int64), x.reshape(-1)[idx]))
            else:
                u.append(x)
        out.append(u)
    return out


def _fold_all(ref: list[np.ndarray], ups: list, ws: list, order, **kw) -> Accumulator:
    acc = Accumulator.for_model(ref, **kw)
    for i in order:
        acc.fold(ups[i], ws[i])
    return acc


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 7), data=st.data(),
       block=st.sampled_from([1, 3, 64, 1 << 18]))
def test_any_arrival_order_gives_the_same_bits(seed: int, n: int, data: st.DataObject,
                                               block: int) -> None:
    """Hypothesis over permutations of the arrival order (and block sizes, sparse/dense)."""
    rng = np.random.default_rng(seed)
    ref = _model(rng)
    ups = _updates(rng, ref, n, sparse_every=2)
    ws = [int(rng.integers(1, 2**29)) if seed % 3 else float(rng.uniform(0.1, 50))
          for _ in range(n)]
    perm = data.draw(st.permutations(range(n)))
    a = _fold_all(ref, ups, ws, range(n))
    b = _fold_all(ref, ups, ws, perm, block=block)
    assert _same(a.mean(), b.mean())
    assert _same(a.sums(), b.sums())
    assert a.total_weight == b.total_weight == float(sum(Fraction(w) for w in ws))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 6), shards=st.integers(1, 9),
       data=st.data())
def test_sharded_equals_unsharded_bit_for_bit(seed: int, n: int, shards: int,
                                              data: st.DataObject) -> None:
    rng = np.random.default_rng(seed)
    ref = _model(rng)
    ups = _updates(rng, ref, n, sparse_every=2)
    ws = [int(rng.integers(1, 10_000)) for _ in range(n)]
    whole = _fold_all(ref, ups, ws, range(n)).mean()
    plan = ShardPlan.for_model(ref, shards)
    assert sum(plan.shard_elements(k) for k in range(shards)) == sum(r.size for r in ref)
    accs = [Accumulator(plan.shard_specs(k)) for k in range(shards)]
    for k in range(shards):  # every shard sees its own arrival order
        for i in data.draw(st.permutations(range(n))):
            accs[k].fold(plan.split(ups[i], k), ws[i])
    assert _same(whole, plan.join([a.mean() for a in accs]))


def test_float64_arrival_order_is_not_reproducible() -> None:
    """Why the accumulator exists: the float64 running sum of the same replies differs
    with the arrival order (so a bit-for-bit comparison of orders can fail)."""
    rng = np.random.default_rng(1)
    ups = [[rng.normal(size=4096).astype(np.float32) * 10.0 ** rng.integers(-6, 6)]
           for _ in range(8)]
    ws = [float(rng.integers(1, 1000)) for _ in ups]
    fwd = weighted_mean(ups, ws)
    back = weighted_mean(ups[::-1], ws[::-1])
    assert not _same(fwd, back)
    exact = [_fold_all([ups[0][0]], ups, ws, order).mean() for order in (range(8),
                                                                          range(7, -1, -1))]
    assert _same(exact[0], exact[1])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5), bits=st.sampled_from([8, 20, 32]))
def test_error_within_the_stated_bound_of_the_exact_mean(seed: int, n: int, bits: int) -> None:
    """Oracle: the exact rational weighted mean (fractions), element by element."""
    rng = np.random.default_rng(seed)
    ref = [rng.normal(size=6).astype(np.float32), np.zeros(3, np.float32)]
    ups = _updates(rng, ref, n)
    ws = [int(rng.integers(1, 2**29)) for _ in range(n)]
    acc = _fold_all(ref, ups, ws, range(n), precision_bits=bits)
    mean, bound = acc.mean(), acc.error_bound()
    total = sum(ws)
    for j in range(len(ref)):
        for e in range(ref[j].size):
            exact = sum(Fraction(w) * Fraction(float(np.asarray(u[j]).reshape(-1)[e]))
                        for u, w in zip(ups, ws, strict=True)) / total
            got = float(mean[j].reshape(-1)[e])
            ulp = float(np.spacing(np.float32(abs(float(exact)))))
            assert abs(got - float(exact)) <= bound[j] + ulp, (j, e, got, float(exact))
    assert bound[0] <= math.ldexp(1.0, grid_exponents(ref, precision_bits=bits)[0] - 1)


def test_integer_weights_give_exact_products_and_a_correctly_rounded_mean() -> None:
    """Values on the grid: every product exact, the sum exact, one rounding at the end."""
    ref = [np.array([1.0, -1.0, 0.5], np.float32)]
    ups = [[np.array([0.75, -0.25, 0.125], np.float32)],
           [np.array([0.5, 0.75, -0.375], np.float32)],
           [np.array([1.0, 1.0, 1.0], np.float32)]]
    ws = [3, 5, 7]
    acc = _fold_all(ref, ups, ws, range(3))
    exact = [sum(Fraction(w) * Fraction(float(u[0][e])) for u, w in zip(ups, ws, strict=True))
             for e in range(3)]
    assert [Fraction(float(v)) for v in acc.sums()[0]] == exact
    assert acc.mean()[0].tolist() == [float(np.float32(float(x / 15))) for x in exact]


def test_sparse_fold_equals_its_dense_form_without_a_dense_copy() -> None:
    rng = np.random.default_rng(2)
    ref = [rng.normal(size=(300, 200)).astype(np.float32)]
    idx = np.sort(rng.choice(ref[0].size, 600, replace=False)).astype(np.int64)
    vals = rng.normal(size=600).astype(np.float32)
    dense = np.zeros(ref[0].size, np.float32)
    dense[idx] = vals
    a, b = Accumulator.for_model(ref), Accumulator.for_model(ref)
    a.fold([Sparse(idx, vals)], 4)
    assert a.nbytes == 8 * ref[0].size + 16 * 600  # buffers sized by the values sent
    b.fold([dense.reshape(ref[0].shape)], 4)
    assert _same(a.mean(), b.mean())


def test_high_limb_carries_are_exact_and_leave_no_trace() -> None:
    """Sums beyond 2**62 grid units move into the second limb; results stay canonical."""
    rng = np.random.default_rng(3)
    ref = [rng.normal(size=257).astype(np.float32)]
    ups = [[(rng.normal(size=257) * 50).astype(np.float32)] for _ in range(9)]
    ws = [int(rng.integers(2**27, 2**29)) for _ in ups]
    big = _fold_all(ref, ups, ws, range(9), precision_bits=48, block=16)
    assert big._hi[0] is not None
    other = _fold_all(ref, ups, ws, [8, 0, 7, 1, 6, 2, 5, 3, 4], precision_bits=48, block=300)
    assert _same(big.mean(), other.mean())
    exact0 = sum(Fraction(w) * Fraction(float(u[0][0])) for u, w in zip(ups, ws, strict=True))
    grid = Fraction(2) ** grid_exponents(ref, precision_bits=48)[0]
    assert abs(Fraction(float(big.sums()[0][0])) - exact0) <= 9 * grid / 2 + abs(exact0) * 2**-52
    # one fold far above the low limb (|q| >= 2**62) takes the split path
    split = Accumulator.for_model(ref, precision_bits=60)
    split.fold([np.full(257, 4.0, np.float32)], 2**20)
    assert split._hi[0] is not None
    assert split.mean()[0].tolist() == [4.0] * 257


def test_a_negative_fold_removes_an_update_exactly() -> None:
    rng = np.random.default_rng(4)
    ref = _model(rng)
    ups = _updates(rng, ref, 3, sparse_every=2)
    with_bad = _fold_all(ref, ups, [5, 7, 11], range(3))
    with_bad.fold(ups[1], -7)
    assert _same(with_bad.mean(), _fold_all(ref, ups, [5, 0, 11], [0, 2]).mean())
    assert with_bad.count == 2 and with_bad.total_weight == 16.0


def test_a_refused_update_leaves_no_trace() -> None:
    rng = np.random.default_rng(5)
    ref = [rng.normal(size=100).astype(np.float32), rng.normal(size=100).astype(np.float32)]
    good = [rng.normal(size=100).astype(np.float32) for _ in ref]
    acc = Accumulator.for_model(ref, block=7)
    acc.fold(good, 3)
    before = acc.state_dict()
    bad_value = [good[0], good[1].copy()]
    bad_value[1][60] = np.inf  # the second tensor, a later block: earlier blocks were folded
    huge = [good[0], np.full(100, 3e38, np.float32)]
    for bad in (bad_value, huge):
        with pytest.raises(UpdateRejected, match="update\\[1\\]"):
            acc.fold(bad, 2**20)
        after = acc.state_dict()
        assert all(np.array_equal(x, y) for x, y in zip(before["lo"], after["lo"], strict=True))
        assert after["weight"] == before["weight"] and acc.count == 1
    assert _same(acc.mean(), _fold_all(ref, [good], [3], [0]).mean())


def test_merge_of_disjoint_sites_equals_one_accumulator() -> None:
    rng = np.random.default_rng(6)
    ref = _model(rng)
    ups = _updates(rng, ref, 6, sparse_every=3)
    ws = [int(rng.integers(1, 100)) for _ in ups]
    left, right = _fold_all(ref, ups, ws, [0, 1, 2]), _fold_all(ref, ups, ws, [3, 4, 5])
    left.merge(right)
    assert _same(left.mean(), _fold_all(ref, ups, ws, range(6)).mean())
    with pytest.raises(ConfigError, match="same shapes"):
        left.merge(Accumulator.for_model(ref[:2]))


def test_state_dict_round_trip_mid_stream() -> None:
    rng = np.random.default_rng(7)
    ref = _model(rng)
    ups = _updates(rng, ref, 4)
    ws = [3, 1, 4, 1]
    acc = _fold_all(ref, ups, ws, [0, 1])
    resumed = Accumulator.from_state_dict(acc.state_dict())
    for i in (2, 3):
        resumed.fold(ups[i], ws[i])
    assert _same(resumed.mean(), _fold_all(ref, ups, ws, range(4)).mean())
    bad = acc.state_dict()
    bad["lo"][0] = bad["lo"][0][:-1]
    with pytest.raises(ConfigError, match="accumulator state"):
        Accumulator.from_state_dict(bad)
    with pytest.raises(ConfigError, match="version"):
        Accumulator.from_state_dict({**acc.state_dict(), "version": 99})


def test_grid_exponents_follow_the_reference_scale() -> None:
    ref = [np.array([0.3, -5.0], np.float32), np.zeros(2, np.float32), np.arange(2),
           np.array([1e-20], np.float64)]
    assert grid_exponents(ref, precision_bits=32) == [3 - 32, 3 - 32, 0, -66 - 32]
    assert grid_exponents([np.zeros(3, np.float32)]) == [1 - 32]  # all zero: scale 1.0
    assert max_abs(np.array([-7.0, 2.0]), block=1) == 7.0
    assert math.isnan(max_abs(np.array([1.0, np.nan])))


@pytest.mark.parametrize("bad", [8 - 1, 61, True, 32.5])
def test_bad_precision_bits_are_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="precision_bits"):
        grid_exponents([np.zeros(2, np.float32)], precision_bits=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("weight", [0, -0.0, math.nan, math.inf, True, "3", None])
def test_bad_weights_are_refused_before_folding(weight: object) -> None:
    acc = Accumulator.for_model([np.zeros(3, np.float32)])
    with pytest.raises(ConfigError, match="weight"):
        acc.fold([np.ones(3, np.float32)], weight)  # type: ignore[arg-type]
    assert acc.count == 0


@pytest.mark.parametrize("update, match", [
    ([np.ones(4, np.float32)], "shape"),
    ([np.ones(3, np.float32), np.ones(3, np.float32)], "2 tensors"),
    ([Sparse(np.array([2, 1]), np.ones(2, np.float32))], "strictly increasing"),
    ([Sparse(np.array([1, 1]), np.ones(2, np.float32))], "strictly increasing"),
    ([Sparse(np.array([0, 3]), np.ones(2, np.float32))], "strictly increasing"),
    ([Sparse(np.array([-1]), np.ones(1, np.float32))], "strictly increasing"),
    ([Sparse(np.array([0, 1]), np.ones(3, np.float32))], "one value each"),
])
def test_bad_updates_are_refused_before_folding(update: list, match: str) -> None:
    acc = Accumulator.for_model([np.zeros(3, np.float32)])
    with pytest.raises(ConfigError, match=match):
        acc.fold(update, 1)
    assert acc.count == 0 and not acc._lo[0].any()


def test_mean_needs_a_positive_total_weight_and_known_dtypes() -> None:
    acc = Accumulator.for_model([np.zeros(3, np.float32)])
    with pytest.raises(ConfigError, match="positive"):
        acc.mean()
    with pytest.raises(ConfigError, match="float or integer"):
        Accumulator([TensorSpec((2,), "bool", 0)])
    with pytest.raises(ConfigError, match="float or integer"):
        grid_exponents([np.array(["a"])])
    with pytest.raises(ConfigError, match="shards"):
        ShardPlan.for_model([np.zeros(3, np.float32)], 4)


def test_memory_is_one_int64_per_element() -> None:
    ref = [np.zeros(1_000_000, np.float32)]
    acc = Accumulator.for_model(ref, block=1 << 16)
    acc.fold([np.ones(1_000_000, np.float32)], 10)
    assert acc.nbytes <= 8 * 1_000_000 + 16 * (1 << 16)


@pytest.mark.parametrize("in_place", [True, False])
def test_mean_npy_is_the_mean_written_into_its_message_bytes(
        in_place: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``mean_npy`` (the new model's npy bytes, written in place) equals ``mean()`` bit for bit
    and loads with ``np.load``, for every dtype and layout; without CPython's ``pythonapi``
    the bytearray fallback gives the same bytes."""
    import io

    from fedagg import npy

    if not in_place:
        monkeypatch.setattr(npy, "_from_string_and_size", lambda: None)
    rng = np.random.default_rng(3)
    ref = [rng.normal(size=(300, 70)).astype(np.float32), np.zeros(7, np.float64),
           np.arange(5, dtype=np.int64), rng.normal(size=1_100_000).astype(np.float32),
           np.zeros((0, 3), np.float32)]
    acc = Accumulator.for_model(ref)
    for i in range(3):
        acc.fold([r + rng.normal(size=r.shape).astype(r.dtype) for r in ref], 3.0 + i)
    for want, (dt, shape, data) in zip(acc.mean(), acc.mean_npy(), strict=True):
        assert type(data) is bytes and dt == str(want.dtype) and shape == want.shape
        got = np.load(io.BytesIO(data), allow_pickle=False)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        assert data == npy.npy_header(want.dtype.str, want.shape) + want.tobytes()
