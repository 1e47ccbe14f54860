"""What a secure round masks: the vector's layout, the masking step, the pre-encoded inputs.

Secure aggregation sums one vector of ring elements per site (``Z_2^b``, fedagg.secagg). For
dense and public-support uploads that vector is the fixed-point encoding of floats, made by
the masker itself (``ClientState.handle_round``). Two secure sparse modes of issue 21 hand it
an input they have already encoded (``ClientState.handle_round_encoded``):

* ``sketch`` (FetchSGD, Rothchild et al. 2020): the **exact** integer count sketch of the
  site's fixed-point update, ``[S_int(q), w_q]`` (:func:`fedagg.compression.ring.encode_table`),
  so the unmasked modular sum is exactly the integer sketch of the summed updates;
* ``vote`` (secure index voting): the fixed-point values on the voted support, then this
  round's vote table packed several counters to a ring element
  (:func:`fedagg.compression.ring.pack_counters`), then the weight: ``[values | votes | w_q]``,
  one secure sum for both (the vote's bytes are part of the masked upload).

:class:`MaskedLayout` is that vector's layout; :func:`masked_layout` derives it from public
data only (the spec, the public history, the model size and the round's ring), so the server
opens the round with the right length and both sides split the sum alike.

References
----------
.. [Rothchild2020] D. Rothchild et al. "FetchSGD: Communication-Efficient Federated Learning
   with Sketching". ICML 2020 (sketches are linear: the sum of sketches is the sketch of the sum).
.. [Bonawitz2017] K. Bonawitz et al. "Practical Secure Aggregation for Privacy-Preserving
   Machine Learning". CCS 2017 (inputs in ``Z_R``, fixed-point encoding, Sec. 3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from fedagg.compression import SketchCompressor, VoteSupport, find_sketch, find_vote_support
from fedagg.compression.ring import counters_per_element, encode_table
from fedagg.errors import ProtocolError, explain
from fedagg.update.history import SupportHistory

if TYPE_CHECKING:
    from fedagg.privacy import DdgEncoder
    from fedagg.secagg import ClientState, MaskedUpload, RoundRequest

__all__ = [
    "SECURE_METRICS",
    "MaskedLayout",
    "RingEncoding",
    "RingMasker",
    "SecAggMasker",
    "encode_private",
    "encode_sketch",
    "encode_values_and_votes",
    "masked_layout",
    "metric_values",
]


@dataclass(frozen=True)
class RingEncoding:
    """The fixed-point encoding of one secure round, as a site uses it.

    Attributes
    ----------
    frac_bits, ring_bits : int
        Fractional bits and ring width ``b`` of the round.
    clip : float
        Values (and sketch counters) are clipped to ``[-clip, clip]``.
    num_sites : int
        Participants of the round (bounds a summed vote counter).
    weight_q : int
        The site's quantised weight (last element of the vector).
    """

    frac_bits: int
    ring_bits: int
    clip: float
    num_sites: int
    weight_q: int


@runtime_checkable
class RingMasker(Protocol):
    """A masking step that also takes already-encoded ring vectors.

    ``mask(values, weight)`` encodes floats itself (dense and public-support uploads);
    :meth:`encoding` and :meth:`mask_encoded` serve the sketch and vote paths.
    """

    rng: np.random.Generator
    """Randomness of the stochastic rounding (private to the site)."""

    def __call__(self, values: NDArray[np.float64], weight: float) -> Any:
        """Encode and mask ``values`` with ``weight``."""

    def encoding(self, weight: float) -> RingEncoding:
        """The round's encoding for a site of ``weight``."""

    def mask_encoded(self, vector: NDArray[np.uint32]) -> Any:
        """Mask a ``[..., w_q]`` ring vector as given."""


