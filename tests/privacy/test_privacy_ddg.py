"""One distributed discrete Gaussian round: site encoder -> modular sum -> server decoder.

Oracles: the plain float sum of the clipped updates (noiseless round trips, within the
rounding bound), the discrete Gaussian's law (the noise of the sum of the encoders), and
modular arithmetic (a sum that leaves the ring decodes to its value minus 2^b).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from fedagg.errors import AbortRound, ConfigError, ProtocolError
from fedagg.privacy import (
    DdgDecoder,
    DdgEncoder,
    DdgParams,
    HadamardRotation,
    clip_to_norm,
    conditional_round,
    discrete_gaussian_pmf,
    discrete_gaussian_variance,
    rounded_l2_bound,
)


def params(**kw: object) -> DdgParams:
    base: dict[str, object] = dict(clip=1.0, gamma=1e-3, sigma_site=0.0, ring_bits=20,
                                   num_sites=5, min_sites=3, dim=100)
    base.update(kw)
    return DdgParams(**base)  # type: ignore[arg-type]


def ring_sum(p: DdgParams, updates: list[np.ndarray], seed: bytes,
             rng: np.random.Generator) -> np.ndarray:
    enc = DdgEncoder(p)
    total = np.zeros(p.padded_dim, np.int64)
    for u in updates:
        e = enc.encode(u, seed=seed, rng=rng)
        assert e.ring.dtype == np.uint32 and e.ring.shape == (p.padded_dim,)
        assert int(e.ring.max(initial=0)) < p.modulus
        total += e.ring
    return (total % p.modulus).astype(np.uint32)


def updates_within(n: int, d: int, clip: float, rng: np.random.Generator) -> list[np.ndarray]:
    """``n`` random updates with norms in (0.1, 0.99) * clip (no clipping)."""
    out = []
    for _ in range(n):
        v = rng.standard_normal(d)
        out.append(v / np.linalg.norm(v) * clip * rng.uniform(0.1, 0.99))
    return out


# ------------------------------------------------------------------------ noiseless sums


@pytest.mark.parametrize("d", [1, 3, 7, 64, 1000, 4097])
@pytest.mark.parametrize("n", [1, 3, 10])
def test_noiseless_round_trip_is_the_sum_within_the_rounding_bound(d: int, n: int) -> None:
    rng = np.random.default_rng(d * 100 + n)
    p = params(num_sites=n, min_sites=n, dim=d)
    xs = updates_within(n, d, p.clip, rng)
    out = DdgDecoder(p).decode(ring_sum(p, xs, b"r", rng), survivors=n, seed=b"r")
    truth = np.sum(xs, axis=0)
    err = float(np.linalg.norm(out.sum - truth))
    # Each site's rounding moves each of the d_pad rotated coordinates by less than one
    # grid step; the rotation is orthogonal: ||error|| < n * gamma * sqrt(d_pad).
    assert err < n * p.gamma * math.sqrt(p.padded_dim)
    # and, summed over independent coordinates, about gamma * sqrt(n d_pad / 6) at most
    # sqrt(n * d_pad / 4) in expectation: a factor 3 leaves room for one round's variation.
    assert err < 3 * p.gamma * math.sqrt(n * p.padded_dim / 4) + 1e-12
    np.testing.assert_allclose(out.mean, out.sum / n, rtol=1e-15)
    assert out.survivors == n and 0 <= out.peak < 0.01


def test_rounding_is_unbiased_over_rounds() -> None:
    """Averaged over 3000 rounds the decoded sum converges to the true sum (unbiased
    rounding; the conditioning of beta = exp(-0.5) leaves no visible bias)."""
    rng = np.random.default_rng(3)
    p = params(gamma=0.05, num_sites=2, min_sites=2, dim=16)
    xs = updates_within(2, 16, 1.0, rng)
    truth = np.sum(xs, axis=0)
    dec = DdgDecoder(p)
    got = np.stack([dec.decode(ring_sum(p, xs, b"u", rng), survivors=2, seed=b"u").sum
                    for _ in range(3000)])
    se = got.std(axis=0) / math.sqrt(len(got))
    assert float(np.max(np.abs(got.mean(axis=0) - truth) / se)) < 5.0


def test_dropouts_decode_the_survivors_sum() -> None:
    rng = np.random.default_rng(4)
    p = params(num_sites=6, min_sites=3, dim=300)
    xs = updates_within(6, 300, 1.0, rng)
    for k in (3, 4, 6):
        out = DdgDecoder(p).decode(ring_sum(p, xs[:k], b"k", rng), survivors=k, seed=b"k")
        assert np.linalg.norm(out.sum - np.sum(xs[:k], axis=0)) < k * p.gamma * math.sqrt(512)
        np.testing.assert_allclose(out.mean, out.sum / k)


def test_clipping_scales_to_exactly_c() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal(1000) * 3
    norm = float(np.linalg.norm(x))
    y = x.copy()
    assert clip_to_norm(y, 1.5) == (norm, True)
    assert float(np.linalg.norm(y)) == pytest.approx(1.5, rel=1e-14)
    np.testing.assert_allclose(y, x * 1.5 / norm, rtol=1e-15)
    z = x.copy()
    assert clip_to_norm(z, 2 * norm) == (norm, False) and np.array_equal(z, x)


def test_encoder_reports_clipping_and_decodes_the_clipped_update() -> None:
    rng = np.random.default_rng(6)
    p = params(num_sites=1, min_sites=1, dim=500, gamma=1e-4)
    x = rng.standard_normal(500) * 10
    e = DdgEncoder(p).encode(x, seed=b"c", rng=rng)
    assert e.clipped and e.norm == pytest.approx(float(np.linalg.norm(x)))
    assert e.tries >= 1 and not e.fallback
    out = DdgDecoder(p).decode(e.ring, survivors=1, seed=b"c").sum
    assert np.linalg.norm(out - x / np.linalg.norm(x)) < p.gamma * math.sqrt(512)
    assert not DdgEncoder(p).encode(x / 1000, seed=b"c", rng=rng).clipped


def test_update_of_any_shape_is_flattened() -> None:
    rng = np.random.default_rng(7)
    p = params(num_sites=1, min_sites=1, dim=12)
    x = rng.standard_normal((3, 4)) * 0.1
    e = DdgEncoder(p).encode(x, seed=b"s", rng=rng)
    out = DdgDecoder(p).decode(e.ring, survivors=1, seed=b"s").sum
    assert np.linalg.norm(out - x.reshape(-1)) < p.gamma * 4


# ------------------------------------------------------------------------- the noise


def noise_sums(sigma_site: float, k: int, rounds: int, d: int = 4096) -> np.ndarray:
    """The centred ring sum of ``k`` encoders of a zero update, ``rounds`` times: exactly the
    sum of their noise shares (zero rotates and rounds to zero)."""
    rng = np.random.default_rng(int(sigma_site * 1000) + k)
    p = params(sigma_site=sigma_site, num_sites=8, min_sites=4, dim=d, ring_bits=24)
    zero = np.zeros(d)
    out = []
    for r in range(rounds):
        s = ring_sum(p, [zero] * k, b"n%d" % r, rng).astype(np.int64)
        s[s >= p.modulus // 2] -= p.modulus
        out.append(s)
    return np.concatenate(out)


@pytest.mark.parametrize("k", [4, 6, 8])
def test_noise_of_any_survivors_has_at_least_the_target_variance(k: int) -> None:
    """Each site adds N_Z(0, sigma^2 / n_min): k >= n_min survivors sum to variance
    k / n_min * sigma^2 >= sigma^2 (sigma_site = 3: its variance is 9 to 1e-15)."""
    sigma_site, n_min = 3.0, 4
    x = noise_sums(sigma_site, k, rounds=40).astype(np.float64)
    target = n_min * sigma_site**2
    expected = k * discrete_gaussian_variance(sigma_site)
    se = expected * math.sqrt(2.0 / x.size)
    assert abs(x.mean()) < 5 * math.sqrt(expected / x.size)
    assert abs(x.var() - expected) < 5 * se
    assert x.var() > target - 5 * se
    assert x.var() == pytest.approx(k / n_min * target, rel=0.03)


def test_noise_sum_matches_the_exact_convolution_for_small_sigma() -> None:
    """sigma_site = 0.5, 4 shares: the sum's law is the 4-fold convolution of N_Z(0, 1/4)
    (not a discrete Gaussian: chi-square against the convolution, computed exactly)."""
    x = noise_sums(0.5, 4, rounds=60)
    base = discrete_gaussian_pmf(0.5, np.arange(-12, 13))
    conv = base
    for _ in range(3):
        conv = np.convolve(conv, base)
    support = np.arange(-48, 49)
    keep = conv * x.size >= 20
    counts = np.array([np.count_nonzero(x == v) for v in support[keep]], dtype=np.float64)
    rest = x.size - counts.sum()
    exp = np.concatenate([conv[keep], [1.0 - conv[keep].sum()]]) * x.size
    pvalue = stats.chisquare(np.concatenate([counts, [rest]]), exp).pvalue
    assert pvalue > 1e-4


def test_noise_sum_is_close_to_a_discrete_gaussian_of_the_summed_variance() -> None:
    """sigma_site = 3, 5 shares: the sum is within chi-square resolution of N_Z(0, 45)
    (KLS 2021: the gap, tau, is ~exp(-2 pi^2 9 / 2), nothing)."""
    x = noise_sums(3.0, 5, rounds=60)
    s = math.sqrt(5 * 9.0)
    support = np.arange(-60, 61)
    pmf = discrete_gaussian_pmf(s, support)
    keep = pmf * x.size >= 20
    counts = np.array([np.count_nonzero(x == v) for v in support[keep]], dtype=np.float64)
    exp = np.concatenate([pmf[keep], [1.0 - pmf[keep].sum()]]) * x.size
    pvalue = stats.chisquare(np.concatenate([counts, [x.size - counts.sum()]]), exp).pvalue
    assert pvalue > 1e-4


def test_noised_round_trip_has_the_stated_noise_on_the_mean() -> None:
    """Decoded mean minus the true mean: std per coordinate = mean_noise_std(k)."""
    rng = np.random.default_rng(8)
    p = params(sigma_site=50.0, gamma=1e-3, num_sites=5, min_sites=3, dim=2048,
               ring_bits=24)
    errs = []
    for r in range(4):
        xs = updates_within(4, 2048, 1.0, rng)
        out = DdgDecoder(p).decode(ring_sum(p, xs, b"m%d" % r, rng), survivors=4,
                                   seed=b"m%d" % r)
        errs.append(out.mean - np.mean(xs, axis=0))
    e = np.concatenate(errs)
    # the rounding adds at most gamma^2 / (4 k) to the variance of the mean
    std = math.sqrt(p.mean_noise_std(4) ** 2 + p.gamma**2 / 16)
    assert float(e.std()) == pytest.approx(std, rel=0.05)
    assert abs(float(e.mean())) < 5 * std / math.sqrt(e.size)


# ----------------------------------------------------------------------- modular wrap


def test_sum_that_leaves_the_ring_wraps_as_stated() -> None:
    """An update aligned with the (known) rotation puts its whole norm on one rotated
    coordinate; four of them exceed 2^(b-1) and the decoded value is the sum minus 2^b on
    that coordinate before the inverse rotation (module docstring of fedagg.privacy.ddg)."""
    p = params(gamma=1e-4, ring_bits=16, num_sites=4, min_sites=4, dim=256)
    assert p.overflow_probability < 1e-3  # honest updates: a wrap is (provably) rare
    rot = HadamardRotation(256, b"w")
    spike = rot.inverse(np.eye(256)[9] * p.clip) * (1 - 1e-9)
    rng = np.random.default_rng(9)
    s = ring_sum(p, [spike] * 4, b"w", rng)
    centred = s.astype(np.int64)
    centred[centred >= p.modulus // 2] -= p.modulus
    true_level = 4 * round(p.clip / p.gamma)  # 40000 > 2^15 - 1
    assert true_level >= p.modulus // 2
    assert abs(int(centred[9]) - (true_level - p.modulus)) <= 4
    out = DdgDecoder(p).decode(s, survivors=4, seed=b"w")
    expected = rot.inverse(centred * p.gamma)
    np.testing.assert_allclose(out.sum, expected, atol=1e-9)
    assert np.linalg.norm(out.sum - 4 * spike) > 6.0  # the wrap is an error of 2^b gamma
    assert out.peak > 0.75
    honest = DdgDecoder(p).decode(ring_sum(p, updates_within(4, 256, 1.0, rng), b"w", rng),
                                  survivors=4, seed=b"w")
    assert honest.peak < 0.25


def test_centring_maps_the_ring_onto_minus_half_to_half() -> None:
    """Ring values 0 .. 2^(b-1) - 1 are themselves, 2^(b-1) .. 2^b - 1 are negative."""
    p = params(num_sites=1, min_sites=1, dim=1, ring_bits=8, gamma=0.1)
    sign = float(HadamardRotation(1, b"c").signs[0])
    dec = DdgDecoder(p)
    for ring, level in ((0, 0), (1, 1), (127, 127), (128, -128), (255, -1)):
        out = dec.decode(np.array([ring], np.uint32), survivors=1, seed=b"c")
        assert out.sum[0] == pytest.approx(sign * p.gamma * level, abs=1e-15)
        assert out.peak == abs(level) / 128


# ------------------------------------------------------------------ conditional rounding


@settings(max_examples=50, deadline=None)
@given(d=st.integers(1, 3000), norm=st.floats(0.0, 1e4), beta=st.sampled_from(
    [0.0, 0.1, math.exp(-0.5), 0.9]), seed=st.integers(0, 2**32 - 1))
def test_conditional_rounding_always_meets_its_bound(d: int, norm: float, beta: float,
                                                     seed: int) -> None:
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(d)
    x = v / np.linalg.norm(v) * norm
    bound_sq = math.floor(rounded_l2_bound(norm, beta, d) ** 2)
    r = conditional_round(x, bound_sq, rng)
    assert int(np.dot(r.values, r.values)) <= bound_sq
    assert np.all(np.abs(r.values - x) < 1.0)
    assert not r.fallback


def test_rounding_cap_falls_back_to_rounding_toward_zero() -> None:
    rng = np.random.default_rng(10)
    x = rng.standard_normal(400) * 3
    bound = math.floor(float(np.dot(x, x)))  # below what random rounding reaches
    r = conditional_round(x, bound, rng, max_tries=3)
    assert r.fallback and r.tries == 3
    np.testing.assert_array_equal(r.values, np.trunc(x).astype(np.int64))
    assert int(np.dot(r.values, r.values)) <= bound


# ------------------------------------------------------------------ property over shapes


@settings(max_examples=40, deadline=None)
@given(d=st.integers(1, 3000), n=st.integers(1, 20), data=st.data())
def test_round_trip_property_over_shapes_and_sites(d: int, n: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, n), label="survivors")
    seed = data.draw(st.binary(max_size=8), label="seed")
    scale = data.draw(st.sampled_from([0.01, 0.5, 3.0]), label="norm scale")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="rng"))
    p = params(num_sites=n, min_sites=k, dim=d, gamma=1e-3, ring_bits=24)
    xs = [rng.standard_normal(d) * scale / math.sqrt(d) for _ in range(k)]
    clipped = [x * min(1.0, p.clip / float(np.linalg.norm(x))) for x in xs]
    out = DdgDecoder(p).decode(ring_sum(p, xs, seed, rng), survivors=k, seed=seed)
    assert out.sum.shape == (d,)
    assert np.linalg.norm(out.sum - np.sum(clipped, axis=0)) < k * p.gamma * math.sqrt(
        p.padded_dim)


@settings(max_examples=25, deadline=None)
@given(d=st.integers(1, 3000), n=st.integers(1, 20), sigma=st.floats(0.5, 500.0),
       seed=st.integers(0, 2**32 - 1))
def test_noised_encodings_are_ring_elements(d: int, n: int, sigma: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    p = params(num_sites=n, min_sites=max(1, n // 2), dim=d, sigma_site=sigma, ring_bits=24)
    e = DdgEncoder(p).encode(rng.standard_normal(d), seed=b"x", rng=rng)
    assert e.ring.dtype == np.uint32 and e.ring.shape == (p.padded_dim,)
    assert int(e.ring.max()) < p.modulus


# ------------------------------------------------------------------------- bad inputs


def test_decoder_refuses_too_few_or_too_many_survivors() -> None:
    p = params()
    s = np.zeros(p.padded_dim, np.uint32)
    with pytest.raises(AbortRound, match="min_sites"):
        DdgDecoder(p).decode(s, survivors=2, seed=b"s")
    with pytest.raises(ProtocolError, match="num_sites"):
        DdgDecoder(p).decode(s, survivors=6, seed=b"s")
    with pytest.raises(ProtocolError, match="survivors"):
        DdgDecoder(p).decode(s, survivors=3.0, seed=b"s")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [np.zeros(100, np.uint32), np.zeros(129, np.uint32),
                                 np.zeros(128, np.float64),
                                 np.full(128, 1 << 20, np.uint32),
                                 np.full(128, -1, np.int64)])
def test_decoder_refuses_malformed_sums(bad: np.ndarray) -> None:
    with pytest.raises(ProtocolError, match="ring sum"):
        DdgDecoder(params()).decode(bad, survivors=3, seed=b"s")


def test_encoder_refuses_wrong_size_and_non_finite() -> None:
    enc = DdgEncoder(params())
    rng = np.random.default_rng(0)
    with pytest.raises(ConfigError, match="update"):
        enc.encode(np.zeros(99), seed=b"s", rng=rng)
    bad = np.zeros(100)
    bad[3] = np.nan
    with pytest.raises(ConfigError, match="finite"):
        enc.encode(bad, seed=b"s", rng=rng)
