"""The upload pipeline: one site update, from the trained model to what is masked or sent.

One pass, in this order (DESIGN.md section 3, step 4)::

    delta = trained - global           computed once, float32 per tensor (float64 flat for
                                       a dense secure upload)
    -> error feedback (residual)       Seide et al. 2014; Stich et al. 2018
    -> select (TopK / public support)  Aji & Heafield 2017; shared supports, fedagg.compression
    -> quantize                        fp16 / bf16 / int8 (plaintext uploads only)
    -> mask                            SecAgg+ (Bell et al. 2020), fedagg.secagg

The secure sparse modes of issue 21 fit the same pass: ``sketch`` (FetchSGD, Rothchild et
al. 2020) replaces error feedback + selection by the exact integer count sketch of the
update; ``vote`` selects the voted support and appends this round's vote to the masked
vector; ``shared-dgc`` is error feedback with DGC's momentum correction (Lin et al. 2018).
Both ``sketch`` and ``vote`` hand the masker an already-encoded ring vector
(:class:`fedagg.update.masked.RingMasker`; layouts in :mod:`fedagg.update.masked`).

The result is one :class:`SiteUpload`, the single carrier of the update inside the site
process: the compressed :class:`~fedagg.compression.Payload` (plaintext), or the flat vector
handed to masking (secure). It is serialised once, at the Flower edge (``strategies.wire``).
Compare PyTorch's ``GradBucket`` + ``hook(state, bucket)``: the pipeline is the hook, the
residual its state.

Flower-free: state comes in and goes out as plain arrays (the caller keeps it, e.g. in
Flower's ``Context.state``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.compression import (
    DGCFeedback,
    ErrorFeedback,
    Payload,
    find_sketch,
    find_vote_support,
)
from fedagg.errors import ConfigError, ProtocolError, explain
from fedagg.privacy import DdgEncoder
from fedagg.update.history import SupportHistory
from fedagg.update.masked import (
    RingMasker,
    encode_private,
    encode_sketch,
    encode_values_and_votes,
    metric_values,
)
from fedagg.update.spec import UploadSpec

__all__ = ["PrivateEncoding", "SiteUpload", "UploadPipeline", "delta_of"]

Residual = dict[str, NDArray[np.float32]]
Masker = Callable[[NDArray[np.float64], float], Any]
"""``mask(values, weight) -> masked upload`` (e.g. ``ClientState.handle_round`` bound to the
round's request)."""


@dataclass(frozen=True)
class PrivateEncoding:
    """A site's distributed-DP encoder of the round and the round's public rotation seed."""

    encoder: DdgEncoder
    seed: bytes


@dataclass
class SiteUpload:
    """A site's update of one round on the way up (the one carrier).

    Attributes
    ----------
    weight : float
        The site's weight (``num-examples``).
    payload : Payload or None
        The compressed update (plaintext uploads).
    values : ndarray of float64 or None
        The flat vector to mask (secure uploads): the dense delta, or the values on the
        round's public support.
    vector : ndarray of uint32 or None
        The pre-encoded ring vector handed to the masker (secure ``sketch``: ``[S_int(q),
        w_q]``; secure ``vote``: ``[values | packed votes | w_q]``).
    masked : object or None
        The masked upload (secure), as the masker returned it.
    residual : dict of str to ndarray
        The new error-feedback residual (empty without ``ef``); stays at the site.
    metrics : dict of str to float
        The site's metrics of the round (sent in the clear only on plaintext uploads).
    """

    weight: float
    payload: Payload | None = None
    values: NDArray[np.float64] | None = None
    vector: NDArray[np.uint32] | None = None
    masked: Any = None
    residual: Residual = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


def _check_like(trained: Sequence[NDArray[Any]], glob: Sequence[NDArray[Any]]) -> None:
    if len(trained) != len(glob):
        raise ProtocolError(explain("trained model", f"{len(trained)} tensors",
                                    f"must hold the global model's {len(glob)} tensors",
                                    "reply with the trained model of the same architecture"))
    for j, (t, g) in enumerate(zip(trained, glob, strict=True)):
        if tuple(np.shape(t)) != tuple(np.shape(g)):
            raise ProtocolError(explain(f"trained model[{j}].shape", tuple(np.shape(t)),
                                        f"must equal the global model's {tuple(np.shape(g))}",
                                        "reply with the trained model of the same architecture"))


def delta_of(trained: Sequence[NDArray[Any]], glob: Sequence[NDArray[Any]]
             ) -> list[NDArray[np.float32]]:
    """``trained - global`` per tensor in float32 (the site's update, computed once).

    Raises
    ------
    ProtocolError
        Tensor count or shapes differ from the global model's.
    """
    _check_like(trained, glob)
    return [np.subtract(np.asarray(t), np.asarray(g), dtype=np.float32)
            for t, g in zip(trained, glob, strict=True)]


def _flat_delta64(trained: Sequence[NDArray[Any]], glob: Sequence[NDArray[Any]]
                  ) -> NDArray[np.float64]:
    """``trained - global`` as one flat float64 vector, written in place (no temporaries)."""
    _check_like(trained, glob)
    out = np.empty(sum(int(np.size(a)) for a in trained), np.float64)
    pos = 0
    for t, g in zip(trained, glob, strict=True):
        n = int(np.size(t))
        np.subtract(np.asarray(t).reshape(-1), np.asarray(g).reshape(-1), out=out[pos:pos + n],
                    dtype=np.float64)
        pos += n
    return out


class UploadPipeline:
    """Runs a round's upload steps at a site.

    Parameters
    ----------
    spec : UploadSpec
        The run's upload spec (as the server's instruction names it).
    history : SupportHistory
        The site's view of the public round history (the model received this round, and
        the previous one when the support needs it).

    Examples
    --------
    >>> import numpy as np
    >>> from fedagg.update import SupportHistory, UploadPipeline, UploadSpec
    >>> spec = UploadSpec.parse("topk:k=1+ef")
    >>> glob = [np.zeros(3, np.float32)]
    >>> pipe = UploadPipeline(spec, SupportHistory.at_site(spec, 0, 1, glob))
    >>> up = pipe.run([np.array([3.0, -1.0, 0.5], np.float32)], weight=10.0,
    ...               rng=np.random.default_rng(0))
    >>> up.payload.to_dense()[0].tolist(), up.residual["residual.0"].tolist()
    ([3.0, 0.0, 0.0], [0.0, -1.0, 0.5])
    """

    def __init__(self, spec: UploadSpec, history: SupportHistory) -> None:
        if history.sent is None:
            raise ProtocolError(explain("SupportHistory.sent", None,
                                        "must hold the global model of the round",
                                        "build it with SupportHistory.at_site(...)"))
        self.spec = spec
        self.history = history

    def run(self, trained: Sequence[NDArray[Any]], *, weight: float,
            residual: Mapping[str, NDArray[Any]] | None = None,
            rng: np.random.Generator, mask: Masker | None = None,
            metrics: Mapping[str, float] | None = None,
            private: PrivateEncoding | None = None) -> SiteUpload:
        """Delta, error feedback, selection, quantization and (secure) masking, in one pass.

        Parameters
        ----------
        trained : sequence of ndarray
            The site's trained model (same tensors as the global model).
        weight : float
            ``num-examples``.
        residual : mapping, optional
            The error-feedback state of the previous rounds (``residual.<i>`` arrays); ignored
            without ``ef``, reset (with a warning by the caller) when its shapes differ.
        rng : numpy.random.Generator
            The site's private generator (stochastic rounding, private random-k).
        mask : callable, optional
            The masking step of secure aggregation, ``mask(values, weight)``; required when
            the spec is secure.
        metrics : mapping, optional
            The site's metrics, carried along.
        private : PrivateEncoding, optional
            Distributed DP of a dense secure round: the update is clipped, rotated, rounded
            and noised in the ring (:func:`fedagg.update.encode_private`) instead of
            fixed-point encoded; its metrics are not masked along (they would need their own
            noise).

        Raises
        ------
        ProtocolError
            The trained model does not match the global model, or a secure spec without a
            masker.
        """
        glob = self.history.sent
        assert glob is not None  # checked in __init__
        out = SiteUpload(weight=float(weight), metrics=dict(metrics or {}))
        if self.spec.secure and mask is None:
            raise ProtocolError(explain("UploadPipeline.run(mask=...)", None,
                                        "a secure upload needs the masking step",
                                        "pass the site's SecAgg+ state"))
        if self.spec.dense:
            if self.spec.secure:
                out.values = _flat_delta64(trained, glob)
                if private is not None:
                    ring = _ring(mask, "private")
                    out.vector = encode_private(out.values, private.encoder,
                                                seed=private.seed, enc=ring.encoding(1.0),
                                                rng=ring.rng)
                    out.masked = ring.mask_encoded(out.vector)
                    return out
            else:
                out.payload = None  # plain FedAvg: the trained model itself is sent
        else:
            delta = delta_of(trained, glob)
            comp = self.history.compressor()
            _load_state(comp, residual, delta)
            if self.spec.secure and self.spec.sketch:
                ring = _ring(mask, "sketch")
                stage = find_sketch(comp)
                assert stage is not None  # the spec names a sketch stage
                out.vector, clipped = encode_sketch(delta, stage, ring.encoding(out.weight),
                                                    ring.rng)
                out.metrics["sketch-clipped-counters"] = float(clipped)
                out.masked = ring.mask_encoded(out.vector)
                return out
            payload = comp.compress(delta, rng=rng)
            if isinstance(comp, ErrorFeedback | DGCFeedback):
                out.residual = comp.state_dict()
            if self.spec.secure:
                if not payload.tensors or not all(t.implicit_indices for t in payload.tensors):
                    raise ProtocolError(explain(
                        "secure upload", "own indices",
                        "a secure upload carries values on a public support only",
                        "set compression.support = random, block or topk-aggregate"))
                out.values = np.concatenate([t.float_values().astype(np.float64)
                                             for t in payload.tensors])
                vote = find_vote_support(comp) if self.spec.votes else None
                if vote is not None:
                    ring = _ring(mask, "vote")
                    dim = sum(int(d.size) for d in delta)
                    out.vector = encode_values_and_votes(out.values, vote, dim=dim,
                                                         enc=ring.encoding(out.weight),
                                                         rng=ring.rng)
                    out.masked = ring.mask_encoded(out.vector)
                    return out
            else:
                out.payload = payload
        if mask is not None and out.values is not None:
            # the site's train loss rides under the masks too (SECURE_METRICS): the server
            # learns only the round's weighted mean of it (clipped like the values)
            out.masked = mask(np.concatenate([out.values, metric_values(out.metrics)]),
                              out.weight)
        return out


def _ring(mask: Masker | None, mode: str) -> RingMasker:
    """The masker as a :class:`RingMasker` (the sketch and vote paths pre-encode)."""
    if not isinstance(mask, RingMasker):
        raise ProtocolError(explain(
            "UploadPipeline.run(mask=...)", type(mask).__name__,
            f"a secure '{mode}' upload hands the masker an already-encoded ring vector",
            "pass a fedagg.update.SecAggMasker (or any RingMasker: encoding() and "
            "mask_encoded())"))
    return mask


def _load_state(comp: object, residual: Mapping[str, NDArray[Any]] | None,
                delta: Sequence[NDArray[np.float32]]) -> None:
    """Restore the error-feedback state kept at the site, when it fits this update.

    ``ErrorFeedback``: ``residual.<i>``; ``DGCFeedback`` (``shared-dgc``): ``residual.<i>``
    and ``momentum.<i>``. A state of other shapes (the model changed) starts afresh.
    """
    if not residual:
        return
    shapes = [d.shape for d in delta]
    if isinstance(comp, ErrorFeedback):
        res = [np.asarray(residual[k]) for k in sorted(residual, key=_index)
               if k.startswith("residual.")]
        if [r.shape for r in res] == shapes:
            comp.load_state_dict({f"residual.{i}": r for i, r in enumerate(res)})
    elif isinstance(comp, DGCFeedback):
        res = [np.asarray(residual[k]) for k in sorted(residual, key=_index)
               if k.startswith("residual.")]
        if [r.shape for r in res] != shapes:
            return
        try:
            comp.load_state_dict(dict(residual))
        except ConfigError:
            comp.reset()


def _index(key: str) -> int:
    try:
        return int(key.rsplit(".", 1)[-1])
    except ValueError:
        return 0
