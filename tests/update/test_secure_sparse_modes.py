"""The secure sparse modes of issue 21 in the upload pipeline, against naive references.

Sites run :class:`fedagg.update.UploadPipeline` with a real SecAgg+ masking step
(:class:`fedagg.update.SecAggMasker` over :class:`fedagg.secagg.ClientState`); the server is
:class:`fedagg.secagg.ServerState` plus :class:`fedagg.update.RoundDecoder`. References are
written here with numpy loops over coordinates, on the public hash arrays (``buckets``,
``signs``; those are checked word by word against SHAKE-256 in tests/compression):

* ``sketch``: the unmasked ring sum is exactly the integer count sketch of the summed
  fixed-point updates of the counted sites (a site dropping before its upload is left out,
  one dropping after it is counted), and the applied coordinates are the naive top-k of the
  naive point queries;
* ``vote``: the server's vote sum equals the naive count of the sites' Bloom filters of the
  top-k of what they did not send, and the next support is the naive most popular one;
* spec rules: ``vote`` refused in plaintext (with the reason), the new modes accepted under
  secure aggregation, the sketch / vote paths refuse a masker that cannot take ring vectors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedagg.compression import VoteSketch, find_sketch, find_vote_support
from fedagg.compression.ring import from_ring
from fedagg.errors import ConfigError, ProtocolError
from fedagg.secagg import (
    ClientState,
    SecAggParams,
    ServerState,
    deterministic_random_bytes,
    fixed_point,
)
from fedagg.update import (
    RoundDecoder,
    SecAggMasker,
    SupportHistory,
    UploadPipeline,
    UploadSpec,
    masked_layout,
)

SHAPES = [(20, 9), (9,), (4, 5)]
DIM = sum(int(np.prod(s)) for s in SHAPES)
N = 6
PARAMS = SecAggParams(threshold=3, clip=8.0, weight_scale=100.0)


class Fed:
    """A SecAgg+ server and ``N`` sites in one process (every site keyed)."""

    def __init__(self, seed: int = 1) -> None:
        self.server = ServerState(PARAMS, run_id=b"issue-21-test-run", threads=1)
        self.clients = {i: ClientState(i, PARAMS, threads=1,
                                       random_bytes=deterministic_random_bytes(seed, f"s{i}"))
                        for i in range(N)}
        request = self.server.begin_setup(range(N))
        for c in self.clients.values():
            self.server.receive_advertise(c.handle_advertise(request))
        for i, req in self.server.close_advertise().items():
            self.server.receive_share_keys(self.clients[i].handle_share_keys(req))
        self.server.close_share_keys()
        self.round = 0

    def requests(self, dim: int) -> dict[int, Any]:
        self.round += 1
        return self.server.begin_round(self.round, tuple(range(N)), dim)

    def finish(self, uploads: dict[int, Any], *, after: int | None = None) -> Any:
        for up in uploads.values():
            self.server.receive_upload(up)
        for i, req in self.server.close_uploads().items():
            if i != after:
                self.server.receive_unmask(self.clients[i].handle_unmask(req))
        return self.server.finish_round()


def _glob(rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


def _trained(rng: np.random.Generator, glob: list[np.ndarray], scale: float) -> list[np.ndarray]:
    return [g + scale * rng.normal(size=g.shape).astype(np.float32) for g in glob]


def _flat_delta(trained: list[np.ndarray], glob: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.subtract(t, g, dtype=np.float32).astype(np.float64).ravel()
                           for t, g in zip(trained, glob, strict=True)])


def _naive_int_sketch(buckets: np.ndarray, signs: np.ndarray, q: np.ndarray,
                      cols: int) -> np.ndarray:
    table = np.zeros((buckets.shape[0], cols), np.int64)
    for j in range(buckets.shape[0]):
        for i in range(q.size):
            table[j, int(buckets[j, i])] += int(signs[j, i]) * int(q[i])
    return table


def _naive_estimates(buckets: np.ndarray, signs: np.ndarray, table: np.ndarray) -> np.ndarray:
    rows, dim = buckets.shape
    return np.array([np.median([signs[j, i] * table[j, buckets[j, i]] for j in range(rows)])
                     for i in range(dim)])


@pytest.mark.parametrize("seed", [0, 1])
def test_masked_sketch_sum_is_the_integer_sketch_of_the_summed_updates(seed: int) -> None:
    rng = np.random.default_rng(seed)
    spec = UploadSpec.parse("sketch:k=12,rows=3,cols=40", secure=True)
    fed = Fed(seed)
    glob = _glob(rng)
    history = SupportHistory.at_site(spec, 5, 1, glob)
    layout = masked_layout(history, DIM, num_sites=N, ring_bits=PARAMS.encoding_for(N)[1])
    assert layout.dim == 3 * 40 and layout.sketch_shape == (3, 40)
    requests = fed.requests(layout.dim)
    weights = [float(w) for w in rng.integers(5, 100, N)]
    before, after = 2, 4  # 2 never uploads; 4 uploads, then misses the unmask (still counted)
    uploads, q = {}, {}
    for i, req in requests.items():
        trained = _trained(rng, glob, 0.3)
        flat = _flat_delta(trained, glob)
        frac_bits, _, w_q = fed.clients[i].round_encoding(req, weights[i])
        mask = SecAggMasker(fed.clients[i], req, rng=np.random.default_rng([seed, i]))
        up = UploadPipeline(spec, history).run(trained, weight=weights[i],
                                               rng=np.random.default_rng(99), mask=mask)
        assert up.payload is None and up.vector is not None
        assert up.metrics["sketch-clipped-counters"] == 0.0
        # the reference quantisation: fixed_point.encode with the masker's generator
        vec = fixed_point.encode(flat, w_q, frac_bits=frac_bits, clip=PARAMS.clip,
                                 rng=np.random.default_rng([seed, i]))
        q[i] = vec[:-1].view(np.int32).astype(np.int64)
        if i != before:
            uploads[i] = up.masked
    result = fed.finish(uploads, after=after)
    counted = [i for i in range(N) if i != before]
    assert list(result.counted) == counted and result.dropped == (before,)
    stage = find_sketch(history.compressor())
    assert stage is not None
    cs = stage.sketch_for(DIM)
    want = _naive_int_sketch(cs.buckets, cs.signs, sum(q[i] for i in counted), cs.cols)
    assert result.total is not None
    got = from_ring(result.total[:-1], result.ring_bits).reshape(cs.shape)
    np.testing.assert_array_equal(got, want)  # exact, in integers
    w_sum = sum(int(fixed_point.quantize_weight(weights[i], PARAMS.weight_scale,
                                                result.frac_bits)) for i in counted)
    assert int(result.total[-1]) & ((1 << result.ring_bits) - 1) == w_sum
    # the server's FetchSGD step (momentum 0, first round): top-k of the naive point queries
    decoder = RoundDecoder(SupportHistory(spec, 5))
    decoder.history.advance(1, glob)
    decoded = decoder.decode(layout, result.mean, result.total, dim=DIM, num_sites=N,
                             ring_bits=result.ring_bits)
    est = _naive_estimates(cs.buckets, cs.signs, want / w_sum)
    top = np.sort(np.argsort(-np.abs(est), kind="stable")[:12])
    np.testing.assert_array_equal(np.flatnonzero(decoded.delta), top)
    np.testing.assert_allclose(decoded.delta[top], est[top], rtol=1e-9, atol=1e-12)
    decoder.accept()


def test_secure_vote_sum_and_next_support_equal_the_naive_count() -> None:
    rng = np.random.default_rng(3)
    spec = UploadSpec.parse("vote:24,vote=10,rows=2,cols=64+ef", secure=True)
    fed = Fed(7)
    glob = _glob(rng)
    server_history = SupportHistory(spec, 9)
    decoder = RoundDecoder(server_history)
    residual: list[dict[str, np.ndarray]] = [{} for _ in range(N)]
    naive_e = [np.zeros(DIM) for _ in range(N)]
    weights = [float(w) for w in rng.integers(5, 100, N)]
    bits = PARAMS.encoding_for(N)[1]
    for rnd in (1, 2, 3):
        server_history.advance(rnd, glob)
        support = server_history.support()
        assert support is not None and support.size == 24
        layout = masked_layout(server_history, DIM, num_sites=N, ring_bits=bits)
        assert layout.values == 24 and layout.vote_counters == 128
        assert layout.vote_bits == 3 and layout.vote_elements == -(-128 // (bits // 3))
        requests = fed.requests(layout.dim)
        uploads, votes, values = {}, [], []
        for i, req in requests.items():
            site = SupportHistory.at_site(spec, 9, rnd, glob, votes=server_history.votes)
            assert np.array_equal(site.support(), support)  # the same support on both sides
            trained = _trained(rng, glob, 0.1)
            up = UploadPipeline(spec, site).run(
                trained, weight=weights[i], residual=residual[i], rng=rng,
                mask=SecAggMasker(fed.clients[i], req, rng=np.random.default_rng(i)))
            residual[i] = up.residual
            uploads[i] = up.masked
            # reference: c = delta + e; send c on the support; vote top-10 of what is left
            c = _flat_delta(trained, glob) + naive_e[i]
            values.append(c[support].copy())
            c[support] = 0.0
            naive_e[i] = c
            vs = VoteSketch(DIM, 2, 64, seed=spec.compressor(run_seed=9, server_round=rnd)
                            .inner.seed, round=rnd)  # type: ignore[attr-defined]
            chosen = np.argsort(-np.abs(c), kind="stable")[:10]
            table = np.zeros((2, 64), np.int64)
            for j in range(2):
                for idx in chosen:
                    table[j, vs.hashes.buckets[j, idx]] = 1
            votes.append(table)
        result = fed.finish(uploads)
        decoded = decoder.decode(layout, result.mean, result.total, dim=DIM, num_sites=N,
                                 ring_bits=result.ring_bits)
        assert decoded.votes is not None
        np.testing.assert_array_equal(decoded.votes, sum(votes))  # secure vote == naive count
        w = np.asarray(weights) / sum(weights)
        mean = sum(wi * v for wi, v in zip(w, values, strict=True))
        assert np.abs(decoded.delta[support] - mean).max() <= result.error_bound + 1e-6
        assert not np.delete(decoded.delta, support).any()
        decoder.accept()
        assert server_history.votes is not None and server_history.votes[0] == rnd
        # the next support: most popular (count-min over rows), public priority, then index
        total = sum(votes)
        pop = np.array([min(total[j, vs.hashes.buckets[j, i]] for j in range(2))
                        for i in range(DIM)])
        prio = vs.priority()
        order = sorted(range(DIM), key=lambda i: (-pop[i], int(prio[i]), i))
        server_history.advance(rnd + 1, glob)
        got = server_history.support()
        assert got is not None
        np.testing.assert_array_equal(got, np.sort(order[:24]))
        server_history.round, server_history.sent = rnd, [g.copy() for g in glob]


def test_vote_is_refused_in_plaintext_with_the_reason() -> None:
    with pytest.raises(ConfigError) as info:
        UploadSpec.parse("vote:0.01,rows=2,cols=512+ef")
    text = str(info.value)
    assert text.startswith("compression.up") and "Bloom filter" in text
    assert "secure" in text and "Fix:" in text
    spec = UploadSpec.parse("vote:0.01,rows=2,cols=512+ef", secure=True)
    assert spec.votes and spec.public_support and spec.error_feedback


@pytest.mark.parametrize("up", ["sketch:k=100,rows=3,cols=500", "shared-dgc:0.01,momentum=0.9",
                                "shared-dgc:0.01,support=aggtopk,random=0.5",
                                "vote:0.01,vote=0.005,rows=2,size=0.01+ef"])
def test_issue_21_modes_run_under_secure_aggregation(up: str) -> None:
    spec = UploadSpec.parse(up, support="random", secure=True)
    assert spec.up == up and not spec.reveals_indices


@pytest.mark.parametrize(("up", "words"), [
    ("sketch:k=100,rows=3,cols=500+shared:0.01", "one sparsifier"),
    ("vote:0.01,rows=2,cols=64+ef+int8", "meaningless"),
    ("sketch:k=10,rows=3,cols=50+ef", "FetchSGD keeps the error at the server"),
])
def test_bad_secure_combinations_are_refused(up: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        UploadSpec.parse(up, support="random", secure=True)


def test_shared_dgc_on_the_aggregate_needs_the_previous_model_and_starts_random() -> None:
    spec = UploadSpec.parse("shared-dgc:0.05,support=aggtopk,random=0.2", secure=True)
    assert spec.needs_previous and spec.error_feedback
    rng = np.random.default_rng(0)
    g0, g1 = _glob(rng), _glob(rng)
    first = SupportHistory.at_site(spec, 3, 1, g0)
    sup = first.support()
    rand = SupportHistory.at_site(UploadSpec.parse("shared-dgc:0.05", secure=True), 3, 1, g0)
    assert sup is not None and np.array_equal(sup, rand.support())  # seeded random, round 1
    later = SupportHistory.at_site(spec, 3, 2, g1, 1, g0).support()
    agg = np.abs(np.concatenate([(b - a).ravel() for a, b in zip(g0, g1, strict=True)]))
    assert later is not None
    top = np.argsort(-agg, kind="stable")[:later.size - round(0.2 * later.size)]
    assert set(top.tolist()) <= set(later.tolist())


def test_sketch_and_vote_refuse_a_masker_that_cannot_take_ring_vectors() -> None:
    rng = np.random.default_rng(1)
    glob = _glob(rng)
    for up in ("sketch:k=5,rows=2,cols=30", "vote:10,rows=2,cols=32+ef"):
        spec = UploadSpec.parse(up, secure=True)
        pipe = UploadPipeline(spec, SupportHistory.at_site(spec, 0, 1, glob))
        with pytest.raises(ProtocolError, match="already-encoded ring vector"):
            pipe.run(_trained(rng, glob, 0.1), weight=3.0, rng=rng, mask=lambda v, w: v)


def test_shared_dgc_keeps_residual_and_momentum_across_rounds() -> None:
    rng = np.random.default_rng(2)
    spec = UploadSpec.parse("shared-dgc:0.1,momentum=0.5,decay=0.9")
    glob = _glob(rng)
    state: dict[str, np.ndarray] = {}
    for rnd in (1, 2):
        trained = _trained(np.random.default_rng(rnd), glob, 0.1)
        pipe = UploadPipeline(spec, SupportHistory.at_site(spec, 0, rnd, glob))
        up = pipe.run(trained, weight=1.0, residual=state, rng=rng)
        assert up.payload is not None and all(t.implicit_indices for t in up.payload.tensors)
        assert {k.split(".")[0] for k in up.residual} == {"residual", "momentum"}
        if rnd == 2:  # the state was loaded: without it the residual would differ
            fresh = UploadPipeline(spec, SupportHistory.at_site(spec, 0, rnd, glob))
            again = fresh.run(trained, weight=1.0, rng=np.random.default_rng(0))
            assert not all(np.array_equal(up.residual[k], again.residual[k])
                           for k in again.residual)
        state = up.residual


def test_decoder_reject_restores_fetchsgd_and_drops_votes() -> None:
    spec = UploadSpec.parse("sketch:k=4,rows=2,cols=16", secure=True)
    history = SupportHistory(spec, 1)
    history.advance(1, [np.zeros(DIM, np.float32)])
    decoder = RoundDecoder(history)
    rng = np.random.default_rng(0)
    layout = masked_layout(history, DIM, num_sites=N, ring_bits=32)
    table = rng.normal(size=layout.values)
    d1 = decoder.decode(layout, table, None, dim=DIM, num_sites=N, ring_bits=32)
    decoder.accept()
    saved = decoder.state_dict()
    assert np.count_nonzero(d1.delta) == 4 and saved["error"].any()
    decoder.decode(layout, rng.normal(size=layout.values), None, dim=DIM, num_sites=N,
                   ring_bits=32)
    decoder.reject()
    after = decoder.state_dict()
    assert all(np.array_equal(saved[k], after[k]) for k in saved if k != "dim")
    # a checkpoint round trip keeps the tables; another sketch refuses them
    other = RoundDecoder(history)
    other.load_state_dict(saved)
    assert other.fetchsgd is not None and np.array_equal(other.fetchsgd.error, saved["error"])
    with pytest.raises(ConfigError, match="another sketch"):
        spec2 = UploadSpec.parse("sketch:k=4,rows=2,cols=17", secure=True)
        h2 = SupportHistory(spec2, 1)
        h2.advance(1, [np.zeros(DIM, np.float32)])
        RoundDecoder(h2).load_state_dict(saved)


def test_vote_counts_above_the_number_of_sites_refuse_the_votes() -> None:
    spec = UploadSpec.parse("vote:10,rows=2,cols=32+ef", secure=True)
    history = SupportHistory(spec, 1)
    history.advance(1, [np.zeros(DIM, np.float32)])
    layout = masked_layout(history, DIM, num_sites=5, ring_bits=32)
    vote = find_vote_support(history.compressor())
    assert vote is not None and layout.vote_bits == 3
    total = np.zeros(layout.dim + 1, np.uint32)
    total[layout.values] = 6  # a counter of 6 "sites" in a round of 5 (fits its 3-bit field)
    total[layout.values + 3] = 5 << 6  # row 1's first counter: 10 counters per element
    decoder = RoundDecoder(history)
    bad = decoder.decode(layout, np.zeros(layout.dim), total, dim=DIM, num_sites=5,
                         ring_bits=32)
    assert bad.votes is None and "vote sum counter = 6: must be in [0, 5]" in bad.vote_problem
    decoder.accept()  # the round's values count; its votes are forgotten
    assert history.votes is None
    total[layout.values] = 5  # five sites that each voted for coordinates hashed there
    ok = RoundDecoder(history).decode(layout, np.zeros(layout.dim), total, dim=DIM,
                                      num_sites=5, ring_bits=32)
    assert ok.vote_problem == "" and ok.votes is not None
    assert int(ok.votes[0, 0]) == 5 and int(ok.votes[1, 0]) == 5


@pytest.mark.parametrize(("table", "cast", "words"), [
    (np.zeros(5, np.int64), 0, "2-D table"),
    (-np.ones((2, 3), np.int64), 0, "2-D table"),
    (np.ones((2, 3)), 0, "2-D table"),
    (np.ones((2, 3), np.int64), 9, "must not be after"),
])
def test_history_refuses_bad_vote_sums(table: np.ndarray, cast: int, words: str) -> None:
    spec = UploadSpec.parse("vote:10,rows=2,cols=3+ef", secure=True)
    with pytest.raises(ProtocolError, match=words):
        SupportHistory.at_site(spec, 0, 2, [np.zeros(DIM, np.float32)], votes=(cast, table))


@pytest.mark.parametrize("secure", [False, True])
def test_aggtopk_with_a_random_share_starts_as_the_seeded_random_support(secure: bool) -> None:
    # round 1 has no aggregate: aggtopk:<amount>,random=<f> is shared:<amount> (random= and
    # all), and the spec is accepted at start-up (it was refused: 'unknown option random')
    spec = UploadSpec.parse("aggtopk:0.05,random=0.2+ef", secure=secure)
    assert spec.needs_previous
    rng = np.random.default_rng(0)
    g0, g1 = _glob(rng), _glob(rng)
    first = SupportHistory.at_site(spec, 3, 1, g0).support()
    rand = SupportHistory.at_site(UploadSpec.parse("shared:0.05+ef", secure=secure), 3, 1, g0)
    assert first is not None and np.array_equal(first, rand.support())
    later = SupportHistory.at_site(spec, 3, 2, g1, 1, g0).support()
    agg = np.abs(np.concatenate([(b - a).ravel() for a, b in zip(g0, g1, strict=True)]))
    assert later is not None
    top = np.argsort(-agg, kind="stable")[:later.size - round(0.2 * later.size)]
    assert set(top.tolist()) <= set(later.tolist())
