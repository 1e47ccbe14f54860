"""Shared supports: determinism from public (seed, round), distribution, gathering."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagg.compression import (
    ErrorFeedback,
    Int8,
    SharedSupport,
    block_support,
    codec,
    find_shared_support,
    random_support,
    reveals_indices,
    topk_of_aggregate,
)
from fedagg.errors import ConfigError

# Golden vectors: a change here means sites on different fedagg versions disagree on supports.
GOLDEN_RANDOM = [49, 346, 424, 477, 733, 864, 898, 964]
GOLDEN_BLOCK_START = 596


def test_random_support_golden() -> None:
    assert random_support(1000, 8, round=3, seed=b"fedagg").tolist() == GOLDEN_RANDOM


def test_block_support_golden() -> None:
    assert block_support(1000, 4, round=3, seed=b"fedagg").tolist() == [
        GOLDEN_BLOCK_START + i for i in range(4)
    ]


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 3000),
    st.floats(0, 1),
    st.integers(0, 10**6),
    st.binary(min_size=0, max_size=40),
)
def test_supports_are_deterministic_sorted_unique_in_range(
    dim: int, frac: float, rnd: int, seed: bytes
) -> None:
    k = int(frac * dim)
    for fn in (random_support, block_support):
        a = fn(dim, k, round=rnd, seed=seed)
        b = fn(dim, k, round=rnd, seed=bytes(seed))  # "another site"
        np.testing.assert_array_equal(a, b)
        assert a.dtype == np.int64 and a.shape == (k,)
        assert np.all(np.diff(a) > 0)
        if k:
            assert a[0] >= 0 and a[-1] < dim


@pytest.mark.parametrize("fn", [random_support, block_support])
def test_different_rounds_and_seeds_differ(fn) -> None:  # type: ignore[no-untyped-def]
    base = fn(100_000, 1000, round=5, seed=b"s").tolist()
    assert fn(100_000, 1000, round=6, seed=b"s").tolist() != base
    assert fn(100_000, 1000, round=5, seed=b"t").tolist() != base
    # length-prefixed hashing: (seed="s", round=5) cannot collide with a shifted split
    assert fn(100_000, 1000, round=5, seed=b"s\x00").tolist() != base


def test_random_support_is_roughly_uniform() -> None:
    counts = np.zeros(100, np.int64)
    for r in range(400):
        counts[random_support(100, 10, round=r, seed=b"u")] += 1
    # each position expected 40 times; binomial sd ~ 6
    assert counts.min() > 15 and counts.max() < 65
    dense = random_support(100, 90, round=1, seed=b"u")  # complement branch
    assert dense.shape == (90,) and len(set(dense.tolist())) == 90


def test_random_support_large_is_fast_enough() -> None:
    sup = random_support(1_000_000, 10_000, round=1, seed=b"big")
    assert sup.shape == (10_000,)
    sup = random_support(1_000_000, 600_000, round=1, seed=b"big")
    assert sup.shape == (600_000,) and np.all(np.diff(sup) > 0)


def test_block_support_wraps() -> None:
    seen_wrap = False
    for r in range(200):
        b = block_support(10, 6, round=r, seed=b"w")
        assert len(b) == 6
        if b[0] == 0 and b[-1] == 9:
            seen_wrap = True
    assert seen_wrap


@pytest.mark.parametrize(
    ("dim", "k", "rnd", "seed"),
    [(-1, 0, 0, b""), (10, 11, 0, b""), (10, -1, 0, b""), (10, 2, -1, b""), (10, 2, 0, "s")],
)
def test_support_argument_errors(dim: int, k: int, rnd: int, seed: bytes) -> None:
    for fn in (random_support, block_support):
        with pytest.raises(ConfigError):
            fn(dim, k, round=rnd, seed=seed)


def test_topk_of_aggregate() -> None:
    agg = np.array([0.1, -5.0, 3.0, 0.0, 4.0, -0.2], np.float32)
    assert topk_of_aggregate(agg, 3, round=0, seed=b"").tolist() == [1, 2, 4]
    mixed = topk_of_aggregate(agg, 4, random_fraction=0.5, round=2, seed=b"s")
    assert mixed.shape == (4,) and {1, 4} <= set(mixed.tolist())  # top-2 + 2 random others
    again = topk_of_aggregate([agg[:2], agg[2:]], 4, random_fraction=0.5, round=2, seed=b"s")
    np.testing.assert_array_equal(mixed, again)
    assert topk_of_aggregate(agg, 6, random_fraction=1.0, round=1, seed=b"").tolist() == list(
        range(6)
    )
    with pytest.raises(ConfigError):
        topk_of_aggregate(np.array([np.nan, 1.0]), 1, round=0, seed=b"")
    with pytest.raises(ConfigError):
        topk_of_aggregate(agg, 2, random_fraction=1.5, round=0, seed=b"")


def test_shared_support_across_sites_and_server() -> None:
    """Two sites with different updates send values on the same positions; no index bytes."""
    shapes = [(20, 10), (7,), ()]
    dim = 208
    seed, rnd = b"federation-seed", 4
    sites = []
    for s in range(2):
        rng = np.random.default_rng(s)
        x = [rng.normal(size=sh).astype(np.float32) for sh in shapes]
        enc = ErrorFeedback(
            SharedSupport(lambda d: random_support(d, 20, round=rnd, seed=seed)), quantizer=Int8(8)
        )
        assert not reveals_indices(enc)
        data = codec.encode(enc.compress(x, rng=rng))
        sites.append((x, enc, data))
    sizes = {len(d) for _, _, d in sites}
    assert len(sizes) == 1  # identical layout: secure-aggregation masks can line up
    server_support = random_support(dim, 20, round=rnd, seed=seed)
    total = np.zeros(dim, np.float64)
    expected = np.zeros(dim, np.float64)
    for x, enc, data in sites:
        dense = codec.decode(data).with_support(server_support).to_dense()
        flat = np.concatenate([d.ravel() for d in dense])
        assert set(np.flatnonzero(flat).tolist()) <= set(server_support.tolist())
        total += flat
        expected += np.concatenate([a.ravel() for a in x])
        stage = find_shared_support(enc)
        assert stage is not None
        np.testing.assert_array_equal(stage.support_for(dim), server_support)
    # the aggregate on the support is the sum of the sites' values (up to int8 rounding)
    np.testing.assert_allclose(total[server_support], expected[server_support], atol=0.1)
    # off-support mass stays in the residuals
    for x, enc, _ in sites:
        assert enc.residuals is not None
        flat_res = np.concatenate([r.ravel() for r in enc.residuals])
        off = np.setdiff1d(np.arange(dim), server_support)
        np.testing.assert_array_equal(flat_res[off], np.concatenate([a.ravel() for a in x])[off])


def test_shared_support_rejects_bad_supports() -> None:
    x = [np.zeros(5, np.float32)]
    rng = np.random.default_rng(0)
    for bad in ([3, 1], [1, 1], [5], [-1], [[0, 1]], [0.5]):
        with pytest.raises(ConfigError):
            SharedSupport(np.array(bad)).compress(x, rng=rng)
    assert SharedSupport([]).compress(x, rng=rng).nnz == 0
    assert find_shared_support(Int8()) is None


@pytest.mark.parametrize(
    ("dim", "k"), [(50, 20), (1000, 37), (7, 3), (3, 1), (64, 32), (10, 9), (100, 77)]
)
def test_random_support_equals_naive_first_distinct_of_stream(dim: int, k: int) -> None:
    """Reference: SHAKE-256 of the length-prefixed key, one 64-bit word at a time."""
    import hashlib

    parts = (b"fedagg/compression/support/v1", b"random", b"ref", (9).to_bytes(8, "big"))
    key = b"".join(len(p).to_bytes(8, "big") + p for p in parts)
    words = hashlib.shake_256(key).digest(8 * 10_000)
    limit = (2**64 // dim) * dim
    taken: list[int] = []
    for j in range(10_000):
        u = int.from_bytes(words[8 * j : 8 * j + 8], "little")
        if u >= limit:
            continue
        if u % dim not in taken:
            taken.append(u % dim)
        if len(taken) == min(k, dim - k):
            break
    expected = sorted(taken) if k <= dim // 2 else sorted(set(range(dim)) - set(taken))
    assert random_support(dim, k, round=9, seed=b"ref").tolist() == expected
