"""Error feedback: remember what compression dropped and add it to the next update.

With a residual ``e`` per tensor (zero at first), one step is::

    corrected = x + e                    # compensate
    payload   = inner.compress(corrected)
    e         = corrected - decode(payload)

so ``decode(payload) + e_new == x + e_old`` (the sum invariant): nothing is lost, only
delayed. Because the residual is taken against the *decoded* payload, the wrapper covers the
whole lossy pipeline (sparsification *and* quantization).

References
----------
.. [Seide2014] F. Seide et al. "1-Bit Stochastic Gradient Descent and its Application to
   Data-Parallel Distributed Training of Speech DNNs". Interspeech 2014 (origin of error
   feedback, "quantization with error feedback", Sec. 3).
.. [Stich2018] S. U. Stich, J.-B. Cordonnier, M. Jaggi. "Sparsified SGD with Memory".
   NeurIPS 2018. Algorithm 1 (memory ``m_t``) and Theorem 2.4.
.. [Karimireddy2019] S. P. Karimireddy et al. "Error Feedback Fixes SignSGD and other
   Gradient Compression Schemes". ICML 2019. Algorithm 2 (EF-SGD).
.. [Lin2018] Y. Lin et al. "Deep Gradient Compression". ICLR 2018. Sec. 3.1 (local
   gradient accumulation).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.compression.base import Chain, Compressor, Quantizer, reveals_indices
from fedagg.compression.payload import Payload, dense_float32
from fedagg.errors import ConfigError, explain

__all__ = ["ErrorFeedback"]

_KEY = re.compile(r"residual\.(\d+)")


class ErrorFeedback:
    """Wrap a compressor (the whole lossy pipeline) with a per-tensor residual.

    Parameters
    ----------
    inner : Compressor
        The lossy pipeline (e.g. ``TopK(0.01)`` or ``Chain(TopK(0.01), Int8())``).
    quantizer : Quantizer, optional
        Shorthand: ``ErrorFeedback(TopK(0.01), quantizer=Int8())`` is
        ``ErrorFeedback(Chain(TopK(0.01), Int8()))``.

    Notes
    -----
    State lives in :attr:`residuals` (float32 arrays, one per tensor, shaped like the
    tensors). :meth:`state_dict` / :meth:`load_state_dict` exchange plain arrays under keys
    ``"residual.0"``, ``"residual.1"``, ... so a Flower client can keep them in
    ``Context.state`` between rounds. An empty state means "no residual yet".

    Examples
    --------
    >>> import numpy as np
    >>> from fedagg.compression import TopK
    >>> ef = ErrorFeedback(TopK(k=1))
    >>> rng = np.random.default_rng(0)
    >>> p = ef.compress([np.array([3.0, -1.0, 0.5], dtype=np.float32)], rng=rng)
    >>> ef.residuals[0].tolist()
    [0.0, -1.0, 0.5]
    """

    def __init__(self, inner: Compressor, quantizer: Quantizer | None = None) -> None:
        self.inner: Compressor = inner if quantizer is None else Chain(inner, quantizer)
        self.residuals: list[NDArray[np.float32]] | None = None

    @property
    def reveals_indices(self) -> bool:
        """Whether the wrapped pipeline sends site-chosen positions."""
        return reveals_indices(self.inner)

    def compress(self, tensors: Sequence[NDArray[Any]], *, rng: np.random.Generator) -> Payload:
        """Compress ``tensors + residual`` and keep what was not delivered as the new residual.

        Raises
        ------
        ConfigError
            If the stored residual does not match the tensors (count or shapes), e.g. the
            model changed while a residual was kept.
        """
        arrs = dense_float32(tensors)
        if self.residuals is None:
            corrected = [a.copy() for a in arrs]
        else:
            self._check_shapes(arrs)
            corrected = [a + r for a, r in zip(arrs, self.residuals, strict=True)]
        payload = self.inner.compress(corrected, rng=rng)
        decoded = payload.to_dense()
        self.residuals = [
            (c - d.reshape(c.shape)).astype(np.float32)
            for c, d in zip(corrected, decoded, strict=True)
        ]
        return payload

    def _check_shapes(self, arrs: list[NDArray[np.float32]]) -> None:
        res = self.residuals or []
        got = [a.shape for a in arrs]
        want = [r.shape for r in res]
        if got != want:
            raise ConfigError(
                explain(
                    "ErrorFeedback residual shapes",
                    want,
                    f"do not match the update's tensor shapes {got}",
                    "reset the state (load_state_dict({})) when the model architecture changes",
                )
            )

    def reset(self) -> None:
        """Forget the residual."""
        self.residuals = None

    def residual_norm(self) -> float:
        """L2 norm of the whole residual (0.0 when empty); handy as a metric."""
        if not self.residuals:
            return 0.0
        return float(np.sqrt(sum(float(np.dot(r.ravel(), r.ravel())) for r in self.residuals)))

    def state_dict(self) -> dict[str, NDArray[np.float32]]:
        """The residuals as ``{"residual.<i>": float32 array}`` (copies; empty if none)."""
        if self.residuals is None:
            return {}
        return {f"residual.{i}": r.copy() for i, r in enumerate(self.residuals)}

    def load_state_dict(self, state: Mapping[str, NDArray[Any]]) -> None:
        """Restore residuals saved by :meth:`state_dict` (``{}`` resets).

        Raises
        ------
        ConfigError
            On unknown keys, missing indices, or non-finite values.
        """
        found: dict[int, NDArray[np.float32]] = {}
        for key, value in state.items():
            m = _KEY.fullmatch(key)
            if m is None:
                raise ConfigError(
                    explain(
                        "ErrorFeedback state key",
                        key,
                        "keys must be 'residual.<i>'",
                        "pass the dict returned by state_dict()",
                    )
                )
            arr = np.array(value, dtype=np.float32, copy=True)
            if not bool(np.all(np.isfinite(arr))):
                raise ConfigError(
                    explain(key, "non-finite", "residuals must be finite", "reset the state")
                )
            found[int(m.group(1))] = arr
        if not found:
            self.residuals = None
            return
        if sorted(found) != list(range(len(found))):
            raise ConfigError(
                explain(
                    "ErrorFeedback state keys",
                    sorted(found),
                    "indices must be 0..n-1 without gaps",
                    "pass the dict returned by state_dict()",
                )
            )
        self.residuals = [found[i] for i in range(len(found))]

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r})"
