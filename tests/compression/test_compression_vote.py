"""Secure index voting: vote tables against a naive count, popularity and support against a
naive implementation, the masked modular sum of votes, the pipelined VoteSupport stage, byte
accounting, the spec, and a CPU-cheap convergence check (issue 21)."""

from __future__ import annotations

import doctest
import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagg.compression import (
    BlockVote,
    ErrorFeedback,
    SharedSupport,
    VoteSketch,
    VoteSupport,
    build_compressor,
    codec,
    find_shared_support,
    find_vote_support,
    random_support,
    reveals_indices,
    ring,
)
from fedagg.compression import vote as vote_module
from fedagg.compression import vote_tables as vote_tables_module
from fedagg.errors import CodecError, ConfigError
from fedagg.secagg import fixed_point, packing
from fedagg.secagg.masking import add_masks

SEED = b"fedagg-public"


# -- naive reference (hash definition of fedagg.compression.sketch, purpose b"vote") ----------
def ref_key(seed: bytes, rnd: int, dim: int, rows: int, cols: int) -> bytes:
    parts = [b"fedagg/compression/sketch/v1", b"vote", seed] + [
        v.to_bytes(8, "big") for v in (rnd, dim, rows, cols)
    ]
    return b"".join(len(p).to_bytes(8, "big") + p for p in parts)


def ref_bucket(key: bytes, row: int, i: int, cols: int) -> int:
    chunk, off = divmod(i, 1 << 16)
    stream = hashlib.shake_256(key + row.to_bytes(4, "big") + chunk.to_bytes(8, "big"))
    w = int.from_bytes(stream.digest(8 * (off + 1))[8 * off :], "little")
    return (w & ((1 << 63) - 1)) % cols


def ref_priority(key: bytes, i: int) -> int:
    chunk, off = divmod(i, 1 << 16)
    domain = b"fedagg/compression/vote/tiebreak/v1"
    stream = hashlib.shake_256(domain + key + chunk.to_bytes(8, "big"))
    return int.from_bytes(stream.digest(8 * (off + 1))[8 * off :], "little")


def naive_topk(x: list[float], k: int) -> list[int]:
    return sorted(sorted(range(len(x)), key=lambda i: (-abs(x[i]), i))[:k])


def naive_vote_sum(vs: VoteSketch, choices: list[list[int]]) -> list[list[int]]:
    key = ref_key(vs.seed, vs.round, vs.dim, vs.rows, vs.cols)
    total = [[0] * vs.cols for _ in range(vs.rows)]
    for chosen in choices:
        for j in range(vs.rows):
            hit = [ref_bucket(key, j, i, vs.cols) for i in set(chosen)]
            if vs.mode == "bloom":
                for b in set(hit):
                    total[j][b] += 1
            else:
                for b in hit:
                    total[j][b] += 1
    return total


def naive_support(vs: VoteSketch, total: list[list[int]], m: int) -> tuple[list[int], list[int]]:
    key = ref_key(vs.seed, vs.round, vs.dim, vs.rows, vs.cols)
    pop = [
        min(total[j][ref_bucket(key, j, i, vs.cols)] for j in range(vs.rows)) for i in range(vs.dim)
    ]
    order = sorted(range(vs.dim), key=lambda i: (-pop[i], ref_priority(key, i), i))
    return pop, sorted(order[:m])


@settings(max_examples=30, deadline=None)
@given(
    dim=st.integers(1, 80),
    rows=st.integers(1, 4),
    cols=st.integers(1, 40),
    sites=st.integers(1, 6),
    mode=st.sampled_from(["bloom", "count"]),
    data=st.data(),
)
def test_vote_sum_popularity_and_support_equal_the_naive_ones(
    dim: int, rows: int, cols: int, sites: int, mode: str, data: st.DataObject
) -> None:
    k = data.draw(st.integers(0, dim))
    m = data.draw(st.integers(0, dim))
    rnd = data.draw(st.integers(0, 1000))
    vs = VoteSketch(dim, rows, cols, seed=SEED, round=rnd, mode=mode)  # type: ignore[arg-type]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    updates = [rng.normal(size=dim) for _ in range(sites)]
    total = sum(vs.vote(u, k) for u in updates)
    choices = [naive_topk(u.tolist(), k) for u in updates]
    naive_total = naive_vote_sum(vs, choices)
    assert np.asarray(total).tolist() == naive_total
    pop, sup = naive_support(vs, naive_total, m)
    assert vs.popularity(total).tolist() == pop
    assert vs.support(total, m).tolist() == sup


