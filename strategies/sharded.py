"""Sharded aggregation on Ray: S actors each hold 1/S of the round's accumulator.

The parameter-server shards of Li et al. 2014 ("Scaling Distributed Machine Learning with
the Parameter Server", OSDI, section 3), on the Ray cluster that Flower's simulation engine
already runs (or one started here, or any ``ray.init`` address). The model is cut into
``S`` contiguous element ranges (:class:`fedagg.accumulate.ShardPlan`); shard ``k`` is a Ray
actor holding an :class:`fedagg.accumulate.Accumulator` of its pieces only.

For each reply the server process puts shard ``k``'s pieces into Ray's object store
(``ray.put``: one copy into shared memory, read zero-copy by the actor) and asks actor ``k``
to fold them; it waits for the folds before the next reply, so the store holds one reply's
chunks at a time and the server process holds nothing of a reply after :meth:`fold`
returns. The actors' accumulators use the whole tensors' grid exponents, so the joined
means equal the unsharded :class:`~fedagg.accumulate.Accumulator`'s bit for bit
(tests/aggregation/test_sharded_ray.py), whatever order the replies arrive in.

A refused fold (a value beyond an accumulator's range) is undone on the shards that took it
(folded again with ``-w``: exact), so a refused reply leaves no trace here either.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt
import ray
from flwr.app import ArrayRecord

from fedagg.accumulate import Accumulator, ShardPlan, Sparse, TensorUpdate, delta_norm
from fedagg.errors import ConfigError, FedaggError, UpdateRejected, explain

__all__ = ["ShardActor", "ShardedAccumulator", "ensure_ray"]

_log = logging.getLogger(__name__)


class ShardActor:
    """One shard's accumulator (run as a Ray actor; plain class for direct tests)."""

    def __init__(self) -> None:
        self.acc: Accumulator | None = None
        self.base: int | None = None

    def reset(self, specs: list[dict[str, Any]]) -> int:
        """Start a round with empty sums over ``specs``; returns the accumulator's bytes.

        The actor's peak-RSS mark is reset too (:meth:`memory` then reports this round's).
        """
        from fedagg.accumulate import TensorSpec
        from fedagg.memory import current_rss, reset_peak

        self.acc = None
        reset_peak()
        self.base = current_rss()
        self.acc = Accumulator([TensorSpec(tuple(s["shape"]), s["dtype"], int(s["exponent"]))
                                for s in specs])
        return self.acc.nbytes

    def fold(self, parts: list[TensorUpdate], weight: float) -> int:
        """Fold this shard's pieces of one reply; returns the accumulator's bytes."""
        if self.acc is None:
            raise ConfigError(explain("shard", "not reset", "reset it before folding",
                                      "call ShardedAccumulator.reset"))
        self.acc.fold(parts, weight)
        return self.acc.nbytes

    def mean(self) -> list[npt.NDArray[Any]]:
        """This shard's pieces of the weighted mean."""
        if self.acc is None:
            raise ConfigError(explain("shard", "not reset", "reset it before reading",
                                      "call ShardedAccumulator.reset"))
        return self.acc.mean()

    def memory(self) -> dict[str, int | None]:
        """This actor process's RSS, peak RSS and RSS at the last reset (the peak is this
        round's; both count the object-store pages it read), its private RSS now and its
        accumulator's bytes."""
        from pathlib import Path

        from fedagg.memory import current_rss, peak_rss

        anon = None
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
        except OSError:
            pass
        return {"rss": current_rss(), "peak": peak_rss(), "base": self.base, "anon": anon,
                "accumulator": None if self.acc is None else self.acc.nbytes}

    def state_dict(self) -> dict[str, Any] | None:
        """The shard accumulator's state (None before the first reset)."""
        return None if self.acc is None else self.acc.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.acc = Accumulator.from_state_dict(state)


def ensure_ray(address: str | None = None, **init: Any) -> None:
    """Join the running Ray cluster (Flower's simulation), or start / connect to one."""
    if not ray.is_initialized():
        _log.info("starting Ray for sharded aggregation (address=%s)", address)
        ray.init(address=address, include_dashboard=False, log_to_driver=False, **init)


