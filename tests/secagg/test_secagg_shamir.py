"""Shamir sharing over GF(2^31 - 1): golden vector, thresholds, secrecy of t - 1 shares."""

from __future__ import annotations

import contextlib
import hashlib
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagg.errors import ProtocolError, VerificationError
from fedagg.secagg import shamir

P = 2**31 - 1


def stream(label: bytes):  # type: ignore[no-untyped-def]
    counter = [0]

    def random_bytes(n: int) -> bytes:
        out = b""
        while len(out) < n:
            counter[0] += 1
            out += hashlib.sha256(label + counter[0].to_bytes(4, "big")).digest()
        return out[:n]

    return random_bytes


def test_golden_vector_wire_format() -> None:
    shares = shamir.split(bytes(range(32)), [1, 2, 3, 4, 5], 3, stream(b"golden"))
    assert shares[0].to_bytes().hex() == (
        "000000010b581825f432dd608be1580f8fe8644aa3944719b543c871b61ae07e8e096c62a3f8297a"
    )
    assert shares[1].to_bytes().hex() == (
        "000000028aab031088446e27c5a53f29cbf0b3632b745c3af9e6aa3482efad50bd75004f83076560"
    )


def test_golden_vector_against_naive_polynomials() -> None:
    """Recompute the shares with Python ints from the documented limb / coefficient layout."""
    secret = bytes(range(32))
    shares = shamir.split(secret, [1, 2, 3, 4, 5], 3, stream(b"golden"))
    rb = stream(b"golden")
    raw = rb(4 * 22)
    words = [int.from_bytes(raw[4 * i : 4 * i + 4], "little") & 0x7FFFFFFF for i in range(22)]
    words = [w for w in words if w < P][:18]
    value = int.from_bytes(secret, "big")
    limbs = [(value >> (30 * i)) & (2**30 - 1) for i in range(9)]
    for share in shares:
        x = share.x
        expected = [(limbs[k] + words[k] * x + words[9 + k] * x * x) % P for k in range(9)]
        assert [int(v) for v in share.y] == expected


