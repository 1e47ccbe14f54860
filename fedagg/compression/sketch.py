"""Count sketches of flat vectors, public hashes, and their fixed-point (ring) form.

A count sketch [Charikar2002]_ with ``rows`` x ``cols`` counters summarises a vector
``x`` of ``dim`` entries: row ``j`` has a bucket hash ``h_j: [dim] -> [cols]`` and a sign
hash ``s_j: [dim] -> {-1, +1}``, and

    ``T[j, b] = sum_{i : h_j(i) = b} s_j(i) * x_i``.

The sketch is **linear**: ``S(a) + S(b) = S(a + b)``. That is what makes it work under secure
aggregation: the masked sum of the sites' tables is the table of the sum of their updates
(FetchSGD, [Rothchild2020]_, Sec. 3). Point queries ``median_j s_j(i) * T[j, h_j(i)]``
estimate every coordinate; the largest estimates are the *heavy hitters* (FetchSGD's
"unsketch", Algorithm 1, line 19).

Public hashes
-------------
Every party (each site and the server) must build the *same* hashes, from public data only.
They are the SHAKE-256 (FIPS 202) stream of the length-prefixed parts
``"fedagg/compression/sketch/v1" || purpose || seed || round || dim || rows || cols``
followed by ``row`` (4 bytes, big-endian) and ``chunk`` (8 bytes, big-endian): coordinate
``i`` of row ``j`` reads little-endian 64-bit word ``i mod 2^16`` of the stream of
``(j, i div 2^16)``. With ``w`` that word, ``h_j(i) = (w mod 2^63) mod cols`` (bias below
``cols / 2^63``) and ``s_j(i) = +1`` if bit 63 of ``w`` is 0, else ``-1`` (independent of the
bucket). No library's random-number API is involved, so sites on different NumPy builds
agree; golden vectors in the tests guard the definition.

Exact integer path
------------------
Summed in floats, linearity holds up to rounding. For the secure path the linearity is
exact: :func:`fedagg.compression.ring.encode_table` quantises the update exactly as
:func:`fedagg.secagg.fixed_point.encode` does (clip, weight, stochastic rounding to
``2^-frac_bits``), sketches the *integers* (:meth:`CountSketch.sketch_int`, int64, exact),
and reduces mod ``2^32``; the low ``b`` bits are the entry in ``Z_2^b``. The modular sum of
the sites' vectors is then exactly ``[S_int(sum_i q_i), sum_i w_q]`` mod ``2^b``: the integer
sketch of the very fixed-point sum dense secure aggregation would have produced.
:func:`~fedagg.compression.ring.decode_table_sum` reads it back with
:func:`fedagg.secagg.fixed_point.decode_sum`.

References
----------
.. [Charikar2002] M. Charikar, K. Chen, M. Farach-Colton. "Finding Frequent Items in Data
   Streams". ICALP 2002 (the count sketch; median-of-rows point queries, Sec. 3).
.. [Rothchild2020] D. Rothchild, A. Panda, E. Ullah, N. Ivkin, I. Stoica, V. Braverman,
   J. Gonzalez, R. Arora. "FetchSGD: Communication-Efficient Federated Learning with
   Sketching". ICML 2020 (Algorithm 1; sketches are linear so they can be summed, Sec. 3).
.. [Bonawitz2017] K. Bonawitz et al. "Practical Secure Aggregation for Privacy-Preserving
   Machine Learning". CCS 2017 (fixed-point encoding in ``Z_2^b``, Sec. 3).
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence
from typing import Any, Final, cast

import numpy as np
from numpy.typing import NDArray

from fedagg.compression.select import topk_indices
from fedagg.errors import ConfigError, explain

__all__ = ["CHUNK", "CountSketch", "flatten", "sketch_update"]

_DOMAIN: Final = b"fedagg/compression/sketch/v1"
CHUNK: Final = 1 << 16
"""Coordinates per SHAKE-256 stream (per row): the streams can be generated independently."""
_LOW63: Final = np.uint64((1 << 63) - 1)
_MAX_ROWS: Final = 64
_MAX_COLS: Final = 2**31 - 1


def is_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def check_int(field: str, value: object, lo: int, hi: int, fix: str) -> int:
    if not is_int(value) or not lo <= operator.index(cast(int, value)) <= hi:
        raise ConfigError(explain(field, value, f"must be an int in [{lo}, {hi}]", fix))
    return operator.index(cast(int, value))


def _key(purpose: bytes, seed: bytes, round_: int, dim: int, rows: int, cols: int) -> bytes:
    parts = (
        _DOMAIN,
        purpose,
        seed,
        round_.to_bytes(8, "big"),
        dim.to_bytes(8, "big"),
        rows.to_bytes(8, "big"),
        cols.to_bytes(8, "big"),
    )
    return b"".join(len(p).to_bytes(8, "big") + p for p in parts)


def flatten(tensors: NDArray[Any] | Sequence[NDArray[Any]]) -> NDArray[np.float64]:
    """The update as one flat float64 vector (tensors raveled and concatenated in order)."""
    if isinstance(tensors, np.ndarray):
        return np.asarray(tensors, dtype=np.float64).ravel()
    parts = [np.asarray(t, dtype=np.float64).ravel() for t in tensors]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.float64)


class CountSketch:
    """A count sketch of ``dim``-vectors with public hashes (Charikar et al. 2002).

    Parameters
    ----------
    dim : int
        Length of the sketched vectors (e.g. the number of model parameters), ``>= 1``.
    rows : int
        Independent rows ``r`` (1..64); point queries take the median over rows.
    cols : int
        Buckets per row ``c`` (``>= 1``). The table has ``r * c`` counters.
    seed : bytes
        Public seed agreed by the federation.
    round : int
        Public hash epoch (``>= 0``). FetchSGD keeps state in sketch space across rounds, so
        it uses one fixed epoch for the whole run; stateless uses (index votes) may rehash
        every round.
    purpose : bytes
        Domain separation between independent uses (``b"count-sketch"``, ``b"vote"``, ...).

    Notes
    -----
    The hashes take ``5 * rows * dim`` bytes (int32 buckets, int8 signs), computed on first
    use and cached. See the module docstring for their exact definition.

    Examples
    --------
    >>> import numpy as np
    >>> cs = CountSketch(8, 3, 4, seed=b"public")
    >>> a, b = np.arange(8.0), np.ones(8)
    >>> bool(np.allclose(cs.sketch(a) + cs.sketch(b), cs.sketch(a + b)))
    True
    >>> cs.heavy_hitters(cs.sketch(np.eye(8)[5] * 10.0), 1).tolist()
    [5]
    """

    def __init__(
        self,
        dim: int,
        rows: int,
        cols: int,
        *,
        seed: bytes,
        round: int = 0,
        purpose: bytes = b"count-sketch",
    ) -> None:
        self.dim = check_int("CountSketch.dim", dim, 1, 2**40, "pass the flat update size")
        self.rows = check_int("CountSketch.rows", rows, 1, _MAX_ROWS, "e.g. rows=5")
        self.cols = check_int("CountSketch.cols", cols, 1, _MAX_COLS, "e.g. cols=dim // 50")
        self.round = check_int("CountSketch.round", round, 0, 2**63 - 1, "a public round >= 0")
        if not isinstance(seed, bytes):
            raise ConfigError(
                explain("CountSketch.seed", type(seed).__name__, "must be bytes", "public bytes")
            )
        if not isinstance(purpose, bytes):
            raise ConfigError(explain("CountSketch.purpose", purpose, "must be bytes", "-"))
        self.seed = seed
        self.purpose = purpose
        self._key = _key(purpose, seed, self.round, self.dim, self.rows, self.cols)
        self._buckets: NDArray[np.int32] | None = None
        self._signs: NDArray[np.int8] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of a table."""
        return (self.rows, self.cols)

    @property
    def size(self) -> int:
        """Counters per table, ``rows * cols``."""
        return self.rows * self.cols

    def fingerprint(self) -> bytes:
        """SHA-256 of the hash definition: equal fingerprints mean identical sketches."""
        return hashlib.sha256(self._key).digest()

    def _hashes(self) -> tuple[NDArray[np.int32], NDArray[np.int8]]:
        if self._buckets is None or self._signs is None:
            buckets = np.empty((self.rows, self.dim), dtype=np.int32)
            signs = np.empty((self.rows, self.dim), dtype=np.int8)
            cols = np.uint64(self.cols)
            for j in range(self.rows):
                for lo in range(0, self.dim, CHUNK):
                    n = min(CHUNK, self.dim - lo)
                    xof = hashlib.shake_256(
                        self._key + j.to_bytes(4, "big") + (lo // CHUNK).to_bytes(8, "big")
                    )
                    w = np.frombuffer(xof.digest(8 * n), dtype="<u8")
                    buckets[j, lo : lo + n] = (w & _LOW63) % cols
                    signs[j, lo : lo + n] = 1 - 2 * (w >> np.uint64(63)).astype(np.int8)
            self._buckets, self._signs = buckets, signs
        return self._buckets, self._signs

    @property
    def buckets(self) -> NDArray[np.int32]:
        """``h_j(i)`` as a ``(rows, dim)`` array (read-only view of the cache)."""
        b = self._hashes()[0].view()
        b.flags.writeable = False
        return b

    @property
    def signs(self) -> NDArray[np.int8]:
        """``s_j(i)`` in ``{-1, +1}`` as a ``(rows, dim)`` array (read-only view)."""
        s = self._hashes()[1].view()
        s.flags.writeable = False
        return s

    def _vector(self, x: NDArray[Any], what: str) -> NDArray[Any]:
        v = np.asarray(x)
        if v.ndim != 1 or v.shape[0] != self.dim:
            raise ConfigError(
                explain(what, v.shape, f"must be a flat vector of {self.dim} entries", "flatten()")
            )
        return v

    def table(self, table: NDArray[Any], what: str = "table") -> NDArray[Any]:
        """``table`` reshaped to ``(rows, cols)``; raises ConfigError if its size differs."""
        t = np.asarray(table)
        if t.size != self.size:
            raise ConfigError(
                explain(what, t.shape, f"must hold rows * cols = {self.size} counters", "-")
            )
        return t.reshape(self.shape)

    def sketch(self, x: NDArray[Any]) -> NDArray[np.float64]:
        """Float sketch ``S(x)``, a ``(rows, cols)`` float64 table (linear up to rounding)."""
        v = self._vector(x, "CountSketch.sketch(x)").astype(np.float64, copy=False)
        if not bool(np.all(np.isfinite(v))):
            raise ConfigError(explain("CountSketch.sketch(x)", "NaN/inf", "must be finite", "-"))
        buckets, signs = self._hashes()
        out = np.empty(self.shape, dtype=np.float64)
        for j in range(self.rows):
            out[j] = np.bincount(buckets[j], weights=signs[j] * v, minlength=self.cols)
        return out

    def sketch_int(self, q: NDArray[Any]) -> NDArray[np.int64]:
        """Integer sketch of an integer vector: exact (int64), so exactly linear.

        Raises
        ------
        ConfigError
            ``q`` is not an integer vector, or ``max|q| * dim`` could overflow int64.
        """
        v = self._vector(q, "CountSketch.sketch_int(q)")
        if not np.issubdtype(v.dtype, np.integer):
            raise ConfigError(
                explain("CountSketch.sketch_int(q)", str(v.dtype), "must be integers", "-")
            )
        v = v.astype(np.int64)
        peak = int(np.abs(v).max()) if v.size else 0
        if peak * self.dim >= 2**62:
            raise ConfigError(
                explain("max|q|", peak, f"times dim={self.dim} must stay below 2**62", "-")
            )
        buckets, signs = self._hashes()
        out = np.zeros(self.shape, dtype=np.int64)
        for j in range(self.rows):
            np.add.at(out[j], buckets[j], signs[j].astype(np.int64) * v)
        return out

    def estimate(self, table: NDArray[Any]) -> NDArray[np.float64]:
        """Point queries for every coordinate: ``median_j s_j(i) * T[j, h_j(i)]``.

        Charikar et al. 2002, Sec. 3 (with an even number of rows the median is the mean of
        the two middle values).
        """
        t = self.table(table).astype(np.float64)
        buckets, signs = self._hashes()
        vals = np.take_along_axis(t, buckets.astype(np.intp), axis=1)
        vals *= signs
        out: NDArray[np.float64] = vals[0] if self.rows == 1 else np.median(vals, axis=0)
        return out

    def heavy_hitters(self, table: NDArray[Any], k: int) -> NDArray[np.int64]:
        """The ``k`` coordinates with the largest ``|estimate|``, sorted; ties: lowest index."""
        k = check_int("heavy_hitters.k", k, 0, self.dim, "0 <= k <= dim")
        return topk_indices(self.estimate(table), k)

    def unsketch(
        self, table: NDArray[Any], k: int
    ) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
        """FetchSGD's ``Top-k(U(S))`` (Algorithm 1, line 19): heavy hitters and estimates."""
        est = self.estimate(table)
        k = check_int("unsketch.k", k, 0, self.dim, "0 <= k <= dim")
        idx = topk_indices(est, k)
        return idx, est[idx]

    def touched(self, indices: NDArray[Any]) -> NDArray[np.bool_]:
        """``(rows, cols)`` mask of the buckets that ``indices`` hash to (the support of ``S(e_I)``)."""
        idx = np.asarray(indices, dtype=np.int64).ravel()
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.dim):
            raise ConfigError(
                explain("indices", "out of range", f"must be in [0, {self.dim})", "-")
            )
        buckets, _ = self._hashes()
        mask = np.zeros(self.shape, dtype=bool)
        for j in range(self.rows):
            mask[j, buckets[j, idx]] = True
        return mask

    def sketch_sparse(self, indices: NDArray[Any], values: NDArray[Any]) -> NDArray[np.float64]:
        """``S(v)`` of the sparse vector with ``values`` at ``indices`` (no dense temporary)."""
        idx = np.asarray(indices, dtype=np.int64).ravel()
        val = np.asarray(values, dtype=np.float64).ravel()
        if idx.shape != val.shape:
            raise ConfigError(explain("values", val.shape, f"must match indices {idx.shape}", "-"))
        self.touched(idx)  # range check
        buckets, signs = self._hashes()
        out = np.empty(self.shape, dtype=np.float64)
        for j in range(self.rows):
            out[j] = np.bincount(buckets[j, idx], weights=signs[j, idx] * val, minlength=self.cols)
        return out

    def __repr__(self) -> str:
        return (
            f"CountSketch(dim={self.dim}, rows={self.rows}, cols={self.cols}, round={self.round})"
        )


def sketch_update(
    tensors: NDArray[Any] | Sequence[NDArray[Any]], sketch: CountSketch
) -> NDArray[np.float64]:
    """Site side, float path: the flat sketch table of the (error-compensated) update.

    The result (``rows * cols`` float64) is what the site hands to secure aggregation as its
    "update" (the existing :meth:`fedagg.secagg.client.ClientState.handle_round` encodes it,
    clipping each counter at ``secagg.clip``), or sends in plaintext.
    """
    return sketch.sketch(flatten(tensors)).ravel()
