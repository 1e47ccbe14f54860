"""Issue 21 end to end: ``sketch``, ``vote`` and ``shared-dgc`` over the real ClientApp.

SecureAggregation(FedAvg()) drives real SecAgg+ rounds; every message crosses Flower's
serialisation (server.inprocess.InProcessGrid) to the real ClientApp (clients.app:app, the
site protocol and the upload pipeline). Inside the sites, the tests only *record* (the
pre-mask inputs, the votes); the oracles are computed here:

* ``sketch``: the unmasked ring sum equals, exactly and in integers, the count sketch of the
  summed fixed-point updates of the counted sites (one site crashes before its upload in
  round 2 and is left out), and the applied coordinates are the naive top-k of the naive
  point queries (round 1; later rounds against FetchSGD's server state fed the naive sums);
* ``vote``: the vote sum the server unmasks equals the naive count of the counted sites'
  votes (with a crash before upload), the next round's support is the naive most popular
  one and every site uses it, the values' mean on it is the plaintext weighted mean within
  the reported bound, and every byte of the vote travels in the masked upload;
* ``shared-dgc``: secure equals plaintext on the same public support; the DGC state (residual
  and momentum) stays in ``Context.state``;
* plaintext: ``vote`` is refused with the reason; ``sketch`` runs FetchSGD on the weighted
  mean of the sites' sketches.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, Message

from clients.app import app
from clients.protocol import EF_KEY
from fedagg.compression import (
    BlockVote,
    FetchSGDServer,
    SketchCompressor,
    VoteSupport,
    find_sketch,
)
from fedagg.compression.ring import from_ring, unpack_counters
from fedagg.config import RunConfig, load_config
from fedagg.data import load_dataset
from fedagg.errors import ConfigError
from fedagg.models import build_model
from fedagg.secagg import MaskedUpload, fixed_point
from fedagg.secagg.packing import packed_words
from fedagg.update import SecAggMasker, UploadPipeline, public_seed
from fedagg.update import masked as masked_mod
from fedagg.update import pipeline as pipeline_mod
from server.inprocess import InProcessGrid, nodes_by_partition
from server.runner import client_config
from strategies.base import RoundResult
from strategies.compressed import Compressed
from strategies.loop import run_train_round
from strategies.registry import build_strategy
from strategies.secure import SecureAggregation
from strategies.wire import PARAMS_KEY, VOTES_KEY, arrays_to_record, record_to_arrays, unpack

BASE = ["run.sites=5", "train.local_epochs=1", "data.max_train_examples=300",
        "secagg.weight_scale=300"]
SKETCH = "sketch:k=60,rows=3,cols=200"
VOTE = "vote:150,vote=60,rows=2,cols=256+ef"
CRASH = ["faults.crash_site=2", "faults.crash_round=2", "faults.crash_stage=upload"]


def _cfg(*overrides: str) -> RunConfig:
    return load_config(None, [*BASE, *overrides])


def _initial(cfg: RunConfig) -> ArrayRecord:
    ds = load_dataset(cfg.data.dataset, test_fraction=cfg.data.test_fraction, seed=cfg.run.seed)
    model = build_model(cfg.model.name, ds.input_shape, ds.num_classes, seed=cfg.run.seed)
    sd = model.state_dict()
    return arrays_to_record([t.detach().numpy().copy() for t in sd.values()], list(sd))


def _round(strategy: Any, grid: InProcessGrid, rnd: int, arrays: ArrayRecord,
           cfg: RunConfig) -> RoundResult:
    return run_train_round(strategy, grid, rnd, arrays, client_config(cfg), 600.0)


def _flat(a: ArrayRecord) -> np.ndarray:
    return np.concatenate([x.astype(np.float64).ravel() for x in record_to_arrays(a)[1]])


def _naive_sketch(buckets: np.ndarray, signs: np.ndarray, q: np.ndarray, cols: int
                  ) -> np.ndarray:
    """``T[j, h_j(i)] += s_j(i) q_i`` one coordinate at a time (int64)."""
    rows, dim = buckets.shape
    table = np.zeros((rows, cols), np.int64)
    for j in range(rows):
        for i in range(dim):
            if q[i]:
                table[j, int(buckets[j, i])] += int(signs[j, i]) * int(q[i])
    return table


def _naive_topk(buckets: np.ndarray, signs: np.ndarray, table: np.ndarray, k: int
                ) -> tuple[np.ndarray, np.ndarray]:
    rows, dim = buckets.shape
    est = np.array([np.median([signs[j, i] * table[j, buckets[j, i]] for j in range(rows)])
                    for i in range(dim)])
    top = np.sort(np.argsort(-np.abs(est), kind="stable")[:k])
    return top, est[top]


class Recorder:
    """What the sites hand their masker (site index, pre-mask vector) and their inputs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.vectors: dict[int, np.ndarray] = {}
        self.inputs: list[tuple[np.ndarray, int, int, float, np.random.Generator]] = []
        self.votes: list[tuple[np.ndarray, np.ndarray]] = []
        self.values: list[tuple[np.ndarray, int]] = []
        real_mask = SecAggMasker.mask_encoded
        real_table = masked_mod.encode_table
        real_compress = VoteSupport.compress
        real_values = pipeline_mod.encode_values_and_votes

        def mask_encoded(masker: SecAggMasker, vector: np.ndarray) -> Any:
            self.vectors[masker.state.site] = vector.copy()
            self.sites.append(masker.state.site)
            return real_mask(masker, vector)

        def encode_table(values: Any, sketch: Any, **kw: Any) -> Any:
            self.inputs.append((np.concatenate([np.asarray(v, np.float64).ravel()
                                                for v in values]),
                                kw["weight_q"], kw["frac_bits"], kw["clip"],
                                copy.deepcopy(kw["rng"])))
            return real_table(values, sketch, **kw)

        def compress(stage: VoteSupport, tensors: Any, *, rng: Any) -> Any:
            out = real_compress(stage, tensors, rng=rng)
            dim = sum(int(np.size(t)) for t in tensors)
            assert stage.last_votes is not None
            self.votes.append((stage.last_votes.copy(), stage.support_for(dim).copy()))
            return out

        def values_and_votes(values: np.ndarray, vote: Any, **kw: Any) -> Any:
            self.values.append((values.copy(), kw["enc"].weight_q))
            return real_values(values, vote, **kw)

        self.sites: list[int] = []
        monkeypatch.setattr(SecAggMasker, "mask_encoded", mask_encoded)
        monkeypatch.setattr(masked_mod, "encode_table", encode_table)
        monkeypatch.setattr(VoteSupport, "compress", compress)
        monkeypatch.setattr(pipeline_mod, "encode_values_and_votes", values_and_votes)

    def clear(self) -> None:
        self.vectors.clear()
        self.inputs.clear()
        self.votes.clear()
        self.values.clear()
        self.sites.clear()