@given(
    secret=st.binary(min_size=32, max_size=32),
    n=st.integers(1, 12),
    data=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_any_t_shares_reconstruct(secret: bytes, n: int, data: st.DataObject) -> None:
    t = data.draw(st.integers(1, n))
    xs = data.draw(st.lists(st.integers(1, P - 1), min_size=n, max_size=n, unique=True))
    shares = shamir.split(secret, xs, t, stream(secret))
    subset = data.draw(st.permutations(shares))[:t]
    assert shamir.reconstruct(subset, t) == secret


def test_all_subsets_of_size_t() -> None:
    secret = b"\xff" * 32  # all limbs at their maximum
    shares = shamir.split(secret, [3, 7, 8, 11, 20], 3, stream(b"s"))
    for subset in itertools.combinations(shares, 3):
        assert shamir.reconstruct(list(subset), 3) == secret


def test_fewer_than_t_shares_refuse_to_reconstruct() -> None:
    shares = shamir.split(b"\x42" * 32, [1, 2, 3, 4], 3, stream(b"x"))
    with pytest.raises(ProtocolError, match="threshold=3"):
        shamir.reconstruct(shares[:2], 3)


def test_t_minus_1_shares_interpolate_to_garbage() -> None:
    secret = b"\x42" * 32
    shares = shamir.split(secret, [1, 2, 3, 4], 3, stream(b"y"))
    try:
        wrong = shamir.reconstruct(shares[:2], 2)
    except VerificationError:
        return
    assert wrong != secret


def test_t_minus_1_shares_are_independent_of_the_secret() -> None:
    """For t = 3, the pair of shares at x = 1, 2 is uniform whatever the secret: compare the
    empirical distributions (top 4 bits of every limb) for two very different secrets."""
    counts = []
    for secret in (bytes(32), b"\xff" * 32):
        rb = stream(secret)
        hist = np.zeros(16)
        for _ in range(300):
            shares = shamir.split(secret, [1, 2, 3], 3, rb)[:2]
            for s in shares:
                hist += np.bincount((s.y >> 27).astype(np.int64), minlength=16)
        counts.append(hist)
    expected = counts[0].sum() / 16
    for hist in counts:
        chi2 = float(((hist - expected) ** 2 / expected).sum())
        assert chi2 < 60, chi2  # df = 15; 60 is far in the tail
    # and: any candidate secret is consistent with the two shares (perfect secrecy)
    shares = shamir.split(b"\x11" * 32, [1, 2, 3], 3, stream(b"z"))[:2]
    for candidate in (bytes(32), b"\x22" * 32):
        limbs = shamir.secret_to_limbs(candidate)
        for k in range(9):
            # unique degree-2 poly through (0, c), (1, y1), (2, y2) exists because x's differ
            y1, y2 = int(shares[0].y[k]), int(shares[1].y[k])
            c = int(limbs[k])
            a2 = ((y2 - c) - 2 * (y1 - c)) * pow(2, -1, P) % P
            a1 = (y1 - c - a2) % P
            assert (c + a1 + a2) % P == y1 and (c + 2 * a1 + 4 * a2) % P == y2


def test_tampered_share_never_yields_the_secret() -> None:
    """A modified share gives a wrong secret or fails the range check (the protocol then
    catches wrong seeds through their commitment and wrong keys through their public key)."""
    shares = shamir.split(b"\x42" * 32, [1, 2, 3], 3, stream(b"t"))
    y = shares[0].y.copy()
    y[0] = (int(y[0]) + 1) % P
    bad = [shamir.Share(1, y), shares[1], shares[2]]
    with contextlib.suppress(VerificationError):
        assert shamir.reconstruct(bad, 3) != b"\x42" * 32


def test_random_garbage_shares_fail_the_range_check() -> None:
    rb = stream(b"garbage")
    failures = 0
    for _ in range(20):
        rows = [shamir.random_field_elements(9, rb).astype(np.uint32) for _ in range(3)]
        try:
            shamir.reconstruct([shamir.Share(x + 1, r) for x, r in enumerate(rows)], 3)
        except VerificationError:
            failures += 1
    assert failures == 20


def test_share_validation_and_repr() -> None:
    share = shamir.split(b"\x42" * 32, [1, 2], 2, stream(b"r"))[0]
    assert repr(share) == "Share(x=1, y=<redacted>)"
    assert shamir.Share.from_bytes(share.to_bytes()).to_bytes() == share.to_bytes()
    with pytest.raises(ProtocolError):
        shamir.Share(0, share.y)
    with pytest.raises(ProtocolError):
        shamir.Share(1, np.full(9, P, np.uint32))  # not a field element
    with pytest.raises(ProtocolError):
        shamir.split(b"\x42" * 32, [1, 1], 2, stream(b"d"))  # duplicate points
    with pytest.raises(ProtocolError):
        shamir.split(b"\x42" * 32, [1, 2], 3, stream(b"d"))  # t > n
    with pytest.raises(ProtocolError):
        shamir.split(b"\x42" * 31, [1, 2], 2, stream(b"d"))


def test_random_field_elements_rejects_p() -> None:
    calls = [b"\xff\xff\xff\x7f" * 2 + b"\x05\x00\x00\x00" * 10]  # two words equal to p

    def rb(n: int) -> bytes:
        return (calls[0] * 10)[:n]

    out = shamir.random_field_elements(3, rb)
    assert out.tolist() == [5, 5, 5]


# -- robust reconstruction (a holder may lie) ----------------------------------------------


def _lie(share: shamir.Share, rb) -> shamir.Share:  # type: ignore[no-untyped-def]
    y = shamir.random_field_elements(9, rb).astype(np.uint32)
    return shamir.Share(share.x, y if not np.array_equal(y, share.y) else (y + 1) % P)


@given(
    secret=st.binary(min_size=32, max_size=32),
    n=st.integers(1, 7),
    data=st.data(),
)
@settings(max_examples=150, deadline=None)
def test_reconstruct_verified_against_brute_force(
    secret: bytes, n: int, data: st.DataObject
) -> None:
    """Oracle: it succeeds exactly when some t-subset of the shares interpolates to a secret
    that passes the check (here: equals the secret), which needs t good shares."""
    t = data.draw(st.integers(1, n))
    rb = stream(secret + bytes([n, t]))
    shares = shamir.split(secret, list(range(1, n + 1)), t, rb)
    bad = data.draw(st.sets(st.integers(0, n - 1)))
    shares = [_lie(s, rb) if i in bad else s for i, s in enumerate(shares)]
    order = data.draw(st.permutations(shares))

    def reference() -> bool:
        for subset in itertools.combinations(shares, t):
            with contextlib.suppress(VerificationError):
                if shamir.reconstruct(list(subset), t) == secret:
                    return True
        return False

    expect = reference()
    assert expect >= (n - len(bad) >= t)  # t good shares always suffice
    try:
        got = shamir.reconstruct_verified(order, t, lambda s: s == secret, max_subsets=10**6)
    except VerificationError:
        assert not expect
    else:
        assert expect and got == secret


def test_decoding_corrects_half_the_redundancy_in_two_checks() -> None:
    """n = 20, t = 8: Berlekamp-Welch corrects (20 - 8) / 2 = 6 wrong shares, here the six
    lowest (so the fast path fails), with one failed and one passing check."""
    secret = b"\x5a" * 32
    rb = stream(b"bw")
    shares = shamir.split(secret, list(range(1, 21)), 8, rb)
    shares = [_lie(s, rb) if s.x <= 6 else s for s in shares]
    calls: list[bytes] = []

    def verify(candidate: bytes) -> bool:
        calls.append(candidate)
        return candidate == secret

    assert shamir.reconstruct_verified(shares, 8, verify) == secret
    assert len(calls) <= 2


def test_one_wrong_share_among_t_plus_one_is_found_by_the_search() -> None:
    secret = b"\x33" * 32
    rb = stream(b"t+1")
    shares = shamir.split(secret, [4, 9, 10, 12], 3, rb)
    shares[0] = _lie(shares[0], rb)  # the lowest x: always in the first attempt
    with pytest.raises(VerificationError):
        shamir.reconstruct(shares, 3)  # the plain function uses the t lowest
    assert shamir.reconstruct_verified(shares, 3, lambda s: s == secret) == secret
    with pytest.raises(VerificationError, match=r"^verification failed$"):
        shamir.reconstruct_verified(shares, 3, lambda s: s == secret, max_subsets=0)


def test_reconstruct_verified_refuses_bad_input() -> None:
    shares = shamir.split(b"\x42" * 32, [1, 2, 3], 2, stream(b"n"))
    with pytest.raises(ProtocolError, match="threshold=3"):
        shamir.reconstruct_verified(shares[:2], 3, lambda s: True)
    with pytest.raises(ProtocolError, match="distinct"):
        shamir.reconstruct_verified([shares[0], shares[0]], 2, lambda s: True)
    with pytest.raises(ProtocolError):
        shamir.reconstruct_verified(shares, 0, lambda s: True)
    with pytest.raises(VerificationError):  # nothing passes the check
        shamir.reconstruct_verified(shares, 2, lambda s: False)
