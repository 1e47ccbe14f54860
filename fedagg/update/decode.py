"""Server side of the upload pipeline: one compressed site update back to a dense delta.

Every check runs on the update alone, before anything is aggregated, and a bad update raises
:class:`~fedagg.errors.UpdateRejected` with the reason (the round goes on without it):
the codec validates every length before allocating (:func:`fedagg.compression.codec.decode`),
then the shapes must equal the global model's, shared-support payloads get the round's public
support, and the dense delta must be finite and within the optional norm bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.accumulate import Sparse
from fedagg.aggregate import global_norm
from fedagg.compression import codec
from fedagg.errors import CodecError, UpdateRejected, explain

__all__ = ["check_delta", "decode_delta", "decode_sparse", "densify"]


def check_delta(delta: Sequence[NDArray[Any]], *, site: str, max_norm: float | None) -> None:
    """Finite values and ``||delta|| <= max_norm`` (when set), or UpdateRejected."""
    for j, d in enumerate(delta):
        if not np.isfinite(np.sum(d, dtype=np.float64)):
            raise UpdateRejected(explain(f"{site}.delta[{j}]", "non-finite values",
                                         "must be finite (no NaN / Inf)",
                                         "check the site's training (learning rate, data)"))
    if max_norm is not None:
        norm = global_norm(delta)
        if not norm <= max_norm:
            raise UpdateRejected(explain(f"{site}.delta_norm", round(norm, 6),
                                         f"must be <= strategy.max_update_norm = {max_norm}",
                                         "check the site, or raise strategy.max_update_norm"))


def decode_delta(data: bytes, *, shapes: Sequence[tuple[int, ...]],
                 support: Callable[[], NDArray[np.int64] | None], site: str = "site",
                 max_norm: float | None = None) -> list[NDArray[np.float32]]:
    """Decode one compressed update into the dense float32 delta, checked.

    Parameters
    ----------
    data : bytes
        The codec bytes the site sent.
    shapes : sequence of tuple
        The global model's tensor shapes.
    support : callable
        Returns the round's public support (computed only when the payload needs one).
    site : str
        Name for messages.
    max_norm : float, optional
        Bound on the delta's L2 norm.

    Raises
    ------
    UpdateRejected
        Undecodable payload (the codec's reason), wrong shapes, a shared-support payload when
        the round has none, non-finite values, or a norm above ``max_norm``.
    """
    numel = sum(int(np.prod(s)) for s in shapes)
    try:
        payload = codec.decode(data, max_elements=max(numel, 1))
        want = [tuple(int(d) for d in s) for s in shapes]
        if [tuple(s) for s in payload.shapes] != want:
            raise UpdateRejected(explain(f"{site}.payload.shapes", payload.shapes[:4],
                                         f"must equal the global model's {want[:4]}",
                                         "compress the delta of the same architecture"))
        if any(t.implicit_indices for t in payload.tensors):
            sup = support()
            if sup is None:
                raise UpdateRejected(explain(f"{site}.payload", "shared-support tensors",
                                             "this round has no shared support",
                                             "site and server must use the same spec"))
            payload = payload.with_support(sup)
        delta = payload.to_dense()
    except CodecError as exc:
        raise UpdateRejected(f"{site}: undecodable payload: {exc}") from None
    check_delta(delta, site=site, max_norm=max_norm)
    return delta


def decode_sparse(data: bytes, *, shapes: Sequence[tuple[int, ...]],
                  support: Callable[[], NDArray[np.int64] | None], site: str = "site",
                  max_norm: float | None = None) -> list[Any]:
    """Decode one compressed update for streaming: sparse tensors stay sparse.

    The same checks as :func:`decode_delta` (codec, shapes, the round's shared support,
    finite values, the norm bound), but a sparse tensor comes back as
    :class:`fedagg.accumulate.Sparse` (its sorted unique positions and float32 values, as the
    codec checked them) instead of a dense copy, so the server folds ``nnz`` values per reply
    (:meth:`fedagg.accumulate.Accumulator.fold`); dense tensors come back as float32 arrays.

    Raises
    ------
    UpdateRejected
        As :func:`decode_delta`.
    """
    numel = sum(int(np.prod(s)) for s in shapes)
    try:
        payload = codec.decode(data, max_elements=max(numel, 1))
        want = [tuple(int(d) for d in s) for s in shapes]
        if [tuple(s) for s in payload.shapes] != want:
            raise UpdateRejected(explain(f"{site}.payload.shapes", payload.shapes[:4],
                                         f"must equal the global model's {want[:4]}",
                                         "compress the delta of the same architecture"))
        if any(t.implicit_indices for t in payload.tensors):
            sup = support()
            if sup is None:
                raise UpdateRejected(explain(f"{site}.payload", "shared-support tensors",
                                             "this round has no shared support",
                                             "site and server must use the same spec"))
            payload = payload.with_support(sup)
        out: list[Any] = []
        for t in payload.tensors:
            vals = t.float_values()
            if t.is_dense:
                out.append(vals.reshape(t.shape))
            elif t.indices is None:  # pragma: no cover - with_support attached every support
                raise UpdateRejected(f"{site}: a shared-support tensor without its support")
            else:
                out.append(Sparse(t.indices, vals))
    except CodecError as exc:
        raise UpdateRejected(f"{site}: undecodable payload: {exc}") from None
    check_delta([u.values if isinstance(u, Sparse) else u for u in out], site=site,
                max_norm=max_norm)
    return out


def densify(values: NDArray[Any], support: NDArray[np.int64] | None, dim: int
            ) -> NDArray[np.float64]:
    """A flat vector of ``dim`` elements from values on ``support`` (``None``: already dense)."""
    if support is None:
        return np.asarray(values, np.float64)
    out = np.zeros(dim, np.float64)
    out[support] = values
    return out
