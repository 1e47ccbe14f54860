"""Count sketch: public hashes (golden + word-by-word reference), oracle against a naive
sketch, exact integer linearity, and the masked modular sum in Z_2^b (issue 21)."""

from __future__ import annotations

import doctest
import hashlib
import statistics

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fedagg.compression import CountSketch, ring
from fedagg.compression import sketch as sk
from fedagg.errors import CodecError, ConfigError
from fedagg.secagg import fixed_point, packing
from fedagg.secagg.masking import add_masks

SEED = b"fedagg-public"


# -- reference implementation of the hash definition (module docstring), word by word -------
def ref_key(purpose: bytes, seed: bytes, rnd: int, dim: int, rows: int, cols: int) -> bytes:
    parts = [b"fedagg/compression/sketch/v1", purpose, seed] + [
        v.to_bytes(8, "big") for v in (rnd, dim, rows, cols)
    ]
    return b"".join(len(p).to_bytes(8, "big") + p for p in parts)


def ref_hash(key: bytes, row: int, i: int) -> tuple[int, int, int]:
    """(bucket before mod cols, i.e. the low 63 bits; sign; raw word) of coordinate i."""
    chunk, off = divmod(i, 1 << 16)
    stream = hashlib.shake_256(key + row.to_bytes(4, "big") + chunk.to_bytes(8, "big"))
    w = int.from_bytes(stream.digest(8 * (off + 1))[8 * off :], "little")
    return w & ((1 << 63) - 1), (1 if w >> 63 == 0 else -1), w


def naive_sketch(cs: CountSketch, x: list[int] | list[float]) -> list[list[int | float]]:
    """Charikar et al.'s definition, one coordinate at a time (hashes from the reference)."""
    key = ref_key(b"count-sketch", cs.seed, cs.round, cs.dim, cs.rows, cs.cols)
    table: list[list[int | float]] = [[0] * cs.cols for _ in range(cs.rows)]
    for j in range(cs.rows):
        for i, v in enumerate(x):
            low, sign, _ = ref_hash(key, j, i)
            table[j][low % cs.cols] += sign * v
    return table


def naive_estimates(cs: CountSketch, table: list[list[int]]) -> list[float]:
    key = ref_key(b"count-sketch", cs.seed, cs.round, cs.dim, cs.rows, cs.cols)
    out = []
    for i in range(cs.dim):
        vals = []
        for j in range(cs.rows):
            low, sign, _ = ref_hash(key, j, i)
            vals.append(sign * table[j][low % cs.cols])
        out.append(float(statistics.median(vals)))
    return out


def naive_topk(est: list[float], k: int) -> list[int]:
    return sorted(sorted(range(len(est)), key=lambda i: (-abs(est[i]), i))[:k])


# -- golden vectors: a change means sites on different fedagg versions disagree --------------
GOLDEN_BUCKETS = [[7, 11, 8, 5, 2, 9, 8, 4], [0, 0, 3, 6, 9, 5, 9, 9], [8, 5, 8, 8, 12, 0, 6, 4]]
GOLDEN_SIGNS = [
    [-1, 1, 1, 1, -1, -1, -1, -1],
    [-1, -1, 1, -1, -1, 1, 1, -1],
    [-1, 1, -1, -1, 1, -1, 1, -1],
]


def test_hashes_golden() -> None:
    cs = CountSketch(8, 3, 13, seed=b"fedagg", round=3)
    assert cs.buckets.tolist() == GOLDEN_BUCKETS
    assert cs.signs.tolist() == GOLDEN_SIGNS


def test_hashes_match_the_word_by_word_reference_across_chunks() -> None:
    dim = (1 << 16) + 40
    cs = CountSketch(dim, 2, 97, seed=SEED, round=5)
    key = ref_key(b"count-sketch", SEED, 5, dim, 2, 97)
    for j in range(2):
        for i in (0, 1, 2, 65534, 65535, 65536, 65537, dim - 1):
            low, sign, _ = ref_hash(key, j, i)
            assert cs.buckets[j, i] == low % 97
            assert cs.signs[j, i] == sign
    assert cs.fingerprint() == hashlib.sha256(key).digest()


