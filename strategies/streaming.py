"""Streamed aggregation of checked updates: fold each one as it comes, keep only its scalars.

The Flower side of :mod:`fedagg.accumulate`. :class:`StreamRound` takes
:class:`~strategies.update.Update` s from any iterable (fedagg FedAvg's decoded replies as
they arrive from the Grid, a compressed wrapper's decoded deltas, ...) and never materialises
it: each update's tensors -- read-only views on the message bytes, or
:class:`~fedagg.accumulate.Sparse` tensors of a compressed reply -- are folded into the
accumulator and released, with the round guards decided on the stream. What stays per update
is scalars, for the metrics and the whole-round statistics
(:class:`~fedagg.accumulate.RoundStatistics`).

:func:`new_accumulator` picks the accumulator: one in this process, or ``shards`` Ray actors
(:class:`strategies.sharded.ShardedAccumulator`; Ray is imported only then). Both give the same
bits for any arrival order.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Protocol, cast

import numpy as np

from fedagg.accumulate import (
    DEFAULT_PRECISION_BITS,
    MEDIAN_MIN_UPDATES,
    Accumulator,
    Retainer,
    RoundStatistics,
    ShardPlan,
    TensorUpdate,
    WeightBuckets,
    delta_norm,
)
from fedagg.aggregate import UpdateGuards, non_finite_message
from fedagg.errors import ConfigError, NonFiniteUpdate, UpdateRejected, explain
from strategies.update import Update

__all__ = ["Folder", "StreamRound", "new_accumulator"]

_log = logging.getLogger(__name__)

class Folder(Protocol):
    """What :func:`fold_replies` needs of an accumulator (plain or sharded)."""

    def fold(self, update: Sequence[TensorUpdate], weight: float) -> float | None: ...

    def mean(self) -> list[np.ndarray]: ...

    @property
    def total_weight(self) -> float: ...

    @property
    def count(self) -> int: ...


def new_accumulator(reference: Sequence[np.ndarray], *, shards: int = 0,
                    precision_bits: int = DEFAULT_PRECISION_BITS,
                    sharded: Any = None, exponents: Sequence[int] | None = None
                    ) -> WeightBuckets:
    """An accumulator for updates shaped like ``reference`` (the round's global model).

    Parameters
    ----------
    reference : sequence of ndarray
        The global model sent this round (the grid is derived from it).
    shards : int
        ``0`` or ``1``: one accumulator in this process; ``S >= 2``: S Ray actors.
    precision_bits : int
        Grid bits below each tensor's scale (:func:`fedagg.accumulate.grid_exponents`).
    sharded : ShardedAccumulator, optional
        Actors of an earlier round to reuse (reset for this round's grid).
    exponents : sequence of int, optional
        ``grid_exponents(reference, precision_bits=...)`` computed earlier (in-process only).

    Returns
    -------
    WeightBuckets
        Its ``first`` is the accumulator real weights go to (a second one is made only for
        weights of 2**32 and more, see :mod:`fedagg.accumulate.weights`).
    """
    def make(reuse: Any = None) -> Any:
        if shards <= 1:
            return Accumulator.for_model(reference, precision_bits=precision_bits,
                                         exponents=exponents)
        plan = ShardPlan.for_model(reference, shards, precision_bits=precision_bits)
        if reuse is not None and getattr(reuse, "shards", None) == shards:
            reuse.reset(plan)
            return reuse
        from strategies.sharded import ShardedAccumulator  # Ray only when sharding is asked for

        return ShardedAccumulator(plan)

    return WeightBuckets(make(sharded), make, [np.asarray(r).dtype.name for r in reference])


class StreamRound:
    """The round-level guards over a stream of checked updates, folded as they come.

    What :func:`strategies.fedavg.guard_updates` decides on a list — a weight that is not a
    finite number in ``(0, max_weight]`` refused; with at least
    :data:`~fedagg.accumulate.MEDIAN_MIN_UPDATES` updates, a delta norm above
    ``norm_outlier_factor`` x the median refused and the remaining weights capped at
    ``max_weight_ratio`` x their median — decided here from the statistics pass, with each
    update folded on arrival and dropped. The few updates a decision may touch are kept aside
    (:class:`~fedagg.accumulate.Retainer`: the ``retain`` largest norms and weights) and
    corrected exactly at the end (a refused one folded again with ``-w``, a capped one with
    ``-w`` then ``c``), so the result is the list-based guards' for any arrival order. A round
    that needs more corrections than were kept is refused (:meth:`close` says why).

    Parameters
    ----------
    accumulator : Folder
        :func:`new_accumulator`'s result for the round's model.
    guards : UpdateGuards
        The round-level bounds.
    current : sequence of ndarray
        The global model (the reference of whole-model updates' norms).
    deltas : bool
        Whether the updates are deltas (else whole models).
    server_round : int
        For messages.
    retain : int
        Updates kept per criterion for corrections.
    spill_dir : path, optional
        Where kept updates of at least 16 MiB are written (default: the system's temp dir).
    expected : int, optional
        The most updates the round can have (the train messages sent). With it, an update
        the guards can no longer refuse or cap whatever else arrives
        (:meth:`~fedagg.accumulate.RoundStatistics.settled`) is not kept aside: in a round of
        honest sites, none is written after the first half. Should more updates come, nothing
        more is skipped; a correction that then needs a skipped update refuses the round as
        any missing correction does (never a wrong sum).
    """

    def __init__(self, accumulator: Folder, guards: UpdateGuards,
                 current: Sequence[np.ndarray], *, deltas: bool, server_round: int,
                 retain: int = 2, spill_dir: str | None = None,
                 expected: int | None = None) -> None:
        self.acc = accumulator
        self.guards = guards
        self.current = current
        self.deltas = deltas
        self.server_round = server_round
        self.stats = RoundStatistics()
        self.retainer = Retainer(retain, directory=spill_dir)
        self.meta: list[tuple[str, Update]] = []
        """``(key, update without its tensors)`` of every folded update."""
        self.rejected: dict[str, str] = {}
        self.capped: dict[str, str] = {}
        self.unfolded: dict[str, str] = {}
        """Updates the accumulator refused (range), kept in the statistics until the norm
        guard has had its say."""
        self._needs_norms = guards.norm_outlier_factor > 0
        self._may_correct = guards.norm_outlier_factor > 0 or guards.max_weight_ratio > 0
        self.expected = expected
        self._added = 0
        self.skipped = 0
        """Updates not kept aside because no whole-round decision could touch them."""

    def add(self, update: Update) -> None:
        """Check the weight, fold the update, record its scalars (and keep it if it may need
        a correction); a refusal is recorded in :attr:`rejected`."""
        tensors, w = update.tensors, update.weight
        self._added += 1
        node = update.key if update.node is not None else f"reply {self._added}"
        g = self.guards
        if not (isinstance(w, int | float) and not isinstance(w, bool) and math.isfinite(w)
                and w > 0) or (g.max_weight is not None and w > g.max_weight):
            self._reject(node, explain(f"{update.site}.weight", w,
                                       "must be a finite number in (0, strategy.max_weight]",
                                       "report the number of examples used for training"))
            return
        if node in self.stats.sites:
            self._reject(node, f"{update.site}: a second update in the same round")
            return
        reference = None if self.deltas else self.current
        fused = self._needs_norms and getattr(self.acc, "fuses_norm", False)
        try:  # the norm from the fold's own pass where the accumulator can (one read)
            norm = (delta_norm(tensors, reference) if self._needs_norms and not fused
                    else float("nan"))
            if fused:
                got = cast(Any, self.acc).fold(tensors, float(w), norm=True,
                                               reference=reference)
                norm = float("nan") if got is None else got
            else:
                self.acc.fold(tensors, float(w))
        except ConfigError as exc:
            self._reject(node, str(exc))
            return
        except NonFiniteUpdate as exc:  # the fold read a NaN / Inf: nothing was folded
            self._reject(node, non_finite_message(update.site, exc.tensor,
                                                  np.asarray(tensors[exc.tensor])))
            return
        except UpdateRejected as exc:  # beyond the accumulator's range: nothing was folded
            if not self._needs_norms:
                self._reject(node, str(exc))
                return
            # the norm guard may still name it (an outlier norm is the better reason)
            if fused:
                norm = delta_norm(tensors, reference)
            self.unfolded[node] = str(exc)
            self.stats.add(node, float(w), norm)
            return
        self.stats.add(node, float(w), norm)
        if self._may_correct and self.retainer.would_keep(node, float(w), norm):
            if self.expected is not None and self.stats.settled(
                    node, norm_factor=g.norm_outlier_factor, weight_ratio=g.max_weight_ratio,
                    expected=self.expected, exclude=list(self.unfolded)):
                self.skipped += 1
            else:
                self.retainer.offer(node, float(w), norm, tensors)
        self.meta.append((node, update.replace(tensors=(), reply=None)))

    def _reject(self, node: str, why: str) -> None:
        self.rejected[node] = why
        _log.warning("round %d: rejected update: %s", self.server_round, why)

    def close(self) -> tuple[list[Update], list[float], str]:
        """Apply the whole-round guards; returns ``(kept meta, their weights, problem)``.

        ``problem`` is '' when the accumulator now holds exactly the guarded sum, else why the
        round cannot be committed (a correction needed an update that was not kept). The
        kept updates are deleted either way.
        """
        g = self.guards
        try:
            refuse: set[str] = set()
            missing: list[str] = []
            if g.norm_outlier_factor > 0 and len(self.stats) >= MEDIAN_MIN_UPDATES:
                median = self.stats.median_norm()
                for node in self.stats.norm_outliers(g.norm_outlier_factor):
                    i = self.stats.sites.index(node)
                    self._reject(node, explain(
                        f"node {node}.delta_norm", float(f"{self.stats.norms[i]:.6g}"),
                        f"must be <= strategy.norm_outlier_factor x the round's median delta "
                        f"norm = {g.norm_outlier_factor} x {median:.6g}",
                        "check the site (a norm bomb?), or raise / turn off (0) "
                        "strategy.norm_outlier_factor"))
                    refuse.add(node)
                    if node not in self.unfolded and not self._correct(
                            node, -self.stats.weights[i], None):
                        missing.append(node)
            for node, why in self.unfolded.items():
                if node not in refuse:
                    self._reject(node, why)
                    refuse.add(node)
            caps = self.stats.capped_weights(g.max_weight_ratio, exclude=sorted(refuse))
            for node, (w, c) in caps.items():
                note = (f"node {node}: weight {w:.6g} capped to {c:.6g} "
                        f"(strategy.max_weight_ratio = {g.max_weight_ratio} x the round's "
                        "median)")
                self.capped[node] = note
                _log.warning("round %d: %s", self.server_round, note)
                if not self._correct(node, -w, c):
                    missing.append(node)
            kept = [(k, u) for k, u in self.meta if k not in refuse]
            weights = [caps[k][1] if k in caps else u.weight for k, u in kept]
            problem = ""
            if missing:
                problem = (f"round {self.server_round}: the round guards refused or capped "
                           f"{len(missing)} more update(s) than the {self.retainer.keep} kept "
                           f"per criterion for an exact correction (nodes {missing[:5]}): "
                           "the streamed sum cannot be corrected, so the round is not "
                           "committed (global model unchanged). Fix: raise "
                           "strategy.hostile_fraction (the share of a round's updates that "
                           "may be refused or capped) or strategy.stream_retain, or turn the "
                           "guard off")
                if self.skipped and self.expected is not None \
                        and len(self.stats) > self.expected:
                    problem += (f" ({len(self.stats)} updates came for {self.expected} "
                                "messages sent, so some were not kept)")
            return [u for _, u in kept], weights, problem
        finally:
            self.retainer.close()

    def _correct(self, node: str, minus: float, then: float | None) -> bool:
        """Fold the kept update of ``node`` with ``minus`` (and then ``then``)."""
        tensors = self.retainer.get(node)
        if tensors is None:
            return False
        self.acc.fold(tensors, minus)
        if then is not None:
            self.acc.fold(tensors, then)
        del tensors
        return True
