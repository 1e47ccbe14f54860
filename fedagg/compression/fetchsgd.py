"""FetchSGD: sites send count sketches, the server keeps momentum and error in sketch space.

Algorithm 1 of [Rothchild2020]_, written for fedagg's convention that a site uploads its
model *delta* (already a descent step, so it is added, not subtracted). Per round ``t``:

====  ===========================================  =======================================
line  paper (gradients ``g``)                      here (deltas ``x``, mean over sites)
====  ===========================================  =======================================
16    ``S^t = 1/W sum_i S(g_i^t)``                 ``S^t`` = weighted mean of site tables
17    ``S_u^t = rho S_u^{t-1} + S^t``              same (``momentum = rho``)
18    ``S_e^t = eta S_u^t + S_e^{t-1}``            same (``lr = eta``, 1 by default)
19    ``Delta^t = Top-k(U(S_e^t))``                :meth:`CountSketch.unsketch`
20    ``S_e^t -= S(Delta^t)``                      ``error_update="subtract"``
21    ``w^{t+1} = w^t - Delta^t``                  ``w^{t+1} = w^t + Delta^t``
====  ===========================================  =======================================

``error_update="zero"`` (the default) instead sets to zero, in both ``S_e`` and ``S_u``, every
counter that ``S(Delta^t)`` touches. This is what the public FetchSGD reference code does
(its comment: subtracting ``S(Delta)`` "should work but doesn't (model diverges)"), and it
stands in for momentum factor masking in sketch space (DGC, [Lin2018]_, Sec. 3.2).

Sites keep no state (error feedback lives at the server, in sketch space), which suits
sites that join only some rounds. All sites and the server use one sketch for the whole run
(public seed, fixed hash epoch): the server state is only meaningful in that sketch.

Optional second round. :meth:`FetchSGDServer.propose` returns the heavy hitters with their
sketch estimates; a caller may fetch exact values on that (public) support with one more
secure sparse round and pass them to :meth:`FetchSGDServer.commit`. Whatever is committed is
what the error accumulation removes, so nothing is lost either way.

References
----------
.. [Rothchild2020] D. Rothchild et al. "FetchSGD: Communication-Efficient Federated Learning
   with Sketching". ICML 2020. Algorithm 1; Sec. 3 (momentum and error in sketch space).
.. [Lin2018] Y. Lin, S. Han, H. Mao, Y. Wang, W. J. Dally. "Deep Gradient Compression".
   ICLR 2018. Sec. 3.2 (momentum correction, momentum factor masking).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from fedagg.compression.payload import Payload, TensorPayload, WireDType
from fedagg.compression.select import k_from_ratio
from fedagg.compression.sketch import CountSketch, flatten
from fedagg.errors import ConfigError, explain

__all__ = ["FetchSGDServer", "SketchCompressor", "SketchUpdate", "find_sketch"]

ErrorUpdate = Literal["zero", "subtract"]


@dataclass(frozen=True)
class SketchUpdate:
    """The sparse update the server applies: ``values`` at sorted flat ``indices``."""

    dim: int
    indices: NDArray[np.int64]
    values: NDArray[np.float64]

    def to_dense(self) -> NDArray[np.float64]:
        """The update as a flat float64 vector of ``dim`` entries."""
        out = np.zeros(self.dim, dtype=np.float64)
        out[self.indices] = self.values
        return out

    def apply(self, flat_weights: NDArray[Any]) -> NDArray[Any]:
        """``w + Delta`` on a flat weight vector (a new array, same dtype)."""
        w = np.array(flat_weights, copy=True)
        if w.shape != (self.dim,):
            raise ConfigError(explain("weights", w.shape, f"must be ({self.dim},)", "flatten()"))
        w[self.indices] += self.values.astype(w.dtype)
        return w


def _check_float(field: str, value: object, lo: float, hi: float) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigError(explain(field, value, "must be a number", f"in [{lo}, {hi}]"))
    x = float(value)
    if not (math.isfinite(x) and lo <= x <= hi):
        raise ConfigError(explain(field, value, f"must be in [{lo}, {hi}]", "fix the value"))
    return x


class FetchSGDServer:
    """Server state of FetchSGD: momentum ``S_u`` and error ``S_e`` tables (Algorithm 1).

    Parameters
    ----------
    sketch : CountSketch
        The run's sketch (same public hashes as the sites').
    k : int
        Coordinates updated per round (``0 <= k <= dim``).
    momentum : float
        ``rho`` in [0, 1). The paper uses 0.9 on minibatch gradients; fedagg's sites send
        multi-step deltas, and a momentum of 0.9 multiplies their step by about 10, so the
        default is 0 (pure error accumulation in sketch space); lower ``lr`` with momentum.
    lr : float
        ``eta`` (> 0); 1 keeps the scale of the sites' deltas.
    error_update : {"zero", "subtract"}
        How the applied update leaves the accumulators (see the module docstring).

    Examples
    --------
    >>> import numpy as np
    >>> cs = CountSketch(100, 5, 40, seed=b"public")
    >>> server = FetchSGDServer(cs, k=2, momentum=0.0)
    >>> x = np.zeros(100); x[[7, 42]] = [3.0, -2.0]
    >>> step = server.step(cs.sketch(x))
    >>> step.indices.tolist(), np.round(step.values, 6).tolist()
    ([7, 42], [3.0, -2.0])
    """

    def __init__(
        self,
        sketch: CountSketch,
        k: int,
        *,
        momentum: float = 0.0,
        lr: float = 1.0,
        error_update: ErrorUpdate = "zero",
    ) -> None:
        if not isinstance(sketch, CountSketch):
            raise ConfigError(
                explain("sketch", type(sketch).__name__, "must be a CountSketch", "-")
            )
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or not 0 <= k <= sketch.dim:
            raise ConfigError(explain("FetchSGDServer.k", k, f"must be in [0, {sketch.dim}]", "-"))
        self.momentum = _check_float("FetchSGDServer.momentum", momentum, 0.0, 0.999999)
        self.lr = _check_float("FetchSGDServer.lr", lr, 1e-12, 1e12)
        if error_update not in ("zero", "subtract"):
            raise ConfigError(
                explain("error_update", error_update, "must be 'zero' or 'subtract'", "'zero'")
            )
        self.sketch = sketch
        self.k = int(k)
        self.error_update: ErrorUpdate = error_update
        self.velocity = np.zeros(sketch.shape, dtype=np.float64)  # S_u
        self.error = np.zeros(sketch.shape, dtype=np.float64)  # S_e
        self._pending: SketchUpdate | None = None

    def propose(self, mean_table: NDArray[Any]) -> SketchUpdate:
        """Lines 17-19: fold the round's mean table in, return the heavy hitters of ``S_e``.

        Call :meth:`commit` next (with these values, or exact ones on the same indices).

        Raises
        ------
        ConfigError
            A previous proposal was not committed, or the table has the wrong size or
            non-finite counters.
        """
        if self._pending is not None:
            raise ConfigError(
                explain("FetchSGDServer", "pending", "propose() called twice", "commit() first")
            )
        t = self.sketch.table(mean_table, "mean_table").astype(np.float64)
        if not bool(np.all(np.isfinite(t))):
            raise ConfigError(explain("mean_table", "NaN/inf", "must be finite", "reject site"))
        self.velocity *= self.momentum
        self.velocity += t
        self.error += self.lr * self.velocity
        idx, est = self.sketch.unsketch(self.error, self.k)
        self._pending = SketchUpdate(self.sketch.dim, idx, est)
        return self._pending

    def commit(self, update: SketchUpdate | None = None) -> SketchUpdate:
        """Line 20: remove the applied update from the accumulators; returns what to apply.

        Parameters
        ----------
        update : SketchUpdate, optional
            Values to apply on the proposed indices (e.g. exact values from a second round);
            default: the sketch estimates of :meth:`propose`.
        """
        if self._pending is None:
            raise ConfigError(explain("FetchSGDServer", "idle", "nothing proposed", "propose()"))
        idx = self._pending.indices
        if update is None:
            update = self._pending
        elif update.dim != self.sketch.dim or not np.array_equal(update.indices, idx):
            raise ConfigError(
                explain("update.indices", "differ", "must be the proposed indices", "reuse them")
            )
        elif update.values.shape != idx.shape or not bool(np.all(np.isfinite(update.values))):
            raise ConfigError(
                explain(
                    "update.values",
                    update.values.shape,
                    f"must be {idx.shape[0]} finite values",
                    "one per proposed index",
                )
            )
        if self.error_update == "subtract":
            self.error -= self.sketch.sketch_sparse(idx, update.values)
        else:
            hit = self.sketch.touched(idx)
            self.error[hit] = 0.0
            self.velocity[hit] = 0.0
        self._pending = None
        return update

    def step(self, mean_table: NDArray[Any]) -> SketchUpdate:
        """One round of Algorithm 1 (``propose`` then ``commit``): the update to add."""
        self.propose(mean_table)
        return self.commit()

    def state_dict(self) -> dict[str, NDArray[Any]]:
        """``{"velocity", "error"}`` tables and the sketch's ``fingerprint`` (uint8), copies.

        Raises
        ------
        ConfigError
            While a proposal is pending (save between rounds).
        """
        if self._pending is not None:
            raise ConfigError(explain("FetchSGDServer", "pending", "mid-round", "commit() first"))
        return {
            "velocity": self.velocity.copy(),
            "error": self.error.copy(),
            "fingerprint": np.frombuffer(self.sketch.fingerprint(), dtype=np.uint8).copy(),
        }

    def load_state_dict(self, state: Mapping[str, NDArray[Any]]) -> None:
        """Restore :meth:`state_dict` output (``{}`` resets to zero tables).

        Raises
        ------
        ConfigError
            Unknown keys, a different sketch (fingerprint), wrong shapes or non-finite values.
        """
        self._pending = None
        if not state:
            self.velocity[:] = 0.0
            self.error[:] = 0.0
            return
        if set(state) != {"velocity", "error", "fingerprint"}:
            raise ConfigError(
                explain(
                    "FetchSGDServer state keys",
                    sorted(state),
                    "must be velocity, error, fingerprint",
                    "pass the dict returned by state_dict()",
                )
            )
        fp = np.asarray(state["fingerprint"], dtype=np.uint8).tobytes()
        if fp != self.sketch.fingerprint():
            raise ConfigError(
                explain(
                    "FetchSGDServer state",
                    "fingerprint",
                    "was saved for another sketch (seed, epoch, dim, rows or cols differ)",
                    "reset with load_state_dict({})",
                )
            )
        tables = {}
        for key in ("velocity", "error"):
            arr = np.array(state[key], dtype=np.float64, copy=True)
            if arr.shape != self.sketch.shape or not bool(np.all(np.isfinite(arr))):
                raise ConfigError(
                    explain(key, arr.shape, f"must be a finite {self.sketch.shape} table", "reset")
                )
            tables[key] = arr
        self.velocity, self.error = tables["velocity"], tables["error"]

    def __repr__(self) -> str:
        return (
            f"FetchSGDServer({self.sketch!r}, k={self.k}, momentum={self.momentum}, "
            f"lr={self.lr}, error_update={self.error_update!r})"
        )


class SketchCompressor:
    """Site-side FetchSGD stage: the payload is the count sketch of the whole update.

    The payload holds one dense float32 tensor of shape ``(rows, cols)`` (the table of the
    flattened, concatenated update). It reveals no index: the server learns a linear
    function of each site's update in plaintext, and only the *sum's* sketch under secure
    aggregation. Do not wrap it in ``ErrorFeedback``: FetchSGD's error lives at the server.

    Parameters
    ----------
    rows : int
        Sketch rows.
    cols : int or None
        Buckets per row; or ``None`` with ``size`` set.
    size : float or None
        Table size as a fraction of ``dim``: ``cols = max(1, ceil(size * dim / rows))``.
    k, k_ratio : int or None, float or None
        Coordinates the server updates per round: ``k``, or ``ceil(k_ratio * dim)``.
    seed : bytes
        Public seed; the hash epoch is ``epoch`` (fixed for the run).
    momentum, lr, error_update
        Server parameters, see :class:`FetchSGDServer`.
    """

    reveals_indices = False

    def __init__(
        self,
        *,
        rows: int,
        cols: int | None = None,
        size: float | None = None,
        k: int | None = None,
        k_ratio: float | None = None,
        seed: bytes,
        epoch: int = 0,
        momentum: float = 0.0,
        lr: float = 1.0,
        error_update: ErrorUpdate = "zero",
    ) -> None:
        if (cols is None) == (size is None):
            raise ConfigError(explain("SketchCompressor", (cols, size), "give cols or size", "-"))
        if (k is None) == (k_ratio is None):
            raise ConfigError(explain("SketchCompressor", (k, k_ratio), "give k or k_ratio", "-"))
        if size is not None:
            _check_float("SketchCompressor.size", size, 1e-9, 1e9)
        if k_ratio is not None:
            _check_float("SketchCompressor.k_ratio", k_ratio, 0.0, 1.0)
        self.rows, self.cols, self.size = rows, cols, size
        self.k, self.k_ratio = k, k_ratio
        self.seed, self.epoch = seed, epoch
        self.momentum, self.lr, self.error_update = momentum, lr, error_update
        self._cache: CountSketch | None = None
        self.sketch_for(1)  # validate rows / cols / seed / epoch now

    def sketch_for(self, dim: int) -> CountSketch:
        """The run's :class:`CountSketch` for updates of ``dim`` entries (cached)."""
        cols = (
            self.cols
            if self.cols is not None
            else max(1, math.ceil((self.size or 0.0) * dim / max(1, int(self.rows))))
        )
        c = self._cache
        if c is None or c.dim != dim or c.cols != cols:
            c = CountSketch(dim, self.rows, cols, seed=self.seed, round=self.epoch)
            if dim > 1:
                self._cache = c
        return c

    def k_for(self, dim: int) -> int:
        """Coordinates updated per round for ``dim`` entries."""
        return min(self.k, dim) if self.k is not None else k_from_ratio(self.k_ratio or 0.0, dim)

    def server(self, dim: int) -> FetchSGDServer:
        """A fresh :class:`FetchSGDServer` for this stage's parameters."""
        return FetchSGDServer(
            self.sketch_for(dim),
            self.k_for(dim),
            momentum=self.momentum,
            lr=self.lr,
            error_update=self.error_update,
        )

    def table(self, tensors: Sequence[NDArray[Any]]) -> NDArray[np.float64]:
        """The flat float64 table of ``tensors`` (what secure aggregation masks)."""
        flat = flatten(tensors)
        return self.sketch_for(int(flat.shape[0])).sketch(flat).ravel()

    def compress(self, tensors: Sequence[NDArray[Any]], *, rng: np.random.Generator) -> Payload:
        """Sketch the update (``rng`` is unused): one ``(rows, cols)`` float32 tensor."""
        del rng
        flat = flatten(tensors)
        table = self.sketch_for(int(flat.shape[0])).sketch(flat)
        return Payload(
            (TensorPayload(table.shape, WireDType.FLOAT32, table.astype(np.float32).ravel()),)
        )

    def __repr__(self) -> str:
        size = f"cols={self.cols}" if self.cols is not None else f"size={self.size}"
        k = f"k={self.k}" if self.k is not None else f"k_ratio={self.k_ratio}"
        return f"SketchCompressor(rows={self.rows}, {size}, {k}, momentum={self.momentum})"


def find_sketch(compressor: object) -> SketchCompressor | None:
    """The :class:`SketchCompressor` inside a pipeline (through ``Chain.first``), or ``None``."""
    node: object = compressor
    for _ in range(16):
        if node is None:
            return None
        if isinstance(node, SketchCompressor):
            return node
        node = getattr(node, "inner", None) or getattr(node, "first", None)
    return None