def test_masked_sketch_sum_is_the_integer_sketch_of_the_sum_and_top_k_is_naive(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch)
    cfg = _cfg("strategy.name=secure", f"compression.up={SKETCH}", *CRASH)
    secure = build_strategy(cfg)
    assert isinstance(secure, SecureAggregation)
    grid = InProcessGrid(app, 5, seed=3)
    arrays = _initial(cfg)
    dim = _flat(arrays).size
    stage = find_sketch(secure.history.spec.compressor(run_seed=cfg.run.seed, server_round=1))
    assert isinstance(stage, SketchCompressor)
    cs = stage.sketch_for(dim)
    naive_server = FetchSGDServer(cs, 60)  # fed the naive sums below
    for rnd in (1, 2, 3):
        rec.clear()
        res = _round(secure, grid, rnd, arrays, cfg)
        assert res.arrays is not None and res.metrics is not None
        result = secure.last_result
        counted = list(result.counted)
        assert len(counted) == (4 if rnd == 2 else 5) and res.report.replies == len(counted)
        assert res.metrics["secagg-values"] == cs.size  # the table is what is masked
        by_site = dict(zip(rec.sites, rec.inputs, strict=True))
        q_sum = np.zeros(dim, np.int64)
        w_sum = 0
        for site in counted:
            flat, w_q, frac_bits, clip, rng = by_site[site]
            q = fixed_point.encode(flat, w_q, frac_bits=frac_bits, clip=clip, rng=rng)
            q_sum += q[:-1].view(np.int32).astype(np.int64)
            w_sum += w_q
        want = _naive_sketch(cs.buckets, cs.signs, q_sum, cs.cols)
        got = from_ring(result.total[:-1], result.ring_bits).reshape(cs.shape)
        np.testing.assert_array_equal(got, want)  # exact, in integers
        assert int(result.total[-1]) & ((1 << result.ring_bits) - 1) == w_sum
        step = _flat(res.arrays) - _flat(arrays)
        mean_table = want / w_sum
        if rnd == 1:  # momentum 0 and no error yet: the naive top-k of the point queries
            top, est = _naive_topk(cs.buckets, cs.signs, mean_table, 60)
            np.testing.assert_array_equal(np.flatnonzero(step), top)
            np.testing.assert_allclose(step[top], est, rtol=1e-5, atol=1e-9)
        proposal = naive_server.step(mean_table)
        np.testing.assert_array_equal(np.flatnonzero(step), proposal.indices)
        np.testing.assert_allclose(step[proposal.indices], proposal.values, rtol=1e-5,
                                   atol=1e-9)
        arrays = res.arrays
    # the server's sketch state is checkpointed and restored
    state = secure.state_dict()
    assert np.array_equal(state["sketch"]["error"], naive_server.error)


