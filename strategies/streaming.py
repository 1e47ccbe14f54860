"""Streamed aggregation of train replies: check each one on its own, fold it, drop it.

The Flower side of :mod:`fedagg.accumulate`. :func:`fold_replies` takes replies from any
iterable (a list, a generator, :func:`strategies.base.stream_replies` yielding them as they
arrive from the Grid) and never materialises it: each reply goes through the strategy's own
per-reply checks (``check``: fedagg FedAvg's :func:`~strategies.fedavg.validate_reply`, the
compressed wrapper's decoder, ...), its arrays — read-only views on the message bytes, or
:class:`~fedagg.accumulate.Sparse` tensors of a compressed reply — are folded into the
accumulator, and the reply is released. What stays per reply is scalars
(:class:`Folded`: node, weight, metrics, delta norm), for the metrics and the whole-round
statistics (:class:`~fedagg.accumulate.RoundStatistics`).

:func:`new_accumulator` picks the accumulator: one in this process, or ``shards`` Ray actors
(:class:`server.sharded.ShardedAccumulator`; Ray is imported only then). Both give the same
bits for any arrival order.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from flwr.app import Message

from fedagg.accumulate import (
    DEFAULT_PRECISION_BITS,
    Accumulator,
    RoundStatistics,
    ShardPlan,
    TensorUpdate,
    delta_norm,
)
from fedagg.errors import UpdateRejected

__all__ = ["Check", "Folded", "Folder", "RoundFold", "fold_replies", "new_accumulator"]

_log = logging.getLogger(__name__)

Check = Callable[[Message], tuple[Sequence[TensorUpdate], float, dict[str, Any]]]
"""One reply -> ``(tensors, weight, metrics)``, or :class:`~fedagg.errors.UpdateRejected`."""


class Folder(Protocol):
    """What :func:`fold_replies` needs of an accumulator (plain or sharded)."""

    def fold(self, update: Sequence[TensorUpdate], weight: float) -> None: ...

    def mean(self) -> list[np.ndarray]: ...

    @property
    def count(self) -> int: ...


@dataclass(frozen=True)
class Folded:
    """The scalars a streamed round keeps of one folded reply."""

    node: int
    weight: float
    metrics: dict[str, Any]
    norm: float
    """L2 norm of the reply's delta (NaN when not computed)."""


@dataclass
class RoundFold:
    """Outcome of :func:`fold_replies`."""

    folded: list[Folded] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    """Node id -> reason, for replies refused by the check or the accumulator."""
    stats: RoundStatistics = field(default_factory=RoundStatistics)
    replies: int = 0
    """Replies taken from the iterable."""


def new_accumulator(reference: Sequence[np.ndarray], *, shards: int = 0,
                    precision_bits: int = DEFAULT_PRECISION_BITS,
                    sharded: Any = None) -> Folder:
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
    """
    if shards <= 1:
        return Accumulator.for_model(reference, precision_bits=precision_bits)
    plan = ShardPlan.for_model(reference, shards, precision_bits=precision_bits)
    if sharded is not None and getattr(sharded, "shards", None) == shards:
        sharded.reset(plan)
        return sharded  # type: ignore[no-any-return]
    from server.sharded import ShardedAccumulator  # Ray only when sharding is asked for

    return ShardedAccumulator(plan)


def fold_replies(replies: Iterable[Message], accumulator: Folder, check: Check, *,
                 reference: Sequence[np.ndarray] | None = None, norms: bool = False,
                 on_reply: Callable[[Message], None] | None = None) -> RoundFold:
    """Check and fold each reply as it comes; keep only scalars of each.

    Parameters
    ----------
    replies : iterable of Message
        Any iterable; it is consumed once and never listed.
    accumulator : Folder
        :func:`new_accumulator`'s result.
    check : Check
        The strategy's per-reply checks, run before anything of the reply is folded.
    reference : sequence of ndarray, optional
        The global model, when the checked tensors are whole models (the norm is then that of
        ``tensors - reference``); ``None`` when they are deltas.
    norms : bool
        Compute each reply's delta L2 norm (one more read of the reply) for the statistics
        pass of the median-relative guards.
    on_reply : callable, optional
        Called with every reply before its check (e.g. to record that a site answered).

    Returns
    -------
    RoundFold
        The folded replies' scalars, the refusals with their reasons and the statistics.
    """
    out = RoundFold()
    seen: set[int] = set()
    for reply in replies:
        out.replies += 1
        node = reply.metadata.src_node_id
        if on_reply is not None:
            on_reply(reply)
        if node in seen:
            out.rejected[str(node)] = f"node {node}: a second reply in the same round"
            _log.warning("rejected update: %s", out.rejected[str(node)])
            continue
        tensors: Sequence[TensorUpdate] = ()
        try:
            tensors, weight, metrics = check(reply)
            norm = delta_norm(tensors, reference) if norms else float("nan")
            accumulator.fold(tensors, weight)
        except UpdateRejected as exc:
            out.rejected[str(node)] = str(exc)
            _log.warning("rejected update: %s", exc)
            del reply
            gc.collect(1)
            continue
        finally:
            del tensors  # the reply's views go with the reply
        seen.add(node)
        out.folded.append(Folded(node=node, weight=float(weight), metrics=dict(metrics),
                                 norm=norm))
        if norms:
            out.stats.add(node, float(weight), norm)
        del reply
        # Flower's typed views (``content.array_records``, built by every check) hold a bound
        # method of themselves: a reference cycle that keeps the whole reply alive until the
        # cyclic GC runs, which large byte buffers do not trigger. Collect the young
        # generations now (microseconds), so a released reply is freed before the next one.
        gc.collect(1)
    return out
