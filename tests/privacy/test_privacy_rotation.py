"""The randomized Hadamard rotation: the transform, orthogonality, exact inverse, seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.linalg import hadamard

from fedagg.errors import ConfigError
from fedagg.privacy import HadamardRotation, fwht_, next_power_of_two


@pytest.mark.parametrize("n", [1, 2, 4, 8, 32, 256])
def test_fwht_is_the_sylvester_hadamard_matrix(n: int) -> None:
    a = np.random.default_rng(n).normal(size=n)
    b = a.copy()
    fwht_(b)
    np.testing.assert_allclose(b, hadamard(n) @ a, rtol=0, atol=1e-12 * n)


def test_fwht_refuses_bad_arrays() -> None:
    with pytest.raises(ValueError):
        fwht_(np.zeros(6))
    with pytest.raises(ValueError):
        fwht_(np.zeros(8, np.float32))  # type: ignore[arg-type]


def test_next_power_of_two() -> None:
    assert [next_power_of_two(d) for d in (1, 2, 3, 4, 5, 199_210)] == [1, 2, 4, 4, 8, 262_144]


def test_matrix_is_orthogonal_and_the_inverse_exact() -> None:
    """The whole matrix ``U = H D`` (first ``d`` columns) for d = 5: ``U^T U = I``."""
    rot = HadamardRotation(5, b"m")
    cols = np.stack([rot.forward(e) for e in np.eye(5)], axis=1)
    np.testing.assert_allclose(cols.T @ cols, np.eye(5), atol=1e-15)
    np.testing.assert_allclose(cols, hadamard(8)[:, :5] * rot.signs[:5] / math.sqrt(8),
                               atol=1e-15)


@pytest.mark.parametrize("d", [1, 2, 3, 7, 1000, 4096, 4097])
def test_round_trip_to_float_precision(d: int) -> None:
    rot = HadamardRotation(d, b"seed")
    x = np.random.default_rng(d).normal(size=d)
    y = rot.forward(x)
    assert y.shape == (rot.padded_dim,)
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-13)
    back = rot.inverse(y)
    assert back.shape == (d,)
    assert float(np.abs(back - x).max()) <= 1e-14 * max(1.0, float(np.abs(x).max())) * (
        1 + math.log2(rot.padded_dim))


@settings(max_examples=60, deadline=None)
@given(d=st.integers(1, 5000), seed=st.binary(min_size=0, max_size=16),
       scale=st.floats(1e-6, 1e6))
def test_round_trip_property(d: int, seed: bytes, scale: float) -> None:
    rot = HadamardRotation(d, seed)
    x = np.random.default_rng(d).normal(size=d) * scale
    np.testing.assert_allclose(rot.inverse(rot.forward(x)), x, rtol=0,
                               atol=1e-13 * scale * (1 + math.log2(rot.padded_dim)))


def test_flattening_of_a_spike() -> None:
    """``H D e_j`` has every coordinate equal to ``+-1/sqrt(d_pad)``: no coordinate keeps the
    spike's norm, whatever the signs."""
    rot = HadamardRotation(1000, b"spike")
    y = rot.forward(np.eye(1000)[17])
    np.testing.assert_allclose(np.abs(y), 1 / math.sqrt(1024), rtol=1e-12)


def test_same_seed_same_rotation_other_seed_other_signs() -> None:
    a, b, c = HadamardRotation(4096, b"r1"), HadamardRotation(4096, b"r1"), HadamardRotation(
        4096, b"r2")
    assert np.array_equal(a.signs, b.signs)
    assert set(np.unique(a.signs).tolist()) == {-1.0, 1.0}
    agree = float(np.mean(a.signs == c.signs))
    assert 0.45 < agree < 0.55
    with pytest.raises(ValueError):
        a.signs[0] = 3.0


def test_large_dimension_round_trip() -> None:
    """d = 3 * 10^6 (padded to 2^22) rotates and returns exactly (no timing asserted)."""
    d = 3_000_000
    rot = HadamardRotation(d, b"big")
    x = np.random.default_rng(0).standard_normal(d)
    back = rot.inverse(rot.forward(x))
    assert float(np.abs(back - x).max()) < 1e-12


@pytest.mark.parametrize("dim", [0, -3, 2.5, True, 2**31])
def test_bad_dim_names_the_field(dim: object) -> None:
    with pytest.raises(ConfigError, match=r"privacy\.dim"):
        HadamardRotation(dim, b"s")  # type: ignore[arg-type]


def test_bad_seed_and_lengths() -> None:
    with pytest.raises(ConfigError, match="seed"):
        HadamardRotation(4, "text")  # type: ignore[arg-type]
    rot = HadamardRotation(5, b"s")
    with pytest.raises(ConfigError, match="update"):
        rot.forward(np.zeros(4))
    with pytest.raises(ConfigError, match="rotated vector"):
        rot.inverse(np.zeros(5))