def test_hashes_depend_on_every_public_input() -> None:
    base = CountSketch(500, 3, 50, seed=SEED, round=1)
    others = [
        CountSketch(500, 3, 50, seed=SEED + b"x", round=1),
        CountSketch(500, 3, 50, seed=SEED, round=2),
        CountSketch(500, 3, 50, seed=SEED, round=1, purpose=b"vote"),
        CountSketch(500, 3, 51, seed=SEED, round=1),
    ]
    for o in others:
        assert o.fingerprint() != base.fingerprint()
        assert not np.array_equal(o.buckets % 50, base.buckets)
    same = CountSketch(500, 3, 50, seed=bytes(SEED), round=1)  # "another site"
    np.testing.assert_array_equal(same.buckets, base.buckets)
    np.testing.assert_array_equal(same.signs, base.signs)
    assert not base.buckets.flags.writeable and not base.signs.flags.writeable


def test_buckets_and_signs_are_balanced() -> None:
    cs = CountSketch(40_000, 2, 8, seed=SEED)
    counts = np.bincount(cs.buckets.ravel(), minlength=8)
    assert abs(counts / counts.sum() - 1 / 8).max() < 0.01
    assert abs(float(cs.signs.mean())) < 0.02


# -- oracle: naive sketch, estimates, top-k ---------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    dim=st.integers(1, 120),
    rows=st.integers(1, 6),
    cols=st.integers(1, 40),
    data=st.data(),
)
def test_integer_sketch_estimates_and_topk_equal_the_naive_ones(
    dim: int, rows: int, cols: int, data: st.DataObject
) -> None:
    x = data.draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=dim, max_size=dim))
    k = data.draw(st.integers(0, dim))
    cs = CountSketch(dim, rows, cols, seed=SEED, round=data.draw(st.integers(0, 2**40)))
    table = cs.sketch_int(np.array(x, dtype=np.int64))
    naive = naive_sketch(cs, x)
    assert table.tolist() == naive
    est = cs.estimate(table)
    assert est.tolist() == naive_estimates(cs, naive)  # type: ignore[arg-type]
    assert cs.heavy_hitters(table, k).tolist() == naive_topk(est.tolist(), k)
    idx, vals = cs.unsketch(table, k)
    assert idx.tolist() == naive_topk(est.tolist(), k)
    np.testing.assert_array_equal(vals, est[idx])


