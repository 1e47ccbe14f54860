"""Bit-packing of Z_2^b values (oracle: a big-integer packer) and the protocol at several b."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagg.errors import ConfigError, ProtocolError
from fedagg.secagg import LocalFederation, SecAggParams, packing
from fedagg.secagg import fixed_point as fp


def naive_pack(values: np.ndarray, bits: int) -> np.ndarray:
    """The documented layout, one group at a time with Python integers."""
    n = len(values)
    lanes = -(-n // 32)
    src = [0] * (32 * lanes)
    for i, v in enumerate(values):
        src[i] = int(v) & ((1 << bits) - 1)
    out = np.zeros(bits * lanes, np.uint32)
    for g in range(lanes):
        group = 0
        for j in range(32):
            group |= src[j * lanes + g] << (j * bits)
        for w in range(bits):
            out[w * lanes + g] = (group >> (32 * w)) & 0xFFFFFFFF
    return out


def _words(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)


@pytest.mark.parametrize("bits", [1, 7, 8, 13, 16, 21, 24, 28, 31])
@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 95, 257])
def test_pack_matches_oracle_and_roundtrips(bits: int, n: int) -> None:
    v = _words(n, bits * 1000 + n)
    packed = packing.pack(v, bits)
    assert packed.dtype == np.uint32 and packed.shape == (packing.packed_words(n, bits),)
    np.testing.assert_array_equal(packed, naive_pack(v, bits))
    np.testing.assert_array_equal(packing.unpack(packed, n, bits), v & np.uint32((1 << bits) - 1))


def test_32_bits_is_the_identity() -> None:
    v = _words(100, 1)
    assert packing.pack(v, 32) is v
    np.testing.assert_array_equal(packing.unpack(v, 100, 32), v)
    assert packing.packed_words(100, 32) == 100


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 32), n=st.integers(0, 300), seed=st.integers(0, 2**32 - 1),
       count=st.integers(1, 5))
def test_sum_of_unpacked_is_exact_mod_2b(bits: int, n: int, seed: int, count: int) -> None:
    """add_unpacked leaves garbage above bit b but the sum is exact mod 2^b."""
    mask = np.uint64((1 << bits) - 1)
    vectors = [_words(n, seed + k) for k in range(count)]
    total = _words(n, seed ^ 0xABCDEF)  # arbitrary start value
    expect = total.astype(np.uint64)
    for v in vectors:
        packing.add_unpacked(total, packing.pack(v, bits), bits)
        expect = expect + v.astype(np.uint64)
    np.testing.assert_array_equal(total.astype(np.uint64) & mask, expect & mask)


def test_wrong_sizes_are_refused() -> None:
    packed = packing.pack(_words(100, 2), 20)
    with pytest.raises(ProtocolError, match="packed vector"):
        packing.unpack(packed[:-1], 100, 20)
    with pytest.raises(ProtocolError, match="packed vector"):
        packing.add_unpacked(np.zeros(101, np.uint32), packed[:-1], 20)
    with pytest.raises(ProtocolError, match="ring bits"):
        packing.pack(_words(3, 3), 33)


# -- the encoding rule ---------------------------------------------------------------------
def test_auto_encoding_meets_precision_with_smallest_ring() -> None:
    f, b = fp.resolve_encoding(50, 1.0, None, None, 1e-6)
    assert (f, b) == (21, 28)
    assert 2.0**-f * 2 <= 1e-6 < 2.0 ** -(f - 1) * 2  # fewest fractional bits
    assert fp.fits(50, 1.0, f, b) and not fp.fits(50, 1.0, f, b - 1)  # smallest ring
    # precision unreachable in 32 bits: the 32-bit ring with the most bits that fit
    f, b = fp.resolve_encoding(50, 8.0, None, None, 1e-6)
    assert b == 32 and f == fp.resolve_frac_bits(50, 8.0, None) == 22
    # explicit ring: the most fractional bits that fit it
    assert fp.resolve_encoding(50, 1.0, None, 32, 1e-6) == (25, 32)
    assert fp.resolve_encoding(50, 1.0, 20, None, 1e-6) == (20, 27)


def test_impossible_encodings_are_explained() -> None:
    with pytest.raises(ConfigError, match=r"ring_bits >= 28"):
        fp.resolve_encoding(50, 1.0, 21, 27)
    with pytest.raises(ConfigError, match=r"secagg\.ring_bits"):
        fp.resolve_encoding(10**4, 4.0, None, 16)
    with pytest.raises(ConfigError, match=r"secagg\.ring_bits"):
        SecAggParams(threshold=1, ring_bits=40)
    with pytest.raises(ConfigError, match=r"secagg\.precision"):
        SecAggParams(threshold=1, precision=0.0)
    with pytest.raises(ConfigError, match=r"secagg\.frac_bits"):
        SecAggParams(threshold=1, frac_bits=28, ring_bits=20)


# -- the protocol at several ring widths -----------------------------------------------------
@pytest.mark.parametrize("ring_bits", [None, 12, 20, 27, 31, 32])
def test_protocol_at_several_ring_widths(ring_bits: int | None) -> None:
    n, dim = 6, 300
    params = SecAggParams(threshold=3, num_neighbours=5, weight_scale=50.0, ring_bits=ring_bits)
    f = LocalFederation(n, params, seed=ring_bits or 0)
    f.setup()
    rng = np.random.default_rng(7)
    ups = [rng.uniform(-1, 1, dim) for _ in range(n)]
    w = [float(x) for x in rng.integers(1, 50, n)]
    res = f.run_round(ups, w, drop_before_upload=[2], drop_after_upload=[4])
    counted = [0, 1, 3, 4, 5]
    expect = sum(w[i] * ups[i] for i in counted) / sum(w[i] for i in counted)
    frac_bits, bits = params.encoding_for(n)
    assert res.ring_bits == bits and res.frac_bits == frac_bits
    if ring_bits is not None:
        assert bits == ring_bits
    err = float(np.abs(res.mean - expect).max())
    assert err <= res.error_bound
    assert err < 2.0 ** -(frac_bits - 6)  # and close to the quantisation step