def test_secure_vote_sum_is_the_naive_count_and_the_support_follows_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch)
    crash = ["faults.crash_site=2", "faults.crash_round=1", "faults.crash_stage=upload"]
    cfg = _cfg("strategy.name=secure", f"compression.up={VOTE}", *crash)
    secure = build_strategy(cfg)
    assert isinstance(secure, SecureAggregation)
    sent: list[Message] = []
    uploads: list[Message] = []

    def recording_app(msg: Message, ctx: Any) -> Message:
        out = app(msg, ctx)
        if msg.content.config_records[PARAMS_KEY]["stage"] == "upload":
            sent.append(msg)
            if not out.has_error():
                uploads.append(out)
        return out

    grid = InProcessGrid(recording_app, 5, seed=5)
    arrays = _initial(cfg)
    dim = _flat(arrays).size
    naive_total = None
    for rnd in (1, 2, 3):
        rec.clear()
        sent.clear()
        uploads.clear()
        res = _round(secure, grid, rnd, arrays, cfg)
        assert res.arrays is not None
        result = secure.last_result
        counted = list(result.counted)
        assert len(counted) == (4 if rnd == 1 else 5)
        support = secure.last_support
        assert support is not None and support.size == 150
        # every site used the server's support; the first one is the seeded random support
        for _, site_support in rec.votes:
            np.testing.assert_array_equal(site_support, support)
        if naive_total is not None:  # the support voted in the previous round
            vs = VoteSupport(support_k=150, vote_k=60, rows=2, cols=256,
                             seed=secure.spec.compressor(run_seed=cfg.run.seed, server_round=rnd)
                             .inner.seed, round=rnd - 1).sketch_for(dim)  # type: ignore[attr-defined]
            pop = np.array([min(naive_total[j, vs.hashes.buckets[j, i]] for j in range(2))
                            for i in range(dim)])
            prio = vs.priority()
            order = sorted(range(dim), key=lambda i: (-pop[i], int(prio[i]), i))
            np.testing.assert_array_equal(support, np.sort(order[:150]))
            assert all(VOTES_KEY in m.content.array_records for m in sent)
        else:
            assert not any(VOTES_KEY in m.content.array_records for m in sent)
        by_site = dict(zip(rec.sites, zip(rec.votes, rec.values, strict=True), strict=True))
        naive_total = sum(by_site[s][0][0] for s in counted)
        assert secure.history.votes is not None and secure.history.votes[0] == rnd
        np.testing.assert_array_equal(secure.history.votes[1], naive_total)  # == naive count
        # the values on the support: the weighted mean of what the counted sites sent
        w = np.array([by_site[s][1][1] for s in counted], np.float64)
        mean = sum(wi * by_site[s][1][0] for wi, s in zip(w, counted, strict=True)) / w.sum()
        step = _flat(res.arrays) - _flat(arrays)
        assert float(np.abs(step[support] - mean).max()) <= result.error_bound + 2e-6
        assert not np.delete(step, support).any()
        # every byte of the vote is in the masked upload: [values | packed votes | weight]
        bits = result.ring_bits
        layout = secure._round.layout  # type: ignore[union-attr]
        assert layout.vote_elements == -(-512 // (bits // layout.vote_bits))
        for site, vector in rec.vectors.items():
            packed = vector[layout.values:layout.values + layout.vote_elements]
            table = unpack_counters(packed, 512, layout.vote_bits, bits).reshape(2, 256)
            np.testing.assert_array_equal(table, by_site[site][0][0])
        for reply in uploads:
            masked = unpack(reply.content, MaskedUpload).masked
            assert masked.size == packed_words(150 + layout.vote_elements + 1, bits)
        arrays = res.arrays


def test_secure_shared_dgc_equals_plaintext_on_the_same_support() -> None:
    up = "shared-dgc:0.05,momentum=0.5,decay=0.9"
    cfg_sec = _cfg("strategy.name=secure", f"compression.up={up}")
    cfg_pl = _cfg("strategy.name=compressed", f"compression.up={up}")
    secure, plain = build_strategy(cfg_sec), build_strategy(cfg_pl)
    assert isinstance(secure, SecureAggregation) and isinstance(plain, Compressed)
    g_sec, g_pl = InProcessGrid(app, 5, seed=3), InProcessGrid(app, 5, seed=3)
    arrays = _initial(cfg_sec)
    for rnd in (1, 2, 3):
        rs = _round(secure, g_sec, rnd, arrays, cfg_sec)
        rp = _round(plain, g_pl, rnd, arrays, cfg_pl)
        assert rs.arrays is not None and rp.arrays is not None and rs.metrics is not None
        step_s, step_p = _flat(rs.arrays) - _flat(arrays), _flat(rp.arrays) - _flat(arrays)
        bound = float(rs.metrics["secagg-error-bound"]) + 2e-6  # type: ignore[arg-type]
        assert float(np.abs(step_s - step_p).max()) <= bound
        assert float(np.abs(step_p).max()) > 100 * bound
        arrays = rp.arrays
    for n_s, n_p in zip(nodes_by_partition(g_sec), nodes_by_partition(g_pl), strict=True):
        rec_s = g_sec.contexts[n_s].state.array_records[EF_KEY]
        rec_p = g_pl.contexts[n_p].state.array_records[EF_KEY]
        assert {k.split(".")[0] for k in rec_s} == {"residual", "momentum"}
        for (k1, a), (k2, b) in zip(zip(*record_to_arrays(rec_s), strict=True),
                                    zip(*record_to_arrays(rec_p), strict=True), strict=True):
            assert k1 == k2 and np.array_equal(a, b)


def test_vote_is_refused_in_plaintext() -> None:
    with pytest.raises(ConfigError) as info:
        build_strategy(_cfg("strategy.name=compressed", f"compression.up={VOTE}"))
    text = str(info.value)
    assert "Bloom filter" in text and "strategy.name = 'secure'" in text


def test_plaintext_sketch_is_fetchsgd_on_the_weighted_mean_of_the_sites_sketches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[tuple[float, np.ndarray]] = []
    real_run = UploadPipeline.run

    def run(pipe: UploadPipeline, trained: Any, **kw: Any) -> Any:
        out = real_run(pipe, trained, **kw)
        assert out.payload is not None
        got.append((out.weight, out.payload.to_dense()[0]))
        return out

    monkeypatch.setattr(UploadPipeline, "run", run)
    cfg = _cfg("strategy.name=compressed", f"compression.up={SKETCH}")
    plain = build_strategy(cfg)
    assert isinstance(plain, Compressed)
    grid = InProcessGrid(app, 5, seed=3)
    arrays = _initial(cfg)
    dim = _flat(arrays).size
    stage = find_sketch(plain.spec.compressor(run_seed=cfg.run.seed, server_round=1))
    assert stage is not None
    server = FetchSGDServer(stage.sketch_for(dim), 60)
    for rnd in (1, 2):
        got.clear()
        res = _round(plain, grid, rnd, arrays, cfg)
        assert res.arrays is not None and len(got) == 5
        total = sum(w for w, _ in got)
        mean = sum(t.astype(np.float64) * (w / total) for w, t in got)
        want = server.step(mean)
        step = _flat(res.arrays) - _flat(arrays)
        np.testing.assert_array_equal(np.flatnonzero(step), want.indices)
        np.testing.assert_allclose(step[want.indices], want.values, rtol=1e-5, atol=1e-9)
        arrays = res.arrays


def test_secure_block_vote_sum_is_the_naive_count_and_the_support_its_top_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch)
    up = "vote:0.02,vote=0.01,block=16+ef"
    cfg = _cfg("strategy.name=secure", f"compression.up={up}", "secagg.ring_bits=12",
               "secagg.frac_bits=6", "secagg.clip=1")
    secure = build_strategy(cfg)
    assert isinstance(secure, SecureAggregation)
    grid = InProcessGrid(app, 5, seed=2)
    arrays = _initial(cfg)
    dim = _flat(arrays).size
    blocks = -(-dim // 16)
    naive_total = None
    for rnd in (1, 2, 3):
        rec.clear()
        res = _round(secure, grid, rnd, arrays, cfg)
        assert res.arrays is not None and secure.last_result.ring_bits == 12
        support = secure.last_support
        assert support is not None
        for _, site_support in rec.votes:
            np.testing.assert_array_equal(site_support, support)
        if naive_total is not None:  # the most popular blocks, public priority, then index
            nb = max(1, round(0.02 * dim) // 16)
            prio = BlockVote(dim, 16, seed=public_seed(cfg.run.seed), round=rnd - 1).priority()
            order = sorted(range(blocks), key=lambda b: (-naive_total[b], int(prio[b]), b))[:nb]
            want = [i for b in sorted(order) for i in range(b * 16, min(b * 16 + 16, dim))]
            assert support.tolist() == want
        by_site = dict(zip(rec.sites, rec.votes, strict=True))
        for table, _ in rec.votes:
            assert table.shape == (1, blocks) and int(table.sum()) == -(-round(0.01 * dim) // 16)
        naive_total = sum(by_site[s][0][0] for s in secure.last_result.counted)
        assert secure.history.votes is not None
        np.testing.assert_array_equal(secure.history.votes[1][0], naive_total)
        step = _flat(res.arrays) - _flat(arrays)
        assert not np.delete(step, support).any() and np.abs(step[support]).max() > 0
        arrays = res.arrays
