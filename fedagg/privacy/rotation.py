"""Randomized Hadamard rotation: spread a vector's energy evenly over its coordinates.

Before a site rounds its update to integers and the sum is reduced modulo ``2^b``, the
distributed discrete Gaussian mechanism rotates the update by a random orthogonal matrix
``U = H D`` (Kairouz, Liu, Steinke, ICML 2021, Sec. 4.2 "flattening"): ``D`` is a diagonal
of independent random signs and ``H`` the normalised Walsh–Hadamard matrix of order
``d_pad`` (the next power of two of the dimension ``d``; the vector is padded with zeros).
Each rotated coordinate ``(H D x)_j = sum_i H_ji D_i x_i`` is a sum of independent symmetric
terms of size ``|x_i| / sqrt(d_pad)``, hence sub-Gaussian with variance proxy
``||x||^2 / d_pad`` (Hoeffding): no coordinate carries much more than its share of the norm,
so the modular sum rarely wraps, whatever the shape of the update.

The signs come from a *public* per-round seed: every site and the server derive the same
``D``, and the server inverts the rotation after the sum (``U^-1 = D H``: ``H`` is symmetric
and orthogonal, ``D^2 = I``). The seed needs no secrecy (the rotation protects utility, not
privacy), but it must not be known to the sites before they compute their updates, or an
update could be aligned with the rotation to concentrate its norm on one coordinate.

The transform is the fast Walsh–Hadamard butterfly, ``O(d_pad log d_pad)`` in place on
float64 with one scratch buffer of ``d_pad / 2`` values (``d = 10^7``: 128 MiB vector,
64 MiB scratch). Round-trip error is a few float64 ulps times ``log2(d_pad)``.

References
----------
.. [KLS2021] P. Kairouz, Z. Liu, T. Steinke. "The Distributed Discrete Gaussian Mechanism for
   Federated Learning with Secure Aggregation". ICML 2021 (Sec. 4.2, Lemma on flattening).
.. [AC2006] N. Ailon, B. Chazelle. "Approximate Nearest Neighbors and the Fast
   Johnson-Lindenstrauss Transform". STOC 2006 (the randomized Hadamard transform).
"""

from __future__ import annotations

import hashlib
from typing import Final

import numpy as np
from numpy.typing import ArrayLike, NDArray

from fedagg.errors import ConfigError, explain

__all__ = ["ROTATION_TAG", "HadamardRotation", "fwht_", "next_power_of_two"]

ROTATION_TAG: Final = b"fedagg/privacy/rotation/v1"
"""Domain-separation tag hashed in front of the round's seed to derive the signs."""
_MAX_DIM: Final = 1 << 30


def next_power_of_two(d: int) -> int:
    """Smallest power of two ``>= d`` (``d >= 1``)."""
    return 1 << max(0, int(d) - 1).bit_length()


