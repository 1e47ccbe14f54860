"""Shamir t-of-n secret sharing of 32-byte secrets over the prime field GF(2^31 - 1).

Shamir, "How to Share a Secret", CACM 22(11), 1979. A 32-byte secret is split into
:data:`NUM_LIMBS` = 9 limbs of 30 bits (each below the prime ``p = 2^31 - 1``), and every limb
is shared with its own random polynomial of degree ``t - 1``. Products of two field elements
stay below ``2^62``, so all arithmetic is vectorised numpy ``uint64`` with no overflow and no
Python-object arrays. Share ``x`` coordinates are ``site id + 1``.

Reconstruction (Lagrange interpolation at 0) checks that every limb is in range; a wrong or
tampered share set fails that check with probability ``1 - 2^-23`` and raises an opaque
:class:`~fedagg.errors.VerificationError`.

:func:`reconstruct_verified` is the robust version the server uses: holders of shares may lie,
so every candidate secret is checked by the caller (against a public key or a commitment), and
when the ``t`` lowest shares fail it decodes the Reed-Solomon code the shares form (Shamir
shares are a Reed-Solomon codeword; McEliece and Sarwate, "On sharing secrets and Reed-Solomon
codes", CACM 1981) with the Berlekamp-Welch algorithm (US patent 4,633,470, 1986; up to
``(n - t) / 2`` wrong shares), then tries other ``t``-subsets, so one bad share never stops a
reconstruction that has ``t`` good ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np
from numpy.typing import NDArray

from fedagg.errors import ProtocolError, VerificationError, explain
from fedagg.secagg.keys import RandomBytes

__all__ = [
    "LIMB_BITS",
    "NUM_LIMBS",
    "PRIME",
    "SECRET_BYTES",
    "SHARE_BYTES",
    "Share",
    "evaluate",
    "lagrange_at_zero",
    "limbs_to_secret",
    "random_field_elements",
    "reconstruct",
    "reconstruct_verified",
    "secret_to_limbs",
    "split",
]

PRIME: Final = 2**31 - 1
LIMB_BITS: Final = 30
SECRET_BYTES: Final = 32
NUM_LIMBS: Final = -(-8 * SECRET_BYTES // LIMB_BITS)  # 9
SHARE_BYTES: Final = 4 + 4 * NUM_LIMBS
_TOP_BITS: Final = 8 * SECRET_BYTES - LIMB_BITS * (NUM_LIMBS - 1)  # 16


class Share:
    """One share ``(x, y)`` of a 32-byte secret; ``repr`` hides ``y``.

    Parameters
    ----------
    x : int
        Evaluation point, ``1 <= x < p`` (the holder's site id + 1).
    y : numpy.ndarray
        :data:`NUM_LIMBS` field elements (``uint32``), one per limb.
    """

    __slots__ = ("x", "y")

    def __init__(self, x: int, y: NDArray[np.uint32]) -> None:
        if not 1 <= x < PRIME:
            raise ProtocolError(explain("share.x", x, f"must be in [1, {PRIME})", "use id + 1"))
        arr = np.asarray(y)
        if arr.shape != (NUM_LIMBS,) or arr.dtype != np.uint32 or bool((arr >= PRIME).any()):
            raise ProtocolError(
                explain("share.y", arr.shape, f"must be {NUM_LIMBS} uint32 < p", "resend")
            )
        self.x = int(x)
        self.y: NDArray[np.uint32] = arr

    def to_bytes(self) -> bytes:
        """``x`` (u32 big-endian) followed by the limbs (u32 little-endian)."""
        return self.x.to_bytes(4, "big") + self.y.astype("<u4").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> Share:
        """Inverse of :meth:`to_bytes`."""
        if len(data) != SHARE_BYTES:
            raise ProtocolError(explain("share", len(data), f"must be {SHARE_BYTES} bytes", "-"))
        y = np.frombuffer(data[4:], dtype="<u4").astype(np.uint32)
        return cls(int.from_bytes(data[:4], "big"), y)

    def __repr__(self) -> str:
        return f"Share(x={self.x}, y=<redacted>)"


def secret_to_limbs(secret: bytes) -> NDArray[np.uint64]:
    """Split a 32-byte secret into 30-bit limbs, least significant first."""
    if not isinstance(secret, bytes) or len(secret) != SECRET_BYTES:
        raise ProtocolError(explain("secret", "<redacted>", "must be 32 bytes", "-"))
    value = int.from_bytes(secret, "big")
    mask = (1 << LIMB_BITS) - 1
    return np.array([(value >> (LIMB_BITS * i)) & mask for i in range(NUM_LIMBS)], np.uint64)


def limbs_to_secret(limbs: NDArray[np.uint64]) -> bytes:
    """Inverse of :func:`secret_to_limbs`; out-of-range limbs raise VerificationError."""
    values = [int(v) for v in limbs]
    if any(v >> LIMB_BITS for v in values) or values[-1] >> _TOP_BITS:
        raise VerificationError()
    value = sum(v << (LIMB_BITS * i) for i, v in enumerate(values))
    return value.to_bytes(SECRET_BYTES, "big")


def random_field_elements(count: int, random_bytes: RandomBytes) -> NDArray[np.uint64]:
    """``count`` uniform elements of GF(p) by rejection sampling of 31-bit words."""
    out = np.empty(0, np.uint64)
    while out.size < count:
        need = count - out.size + 4
        words = np.frombuffer(bytes(random_bytes(4 * need)), dtype="<u4").astype(np.uint64)
        words &= np.uint64(0x7FFFFFFF)
        out = np.concatenate([out, words[words < PRIME]])
    return out[:count]


def evaluate(coefficients: NDArray[np.uint64], xs: Sequence[int]) -> NDArray[np.uint64]:
    """Evaluate polynomials at ``xs`` by Horner's rule, vectorised.

    Parameters
    ----------
    coefficients : numpy.ndarray
        ``(t, L)`` array; row 0 is the constant term (the secret limbs).
    xs : sequence of int
        Evaluation points.

    Returns
    -------
    numpy.ndarray
        ``(len(xs), L)`` array of field elements.
    """
    x = np.asarray(xs, dtype=np.uint64)[:, None]
    p = np.uint64(PRIME)
    acc = np.zeros((len(xs), coefficients.shape[1]), np.uint64)
    for row in coefficients[::-1]:
        acc = (acc * x + row[None, :]) % p  # acc, x < 2^31: product < 2^62
    return acc


def _check_points(xs: Sequence[int], threshold: int) -> None:
    if not 1 <= threshold <= len(xs):
        raise ProtocolError(
            explain("threshold", threshold, f"must be in [1, {len(xs)}] (holders)", "lower it")
        )
    if len(set(xs)) != len(xs) or any(not 1 <= x < PRIME for x in xs):
        raise ProtocolError(explain("share points", list(xs), "must be distinct, in [1, p)", "-"))


def split(
    secret: bytes, xs: Sequence[int], threshold: int, random_bytes: RandomBytes
) -> list[Share]:
    """Shamir-share ``secret`` so that any ``threshold`` of the shares at ``xs`` recover it.

    Parameters
    ----------
    secret : bytes
        32-byte secret.
    xs : sequence of int
        Distinct nonzero evaluation points (holder id + 1).
    threshold : int
        ``t``: shares needed to reconstruct; ``t - 1`` shares are independent of the secret.
    random_bytes : callable
        Source of the polynomial coefficients.
    """
    _check_points(xs, threshold)
    coefficients = np.empty((threshold, NUM_LIMBS), np.uint64)
    coefficients[0] = secret_to_limbs(secret)
    if threshold > 1:
        coefficients[1:] = random_field_elements((threshold - 1) * NUM_LIMBS, random_bytes).reshape(
            threshold - 1, NUM_LIMBS
        )
    ys = evaluate(coefficients, xs).astype(np.uint32)
    return [Share(x, ys[i]) for i, x in enumerate(xs)]


def lagrange_at_zero(xs: Sequence[int]) -> list[int]:
    """Lagrange basis coefficients ``lambda_j = prod_{m != j} x_m / (x_m - x_j)`` mod p."""
    out = []
    for j, xj in enumerate(xs):
        num, den = 1, 1
        for m, xm in enumerate(xs):
            if m != j:
                num = num * xm % PRIME
                den = den * (xm - xj) % PRIME
        out.append(num * pow(den, -1, PRIME) % PRIME)
    return out


def reconstruct(shares: Sequence[Share], threshold: int) -> bytes:
    """Recover the secret from at least ``threshold`` shares (the ``t`` lowest ``x`` are used).

    Raises
    ------
    ProtocolError
        Fewer than ``threshold`` shares, or duplicate points.
    VerificationError
        The interpolated value is not a valid secret (wrong, mixed or tampered shares).
    """
    if threshold < 1 or len(shares) < threshold:
        raise ProtocolError(
            explain("shares", len(shares), f"need at least threshold={threshold}", "wait for more")
        )
    chosen = sorted(shares, key=lambda s: s.x)[:threshold]
    _check_points([s.x for s in chosen], threshold)
    return _interpolate(chosen)


MAX_SUBSETS: Final = 4096
"""Default bound on the ``t``-subsets :func:`reconstruct_verified` tries after decoding fails."""


def _interpolate(chosen: Sequence[Share]) -> bytes:
    """Secret from exactly ``len(chosen)`` shares (VerificationError if it is not valid)."""
    xs = [s.x for s in chosen]
    p = np.uint64(PRIME)
    lam = np.array(lagrange_at_zero(xs), np.uint64)[:, None]
    ys = np.stack([s.y for s in chosen]).astype(np.uint64)
    # each product < 2^62, reduced before the sum: t terms < 2^31 sum without overflow
    acc = ((lam * ys) % p).sum(axis=0, dtype=np.uint64) % p
    return limbs_to_secret(acc)


def _solve_mod_p(rows: list[list[int]], unknowns: int) -> list[int] | None:
    """One solution of the augmented system ``rows`` over GF(p) (free unknowns = 0), or None."""
    pivots: list[int] = []
    r = 0
    for col in range(unknowns):
        pivot = next((i for i in range(r, len(rows)) if rows[i][col]), None)
        if pivot is None:
            continue
        rows[r], rows[pivot] = rows[pivot], rows[r]
        inv = pow(rows[r][col], -1, PRIME)
        rows[r] = [v * inv % PRIME for v in rows[r]]
        for i in range(len(rows)):
            if i != r and rows[i][col]:
                f = rows[i][col]
                rows[i] = [(a - f * b) % PRIME for a, b in zip(rows[i], rows[r], strict=True)]
        pivots.append(col)
        r += 1
    if any(row[unknowns] for row in rows[r:]):  # 0 = nonzero: inconsistent
        return None
    solution = [0] * unknowns
    for i, col in enumerate(pivots):
        solution[col] = rows[i][unknowns]
    return solution


def _poly_divide(num: list[int], den: list[int]) -> tuple[list[int], bool]:
    """``num / den`` over GF(p) (coefficients low first; ``den`` monic): quotient, exact?"""
    rem = list(num)
    quotient = [0] * max(len(num) - len(den) + 1, 1)
    for shift in range(len(num) - len(den), -1, -1):
        coef = rem[shift + len(den) - 1]
        quotient[shift] = coef
        if coef:
            for i, d in enumerate(den):
                rem[shift + i] = (rem[shift + i] - coef * d) % PRIME
    return quotient, not any(rem)


def _berlekamp_welch(xs: Sequence[int], ys: Sequence[int], threshold: int) -> list[int] | None:
    """Coefficients of the degree ``< threshold`` polynomial through all but at most
    ``e = (n - threshold) // 2`` of the points, or None (Berlekamp-Welch)."""
    n = len(xs)
    e = (n - threshold) // 2
    if e < 1:
        return None
    nq = e + threshold  # Q has degree < e + t; E is monic of degree e
    rows = []
    for x, y in zip(xs, ys, strict=True):
        powers = [1]
        for _ in range(nq):
            powers.append(powers[-1] * x % PRIME)
        rows.append(
            powers[:nq] + [(-y * powers[j]) % PRIME for j in range(e)] + [y * powers[e] % PRIME]
        )
    solution = _solve_mod_p(rows, nq + e)
    if solution is None:
        return None
    quotient, exact = _poly_divide(solution[:nq], [*solution[nq:], 1])
    if not exact or any(quotient[threshold:]):
        return None
    return (quotient + [0] * threshold)[:threshold]


def _decode(shares: Sequence[Share], threshold: int) -> bytes | None:
    """Secret by Berlekamp-Welch, limb by limb (None when the shares cannot be decoded)."""
    xs = [s.x for s in shares]
    limbs = []
    for k in range(NUM_LIMBS):
        coefficients = _berlekamp_welch(xs, [int(s.y[k]) for s in shares], threshold)
        if coefficients is None:
            return None
        limbs.append(coefficients[0])
    try:
        return limbs_to_secret(np.array(limbs, np.uint64))
    except VerificationError:
        return None


def reconstruct_verified(
    shares: Sequence[Share],
    threshold: int,
    verify: Callable[[bytes], bool],
    *,
    max_subsets: int = MAX_SUBSETS,
) -> bytes:
    """Recover a secret from shares some of which may be wrong, checking every candidate.

    Parameters
    ----------
    shares : sequence of Share
        At least ``threshold`` shares with distinct ``x`` (some may be wrong).
    threshold : int
        ``t``.
    verify : callable
        ``verify(secret) -> bool``: whether a candidate is the real secret (for a mask key:
        its public key is the announced one; for a self-mask seed: it opens the commitment).
    max_subsets : int
        Bound on the further ``t``-subsets tried when decoding fails (each costs one
        interpolation and one ``verify``).

    Returns
    -------
    bytes
        The secret (it passed ``verify``).

    Raises
    ------
    ProtocolError
        Fewer than ``threshold`` shares, or duplicate points.
    VerificationError
        No candidate passed ``verify``: fewer than ``t`` good shares (or more wrong ones than
        decoding and the bounded search can get around). The message says nothing more.

    Notes
    -----
    Order of attempts: the ``t`` lowest-``x`` shares (the honest case costs one
    interpolation); Berlekamp-Welch decoding of all ``n`` shares, which corrects up to
    ``(n - t) / 2`` wrong ones; then other ``t``-subsets, leaving out 1, 2, ... of the
    lowest ``t + 1``, ``t + 2``, ... shares, which finds the secret whenever ``t`` shares are
    good and the bound allows: ``e`` wrong shares cost at most
    ``sum_{s <= e} C(t + s, s)`` tries (``t + 1`` for one, as with ``n = t + 1``).
    """
    if threshold < 1 or len(shares) < threshold:
        raise ProtocolError(
            explain("shares", len(shares), f"need at least threshold={threshold}", "wait for more")
        )
    ordered = sorted(shares, key=lambda s: s.x)
    _check_points([s.x for s in ordered], len(ordered))

    def attempt(subset: Sequence[Share]) -> bytes | None:
        try:
            secret = _interpolate(subset)
        except VerificationError:
            return None
        return secret if verify(secret) else None

    secret = attempt(ordered[:threshold])
    if secret is not None:
        return secret
    decoded = _decode(ordered, threshold)
    if decoded is not None and verify(decoded):
        return decoded
    tried = 0
    for size in range(1, len(ordered) - threshold + 1):
        # leave out `size` of the first t + size shares: distinct bases, fewest exclusions first
        window = range(threshold + size)
        for excluded in itertools.combinations(window, size):
            if tried >= max_subsets:
                raise VerificationError()
            tried += 1
            skip = set(excluded)
            basis = [ordered[i] for i in window if i not in skip]
            secret = attempt(basis)
            if secret is not None:
                return secret
    raise VerificationError()