def test_float_sketch_matches_naive() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=70)
    cs = CountSketch(70, 4, 9, seed=SEED)
    np.testing.assert_allclose(cs.sketch(x), np.array(naive_sketch(cs, x.tolist())), atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    dim=st.integers(1, 3000),
    rows=st.integers(1, 7),
    cols=st.integers(1, 500),
    sites=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
)
def test_linearity_exact_in_integers_close_in_floats(
    dim: int, rows: int, cols: int, sites: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    cs = CountSketch(dim, rows, cols, seed=SEED)
    qs = rng.integers(-(2**30), 2**30, size=(sites, dim))
    total = sum(cs.sketch_int(q) for q in qs)
    np.testing.assert_array_equal(total, cs.sketch_int(qs.sum(axis=0)))
    xs = rng.normal(size=(sites, dim))
    np.testing.assert_allclose(sum(cs.sketch(x) for x in xs), cs.sketch(xs.sum(axis=0)), atol=1e-9)


@settings(max_examples=30, deadline=None)
@given(dim=st.integers(50, 4000), k=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_heavy_hitters_recovered_exactly_when_sparse(dim: int, k: int, seed: int) -> None:
    """k spikes far above the noise: the top-k is exactly the spikes, whenever no coordinate
    shares a bucket with another spike in half of the rows or more (then the median of every
    coordinate is taken over a majority of spike-free buckets, Charikar et al. 2002, Sec. 3)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(scale=1e-4, size=dim)
    spikes = rng.choice(dim, size=k, replace=False)
    x[spikes] = rng.choice([-1.0, 1.0], size=k) * (10.0 + rng.random(k))
    cs = CountSketch(dim, 5, 50 * k, seed=SEED)
    is_spike = np.isin(np.arange(dim), spikes)
    shared = np.zeros(dim, dtype=np.int64)  # rows in which i meets another spike
    for j in range(cs.rows):
        per_bucket = np.bincount(cs.buckets[j, spikes], minlength=cs.cols)
        shared += (per_bucket[cs.buckets[j]] - is_spike) > 0
    assume(bool(np.all(2 * shared < cs.rows)))
    idx, vals = cs.unsketch(cs.sketch(x), k)
    assert idx.tolist() == sorted(spikes.tolist())
    np.testing.assert_allclose(vals, x[idx], atol=0.05)


def test_sketch_sparse_and_touched() -> None:
    rng = np.random.default_rng(1)
    cs = CountSketch(300, 3, 17, seed=SEED)
    idx = np.array([3, 100, 299])
    vals = rng.normal(size=3)
    dense = np.zeros(300)
    dense[idx] = vals
    np.testing.assert_allclose(cs.sketch_sparse(idx, vals), cs.sketch(dense), atol=1e-12)
    np.testing.assert_array_equal(
        cs.touched(idx), cs.sketch_int((dense != 0).astype(np.int64)) != 0
    )


# -- fixed point: exact masked modular sum in Z_2^b ------------------------------------------
def _pairwise_masked(vectors: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    """Each pair (i < j) shares a key; i adds its PRG stream, j subtracts it (Bonawitz et al.)."""
    out = [v.copy() for v in vectors]
    n = len(out)
    for i in range(n):
        for j in range(i + 1, n):
            key = rng.bytes(32)
            add_masks(out[i], [(1, key)])
            add_masks(out[j], [(-1, key)])
    return out


@settings(max_examples=25, deadline=None)
@given(
    dim=st.integers(1, 2000),
    rows=st.integers(1, 6),
    cols=st.integers(1, 300),
    sites=st.integers(2, 8),
    ring_bits=st.sampled_from([None, 20, 24, 32]),
    seed=st.integers(0, 2**32 - 1),
)
def test_masked_modular_sum_of_tables_is_the_integer_sketch_of_the_sum(
    dim: int, rows: int, cols: int, sites: int, ring_bits: int | None, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    clip, table_clip = 0.5, 64.0
    frac_bits, bits = fixed_point.resolve_encoding(sites, table_clip, None, ring_bits)
    cs = CountSketch(dim, rows, cols, seed=SEED, round=seed)
    xs = rng.normal(scale=0.01, size=(sites, dim))
    wq = [
        fixed_point.quantize_weight(float(w), 100.0, frac_bits) for w in rng.integers(1, 100, sites)
    ]
    uploads, qsum = [], np.zeros(dim, dtype=np.int64)
    for i in range(sites):
        vec, clipped = ring.encode_table(
            xs[i],
            cs,
            weight_q=wq[i],
            frac_bits=frac_bits,
            clip=clip,
            table_clip=table_clip,
            rng=np.random.default_rng([seed, i]),
        )
        assume(clipped == 0)  # (the exact claim is for unclipped tables)
        assert vec.shape == (cs.size + 1,) and vec.dtype == np.uint32
        # the dense encoding with the same generator: the q the site sketched
        dense = fixed_point.encode(
            xs[i], wq[i], frac_bits=frac_bits, clip=clip, rng=np.random.default_rng([seed, i])
        )
        qsum += dense[:-1].view(np.int32)
        uploads.append(vec)
    masked = _pairwise_masked(uploads, rng)
    total = np.zeros(cs.size + 1, dtype=np.uint32)
    for m in masked:  # on the wire: packed at b bits; the server adds without unpacking
        packing.add_unpacked(total, packing.pack(m, bits), bits)
    total &= np.uint32((1 << bits) - 1)
    counters = ring.to_ring(cs.sketch_int(qsum), bits)
    expected = np.concatenate([counters, [sum(wq)]]).astype(np.uint32)
    np.testing.assert_array_equal(total, expected)  # exact, in Z_2^b
    table, weight = ring.decode_table_sum(total, cs, frac_bits=frac_bits, ring_bits=bits)
    assert weight == sum(wq) * 2.0**-frac_bits
    np.testing.assert_array_equal(table, cs.sketch_int(qsum) * 2.0**-frac_bits)
    # ... i.e. the sketch of what dense secure aggregation would have decoded
    dense_total = np.concatenate([(qsum & 0xFFFFFFFF).astype(np.uint32), [np.uint32(sum(wq))]])
    dense_sum, _ = fixed_point.decode_sum(dense_total, frac_bits, 32)
    np.testing.assert_allclose(table, cs.sketch(dense_sum), atol=1e-9)


def test_encode_table_clips_counters_and_counts_them() -> None:
    cs = CountSketch(100, 2, 1, seed=SEED)  # one bucket per row: everything collides
    x = np.full(100, 0.5) * cs.signs[0]  # row 0 adds up to 50
    vec, clipped = ring.encode_table(
        x, cs, weight_q=2**10, frac_bits=10, clip=1.0, table_clip=2.0, rng=np.random.default_rng(0)
    )
    assert clipped >= 1
    counters = ring.from_ring(vec[:-1])
    assert int(np.abs(counters).max()) <= 2 * 2**10


def test_ring_round_trip_sign_extends() -> None:
    t = np.array([-5, 0, 7, -(2**19), 2**19 - 1], dtype=np.int64)
    for bits in (20, 24, 32):
        np.testing.assert_array_equal(ring.from_ring(ring.to_ring(t, bits), bits), t)
    assert ring.ring_nbytes(33, 32) == 132 and ring.ring_nbytes(33, 8) == 4 * 8 * 2


def test_sketch_update_flattens_tensors() -> None:
    cs = CountSketch(12, 3, 5, seed=SEED)
    a, b = np.arange(6.0).reshape(2, 3), np.ones((2, 3))
    flat = np.concatenate([a.ravel(), b.ravel()])
    np.testing.assert_array_equal(sk.sketch_update([a, b], cs), cs.sketch(flat).ravel())


# -- negative tests ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dim": 0}, "CountSketch.dim"),
        ({"dim": 2.5}, "CountSketch.dim"),
        ({"rows": 0}, "CountSketch.rows"),
        ({"rows": 65}, "CountSketch.rows"),
        ({"cols": 0}, "CountSketch.cols"),
        ({"cols": True}, "CountSketch.cols"),
        ({"round": -1}, "CountSketch.round"),
        ({"seed": "text"}, "CountSketch.seed"),
        ({"purpose": "text"}, "CountSketch.purpose"),
    ],
)
def test_bad_parameters_raise_named_errors(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"dim": 10, "rows": 3, "cols": 4, "seed": SEED}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        CountSketch(**args)  # type: ignore[arg-type]


def test_bad_inputs_raise_named_errors() -> None:
    cs = CountSketch(10, 3, 4, seed=SEED)
    with pytest.raises(ConfigError, match="flat vector of 10"):
        cs.sketch(np.zeros(11))
    with pytest.raises(ConfigError, match="finite"):
        cs.sketch(np.full(10, np.nan))
    with pytest.raises(ConfigError, match="integers"):
        cs.sketch_int(np.zeros(10))
    with pytest.raises(ConfigError, match="2\\*\\*62"):
        cs.sketch_int(np.full(10, 2**60, dtype=np.int64))
    with pytest.raises(ConfigError, match="rows \\* cols = 12"):
        cs.estimate(np.zeros(13))
    with pytest.raises(ConfigError, match=r"heavy_hitters\.k"):
        cs.heavy_hitters(np.zeros(12), 11)
    with pytest.raises(ConfigError, match="indices"):
        cs.touched(np.array([10]))
    with pytest.raises(ConfigError, match="ring_bits"):
        ring.to_ring(np.zeros(3, dtype=np.int64), 33)
    with pytest.raises(ConfigError, match="integers"):
        ring.to_ring(np.zeros(3))
    with pytest.raises(CodecError, match="uint32"):
        ring.from_ring(np.zeros(3, dtype=np.int64))
    with pytest.raises(CodecError, match="rows \\* cols \\+ 1"):
        ring.decode_table_sum(np.zeros(12, dtype=np.uint32), cs, frac_bits=10)
    with pytest.raises(ConfigError, match="table_clip"):
        ring.encode_table(
            np.zeros(10),
            cs,
            weight_q=1,
            frac_bits=10,
            clip=1.0,
            table_clip=0.0,
            rng=np.random.default_rng(0),
        )
    with pytest.raises(ConfigError, match="update size"):
        ring.encode_table(
            np.zeros(9),
            cs,
            weight_q=1,
            frac_bits=10,
            clip=1.0,
            table_clip=1.0,
            rng=np.random.default_rng(0),
        )


def test_docstring_examples() -> None:
    assert doctest.testmod(sk, optionflags=doctest.ELLIPSIS).failed == 0
