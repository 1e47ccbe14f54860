"""The upload pipeline against a naive reference: plain EF-TopK, then a plain (masking) sum.

Sites run :class:`fedagg.update.UploadPipeline` over several rounds (residuals carried in the
:class:`~fedagg.update.SiteUpload` as a Flower site keeps them in ``Context.state``); the server
decodes with :func:`fedagg.update.decode_delta` (plaintext) or unmasks the SecAgg+ sum
(:class:`fedagg.secagg.LocalFederation`, real masking, every message round-tripped). The
reference is written here with numpy only: ``c = delta + e``, keep the top-k of ``|c|`` (or the
public support), ``e = c - sent``, weighted mean of what was sent.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagg.compression import codec
from fedagg.secagg import LocalFederation, SecAggParams
from fedagg.update import (
    SECURE_METRICS,
    SupportHistory,
    UploadPipeline,
    UploadSpec,
    decode_delta,
    densify,
)

SHAPES = [(13, 7), (7,), (3, 4, 5)]


def _deltas(rng: np.random.Generator, n: int) -> list[list[np.ndarray]]:
    return [[rng.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(n)]


def _naive_topk(c: np.ndarray, ratio: float) -> np.ndarray:
    k = int(np.ceil(ratio * c.size - 1e-9))
    keep = np.argsort(-np.abs(c.ravel()), kind="stable")[:k]
    out = np.zeros(c.size, np.float32)
    out[keep] = c.ravel()[keep]
    return out.reshape(c.shape)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), sites=st.integers(1, 5), ratio=st.sampled_from([0.05, 0.2, 0.5]))
def test_plaintext_ef_topk_equals_the_naive_reference(seed: int, sites: int, ratio: float) -> None:
    rng = np.random.default_rng(seed)
    spec = UploadSpec.parse(f"topk:{ratio}+ef")
    glob = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    weights = [float(w) for w in rng.integers(1, 50, size=sites)]
    residual: list[dict[str, np.ndarray]] = [{} for _ in range(sites)]
    naive_e = [[np.zeros(s, np.float32) for s in SHAPES] for _ in range(sites)]
    for rnd in range(1, 4):
        deltas = _deltas(rng, sites)
        history = SupportHistory.at_site(spec, 7, rnd, glob)
        got, want = [], []
        for i in range(sites):
            trained = [g + d for g, d in zip(glob, deltas[i], strict=True)]
            up = UploadPipeline(spec, history).run(trained, weight=weights[i],
                                                   residual=residual[i], rng=rng)
            residual[i] = up.residual
            assert up.payload is not None and up.values is None
            got.append(decode_delta(codec.encode(up.payload), shapes=SHAPES,
                                    support=history.support))
            sent = []
            for j, d in enumerate(deltas[i]):
                c = (np.asarray(glob[j] + d, np.float32) - glob[j]) + naive_e[i][j]
                s = _naive_topk(c, ratio)
                naive_e[i][j] = c - s
                sent.append(s)
            want.append(sent)
        w = np.asarray(weights) / sum(weights)
        for j in range(len(SHAPES)):
            agg = sum(wi * g[j].astype(np.float64) for wi, g in zip(w, got, strict=True))
            ref = sum(wi * r[j].astype(np.float64) for wi, r in zip(w, want, strict=True))
            np.testing.assert_allclose(agg, ref, rtol=1e-6, atol=1e-7)
        for i in range(sites):  # the residual the site keeps is the reference's, too
            for j in range(len(SHAPES)):
                np.testing.assert_allclose(residual[i][f"residual.{j}"], naive_e[i][j],
                                           rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("support", ["random", "block"])
@pytest.mark.parametrize("sites", [2, 5])
def test_secure_sparse_masked_sum_equals_the_naive_reference(support: str, sites: int) -> None:
    """Pipeline + real SecAgg+ masking over 3 rounds == naive EF on the public support."""
    rng = np.random.default_rng(sites)
    spec = UploadSpec.parse("topk:0.1+ef", support=support, secure=True)
    params = SecAggParams(threshold=(sites - 1) // 2 + 1, clip=8.0, precision=1e-7,
                          weight_scale=100.0)  # t > k/2
    fed = LocalFederation(sites, params, seed=3)
    fed.setup()
    glob = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    dim = sum(int(np.prod(s)) for s in SHAPES)
    weights = [float(w) for w in rng.integers(1, 50, size=sites)]
    residual: list[dict[str, np.ndarray]] = [{} for _ in range(sites)]
    naive_e = [np.zeros(dim, np.float64) for _ in range(sites)]
    for rnd in range(1, 4):
        history = SupportHistory.at_site(spec, 11, rnd, glob)
        support_idx = history.support()
        assert support_idx is not None and 0 < support_idx.size < dim
        deltas = _deltas(rng, sites)
        values, naive_vals = [], []
        for i in range(sites):
            trained = [g + d for g, d in zip(glob, deltas[i], strict=True)]
            up = UploadPipeline(spec, history).run(trained, weight=weights[i],
                                                   residual=residual[i], rng=rng,
                                                   mask=lambda v, w: ("masked", v.size, w))
            residual[i] = up.residual
            # the values on the support, then the metric slots (the train loss, masked too)
            assert up.masked == ("masked", support_idx.size + 2 * len(SECURE_METRICS),
                                 weights[i]) and up.payload is None
            values.append(up.values)
            flat = np.concatenate([((g + d) - g).astype(np.float32).ravel().astype(np.float64)
                                   for g, d in zip(glob, deltas[i], strict=True)])
            c = flat + naive_e[i]
            naive_vals.append(c[support_idx])
            c[support_idx] = 0.0
            naive_e[i] = c
        result = fed.run_round(values, weights)  # real double masking, unmasked sum / weight
        mean = densify(result.mean, support_idx, dim)
        w = np.asarray(weights) / sum(weights)
        ref = densify(sum(wi * v for wi, v in zip(w, naive_vals, strict=True)), support_idx, dim)
        assert np.abs(mean - ref).max() <= result.error_bound + 1e-6
        for i in range(sites):
            kept = np.concatenate([residual[i][f"residual.{j}"].ravel()
                                   for j in range(len(SHAPES))])
            np.testing.assert_allclose(kept, naive_e[i], rtol=1e-5, atol=1e-6)


def test_dense_secure_values_are_the_flat_delta_in_float64() -> None:
    rng = np.random.default_rng(0)
    spec = UploadSpec.parse("none", secure=True)
    glob = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    trained = [g + rng.normal(size=g.shape).astype(np.float32) for g in glob]
    up = UploadPipeline(spec, SupportHistory.at_site(spec, 0, 1, glob)).run(
        trained, weight=3.0, rng=rng, mask=lambda v, w: w)
    want = np.concatenate([t.astype(np.float64).ravel() - g.astype(np.float64).ravel()
                           for t, g in zip(trained, glob, strict=True)])
    assert up.values is not None and up.values.dtype == np.float64
    np.testing.assert_array_equal(up.values, want)
    assert up.masked == 3.0


def test_spec_is_parsed_once_and_checked_at_construction() -> None:
    a = UploadSpec.parse("topk:0.01+ef", support="random", secure=True)
    assert a is UploadSpec.parse("topk:0.01+ef", support="random", secure=True)  # memoized
    assert a.up == "shared:0.01+ef" and a.public_support and a.error_feedback
    from fedagg.errors import ConfigError

    with pytest.raises(ConfigError, match="ratio"):
        UploadSpec.parse("topk:2.5")
    with pytest.raises(ConfigError, match="chooses indices per site"):
        UploadSpec.parse("topk:0.01", secure=True)
