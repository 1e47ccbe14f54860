"""Streaming aggregation, Flower-free: fold one checked update at a time, keep none.

* :class:`Accumulator` — the running weighted sum of site updates: exact integer sums on a
  fixed-point grid fixed before the round (:func:`grid_exponents`), so the result is the
  same for every arrival order and every split into shards, bit for bit; dense or
  :class:`Sparse` tensors (no dense copy per reply); 8 bytes per element; exact removal of a
  fold (negative weight) and exact :meth:`Accumulator.merge`; ``state_dict``.
* :class:`ShardPlan` — the model cut into ``S`` contiguous flat ranges, each tensor piece
  addressed without copies, for sharded aggregation (one accumulator per shard; the Ray
  actors in ``strategies/sharded.py``).
* :class:`RoundStatistics` / :func:`delta_norm` — the statistics pass of the whole-round
  checks (median weight, median delta norm): scalars per reply, never the updates;
  :class:`Retainer` keeps the few updates those checks may still correct (bounded, spilled
  to disk when large).

See docs/architecture/server-memory.md for the server's memory model.
"""

from fedagg.accumulate.exact import Accumulator
from fedagg.accumulate.grid import (
    BLOCK,
    DEFAULT_PRECISION_BITS,
    Sparse,
    TensorSpec,
    TensorUpdate,
    grid_exponents,
    max_abs,
)
from fedagg.accumulate.layout import Piece, ShardPlan
from fedagg.accumulate.retain import DEFAULT_SPILL_BYTES, Retainer
from fedagg.accumulate.stats import RoundStatistics, delta_norm, median_floor
from fedagg.accumulate.weights import BUCKET_BITS, WeightBuckets
from fedagg.aggregate import MEDIAN_MIN_UPDATES

__all__ = [
    "BLOCK",
    "BUCKET_BITS",
    "DEFAULT_PRECISION_BITS",
    "DEFAULT_SPILL_BYTES",
    "MEDIAN_MIN_UPDATES",
    "Accumulator",
    "Piece",
    "Retainer",
    "RoundStatistics",
    "ShardPlan",
    "Sparse",
    "TensorSpec",
    "TensorUpdate",
    "WeightBuckets",
    "delta_norm",
    "grid_exponents",
    "max_abs",
    "median_floor",
]
