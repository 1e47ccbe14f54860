"""Error feedback for shared supports: DGC's momentum correction, masking, clipping, decay.

With a public support (random, block, top-k of the aggregate, voted) every site sends the
*same* few coordinates, so a coordinate may be missed for many rounds and its residual grows
stale. :class:`DGCFeedback` is error feedback with the tools of Deep Gradient Compression
[Lin2018]_, applied across rounds to each site's delta ``x_t``::

    x_t  <- x_t * min(1, clip_norm / ||x_t||)     # local gradient clipping   (Sec. 3.3)
    u_t   = momentum * u_{t-1} + x_t               # momentum correction       (Sec. 3.2)
    v_t   = decay * v_{t-1} + u_t                  # accumulation (+ residual decay)
    send    inner.compress(v_t)                    # e.g. values on the shared support
    v_t  <- v_t - decode(sent)                     # what was sent leaves the residual
    u_t[sent] = 0                                  # momentum factor masking   (Sec. 3.3)

* ``momentum = 0``, ``decay = 1``, no clipping is exactly
  :class:`~fedagg.compression.error_feedback.ErrorFeedback` (bit for bit; tested). The sum
  invariant ``decode + v_new = x + v_old`` then holds; with momentum or decay it does not,
  by design.
* **Momentum correction** accumulates the site's momentum instead of its raw delta, so that
  a coordinate sent late carries the velocity it would have had (DGC Eq. 4-5); **factor
  masking** stops the stale momentum of a coordinate once it is sent.
* **Residual decay** (``decay < 1``, not in DGC) shrinks what the support keeps missing: a
  coordinate missed for ``a`` rounds contributes ``decay^a`` of its old mass, bounding how
  stale an update can be when it finally goes out. Mass is lost on purpose; keep ``decay``
  close to 1 (e.g. 0.9-0.99).
* **Clipping** bounds one site's delta norm before accumulation (DGC clips each worker's
  gradient at ``N^{-1/2}`` of the global threshold; pass the per-site threshold).

References
----------
.. [Lin2018] Y. Lin, S. Han, H. Mao, Y. Wang, W. J. Dally. "Deep Gradient Compression:
   Reducing the Communication Bandwidth for Distributed Training". ICLR 2018. Sec. 3.2
   (momentum correction), Sec. 3.3 (local gradient clipping, momentum factor masking).
.. [Stich2018] S. U. Stich, J.-B. Cordonnier, M. Jaggi. "Sparsified SGD with Memory".
   NeurIPS 2018 (the error-feedback memory this extends).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.compression.base import Compressor, reveals_indices
from fedagg.compression.payload import Payload, dense_float32
from fedagg.errors import ConfigError, explain

__all__ = ["DGCFeedback"]

_KEY = re.compile(r"(residual|momentum)\.(\d+)")


def _check(field: str, value: object, lo: float, hi: float, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(explain(field, value, "must be a number", fix))
    x = float(value)
    if not (math.isfinite(x) and lo <= x <= hi):
        raise ConfigError(explain(field, value, f"must be in [{lo}, {hi}]", fix))
    return x


class DGCFeedback:
    """Error feedback with momentum correction, factor masking, clipping and residual decay.

    Parameters
    ----------
    inner : Compressor
        The lossy pipeline, typically a :class:`~fedagg.compression.support.SharedSupport`
        or :class:`~fedagg.compression.vote.VoteSupport`.
    momentum : float
        Momentum ``m`` in [0, 1) (0: none; DGC uses the optimizer's, e.g. 0.9).
    decay : float
        Residual decay in (0, 1] (1: none).
    clip_norm : float or None
        Per-site L2 threshold of the delta before accumulation (None: no clipping).

    Examples
    --------
    >>> import numpy as np
    >>> from fedagg.compression import SharedSupport
    >>> ef = DGCFeedback(SharedSupport(np.array([0])), momentum=0.5)
    >>> rng = np.random.default_rng(0)
    >>> _ = ef.compress([np.array([1.0, 2.0], dtype=np.float32)], rng=rng)
    >>> _ = ef.compress([np.array([1.0, 2.0], dtype=np.float32)], rng=rng)
    >>> ef.residuals[0].tolist(), ef.velocity[0].tolist()   # 2 + (0.5 * 2 + 2); u[0] masked
    ([0.0, 5.0], [0.0, 3.0])
    """

    def __init__(
        self,
        inner: Compressor,
        *,
        momentum: float = 0.0,
        decay: float = 1.0,
        clip_norm: float | None = None,
    ) -> None:
        self.inner = inner
        self.momentum = _check("DGCFeedback.momentum", momentum, 0.0, 0.999999, "e.g. 0.9")
        self.decay = _check("DGCFeedback.decay", decay, 1e-9, 1.0, "e.g. 0.99, or 1 for none")
        self.clip_norm = (
            None
            if clip_norm is None
            else _check("DGCFeedback.clip_norm", clip_norm, 1e-30, 1e30, "a positive norm")
        )
        self.residuals: list[NDArray[np.float32]] | None = None
        self.velocity: list[NDArray[np.float32]] | None = None

    @property
    def reveals_indices(self) -> bool:
        """Whether the wrapped pipeline sends site-chosen positions."""
        return reveals_indices(self.inner)

    def _check_shapes(self, arrs: list[NDArray[np.float32]]) -> None:
        want = [r.shape for r in self.residuals or []]
        got = [a.shape for a in arrs]
        if want != got:
            raise ConfigError(
                explain(
                    "DGCFeedback state shapes",
                    want,
                    f"do not match the update's tensor shapes {got}",
                    "reset the state (load_state_dict({})) when the model changes",
                )
            )

    def compress(self, tensors: Sequence[NDArray[Any]], *, rng: np.random.Generator) -> Payload:
        """Accumulate ``tensors`` (see the module docstring), compress, keep the rest."""
        arrs = dense_float32(tensors)
        if self.residuals is not None:
            self._check_shapes(arrs)
        if self.clip_norm is not None:
            norm = math.sqrt(sum(float(np.dot(a.ravel(), a.ravel())) for a in arrs))
            if norm > self.clip_norm:
                s = np.float32(self.clip_norm / norm)
                arrs = [a * s for a in arrs]
        if self.momentum == 0.0 or self.velocity is None:
            u = [a.copy() for a in arrs]
        else:
            m = np.float32(self.momentum)
            u = [m * v + a for v, a in zip(self.velocity, arrs, strict=True)]
        if self.residuals is None:
            acc = [x.copy() for x in u]
        elif self.decay == 1.0:
            acc = [x + r for x, r in zip(u, self.residuals, strict=True)]
        else:
            d = np.float32(self.decay)
            acc = [x + d * r for x, r in zip(u, self.residuals, strict=True)]
        payload = self.inner.compress(acc, rng=rng)
        decoded = payload.to_dense()
        self.residuals = [
            (c - s.reshape(c.shape)).astype(np.float32) for c, s in zip(acc, decoded, strict=True)
        ]
        if self.momentum != 0.0:
            for i, t in enumerate(payload.tensors):
                flat = u[i].reshape(-1)
                # to_dense() above already refused a support-less shared-support tensor
                if t.indices is not None:
                    flat[t.indices] = 0.0
                else:
                    flat[:] = 0.0
        self.velocity = [x.astype(np.float32) for x in u] if self.momentum != 0.0 else None
        return payload

    def reset(self) -> None:
        """Forget the residual and the momentum."""
        self.residuals = None
        self.velocity = None

    def residual_norm(self) -> float:
        """L2 norm of the whole residual (0.0 when empty)."""
        if not self.residuals:
            return 0.0
        return float(np.sqrt(sum(float(np.dot(r.ravel(), r.ravel())) for r in self.residuals)))

    def state_dict(self) -> dict[str, NDArray[np.float32]]:
        """``{"residual.<i>": ..., "momentum.<i>": ...}`` float32 copies (empty if none)."""
        out: dict[str, NDArray[np.float32]] = {}
        for name, arrs in (("residual", self.residuals), ("momentum", self.velocity)):
            for i, a in enumerate(arrs or []):
                out[f"{name}.{i}"] = a.copy()
        return out

    def load_state_dict(self, state: Mapping[str, NDArray[Any]]) -> None:
        """Restore :meth:`state_dict` output (``{}`` resets).

        Raises
        ------
        ConfigError
            Unknown keys, gaps, mismatched shapes or non-finite values.
        """
        found: dict[str, dict[int, NDArray[np.float32]]] = {"residual": {}, "momentum": {}}
        for key, value in state.items():
            m = _KEY.fullmatch(key)
            if m is None:
                raise ConfigError(
                    explain(
                        "DGCFeedback state key",
                        key,
                        "must be 'residual.<i>' or 'momentum.<i>'",
                        "pass the dict returned by state_dict()",
                    )
                )
            arr = np.array(value, dtype=np.float32, copy=True)
            if not bool(np.all(np.isfinite(arr))):
                raise ConfigError(explain(key, "non-finite", "must be finite", "reset the state"))
            found[m.group(1)][int(m.group(2))] = arr
        res, mom = found["residual"], found["momentum"]
        for name, part in (("residual", res), ("momentum", mom)):
            if sorted(part) != list(range(len(part))):
                raise ConfigError(
                    explain(f"DGCFeedback {name} keys", sorted(part), "must be 0..n-1", "-")
                )
        if mom and [mom[i].shape for i in sorted(mom)] != [res[i].shape for i in sorted(res)]:
            raise ConfigError(
                explain("DGCFeedback momentum", "shapes", "must match the residuals", "reset")
            )
        self.residuals = [res[i] for i in range(len(res))] if res else None
        self.velocity = [mom[i] for i in range(len(mom))] if mom else None

    def __repr__(self) -> str:
        return (
            f"DGCFeedback({self.inner!r}, momentum={self.momentum}, decay={self.decay}, "
            f"clip_norm={self.clip_norm})"
        )
