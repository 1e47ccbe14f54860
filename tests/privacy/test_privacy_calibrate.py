"""Calibration of gamma and sigma, and the parameters' validation (errors name the field)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from fedagg.errors import ConfigError
from fedagg.privacy import (
    DdgDecoder,
    DdgEncoder,
    DdgParams,
    calibrate_ddg,
    ddg_epsilon,
    gaussian_noise_multiplier,
)

BENCH: dict[str, Any] = dict(clip=1.0, dim=199_210, num_sites=20, min_sites=16,
                             ring_bits=18, delta=1e-5, participations=150)


@pytest.mark.parametrize("eps", [2.0, 4.0, 8.0])
def test_benchmark_case_meets_budget_and_ring(eps: float) -> None:
    """Fashion-MNIST 2NN (d = 199,210), 20 sites, noise for 16, 18-bit ring, 150 rounds."""
    cal = calibrate_ddg(epsilon=eps, **BENCH)
    p = cal.params
    assert eps * (1 - 1e-4) <= cal.epsilon <= eps
    assert cal.epsilon == ddg_epsilon(p, delta=1e-5, participations=150)
    assert 0.5e-6 <= cal.overflow_probability <= 1e-6 == pytest.approx(1e-6)
    assert cal.bits_per_coordinate == 18 and p.padded_dim == 262_144
    # no smaller gamma keeps the wrap bound (gamma is the smallest one that fits)
    smaller = DdgParams(clip=1.0, gamma=p.gamma * 0.999, sigma_site=p.sigma_site * 1.001,
                        ring_bits=18, num_sites=20, min_sites=16, dim=199_210)
    assert smaller.overflow_probability > 1e-6
    # versus central DP at the same clip and budget: N(0, (z c / n)^2) on the mean
    central = gaussian_noise_multiplier(eps, delta=1e-5, rounds=150) / 20
    ratio = cal.mean_noise_std() / central
    assert math.sqrt(20 / 16) < ratio < 1.3
    assert cal.sensitivity_inflation >= 1.0


def test_a_tighter_ring_costs_noise() -> None:
    wide = calibrate_ddg(epsilon=4.0, **{**BENCH, "ring_bits": 20})
    narrow = calibrate_ddg(epsilon=4.0, **{**BENCH, "ring_bits": 17})
    assert narrow.mean_noise_std() > wide.mean_noise_std()
    assert narrow.params.gamma > wide.params.gamma


def test_ring_too_small_names_ring_bits_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"privacy.ring_bits = 16.*ring_bits >= 17"):
        calibrate_ddg(epsilon=2.0, **{**BENCH, "ring_bits": 16})


def test_calibrated_round_end_to_end() -> None:
    """Calibrate a small case, run 10 sites through encoder -> modular sum -> decoder; the
    decoded mean's error has the std the calibration states."""
    cal = calibrate_ddg(clip=1.0, dim=1000, num_sites=10, min_sites=8, ring_bits=16,
                        epsilon=4.0, delta=1e-5, participations=50)
    p = cal.params
    rng = np.random.default_rng(0)
    errs = []
    for r in range(6):
        xs = [rng.standard_normal(1000) * 0.05 for _ in range(10)]
        enc = [DdgEncoder(p).encode(x, seed=b"e%d" % r, rng=rng) for x in xs]
        total = (np.sum([e.ring.astype(np.int64) for e in enc], axis=0) % p.modulus)
        out = DdgDecoder(p).decode(total.astype(np.uint32), survivors=10, seed=b"e%d" % r)
        clipped = [x * min(1.0, 1.0 / np.linalg.norm(x)) for x in xs]
        errs.append(out.mean - np.mean(clipped, axis=0))
        assert out.peak < 0.9
    e = np.concatenate(errs)
    std = math.sqrt(cal.mean_noise_std() ** 2 + p.gamma**2 / 40)
    assert float(e.std()) == pytest.approx(std, rel=0.05)


