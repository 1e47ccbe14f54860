"""The upload pipeline: one site update, parsed, encoded and decoded in one place.

Flower-free core shared by both sides of a round:

* :class:`UploadSpec` — ``compression.up`` / ``support`` / ``down`` (and whether the run is
  secure), checked and parsed once;
* :class:`SupportHistory` — the public history (models sent in this and the previous round)
  that shared supports are derived from, kept alike by the server and the sites;
* :class:`UploadPipeline` — at a site: delta once -> error feedback -> TopK or public
  support -> quantization -> masking, producing one :class:`SiteUpload`;
* :func:`decode_delta` / :func:`check_delta` / :func:`densify` — at the server: one update
  back to a checked dense delta;
* :func:`encode_down` / :func:`decode_down` — the global model's optional fp16 / bf16 codec;
* :class:`MaskedLayout` / :func:`masked_layout` / :class:`SecAggMasker` — what a secure round
  masks (``[values | metric slots | packed votes | weight]``, or the exact integer sketch; the
  sites' train loss rides in the metric slots, :data:`SECURE_METRICS`), and the masking step
  that also takes pre-encoded ring vectors;
* :class:`RoundDecoder` — at the server: the round's aggregate back to the delta to apply
  (FetchSGD's step for ``sketch``, the vote sum for ``vote``).

The Flower side serialises these objects once, in the public wire adapter
``strategies.wire`` used by both the strategies and the client mod.
"""

from fedagg.update.decode import check_delta, decode_delta, densify
from fedagg.update.downlink import decode_down, encode_down
from fedagg.update.history import SupportHistory, flat_difference
from fedagg.update.masked import (
    SECURE_METRICS,
    MaskedLayout,
    RingEncoding,
    RingMasker,
    SecAggMasker,
    encode_private,
    masked_layout,
    metric_values,
)
from fedagg.update.pipeline import PrivateEncoding, SiteUpload, UploadPipeline, delta_of
from fedagg.update.server import Decoded, RoundDecoder, vote_sum_problem
from fedagg.update.spec import (
    DOWN_CODECS,
    REVEALING_SUPPORTS,
    SUPPORTS,
    UploadSpec,
    effective_spec,
    public_seed,
)

__all__ = [
    "DOWN_CODECS",
    "REVEALING_SUPPORTS",
    "SECURE_METRICS",
    "SUPPORTS",
    "Decoded",
    "MaskedLayout",
    "PrivateEncoding",
    "RingEncoding",
    "RingMasker",
    "RoundDecoder",
    "SecAggMasker",
    "SiteUpload",
    "SupportHistory",
    "UploadPipeline",
    "UploadSpec",
    "check_delta",
    "decode_delta",
    "decode_down",
    "delta_of",
    "densify",
    "effective_spec",
    "encode_down",
    "encode_private",
    "flat_difference",
    "masked_layout",
    "metric_values",
    "public_seed",
    "vote_sum_problem",
]
