"""TopK (exact, by magnitude) and random-k against naive references."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedagg.compression import RandomK, TopK, reveals_indices
from fedagg.compression.select import k_from_ratio, topk_indices
from fedagg.errors import ConfigError


def naive_topk(v: np.ndarray, k: int) -> np.ndarray:
    """Reference: stable sort by (-|v|, index), take k, sort ascending."""
    order = sorted(range(len(v)), key=lambda i: (-abs(float(v[i])), i))
    return np.array(sorted(order[:k]), dtype=np.int64)


finite32 = st.floats(-1e6, 1e6, width=32, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float32, st.integers(0, 60), elements=finite32), st.data())
def test_topk_indices_match_naive_reference(v: np.ndarray, data: st.DataObject) -> None:
    k = data.draw(st.integers(0, len(v)))
    got = topk_indices(v, k)
    np.testing.assert_array_equal(got, naive_topk(v, k))


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 50), elements=st.sampled_from([0.0, 1.0, -1.0, 2.0])))
def test_topk_ties_go_to_lowest_index(v: np.ndarray) -> None:
    for k in range(len(v) + 1):
        np.testing.assert_array_equal(topk_indices(v, k), naive_topk(v, k))


def test_topk_keeps_largest_magnitudes_per_tensor() -> None:
    x = [
        np.array([[0.1, -5.0, 2.0], [3.0, -0.2, 0.0]], np.float32),
        np.array([1.0, -1.5, 0.5, 0.25], np.float32),
    ]
    p = TopK(k=2).compress(x, rng=np.random.default_rng(0))
    t0, t1 = p.tensors
    assert t0.indices is not None and t0.indices.tolist() == [1, 3]
    assert t0.values.tolist() == [-5.0, 3.0]
    assert t1.indices is not None and t1.indices.tolist() == [0, 1]
    dense = p.to_dense()
    assert dense[0].tolist() == [[0.0, -5.0, 0.0], [3.0, 0.0, 0.0]]


def test_topk_global_scope_uses_one_threshold() -> None:
    x = [np.array([10.0, 9.0, 8.0], np.float32), np.array([1.0, -20.0], np.float32)]
    p = TopK(k=3, scope="global").compress(x, rng=np.random.default_rng(0))
    assert [t.indices.tolist() if t.indices is not None else None for t in p.tensors] == [
        [0, 1],
        [1],
    ]
    p = TopK(0.4, scope="global").compress(x, rng=np.random.default_rng(0))  # k = 2 of 5
    assert p.nnz == 2
    assert sorted(float(v) for t in p.tensors for v in t.values) == [-20.0, 10.0]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 7), min_size=0, max_size=2), min_size=1, max_size=4),
    st.floats(0, 1),
    st.sampled_from(["tensor", "global"]),
    st.integers(0, 2**31),
)
def test_topk_counts_and_values(shapes: list, ratio: float, scope: str, seed: int) -> None:  # type: ignore[type-arg]
    rng = np.random.default_rng(seed)
    x = [rng.normal(size=tuple(s)).astype(np.float32) for s in shapes]
    p = TopK(ratio, scope=scope).compress(x, rng=rng)  # type: ignore[arg-type]
    if scope == "tensor":
        assert [t.nnz for t in p.tensors] == [k_from_ratio(ratio, a.size) for a in x]
    else:
        assert p.nnz == k_from_ratio(ratio, sum(a.size for a in x))
    # every kept magnitude >= every dropped magnitude (per scope)
    dense = p.to_dense()
    kept = [np.abs(a[d != 0]) for a, d in zip(x, dense, strict=True)]
    dropped = [np.abs(a[d == 0]) for a, d in zip(x, dense, strict=True)]
    groups = list(zip(kept, dropped, strict=True))
    if scope == "global":
        groups = [(np.concatenate(kept), np.concatenate(dropped))]
    for k_, d_ in groups:
        if k_.size and d_.size:
            assert k_.min() >= d_.max()
    for a, d in zip(x, dense, strict=True):  # sent values are exact copies
        np.testing.assert_array_equal(d[d != 0], a[d != 0])


def test_k_from_ratio_edges() -> None:
    assert k_from_ratio(0.0, 10) == 0
    assert k_from_ratio(1.0, 10) == 10
    assert k_from_ratio(0.3, 10) == 3  # not 4 from 3.0000000000000004
    assert k_from_ratio(0.01, 10) == 1
    assert k_from_ratio(0.5, 0) == 0


def test_topk_is_fast_for_one_million() -> None:
    rng = np.random.default_rng(0)
    x = [rng.normal(size=1_000_000).astype(np.float32)]
    comp = TopK(0.01)
    comp.compress(x, rng=rng)  # warm up
    start = time.perf_counter()
    p = comp.compress(x, rng=rng)
    elapsed = time.perf_counter() - start
    assert p.nnz == 10_000
    assert elapsed < 0.5, f"TopK on 1M took {elapsed:.3f}s"
    thr = np.sort(np.abs(x[0]))[-10_000]
    assert float(np.abs(p.tensors[0].values).min()) == float(thr)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"ratio": 1.5}, {"ratio": -0.1}, {"ratio": 0.1, "k": 3}, {"k": -1}, {"k": 1.5}],
)
def test_topk_rejects_bad_arguments(kwargs: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError):
        TopK(**kwargs)
    with pytest.raises(ConfigError):
        RandomK(**kwargs)


def test_topk_bad_scope() -> None:
    with pytest.raises(ConfigError, match="scope"):
        TopK(0.1, scope="layer")  # type: ignore[arg-type]


def test_randomk_private_uses_rng() -> None:
    x = [np.arange(1000, dtype=np.float32)]
    a = RandomK(0.05).compress(x, rng=np.random.default_rng(1))
    b = RandomK(0.05).compress(x, rng=np.random.default_rng(1))
    c = RandomK(0.05).compress(x, rng=np.random.default_rng(2))
    assert a.equals(b) and not a.equals(c)
    assert a.nnz == 50
    t = a.tensors[0]
    assert t.indices is not None
    np.testing.assert_array_equal(t.values, t.indices.astype(np.float32))


def test_randomk_seeded_is_shared_across_sites_and_rounds_differ() -> None:
    rng1, rng2 = np.random.default_rng(1), np.random.default_rng(2)
    x1 = [np.ones((40, 25), np.float32), np.ones(100, np.float32)]
    x2 = [np.full((40, 25), 2, np.float32), np.full(100, 2, np.float32)]
    p1 = RandomK(0.1, seed=b"pub", round=3).compress(x1, rng=rng1)
    p2 = RandomK(0.1, seed=b"pub", round=3).compress(x2, rng=rng2)
    p3 = RandomK(0.1, seed=b"pub", round=4).compress(x1, rng=rng1)
    idx = [[t.indices.tolist() for t in p.tensors if t.indices is not None] for p in (p1, p2, p3)]
    assert idx[0] == idx[1]
    assert idx[0] != idx[2]
    assert idx[0][0][:10] != idx[0][1][:10]  # per-tensor streams differ


def test_own_index_modes_declare_that_they_reveal_indices() -> None:
    assert reveals_indices(TopK(0.1))
    assert reveals_indices(RandomK(0.1))
    assert reveals_indices(object())  # unknown plugins are assumed to reveal