@settings(max_examples=30, deadline=None)
@given(dim=st.integers(1, 2000), sites=st.integers(1, 20), seed=st.integers(0, 2**32 - 1))
def test_popularity_never_underestimates_the_number_of_votes(
    dim: int, sites: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    k = max(1, dim // 20)
    vs = VoteSketch(dim, 3, max(1, dim // 10), seed=SEED, round=seed % 100)
    chosen = [rng.choice(dim, size=k, replace=False) for _ in range(sites)]
    votes = np.bincount(np.concatenate(chosen), minlength=dim)
    pop = vs.popularity(sum(vs.encode(c) for c in chosen))
    assert np.all(pop >= votes) and int(pop.max()) <= sites


def test_support_is_the_naive_most_voted_when_nothing_collides() -> None:
    """cols >> k * sites: the summed Bloom filter counts exactly; the support is the naive
    count of indices (ties broken by the public priority)."""
    rng = np.random.default_rng(2)
    dim, sites, k, m = 500, 8, 5, 6
    popular = rng.choice(dim, size=m, replace=False)
    chosen = []
    for s in range(sites):
        own = rng.choice(np.setdiff1d(np.arange(dim), popular), size=k - 3, replace=False)
        chosen.append(np.concatenate([popular[(s + np.arange(3)) % m], own]))
    vs = VoteSketch(dim, 4, 50_000, seed=SEED, round=1)
    total = sum(vs.encode(c) for c in chosen)
    counts = np.bincount(np.concatenate(chosen), minlength=dim)
    np.testing.assert_array_equal(vs.popularity(total), counts)
    assert vs.support(total, m).tolist() == sorted(popular.tolist())


def _masked_sum(tables: list[np.ndarray], bits: int, rng: np.random.Generator) -> np.ndarray:
    vecs = [t.copy() for t in tables]
    for i in range(len(vecs)):
        for j in range(i + 1, len(vecs)):
            key = rng.bytes(32)
            add_masks(vecs[i], [(1, key)])
            add_masks(vecs[j], [(-1, key)])
    total = np.zeros(vecs[0].shape[0], dtype=np.uint32)
    for v in vecs:
        packing.add_unpacked(total, packing.pack(v, bits), bits)
    return total


@settings(max_examples=25, deadline=None)
@given(
    dim=st.integers(1, 3000),
    sites=st.integers(2, 12),
    mode=st.sampled_from(["bloom", "count"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_masked_modular_vote_sum_gives_the_plaintext_support(
    dim: int, sites: int, mode: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    k = max(1, dim // 50)
    vs = VoteSketch(dim, 3, max(1, dim // 20), seed=SEED, round=4, mode=mode)  # type: ignore[arg-type]
    bits = vote_module.vote_ring_bits(sites, k, mode)  # type: ignore[arg-type]
    tables = [vs.vote(rng.normal(size=dim), k) for _ in range(sites)]
    plain = sum(tables)
    masked = _masked_sum([vs.encode_ring(t, bits) for t in tables], bits, rng)
    np.testing.assert_array_equal(vs.decode_sum(masked, bits), plain)
    m = max(1, dim // 100)
    np.testing.assert_array_equal(vs.support(vs.decode_sum(masked, bits), m), vs.support(plain, m))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 500),
    field_bits=st.integers(1, 16),
    ring_bits=st.sampled_from([16, 24, 27, 32]),
    seed=st.integers(0, 2**32 - 1),
)
def test_pack_counters_round_trip(n: int, field_bits: int, ring_bits: int, seed: int) -> None:
    if field_bits > ring_bits:
        field_bits = ring_bits
    c = np.random.default_rng(seed).integers(0, 1 << field_bits, size=n)
    packed = ring.pack_counters(c, field_bits, ring_bits)
    per = ring.counters_per_element(field_bits, ring_bits)
    assert packed.dtype == np.uint32 and packed.shape == (-(-n // per),)
    assert int(packed.max(initial=0)) < 1 << ring_bits
    np.testing.assert_array_equal(ring.unpack_counters(packed, n, field_bits, ring_bits), c)


@settings(max_examples=20, deadline=None)
@given(
    dim=st.integers(1, 1500),
    sites=st.integers(2, 15),
    ring_bits=st.sampled_from([None, 32]),
    seed=st.integers(0, 2**32 - 1),
)
def test_votes_ride_in_the_masked_values_vector(
    dim: int, sites: int, ring_bits: int | None, seed: int
) -> None:
    """One masked vector per site, ``[values on the support, weight, packed votes]``: the
    values decode as in dense secure aggregation and the votes unpack to the plaintext sum."""
    rng = np.random.default_rng(seed)
    frac_bits, bits = fixed_point.resolve_encoding(sites, 1.0, None, ring_bits)
    k = max(1, dim // 50)
    vs = VoteSketch(dim, 3, max(1, dim // 20), seed=SEED, round=5)
    field = vote_module.vote_ring_bits(sites, k)
    sup = random_support(dim, max(1, dim // 100), round=5, seed=SEED)
    uploads, votes, expected = [], [], np.zeros(sup.shape[0])
    for i in range(sites):
        x = rng.normal(scale=0.1, size=dim)
        vals = fixed_point.encode(
            x[sup],
            2**frac_bits,
            frac_bits=frac_bits,
            clip=1.0,
            rng=np.random.default_rng([seed, i]),
        )
        expected += x[sup]
        table = vs.vote(x, k)
        votes.append(table)
        uploads.append(np.concatenate([vals, ring.pack_counters(table, field, bits)]))
    total = _masked_sum(uploads, bits, rng)
    n_vals = sup.shape[0] + 1
    summed, weight = fixed_point.decode_sum(total[:n_vals], frac_bits, bits)
    assert weight == sites
    np.testing.assert_allclose(summed, expected, atol=sites * 2.0**-frac_bits)
    got = ring.unpack_counters(total[n_vals:], vs.size, field, bits)
    np.testing.assert_array_equal(got.reshape(3, -1), sum(votes))


def test_pack_counters_errors() -> None:
    with pytest.raises(ConfigError, match="must be in \\[0, 2\\^5\\)"):
        ring.pack_counters(np.array([32]), 5)
    with pytest.raises(ConfigError, match="must be in"):
        ring.pack_counters(np.array([-1]), 5)
    with pytest.raises(ConfigError, match="integers"):
        ring.pack_counters(np.array([0.5]), 5)
    with pytest.raises(ConfigError, match="field_bits"):
        ring.counters_per_element(33, 32)
    with pytest.raises(CodecError, match="packed counters"):
        ring.unpack_counters(np.zeros(3, dtype=np.uint32), 30, 5)


def test_support_random_fraction_and_priority() -> None:
    vs = VoteSketch(1000, 3, 64, seed=SEED, round=2)
    total = vs.encode(np.arange(10))
    sup = vs.support(total, 20, random_fraction=0.5)
    assert sup.shape == (20,) and np.all(np.diff(sup) > 0)
    assert set(vs.support(total, 10).tolist()) <= set(range(1000))
    again = VoteSketch(1000, 3, 64, seed=bytes(SEED), round=2).support(
        total, 20, random_fraction=0.5
    )
    np.testing.assert_array_equal(sup, again)  # every party computes the same support
    p = vs.priority()
    assert p.dtype == np.uint64 and p.shape == (1000,)
    assert not np.array_equal(p, VoteSketch(1000, 3, 64, seed=SEED, round=3).priority())


def test_vote_ring_bits_and_round_nbytes() -> None:
    assert vote_module.vote_ring_bits(20, 2000) == 5  # a summed Bloom counter <= 20
    assert vote_module.vote_ring_bits(20, 2000, "count") == 16  # <= 40,000
    assert vote_module.vote_ring_bits(1, 1) == 1
    sizes = vote_module.round_nbytes(
        vote_counters=3 * 4096, vote_bits=5, support=1992, value_bits=27, one_vector=False
    )
    assert sizes["vote"] == 4 * 5 * 384 and sizes["values"] == 4 * 27 * 63
    assert sizes["total"] == sizes["vote"] + sizes["values"]
    one = vote_module.round_nbytes(vote_counters=3 * 4096, vote_bits=5, support=1992, value_bits=32)
    assert one["values"] == 4 * 1993 and one["vote"] == 4 * 2048  # six 5-bit counters a word
    assert one["total"] == packing.packed_words(1993 + 2048, 32) * 4
    with pytest.raises(ConfigError, match="more than 32 bits"):
        vote_module.vote_ring_bits(2**20, 2**20, "count")
    with pytest.raises(ConfigError, match="num_sites"):
        vote_module.vote_ring_bits(0, 1)
    with pytest.raises(ConfigError, match="mode"):
        vote_module.vote_ring_bits(3, 1, "exact")  # type: ignore[arg-type]


# -- the pipelined stage ----------------------------------------------------------------------
def test_vote_support_first_round_then_voted_support_and_server_decode() -> None:
    rng = np.random.default_rng(4)
    dim, sites, m = 2000, 5, 20
    deltas = [[rng.normal(size=(40, 50)).astype(np.float32)] for _ in range(sites)]
    stage0 = build_compressor("vote:20,rows=3,cols=400+ef", seed=SEED, round=0)
    v0 = find_vote_support(stage0)
    assert isinstance(v0, VoteSupport) and isinstance(v0, SharedSupport)
    assert not reveals_indices(stage0)
    first = random_support(dim, m, round=0, seed=b"vote-first\x00" + SEED)
    np.testing.assert_array_equal(v0.support_for(dim), first)
    # round 0: values on the public random support; each site leaves its vote for round 1
    efs = [build_compressor("vote:20,rows=3,cols=400+ef", seed=SEED, round=0) for _ in range(sites)]
    total = np.zeros((3, 400), dtype=np.int64)
    packed_sum = np.zeros(120, dtype=np.uint32)  # 3-bit fields (5 sites): 10 per element
    for ef, d in zip(efs, deltas, strict=True):
        ef.compress(d, rng=rng)
        stage = find_vote_support(ef)
        assert stage is not None and stage.last_votes is not None
        rest = d[0].ravel().astype(np.float64).copy()
        rest[first] = 0.0  # the vote is on what the site did not send yet
        np.testing.assert_array_equal(stage.last_votes, stage.sketch_for(dim).vote(rest, m))
        total += stage.last_votes
        packed_sum += stage.packed_votes(dim=dim, num_sites=sites, ring_bits=32)
    assert v0.requires_secure_aggregation  # a vote table is a Bloom filter of a site's top-k
    np.testing.assert_array_equal(
        v0.unpack_votes(packed_sum, dim=dim, num_sites=sites, ring_bits=32), total
    )
    with pytest.raises(ConfigError, match="no vote yet"):
        v0.packed_votes(dim=dim, num_sites=sites, ring_bits=32)
    # round 1: site and server derive the same support from the public vote sum
    site = build_compressor("vote:20,rows=3,cols=400+ef", seed=SEED, round=1)
    server = build_compressor("vote:20,rows=3,cols=400", seed=SEED, round=1)
    for c in (site, server):
        s = find_vote_support(c)
        assert s is not None
        s.use_votes(total, round=0)
    expected = VoteSketch(dim, 3, 400, seed=SEED, round=0).support(total, m)
    payload = site.compress(deltas[0], rng=rng)
    stage_srv = find_shared_support(server)
    assert stage_srv is not None
    sup = stage_srv.support_for(dim)
    np.testing.assert_array_equal(sup, expected)
    decoded = codec.decode(codec.encode(payload)).with_support(sup).to_dense()[0].ravel()
    np.testing.assert_array_equal(decoded[sup], deltas[0][0].ravel()[sup])


def test_vote_support_options() -> None:
    s = VoteSupport(
        support_ratio=0.01,
        vote_k=5,
        rows=2,
        size=0.1,
        seed=SEED,
        round=3,
        mode="count",
        random_fraction=0.25,
    )
    assert s.m_for(10_000) == 100 and s.votes_for(10_000) == 5
    assert s.sketch_for(10_000).cols == 500 and s.sketch_for(10_000).mode == "count"
    s.use_votes(s.vote([np.ones(10_000)]), round=3)
    assert s.support_for(10_000).shape == (100,)
    assert VoteSupport(support_k=7, cols=9, seed=SEED, round=0).votes_for(100) == 7
    assert "VoteSupport" in repr(s) and "VoteSketch" in repr(s.sketch_for(10))


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("vote:0.01,rows=3", "cols=<int> or size="),
        ("vote:rows=3,cols=40", "exactly one amount"),
        ("vote:0.01,rows=3,cols=40,mode=exact", "mode 'exact'"),
        ("vote:0.01,rows=3,cols=40,random=2", "random 2.0"),
        ("vote:0.01,vote=1.5,rows=3,cols=40", "ratio 1.5"),
        ("vote:0.01,rows=99,cols=40", "rows 99"),
        ("vote:0.01,rows=3,cols=40,momentum=0.9", "unknown option"),
    ],
)
def test_vote_spec_errors(spec: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_compressor(spec, seed=SEED, round=1)


def test_vote_spec_needs_seed_and_round_and_parses_options() -> None:
    with pytest.raises(ConfigError, match="seed and round"):
        build_compressor("vote:0.01,rows=3,cols=40")
    c = build_compressor(
        "vote:k=30,vote=0.005,rows=2,size=0.02,mode=count,random=0.1+ef", seed=SEED, round=2
    )
    assert isinstance(c, ErrorFeedback)
    s = find_vote_support(c)
    assert s is not None and s.m_for(1000) == 30 and s.votes_for(1000) == 5
    assert (s.rows, s.mode, s.random_fraction, s.round) == (2, "count", 0.1, 2)
    assert find_vote_support(build_compressor("shared:0.01", seed=SEED, round=1)) is None


def test_vote_bad_inputs() -> None:
    vs = VoteSketch(100, 3, 10, seed=SEED, round=0)
    with pytest.raises(ConfigError, match=r"VoteSketch\.mode"):
        VoteSketch(100, 3, 10, seed=SEED, round=0, mode="exact")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"CountSketch\.cols"):
        VoteSketch(100, 3, 0, seed=SEED, round=0)
    with pytest.raises(ConfigError, match="vote indices"):
        vs.encode([100])
    with pytest.raises(ConfigError, match="vote k"):
        vs.vote(np.zeros(100), 101)
    with pytest.raises(ConfigError, match="vote vector"):
        vs.vote(np.zeros(99), 1)
    with pytest.raises(CodecError, match="vote sum"):
        vs.decode_sum(np.zeros(29, dtype=np.uint32), 8)
    with pytest.raises(ConfigError, match="counts must be >= 0"):
        vs.popularity(-np.ones(30, dtype=np.int64))
    with pytest.raises(ConfigError, match="support size"):
        vs.support(np.zeros(30, dtype=np.int64), 101)
    with pytest.raises(ConfigError, match="random_fraction"):
        vs.support(np.zeros(30, dtype=np.int64), 1, random_fraction=1.5)
    with pytest.raises(ConfigError, match="one support size"):
        VoteSupport(cols=4, seed=SEED, round=0)
    with pytest.raises(ConfigError, match="one vote k"):
        VoteSupport(support_k=1, vote_k=1, vote_ratio=0.1, cols=4, seed=SEED, round=0)
    with pytest.raises(ConfigError, match="cols or size"):
        VoteSupport(support_k=1, seed=SEED, round=0)


# -- CPU-cheap convergence check ---------------------------------------------------------------
def test_voted_support_trains_within_a_few_percent_of_dense_and_beats_random() -> None:
    """10 sites, 10,000 parameters, 150 rounds, one local step (lr 0.02); the support has 1 %
    of the coordinates, the vote 3 x 400 counters. Voted support + EF ends within 1 % of dense;
    the seeded random support of the same size + EF is far behind (0.34)."""
    rng = np.random.default_rng(0)
    dim, sites, rounds, lr = 10_000, 10, 150, 0.02
    wstar = np.zeros(dim)
    wstar[rng.choice(dim, 50, replace=False)] = rng.normal(size=50)
    a = [rng.uniform(0.5, 1.5, size=dim) for _ in range(sites)]
    b = [ai * wstar + rng.normal(scale=0.01, size=dim) for ai in a]

    def progress(w: np.ndarray) -> float:
        def loss(v: np.ndarray) -> float:
            return float(
                sum(0.5 * (ai * v * v).sum() - (bi * v).sum() for ai, bi in zip(a, b, strict=True))
            )

        opt = sum(b) / sum(a)
        return (loss(np.zeros(dim)) - loss(w)) / (loss(np.zeros(dim)) - loss(opt))

    def train(spec: str) -> float:
        w = np.zeros(dim)
        efs = [ErrorFeedback(SharedSupport(np.empty(0, np.int64))) for _ in range(sites)]
        votes: np.ndarray | None = None
        for r in range(rounds):
            stage = build_compressor(spec, seed=SEED, round=r)  # one public stage per round
            voter = find_vote_support(stage)
            if voter is not None and votes is not None:
                voter.use_votes(votes, round=r - 1)
            total, new_votes = np.zeros(dim), None
            for ef, ai, bi in zip(efs, a, b, strict=True):
                ef.inner = stage
                payload = ef.compress([(-lr * (ai * w - bi)).astype(np.float32)], rng=rng)
                total += payload.to_dense()[0]
                if voter is not None:
                    assert voter.last_votes is not None
                    new_votes = (
                        voter.last_votes if new_votes is None else new_votes + voter.last_votes
                    )
            votes = new_votes
            w = w + total / sites
        return progress(w)

    dense = np.zeros(dim)
    for _ in range(rounds):
        dense = dense + np.mean(
            [-lr * (ai * dense - bi) for ai, bi in zip(a, b, strict=True)], axis=0
        )
    p_dense = progress(dense)
    p_vote = train("vote:100,rows=3,cols=400")
    p_random = train("shared:100")
    assert p_dense > 0.99
    assert p_vote > 0.98 * p_dense
    assert p_vote > p_random + 0.1


def test_docstring_examples() -> None:
    for module in (vote_module, vote_tables_module):  # VoteSketch / BlockVote: vote_tables
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0


# -- block votes (vote:...,block=B) ---------------------------------------------------------
def _naive_block_vote(x: list[float], block: int, k: int) -> list[int]:
    """The blocks of the k largest L1 masses (ties: lowest block), as a 0/1 list."""
    blocks = -(-len(x) // block)
    mass = [sum(abs(v) for v in x[b * block:(b + 1) * block]) for b in range(blocks)]
    chosen = sorted(range(blocks), key=lambda b: (-mass[b], b))[:k]
    return [1 if b in chosen else 0 for b in range(blocks)]


@settings(max_examples=30, deadline=None)
@given(dim=st.integers(1, 90), block=st.integers(1, 12), sites=st.integers(1, 6), data=st.data())
def test_block_votes_sum_and_support_equal_the_naive_ones(dim: int, block: int, sites: int,
                                                          data: st.DataObject) -> None:
    bv = BlockVote(dim, block, seed=b"s", round=3)
    blocks = -(-dim // block)
    k = data.draw(st.integers(0, blocks))
    vectors = [data.draw(st.lists(st.floats(-4, 4, width=32), min_size=dim, max_size=dim))
               for _ in range(sites)]
    total = sum(bv.vote(np.array(v), k) for v in vectors)
    naive = [sum(col) for col in zip(*[_naive_block_vote(v, block, k) for v in vectors],
                                     strict=True)]
    assert total.shape == (1, blocks) and total[0].tolist() == naive
    m = data.draw(st.integers(0, dim))
    prio = bv.priority()
    nb = 0 if m == 0 else min(blocks, max(1, m // block))
    order = sorted(range(blocks), key=lambda b: (-naive[b], int(prio[b]), b))[:nb]
    want = [i for b in sorted(order) for i in range(b * block, min((b + 1) * block, dim))]
    assert bv.support(total, m).tolist() == want


def test_block_vote_support_from_the_spec_and_its_errors() -> None:
    comp = build_compressor("vote:0.2,vote=0.1,block=4+ef", seed=b"x", round=2)
    stage = find_vote_support(comp)
    assert stage is not None and stage.block == 4
    vs = stage.sketch_for(40)
    assert isinstance(vs, BlockVote) and vs.size == 10 and (vs.rows, vs.cols) == (1, 10)
    assert stage.support_for(40).size == 8  # 0.2 * 40 = 8 coordinates = 2 blocks
    x = np.zeros(40, np.float32)
    x[[5, 6, 33]] = [3.0, 2.0, 9.0]
    stage.compress([x], rng=np.random.default_rng(0))
    assert stage.last_votes is not None and stage.last_votes.shape == (1, 10)
    assert int(stage.last_votes.sum()) == 1  # vote = 0.1 * 40 = 4 coordinates = 1 block
    for bad, words in [("vote:0.2,block=4,rows=2+ef", "do not apply"),
                       ("vote:0.2,block=0+ef", "block must be >= 1"),
                       ("vote:0.2,block=4,mode=count+ef", "do not apply")]:
        with pytest.raises(ConfigError, match=words):
            build_compressor(bad, seed=b"x", round=2)
    with pytest.raises(ConfigError, match="vote blocks"):
        BlockVote(10, 4, seed=b"x", round=0).vote(np.zeros(10), 4)
