"""The model cut into shards: ``S`` contiguous ranges of the flattened tensors.

A parameter server with ``S`` shards (Li et al. 2014, "Scaling Distributed Machine Learning
with the Parameter Server", OSDI, section 3: key ranges partitioned over server nodes) gives
each shard a contiguous range of the model's elements in tensor order, balanced by element
count; a range may cut a tensor, so a shard holds *pieces* (tensor, flat start, flat stop).
Each shard aggregates its pieces in an :class:`~fedagg.accumulate.Accumulator` whose 1-D
tensor specs carry the *whole* tensor's grid exponent: every element is folded exactly as the
unsharded accumulator folds it, so the joined shard means equal the unsharded mean bit for bit.

:meth:`ShardPlan.split` hands out one shard's pieces of an update as views (no copy of dense
tensors; a sparse tensor's positions are re-based for the piece), :meth:`ShardPlan.join`
writes the shards' results back into whole tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fedagg.accumulate.grid import (
    DEFAULT_PRECISION_BITS,
    Sparse,
    TensorSpec,
    TensorUpdate,
    grid_exponents,
)
from fedagg.errors import ConfigError, explain

__all__ = ["Piece", "ShardPlan"]


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened tensor ``tensor``."""

    tensor: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        """Number of elements."""
        return self.stop - self.start


class ShardPlan:
    """``S`` contiguous, element-balanced shards of a model's tensors.

    Parameters
    ----------
    specs : sequence of TensorSpec
        The whole model's tensors (shapes, dtypes, grid exponents).
    shards : int
        Number of shards ``S >= 1`` (at most the number of elements, if any).

    Attributes
    ----------
    pieces : list of list of Piece
        ``pieces[k]``: shard ``k``'s pieces in model order (an empty tensor belongs to the
        shard where its position falls, as a piece of size 0).
    """

    def __init__(self, specs: Sequence[TensorSpec], shards: int) -> None:
        self.specs = list(specs)
        total = sum(s.size for s in self.specs)
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1 or (
                total and shards > total):
            raise ConfigError(explain("shards", shards,
                                      f"must be an int in 1..{max(total, 1)} (the model's "
                                      "number of elements)", "use fewer shards"))
        self.shards = shards
        bounds = [round(k * total / shards) for k in range(shards + 1)]
        self.pieces: list[list[Piece]] = [[] for _ in range(shards)]
        offset = 0
        for j, s in enumerate(self.specs):
            a, b = offset, offset + s.size
            if s.size == 0:  # an empty tensor goes with the shard its position falls in
                k = next((k for k in range(shards) if a < bounds[k + 1]), shards - 1)
                self.pieces[k].append(Piece(j, 0, 0))
            for k in range(shards):
                lo, hi = max(a, bounds[k]), min(b, bounds[k + 1])
                if lo < hi:
                    self.pieces[k].append(Piece(j, lo - a, hi - a))
            offset = b

    @classmethod
    def for_model(cls, reference: Sequence[npt.NDArray[Any]], shards: int, *,
                  precision_bits: int = DEFAULT_PRECISION_BITS) -> ShardPlan:
        """The plan of a model (grid exponents from ``reference``, see ``grid_exponents``)."""
        exps = grid_exponents(reference, precision_bits=precision_bits)
        return cls([TensorSpec(tuple(np.shape(r)), np.asarray(r).dtype.name, e)
                    for r, e in zip(reference, exps, strict=True)], shards)

    def shard_specs(self, k: int) -> list[TensorSpec]:
        """Shard ``k``'s 1-D pieces as accumulator specs (the whole tensor's exponent)."""
        return [TensorSpec((p.size,), self.specs[p.tensor].dtype, self.specs[p.tensor].exponent)
                for p in self.pieces[k]]

    def shard_elements(self, k: int) -> int:
        """Number of elements of shard ``k``."""
        return sum(p.size for p in self.pieces[k])

    def split(self, update: Sequence[TensorUpdate], k: int) -> list[TensorUpdate]:
        """Shard ``k``'s pieces of one update: views of dense tensors, re-based sparse ones.

        Raises
        ------
        ConfigError
            The update does not have the plan's tensor count or shapes.
        """
        if len(update) != len(self.specs):
            raise ConfigError(explain("update", f"{len(update)} tensors",
                                      f"must hold {len(self.specs)} tensors",
                                      "split updates of the plan's model"))
        out: list[TensorUpdate] = []
        for p in self.pieces[k]:
            u = update[p.tensor]
            if isinstance(u, Sparse):
                idx = np.asarray(u.indices)
                lo, hi = np.searchsorted(idx, [p.start, p.stop])
                out.append(Sparse(idx[lo:hi] - p.start, np.asarray(u.values)[lo:hi]))
            else:
                a = np.asarray(u)
                if a.size != self.specs[p.tensor].size:
                    raise ConfigError(explain(f"update[{p.tensor}].shape", a.shape,
                                              f"must equal {self.specs[p.tensor].shape}",
                                              "split updates of the plan's model"))
                out.append(a.reshape(-1)[p.start:p.stop])
        return out

    def join(self, parts: Sequence[Sequence[npt.NDArray[Any]]]) -> list[npt.NDArray[Any]]:
        """Whole tensors from every shard's results (``parts[k]``: shard ``k``'s pieces)."""
        out = [np.empty(s.size, np.dtype(s.dtype)) for s in self.specs]
        for k in range(self.shards):
            self.join_into(out, k, parts[k])
        return [o.reshape(s.shape) for o, s in zip(out, self.specs, strict=True)]

    def join_into(self, out: Sequence[npt.NDArray[Any]], k: int,
                  pieces: Sequence[npt.NDArray[Any]]) -> None:
        """Write shard ``k``'s results into the whole tensors ``out`` (one shard at a time,
        so a caller holds only one shard's results besides ``out``).

        Raises
        ------
        ConfigError
            Another number of pieces or other piece sizes than the plan's.
        """
        want = self.pieces[k]
        if len(pieces) != len(want) or any(
                math.prod(np.shape(g)) != p.size for g, p in zip(pieces, want, strict=False)):
            raise ConfigError(explain(f"shard {k} result", [np.shape(g) for g in pieces][:3],
                                      f"must be the plan's pieces {want[:3]}",
                                      "join results of the same plan"))
        for g, p in zip(pieces, want, strict=True):
            flat = out[p.tensor].reshape(-1)
            flat[p.start:p.stop] = np.asarray(g).reshape(-1)