class SecAggMasker:
    """The masking step of one SecAgg+ round at a site: its ``ClientState`` and request.

    Parameters
    ----------
    state : fedagg.secagg.ClientState
        The site's protocol state (keyed, ready for the round).
    request : fedagg.secagg.RoundRequest
        The server's round request.
    rng : numpy.random.Generator
        Randomness of the stochastic rounding (an unseeded generator in deployment).
    binding : bytes, optional
        The round binding of the model this site received
        (:func:`fedagg.secagg.keys.round_binding`): the request must name it.
    """

    def __init__(self, state: ClientState, request: RoundRequest, *,
                 rng: np.random.Generator, binding: bytes | None = None) -> None:
        self.state, self.request, self.rng = state, request, rng
        self.binding = binding

    def __call__(self, values: NDArray[np.float64], weight: float) -> MaskedUpload:
        """``ClientState.handle_round``: fixed-point encode, mask, share."""
        return self.state.handle_round(self.request, values, weight, rng=self.rng,
                                       binding=self.binding)

    def encoding(self, weight: float) -> RingEncoding:
        """``ClientState.round_encoding`` of the request, with the clip and the site count."""
        frac_bits, ring_bits, weight_q = self.state.round_encoding(self.request, weight)
        return RingEncoding(frac_bits, ring_bits, float(self.state.params.clip),
                            len(tuple(self.request.participants)), weight_q)

    def mask_encoded(self, vector: NDArray[np.uint32]) -> MaskedUpload:
        """``ClientState.handle_round_encoded``: mask the ring vector as given."""
        return self.state.handle_round_encoded(self.request, vector, binding=self.binding)


