"""The two small interfaces of the compression core, and how they compose.

* A :class:`Compressor` turns a list of float tensors into a :class:`~.payload.Payload`
  (site side). Sparsifiers (:class:`~.topk.TopK`, :class:`~.topk.RandomK`,
  :class:`~.support.SharedSupport`), the dense :class:`Identity` and every quantizer are
  compressors.
* A :class:`Quantizer` re-encodes the float32 values of a payload into a narrower wire dtype
  (:class:`~.quantize.FP16`, :class:`~.quantize.BF16`, :class:`~.quantize.Int8`).

Composition is by wrapping (as PyTorch ``ddp_comm_hooks`` and Flower's strategy wrappers)::

    ErrorFeedback(Chain(TopK(0.01), Int8()))

:class:`Chain` runs one compressor and then quantizers; :class:`~.error_feedback.ErrorFeedback`
wraps the *whole* lossy pipeline so that quantization error is fed back too. The server side
only needs :meth:`Payload.to_dense() <fedagg.compression.payload.Payload.to_dense>`.

Index disclosure
----------------
Every compressor has a boolean ``reveals_indices``: ``True`` when each site picks its own
positions and sends them (own-index modes such as TopK). The server then learns which
coordinates each site considered important, and pairwise secure-aggregation masks cannot
cancel on different supports. :func:`reveals_indices` treats unknown (plugin) compressors as
revealing unless they say otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from fedagg.compression.payload import Payload, TensorPayload, WireDType, dense_float32

__all__ = ["Chain", "Compressor", "Identity", "Quantizer", "reveals_indices"]


@runtime_checkable
class Compressor(Protocol):
    """Site-side encoder: float tensors in, :class:`~.payload.Payload` out."""

    def compress(self, tensors: Sequence[NDArray[Any]], *, rng: np.random.Generator) -> Payload:
        """Compress ``tensors`` (one array per model tensor).

        Parameters
        ----------
        tensors : sequence of ndarray
            The update (e.g. the model delta), one array per tensor; cast to float32.
        rng : numpy.random.Generator
            Source of randomness for stochastic stages (stochastic rounding, private
            random-k). Deterministic stages ignore it.

        Returns
        -------
        Payload
        """
        ...


@runtime_checkable
class Quantizer(Protocol):
    """Re-encodes the float32 values of a payload in a narrower wire dtype."""

    def quantize(self, payload: Payload, *, rng: np.random.Generator) -> Payload:
        """Return ``payload`` with every tensor's values in this quantizer's wire dtype."""
        ...


def reveals_indices(compressor: object) -> bool:
    """Whether ``compressor`` sends site-chosen positions (own-index mode).

    Compressors that do not declare ``reveals_indices`` are assumed to reveal them.
    """
    return bool(getattr(compressor, "reveals_indices", True))


class Identity:
    """Dense float32: every value is sent, nothing is lost. The ``"none"`` spec."""

    reveals_indices = False

    def compress(self, tensors: Sequence[NDArray[Any]], *, rng: np.random.Generator) -> Payload:
        """Wrap each tensor as a dense float32 :class:`~.payload.TensorPayload`."""
        del rng
        return Payload(
            tuple(
                TensorPayload(tuple(int(d) for d in t.shape), WireDType.FLOAT32, t.ravel().copy())
                for t in dense_float32(tensors)
            )
        )

    def __repr__(self) -> str:
        return "Identity()"


class Chain:
    """Run one compressor, then quantizers on its output.

    Parameters
    ----------
    first : Compressor
        Produces the float32 payload (a sparsifier or :class:`Identity`).
    *quantizers : Quantizer
        Applied in order to the payload's values.

    Examples
    --------
    >>> from fedagg.compression import TopK, Int8
    >>> pipeline = Chain(TopK(0.01), Int8(chunk_size=128))
    """

    def __init__(self, first: Compressor, *quantizers: Quantizer) -> None:
        self.first = first
        self.quantizers = tuple(quantizers)

    @property
    def reveals_indices(self) -> bool:
        """Whether the first stage sends site-chosen positions."""
        return reveals_indices(self.first)

    def compress(self, tensors: Sequence[NDArray[Any]], *, rng: np.random.Generator) -> Payload:
        """Compress with :attr:`first`, then quantize with each quantizer in turn."""
        payload = self.first.compress(tensors, rng=rng)
        for q in self.quantizers:
            payload = q.quantize(payload, rng=rng)
        return payload

    def __repr__(self) -> str:
        inner = ", ".join(repr(s) for s in (self.first, *self.quantizers))
        return f"Chain({inner})"