def fwht_(a: NDArray[np.float64], scratch: NDArray[np.float64] | None = None) -> None:
    """Unnormalised fast Walsh–Hadamard transform of ``a``, in place.

    After the call ``a`` holds ``H_n a`` with ``H_n`` the Sylvester–Hadamard matrix of order
    ``n = a.size`` (entries ``+-1``; divide by ``sqrt(n)`` for the orthogonal matrix).
    Stage ``h`` views ``a`` as ``(n / 2h, 2, h)`` and replaces each pair of half-blocks
    ``(u, v)`` by ``(u + v, u - v)``.

    Parameters
    ----------
    a : numpy.ndarray
        One-dimensional, C-contiguous float64 array whose size is a power of two.
    scratch : numpy.ndarray, optional
        float64 buffer of at least ``n / 2`` values (allocated when omitted).
    """
    n = a.size
    if n & (n - 1) or a.ndim != 1 or not a.flags.c_contiguous or a.dtype != np.float64:
        raise ValueError("fwht_ needs a contiguous 1-D float64 array of power-of-two size")
    if n < 2:
        return
    buf = np.empty(n // 2, np.float64) if scratch is None else scratch[: n // 2]
    h = 1
    while h < n:
        view = a.reshape(-1, 2, h)
        u, v = view[:, 0, :], view[:, 1, :]
        tmp = buf.reshape(u.shape)
        np.copyto(tmp, u)
        u += v
        np.subtract(tmp, v, out=v)
        h *= 2


class HadamardRotation:
    """The orthogonal map ``x -> H D [x, 0...]`` of one round, and its inverse.

    Parameters
    ----------
    dim : int
        Length ``d`` of the vectors rotated (the flattened update); ``1 <= d <= 2^30``.
    seed : bytes
        The round's public seed; ``D``'s signs are a numpy PCG64 stream seeded with
        ``SHA-256(ROTATION_TAG || seed)`` (all 256 bits), so every party derives the same
        rotation and a different seed gives an independent one.

    Attributes
    ----------
    dim, padded_dim : int
        ``d`` and ``d_pad = next_power_of_two(d)``.

    Examples
    --------
    >>> rot = HadamardRotation(3, b"round-1")
    >>> y = rot.forward(np.array([3.0, 0.0, 4.0]))
    >>> y.shape, round(float(np.linalg.norm(y)), 12)
    ((4,), 5.0)
    >>> np.allclose(rot.inverse(y), [3.0, 0.0, 4.0])
    True
    """

    def __init__(self, dim: int, seed: bytes) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or not (
                1 <= int(dim) <= _MAX_DIM):
            raise ConfigError(explain("privacy.dim", dim, f"must be a whole number in "
                                      f"[1, {_MAX_DIM}]", "pass the flattened update's size"))
        if not isinstance(seed, bytes | bytearray):
            raise ConfigError(explain("rotation seed", type(seed).__name__, "must be bytes",
                                      "pass the round's public seed as bytes"))
        self.dim = int(dim)
        self.padded_dim = next_power_of_two(self.dim)
        digest = hashlib.sha256(ROTATION_TAG + bytes(seed)).digest()
        rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest, "big")))
        bits = rng.integers(0, 2, self.padded_dim, dtype=np.int8)
        self._signs: NDArray[np.float64] = 1.0 - 2.0 * bits.astype(np.float64)
        self._scale = 1.0 / np.sqrt(float(self.padded_dim))

    @property
    def signs(self) -> NDArray[np.float64]:
        """A read-only view of ``D``'s diagonal (``+-1.0``, ``padded_dim`` values)."""
        view = self._signs.view()
        view.flags.writeable = False
        return view

    def forward(self, x: ArrayLike) -> NDArray[np.float64]:
        """``H D [x, 0, ..., 0]``: ``padded_dim`` float64 values with the norm of ``x``.

        Raises
        ------
        ConfigError
            ``x`` does not have ``dim`` elements.
        """
        v = np.asarray(x, dtype=np.float64).reshape(-1)
        if v.size != self.dim:
            raise ConfigError(explain("update", v.size, f"must have {self.dim} elements",
                                      "pass the flattened update of the round's model"))
        out = np.zeros(self.padded_dim, np.float64)
        np.multiply(v, self._signs[: self.dim], out=out[: self.dim])
        fwht_(out)
        out *= self._scale
        return out

    def inverse(self, y: ArrayLike) -> NDArray[np.float64]:
        """``(D H y)[:dim]``: undo :meth:`forward` and drop the padding.

        Raises
        ------
        ConfigError
            ``y`` does not have ``padded_dim`` elements.
        """
        v = np.array(y, dtype=np.float64, copy=True).reshape(-1)
        if v.size != self.padded_dim:
            raise ConfigError(explain("rotated vector", v.size,
                                      f"must have {self.padded_dim} elements",
                                      "pass the full padded vector"))
        fwht_(v)
        v *= self._scale
        v *= self._signs
        out: NDArray[np.float64] = v[: self.dim].copy()
        return out