@dataclass(frozen=True)
class MaskedLayout:
    """The masked vector of one secure round: ``[values | packed votes | weight]``.

    Attributes
    ----------
    values : int
        Fixed-point elements: the dense delta, the values on the shared support, or the
        ``rows * cols`` counters of the count sketch.
    sketch_shape : tuple of int or None
        ``(rows, cols)`` when the values are a sketch table.
    vote_counters, vote_bits, vote_elements : int
        Counters of the vote table, bits per packed counter, and the ring elements that
        carry them (0 without votes).
    """

    values: int
    sketch_shape: tuple[int, int] | None = None
    vote_counters: int = 0
    vote_bits: int = 0
    vote_elements: int = 0
    metric_slots: int = 0
    private: bool = False
    """The values are a site's distributed-DP encoding (:func:`encode_private`): ring
    elements, decoded from the ring sum by :class:`fedagg.privacy.DdgDecoder`."""

    @property
    def dim(self) -> int:
        """``RoundRequest.dim``: elements before the weight."""
        return self.values + self.metric_slots + self.vote_elements

    @property
    def encoded(self) -> bool:
        """Whether the site encodes the vector itself (sketch or votes)."""
        return self.sketch_shape is not None or self.vote_elements > 0 or self.private

    def split(self, total: NDArray[np.uint32]) -> NDArray[np.uint32]:
        """The packed vote elements of an unmasked sum (``dim + 1`` elements).

        Raises
        ------
        ProtocolError
            ``total`` does not have ``dim + 1`` elements.
        """
        t = np.asarray(total)
        if t.shape != (self.dim + 1,):
            raise ProtocolError(explain("unmasked sum", t.shape,
                                        f"must have {self.dim + 1} elements", "-"))
        start = self.values + self.metric_slots
        out: NDArray[np.uint32] = t[start:start + self.vote_elements].astype(np.uint32)
        return out

    def metrics(self, mean: NDArray[Any]) -> dict[str, float]:
        """The sites' mean metrics from the unmasked mean (:data:`SECURE_METRICS`): each slot
        pair is ``(w * value, w * reported)`` summed, so the mean over the sites that report
        it is their ratio."""
        out: dict[str, float] = {}
        m = np.asarray(mean, np.float64)
        for k, name in enumerate(SECURE_METRICS[:self.metric_slots // 2]):
            value, reported = m[self.values + 2 * k], m[self.values + 2 * k + 1]
            if reported > 0 and np.isfinite(value):
                out[name] = float(value / reported)
        return out


def masked_layout(history: SupportHistory, dim: int, *, num_sites: int,
                  ring_bits: int) -> MaskedLayout:
    """The round's layout from public data: the spec, the history, ``dim`` and the ring.

    Raises
    ------
    ProtocolError
        A sparse spec whose round has no support.
    """
    spec = history.spec
    slots = 2 * len(SECURE_METRICS)
    if spec.dense:
        return MaskedLayout(values=int(dim), metric_slots=slots)
    if spec.sketch:
        stage = _sketch_stage(history)
        sk = stage.sketch_for(int(dim))
        return MaskedLayout(values=sk.size, sketch_shape=sk.shape)
    support = history.support()
    if support is None:
        raise ProtocolError(explain("secure sparse round", spec.up, "has no shared support",
                                    "use a public-support, vote or sketch spec"))
    vote = find_vote_support(history.compressor()) if spec.votes else None
    if vote is None:
        return MaskedLayout(values=int(support.size), metric_slots=slots)
    counters = vote.sketch_for(int(dim)).size
    bits = vote.vote_field_bits(int(dim), int(num_sites))
    per = counters_per_element(bits, int(ring_bits))
    return MaskedLayout(values=int(support.size), vote_counters=counters, vote_bits=bits,
                        vote_elements=-(-counters // per))


SECURE_METRICS = ("train_loss",)
"""The site metrics a dense or public-support secure round sums under the masks, after the
values: two slots each, ``w * value`` and ``w * 1`` (0 when the site does not report it), so
the server learns only their weighted mean over the sites that report them (values clipped to
``secagg.clip`` like the update's). Sketch and vote rounds carry none."""


def metric_values(metrics: Mapping[str, Any]) -> NDArray[np.float64]:
    """Site: the metric slots of :data:`SECURE_METRICS` (the encoder clips them like the
    values)."""
    out = np.zeros(2 * len(SECURE_METRICS), np.float64)
    for k, name in enumerate(SECURE_METRICS):
        v = metrics.get(name, metrics.get(name.replace("_", "-")))
        if isinstance(v, int | float) and not isinstance(v, bool) and np.isfinite(v):
            out[2 * k], out[2 * k + 1] = float(v), 1.0
    return out


def _sketch_stage(history: SupportHistory) -> SketchCompressor:
    stage = find_sketch(history.compressor())
    if stage is None:  # the spec says sketch: unreachable unless a plugin renames stages
        raise ProtocolError(explain("compression.up", history.spec.up, "has no sketch stage",
                                    "use a 'sketch:...' spec"))
    return stage


def encode_sketch(delta: Sequence[NDArray[Any]], stage: SketchCompressor, enc: RingEncoding,
                  rng: np.random.Generator) -> tuple[NDArray[np.uint32], int]:
    """Site: ``[S_int(q), w_q]`` of the update, exact path; and the clipped-counter count.

    ``q`` is the fixed-point update (clipped at ``enc.clip``, stochastic rounding), the
    integer sketch is clipped to ``+-enc.clip`` in value units, so the round's headroom
    (computed by secure aggregation for ``enc.clip``) also holds for the summed counters.
    """
    flat_dim = sum(int(np.size(d)) for d in delta)
    return encode_table(delta, stage.sketch_for(flat_dim), weight_q=enc.weight_q,
                        frac_bits=enc.frac_bits, clip=enc.clip, table_clip=enc.clip, rng=rng)


def encode_values_and_votes(values: NDArray[np.float64], vote: VoteSupport, *, dim: int,
                            enc: RingEncoding, rng: np.random.Generator
                            ) -> NDArray[np.uint32]:
    """Site: ``[fixed-point values | packed votes (VoteSupport.last_votes) | w_q]``.

    Raises
    ------
    ConfigError
        No vote was cast (compress first) or a counter does not fit its field.
    """
    from fedagg.secagg import fixed_point

    vec = fixed_point.encode(values, enc.weight_q, frac_bits=enc.frac_bits, clip=enc.clip,
                             rng=rng)
    votes = vote.packed_votes(dim=int(dim), num_sites=enc.num_sites, ring_bits=enc.ring_bits)
    out: NDArray[np.uint32] = np.concatenate([vec[:-1], votes, vec[-1:]]).astype(np.uint32)
    return out


def encode_private(values: NDArray[np.float64], encoder: DdgEncoder, *, seed: bytes,
                   enc: RingEncoding, rng: np.random.Generator) -> NDArray[np.uint32]:
    """Site: ``[DDG encoding of values | w_q]`` under distributed DP (Kairouz, Liu, Steinke,
    ICML 2021): the update clipped to ``clip`` in L2, scaled, rotated with the round's public
    ``seed``, rounded and noised in ``Z_2^b`` (:class:`fedagg.privacy.DdgEncoder`); the weight
    element is ``2^f``, the quantised ``secagg.weight_scale``, at every site (the private
    mean is unweighted: the server reads the number of sites from the summed weight).

    Raises
    ------
    ProtocolError
        The secure round's ring is not the one the noise was calibrated for.
    """
    if enc.ring_bits != encoder.params.ring_bits:
        raise ProtocolError(explain(
            "secure round ring_bits", enc.ring_bits,
            f"must be privacy.ring_bits = {encoder.params.ring_bits}, the ring the noise was "
            "calibrated for", "run the same configuration on the server and the sites"))
    ring = encoder.encode(values, seed=seed, rng=rng).ring
    out: NDArray[np.uint32] = np.concatenate(
        [ring, np.asarray([1 << enc.frac_bits], np.uint32)]).astype(np.uint32)
    return out