def _specs(plan: ShardPlan, k: int) -> list[dict[str, Any]]:
    return [{"shape": list(s.shape), "dtype": s.dtype, "exponent": s.exponent}
            for s in plan.shard_specs(k)]


def _cause(exc: Exception) -> Exception:
    """The fedagg error inside a Ray task error (or the error itself)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, FedaggError) else exc


class ShardedAccumulator:
    """The :class:`~fedagg.accumulate.Accumulator` interface, split over S Ray actors.

    Parameters
    ----------
    plan : ShardPlan
        The model's shards (and grid); :meth:`reset` takes the next round's plan.
    num_cpus : float
        CPUs each actor reserves (default 0: the folds are memory-bound, and the simulated
        sites keep the CPUs they asked for).
    address : str, optional
        Ray address when Ray is not running yet (default: a local cluster).

    Notes
    -----
    Server-process memory: the reply being folded (held by the caller) and, while a fold runs,
    the object-store pages its chunks were written to; the accumulator lives in the actors
    (8 bytes per element / S each). See docs/architecture/server-memory.md.
    """

    def __init__(self, plan: ShardPlan, *, num_cpus: float = 0.0,
                 address: str | None = None) -> None:
        ensure_ray(address)
        actor: Any = ray.remote(num_cpus=num_cpus)(ShardActor)
        self._actors: list[Any] = [actor.remote() for _ in range(plan.shards)]
        self.plan = plan
        self._weight = Fraction(0)
        self._count = 0
        self.nbytes_per_shard: list[int] = []
        self.reset(plan)

    @property
    def shards(self) -> int:
        """Number of shards (actors)."""
        return len(self._actors)

    @property
    def count(self) -> int:
        """Folds so far (a fold with a negative weight counts -1)."""
        return self._count

    @property
    def total_weight(self) -> float:
        """The exact sum of the weights folded so far, rounded once to float64."""
        return float(self._weight)

    def reset(self, plan: ShardPlan | None = None) -> None:
        """Empty sums for a new round (``plan``: the round's grid; same number of shards)."""
        plan = plan or self.plan
        if plan.shards != len(self._actors):
            raise ConfigError(explain("plan.shards", plan.shards,
                                      f"must equal the {len(self._actors)} actors",
                                      "build a new ShardedAccumulator for another S"))
        self.plan = plan
        self.nbytes_per_shard = ray.get([a.reset.remote(_specs(plan, k))
                                         for k, a in enumerate(self._actors)])
        self._weight, self._count = Fraction(0), 0

    fuses_norm = True
    """:meth:`fold` can return the delta norm, computed here while the shards fold."""

    def fold(self, update: Sequence[TensorUpdate], weight: float, *, norm: bool = False,
             reference: Sequence[npt.NDArray[Any]] | None = None) -> float | None:
        """Fold one reply: its pieces go to the shards through Ray's object store.

        Returns once every shard has folded its pieces (the object store then frees them);
        with ``norm`` the reply's ``delta_norm(update, reference)``, computed in this process
        while the shards fold.

        Raises
        ------
        UpdateRejected
            A shard refused its pieces (the shards that took theirs are corrected exactly).
        ConfigError
            A bad weight or an update of another model (nothing is folded).
        """
        w = float(weight)
        if not (np.isfinite(w) and w != 0.0):
            raise ConfigError(explain("weight", weight, "must be a finite non-zero number",
                                      "pass the site's number of examples"))
        if norm and reference is not None and any(isinstance(u, Sparse) for u in update):
            raise ConfigError(explain("update", "sparse tensors", "a sparse tensor is a delta: "
                                      "pass no reference", "compute the norm of the delta"))
        refs = [ray.put(self.plan.split(update, k)) for k in range(self.shards)]
        futures = [a.fold.remote(r, w) for a, r in zip(self._actors, refs, strict=True)]
        size = delta_norm(update, reference) if norm else None  # overlaps the shards' folds
        errors: dict[int, Exception] = {}
        for k, f in enumerate(futures):
            try:
                self.nbytes_per_shard[k] = ray.get(f)
            except Exception as exc:  # a Ray task error around the shard's own error
                errors[k] = _cause(exc)
        if errors:
            ok = [k for k in range(self.shards) if k not in errors]
            ray.get([self._actors[k].fold.remote(refs[k], -w) for k in ok])
            first = errors[min(errors)]
            if isinstance(first, FedaggError):
                raise first
            raise UpdateRejected(f"shard {min(errors)} refused the update: {first}")
        del refs, futures
        self._weight += Fraction(w)
        self._count += 1 if w > 0 else -1
        return size

    def mean(self) -> list[npt.NDArray[Any]]:
        """The weighted mean, whole tensors (gathered one shard at a time).

        Raises
        ------
        ConfigError
            Nothing was folded, or the weights do not sum to a positive number.
        """
        if self._weight <= 0:
            raise ConfigError(explain("weights", float(self._weight),
                                      "must sum to a positive number", "fold at least one update"))
        out = [np.empty(s.size, np.dtype(s.dtype)) for s in self.plan.specs]
        for k, a in enumerate(self._actors):
            pieces = ray.get(a.mean.remote())
            self.plan.join_into(out, k, pieces)
            del pieces
        return [o.reshape(s.shape) for o, s in zip(out, self.plan.specs, strict=True)]

    def mean_record(self, keys: Sequence[str]) -> ArrayRecord:
        """The weighted mean as a Flower ArrayRecord, built from the shards' pieces directly.

        Each tensor's npy bytes are joined from its pieces as they lie in the object store
        (zero-copy views), so this process holds the record (one model) and no second copy
        of the mean (:meth:`mean` + ``arrays_to_record`` would hold two).

        Raises
        ------
        ConfigError
            Nothing was folded, or ``keys`` is not one name per tensor.
        """
        from flwr.app import Array

        from strategies.wire.arrays import _npy_header_bytes

        if self._weight <= 0:
            raise ConfigError(explain("weights", float(self._weight),
                                      "must sum to a positive number", "fold at least one update"))
        if len(keys) != len(self.plan.specs):
            raise ConfigError(explain("keys", list(keys)[:3],
                                      f"must name the {len(self.plan.specs)} tensors",
                                      "pass the global model's keys"))
        results = ray.get([a.mean.remote() for a in self._actors])  # zero-copy views
        parts: list[list[Any]] = [[] for _ in self.plan.specs]
        for k, pieces in enumerate(results):
            for p, arr in zip(self.plan.pieces[k], pieces, strict=True):
                parts[p.tensor].append(np.ascontiguousarray(arr).data.cast("B"))
        arrays = {}
        for j, (key, spec) in enumerate(zip(keys, self.plan.specs, strict=True)):
            dt = np.dtype(spec.dtype)
            data = b"".join([_npy_header_bytes(dt.str, spec.shape), *parts[j]])
            parts[j] = []
            arrays[key] = Array(dtype=str(dt), shape=spec.shape, stype="numpy.ndarray",
                                data=data)
        del results
        return ArrayRecord(arrays)

    def actor_memory(self) -> list[dict[str, int | None]]:
        """Per actor: process RSS, peak RSS and accumulator bytes (:meth:`ShardActor.memory`)."""
        return list(ray.get([a.memory.remote() for a in self._actors]))

    def state_dict(self) -> dict[str, Any]:
        """Every shard's state (gathered: the size of the whole accumulator)."""
        return {"shards": ray.get([a.state_dict.remote() for a in self._actors]),
                "weight": [str(self._weight.numerator), str(self._weight.denominator)],
                "count": self._count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (same plan and number of shards)."""
        shards = state.get("shards")
        if not isinstance(shards, list) or len(shards) != self.shards:
            raise ConfigError(explain("sharded state.shards", type(shards).__name__,
                                      f"must be a list of {self.shards} shard states",
                                      "restore a state of the same number of shards"))
        ray.get([a.load_state_dict.remote(s) for a, s in zip(self._actors, shards,
                                                             strict=True)])
        self._weight = Fraction(int(state["weight"][0]), int(state["weight"][1]))
        self._count = int(state["count"])

    def close(self) -> None:
        """Stop the actors (their memory is released)."""
        for a in self._actors:
            ray.kill(a)
        self._actors = []

    def __enter__(self) -> ShardedAccumulator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
