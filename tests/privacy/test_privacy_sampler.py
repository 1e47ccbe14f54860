"""The discrete Gaussian sampler against its pmf (CKS 2020): chi-square, DKW, moments."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from fedagg.errors import ConfigError
from fedagg.privacy import (
    discrete_gaussian_pmf,
    discrete_gaussian_variance,
    sample_discrete_gaussian,
)

N = 400_000


def chi_square_pvalue(samples: np.ndarray, pmf: np.ndarray, support: np.ndarray) -> float:
    """Chi-square goodness of fit on the integers ``support`` (outer cells pooled so every
    expected count is >= 20; everything outside the support goes to the end cells)."""
    n = samples.size
    expected = pmf * n
    lo = int(np.argmax(np.cumsum(expected) >= 20))
    hi = len(support) - 1 - int(np.argmax(np.cumsum(expected[::-1]) >= 20))
    edges = support[lo:hi + 1]
    counts = np.array([np.count_nonzero(samples <= edges[0])]
                      + [np.count_nonzero(samples == v) for v in edges[1:-1]]
                      + [np.count_nonzero(samples >= edges[-1])], dtype=np.float64)
    cdf = np.cumsum(pmf)
    exp_cells = np.concatenate([[cdf[lo]], pmf[lo + 1:hi], [1.0 - cdf[hi - 1]]]) * n
    assert counts.sum() == n
    return float(stats.chisquare(counts, exp_cells).pvalue)


def support_for(sigma: float) -> np.ndarray:
    half = int(12 * sigma) + 4
    return np.arange(-half, half + 1)


@pytest.mark.parametrize("sigma", [0.5, 3.0, 50.0])
def test_chi_square_against_the_pmf(sigma: float) -> None:
    x = sample_discrete_gaussian(sigma, N, np.random.default_rng(11))
    support = support_for(sigma)
    pmf = discrete_gaussian_pmf(sigma, support)
    assert abs(pmf.sum() - 1.0) < 1e-12
    assert chi_square_pvalue(x, pmf, support) > 1e-4


@pytest.mark.parametrize("sigma", [0.5, 3.0, 50.0])
def test_chi_square_rejects_a_wrong_distribution(sigma: float) -> None:
    """The test above has power: a rounded continuous Gaussian of 8 % larger scale fails."""
    rng = np.random.default_rng(12)
    wrong = np.rint(rng.normal(0.0, sigma * 1.08, N)).astype(np.int64)
    support = support_for(sigma * 1.08)
    assert chi_square_pvalue(wrong, discrete_gaussian_pmf(sigma, support), support) < 1e-6


@pytest.mark.parametrize("sigma", [0.5, 3.0, 50.0])
def test_empirical_cdf_within_dkw_band(sigma: float) -> None:
    """Dvoretzky–Kiefer–Wolfowitz (Massart's constant; holds for discrete laws too):
    ``P[sup |F_n - F| > e] <= 2 exp(-2 n e^2)``, here with probability 1e-6."""
    x = np.sort(sample_discrete_gaussian(sigma, N, np.random.default_rng(13)))
    support = support_for(sigma)
    cdf = np.cumsum(discrete_gaussian_pmf(sigma, support))
    empirical = np.searchsorted(x, support, side="right") / N
    band = math.sqrt(math.log(2 / 1e-6) / (2 * N))
    assert float(np.abs(empirical - cdf).max()) < band


@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0, 50.0])
def test_mean_and_variance(sigma: float) -> None:
    x = sample_discrete_gaussian(sigma, N, np.random.default_rng(14)).astype(np.float64)
    support = support_for(sigma)
    pmf = discrete_gaussian_pmf(sigma, support)
    var = discrete_gaussian_variance(sigma)
    assert var == pytest.approx(float((pmf * support**2).sum()), rel=1e-9)
    fourth = float((pmf * support.astype(np.float64) ** 4).sum())
    assert abs(x.mean()) < 5 * math.sqrt(var / N)
    assert abs(x.var() - var) < 5 * math.sqrt((fourth - var * var) / N)
    assert var <= sigma**2


def test_variance_below_sigma_squared_for_small_sigma() -> None:
    assert discrete_gaussian_variance(0.5) == pytest.approx(0.2150127, rel=1e-6)
    assert discrete_gaussian_variance(1.0) == pytest.approx(1.0, rel=1e-6)
    assert discrete_gaussian_variance(1.0) < 1.0


def test_more_than_one_chunk() -> None:
    """Sizes beyond one internal chunk (2^20) are filled everywhere, with the right law."""
    x = sample_discrete_gaussian(3.0, (1 << 20) + 12345, np.random.default_rng(15))
    tail = x[1 << 20:].astype(np.float64)
    assert abs(x.astype(np.float64).var() - 9.0) < 0.05
    assert abs(tail.var() - 9.0) < 0.6 and tail.std() > 0


def test_seeded_and_zero() -> None:
    a = sample_discrete_gaussian(2.0, 1000, np.random.default_rng(1))
    b = sample_discrete_gaussian(2.0, 1000, np.random.default_rng(1))
    assert a.dtype == np.int64 and np.array_equal(a, b)
    assert not sample_discrete_gaussian(0.0, 10, np.random.default_rng(1)).any()
    assert sample_discrete_gaussian(3.0, 0, np.random.default_rng(1)).size == 0
    assert discrete_gaussian_pmf(0.0, [0, 1]).tolist() == [1.0, 0.0]


@pytest.mark.parametrize("sigma", [-1.0, math.nan, math.inf, "3", True, 2.0**41])
def test_bad_sigma_names_the_field(sigma: object) -> None:
    with pytest.raises(ConfigError, match=r"privacy\.sigma_site"):
        sample_discrete_gaussian(sigma, 10, np.random.default_rng(0))  # type: ignore[arg-type]


def test_bad_size() -> None:
    with pytest.raises(ConfigError, match="size"):
        sample_discrete_gaussian(1.0, -1, np.random.default_rng(0))