@pytest.mark.parametrize("kw, field", [
    (dict(clip=0.0), "privacy.clip"),
    (dict(clip=math.nan), "privacy.clip"),
    (dict(epsilon=0.0), "privacy.epsilon"),
    (dict(epsilon=math.inf), "privacy.epsilon"),
    (dict(delta=0.0), "privacy.delta"),
    (dict(delta=2.0), "privacy.delta"),
    (dict(participations=0), "privacy.participations"),
    (dict(participations=1.5), "privacy.participations"),
    (dict(min_sites=21), "privacy.min_sites"),
    (dict(min_sites=0), "privacy.min_sites"),
    (dict(num_sites=0), "privacy.num_sites"),
    (dict(dim=0), "privacy.dim"),
    (dict(ring_bits=7), "privacy.ring_bits"),
    (dict(ring_bits=33), "privacy.ring_bits"),
    (dict(beta=1.0), "privacy.beta"),
    (dict(overflow_probability=0.5), "privacy.overflow_probability"),
    (dict(overflow_probability=0.0), "privacy.overflow_probability"),
])
def test_calibrate_arguments_name_the_field(kw: dict[str, Any], field: str) -> None:
    args = {**BENCH, "epsilon": 4.0, **kw}
    with pytest.raises(ConfigError, match=field):
        calibrate_ddg(**args)


GOOD: dict[str, Any] = dict(clip=1.0, gamma=1e-3, sigma_site=10.0, ring_bits=20, num_sites=5,
                            min_sites=3, dim=100)


@pytest.mark.parametrize("kw, field", [
    (dict(clip=0.0), "privacy.clip"),
    (dict(clip=-1.0), "privacy.clip"),
    (dict(clip="1"), "privacy.clip"),
    (dict(clip=math.inf), "privacy.clip"),
    (dict(gamma=0.0), "privacy.gamma"),
    (dict(gamma=True), "privacy.gamma"),
    (dict(gamma=1e-20), "privacy.gamma"),
    (dict(sigma_site=0.3), "privacy.sigma_site"),
    (dict(sigma_site=-1.0), "privacy.sigma_site"),
    (dict(sigma_site=math.nan), "privacy.sigma_site"),
    (dict(ring_bits=7), "privacy.ring_bits"),
    (dict(ring_bits=33), "privacy.ring_bits"),
    (dict(ring_bits=20.0), "privacy.ring_bits"),
    (dict(num_sites=0), "privacy.num_sites"),
    (dict(min_sites=6), "privacy.min_sites"),
    (dict(min_sites=0), "privacy.min_sites"),
    (dict(dim=0), "privacy.dim"),
    (dict(dim=2**31), "privacy.dim"),
    (dict(beta=1.0), "privacy.beta"),
    (dict(beta=-0.1), "privacy.beta"),
    (dict(max_tries=0), "privacy.max_tries"),
    # headroom: the sum of 5 sites at sigma_site = 1e5 does not fit 2^19
    (dict(sigma_site=1e5), "privacy.ring_bits"),
    (dict(ring_bits=8, num_sites=200, min_sites=3), "privacy.ring_bits"),
])
def test_params_name_the_bad_field(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        DdgParams(**{**GOOD, **kw})
    assert "Fix:" in str(info.value)


def test_headroom_error_explains_the_wrap_probability() -> None:
    with pytest.raises(ConfigError, match=r"too small for the sum of 5 sites.*wraps"):
        DdgParams(**{**GOOD, "sigma_site": 1e5})


def test_params_derived_values() -> None:
    p = DdgParams(**GOOD)
    assert p.padded_dim == 128 and p.modulus == 2**20 and p.noise_shares == 3
    assert p.sigma == pytest.approx(math.sqrt(3) * 10)
    assert p.l2_bound**2 == pytest.approx(1000**2 + 128 / 4 + (1000 + math.sqrt(128) / 2))
    assert p.bound_sq == math.floor(p.l2_bound**2)
    assert p.l1_bound == pytest.approx(math.sqrt(128) * p.l2_bound)
    assert p.mean_noise_std(4) == pytest.approx(1e-3 * 10 / 2)
