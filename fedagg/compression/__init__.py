"""Compressed site updates: sparsifiers, quantizers, error feedback, a versioned wire codec.

Flower-free core (numpy only). Site side::

    from fedagg.compression import ErrorFeedback, TopK, Int8, Chain, codec
    enc = ErrorFeedback(Chain(TopK(0.01), Int8()))
    enc.load_state_dict(saved)                 # residual from the previous round ({} at first)
    data = codec.encode(enc.compress(delta, rng=rng))
    saved = enc.state_dict()

Server side::

    update = codec.decode(data).to_dense()      # list of float32 arrays

Or from a spec: ``build_compressor("topk:0.01+ef+int8")``. Supports shared by all sites
(for secure aggregation, no index bytes) live in :mod:`fedagg.compression.support`; the
secure sparse modes that train closer to dense in :mod:`~fedagg.compression.sketch` /
:mod:`~fedagg.compression.fetchsgd` (FetchSGD count sketches), :mod:`~fedagg.compression.vote`
(secure index voting) and :mod:`~fedagg.compression.dgc` (error feedback for shared supports).
See ``docs/compression.md``.
"""

from __future__ import annotations

from fedagg.compression import codec
from fedagg.compression.base import Chain, Compressor, Identity, Quantizer, reveals_indices
from fedagg.compression.dgc import DGCFeedback
from fedagg.compression.error_feedback import ErrorFeedback
from fedagg.compression.fetchsgd import FetchSGDServer, SketchCompressor, SketchUpdate, find_sketch
from fedagg.compression.payload import (
    FORMAT_VERSION,
    Payload,
    TensorPayload,
    WireDType,
    bf16_bits_to_float32,
    float32_to_bf16_bits,
)
from fedagg.compression.quantize import BF16, FP16, Int8
from fedagg.compression.sketch import CountSketch
from fedagg.compression.spec import ParsedSpec, build_compressor, parse_spec, registry
from fedagg.compression.stage_context import StageContext, StageFactory
from fedagg.compression.support import (
    SharedSupport,
    block_support,
    find_shared_support,
    random_support,
    topk_of_aggregate,
)
from fedagg.compression.topk import RandomK, TopK
from fedagg.compression.vote import VoteSupport, find_vote_support
from fedagg.compression.vote_tables import BlockVote, VoteSketch

__all__ = [
    "BF16",
    "FORMAT_VERSION",
    "FP16",
    "BlockVote",
    "Chain",
    "Compressor",
    "CountSketch",
    "DGCFeedback",
    "ErrorFeedback",
    "FetchSGDServer",
    "Identity",
    "Int8",
    "ParsedSpec",
    "Payload",
    "Quantizer",
    "RandomK",
    "SharedSupport",
    "SketchCompressor",
    "SketchUpdate",
    "StageContext",
    "StageFactory",
    "TensorPayload",
    "TopK",
    "VoteSketch",
    "VoteSupport",
    "WireDType",
    "bf16_bits_to_float32",
    "block_support",
    "build_compressor",
    "codec",
    "find_shared_support",
    "find_sketch",
    "find_vote_support",
    "float32_to_bf16_bits",
    "parse_spec",
    "random_support",
    "registry",
    "reveals_indices",
    "topk_of_aggregate",
]
