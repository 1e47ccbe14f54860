"""The server side's one carrier, :class:`Update`, and what a round reports, :class:`RoundReport`.

Every train reply becomes one :class:`Update` when a codec decodes it
(:mod:`strategies.codec`: plain, compressed or masked replies); from then on nothing else
travels between the server-side steps -- the round guards, the accumulator, a wrapper handing
updates to its inner strategy, the asynchronous buffer. Compare PyTorch's ``GradBucket``: one
object per unit of communication, handed to every hook.

A round's outcome is one :class:`RoundReport` (who was sampled, who replied, which updates were
accepted, refused or capped and why, bytes and seconds); fedagg's strategies fill the report of
the round they are aggregating (:attr:`strategies.base.FedaggStrategy.report`) and the round
loop merges it with what the exchange saw.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from flwr.app import Message

from fedagg.accumulate import TensorUpdate

__all__ = ["RoundReport", "Update", "node_of", "numbers", "partition_of"]

_log = logging.getLogger(__name__)

Kind = Literal["model", "delta"]


def node_of(reply: Message) -> int | None:
    """The sender's node id as the transport gives it, or None when a reply has none (a test's
    message mock, a reply built by hand)."""
    try:
        node = reply.metadata.src_node_id
    except (AttributeError, ValueError):
        return None
    return node if isinstance(node, int) and not isinstance(node, bool) else None


@dataclass(frozen=True)
class Update:
    """One site's update, as every server-side step sees it.

    Attributes
    ----------
    tensors : sequence of ndarray or Sparse
        The update, one entry per tensor of the model: read-only views on the reply's bytes,
        or :class:`fedagg.accumulate.Sparse` positions and values of a compressed reply.
    weight : float
        Its weight (the site's number of examples, checked finite and > 0).
    metrics : mapping
        The reply's metrics (the weight included; ``partition-id`` is only a label).
    node : int or None
        The sender's node id as the transport authenticates it (None: the reply had none).
    kind : {"model", "delta"}
        Whether ``tensors`` are the site's whole model or its change to the global model.
    round : int or None
        The server round the reply answers.
    version : int or None
        The model version the site trained from (asynchronous aggregation).
    reply : Message or None
        The reply it was decoded from (for an inner strategy that takes replies).
    """

    tensors: Sequence[TensorUpdate]
    weight: float
    metrics: Mapping[str, Any]
    node: int | None = None
    kind: Kind = "model"
    round: int | None = None
    version: int | None = None
    reply: Message | None = field(default=None, repr=False, compare=False)

    @property
    def site(self) -> str:
        """How messages name the sender: ``"node N"`` (``"a reply"`` without a node id)."""
        return f"node {self.node}" if self.node is not None else "a reply"

    @property
    def key(self) -> str:
        """The sender as a key of :class:`RoundReport` maps (``str(node)``, ``"?"``)."""
        return str(self.node) if self.node is not None else "?"

    def replace(self, **changes: Any) -> Update:
        """A copy with ``changes`` (dataclasses.replace)."""
        return dataclasses.replace(self, **changes)


@dataclass
class RoundReport:
    """What one round (or one asynchronous version) did, for the run's records.

    Attributes
    ----------
    sampled : int
        Train messages sent.
    replies : int
        Replies received that were not error replies.
    accepted : list of int
        Partition ids of the sites whose update is in the aggregate (-1 when unknown).
    refused : dict
        Who -> why, for replies or updates left out (a node id, ``"server"`` for the whole
        aggregate, ``"round"`` for a refused round, ``"votes"`` for a secure round's refused
        vote sum).
    capped : dict
        Node id -> note, for weights the round guards lowered.
    errors : dict
        Node id -> reason, for error replies, sites that did not answer in time or dropped.
    site_metrics : dict
        Node id -> the site's numeric metrics (within the strategy's metric limits), its
        ``partition-id`` as it reported it: a label, never the key (the node id is what the
        transport authenticates).
    metrics_dropped : dict
        Node id -> why some of its metrics were left out (too many or too long keys, a list
        too long, a ``partition-id`` claimed by another node of the round as well).
    bytes_down, bytes_up : int
        Serialised bytes sent and received (every exchange of the round).
    exchanges : int
        Server -> sites -> server trips.
    seconds : dict
        Phase -> seconds.
    aborted : str
        Why the round was aborted ('' when it was not).
    """

    sampled: int = 0
    replies: int = 0
    accepted: list[int] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    capped: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    site_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    metrics_dropped: dict[str, str] = field(default_factory=dict)
    bytes_down: int = 0
    bytes_up: int = 0
    exchanges: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    aborted: str = ""

    @property
    def failures(self) -> int:
        """Sites that failed: error replies, silent or dropped sites (``errors`` by node id)."""
        return sum(1 for k in self.errors if k.lstrip("-").isdigit())

    def refuse(self, who: str, why: str, *, log: bool = True) -> None:
        """Record (and log) that ``who``'s reply or update was left out."""
        self.refused[who] = why
        if log:
            _log.warning("rejected update: %s", why)

    def add_time(self, phase: str, seconds: float) -> None:
        """Add ``seconds`` to ``phase``."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def merge(self, other: RoundReport) -> None:
        """Add ``other`` (an inner strategy's or an exchange's report) into this one; what this
        report already says about a site wins."""
        self.bytes_down += other.bytes_down
        self.bytes_up += other.bytes_up
        self.exchanges += other.exchanges
        self.replies = max(self.replies, other.replies)
        self.sampled = max(self.sampled, other.sampled)
        for mine, theirs in ((self.refused, other.refused), (self.capped, other.capped),
                             (self.errors, other.errors), (self.site_metrics, other.site_metrics),
                             (self.metrics_dropped, other.metrics_dropped)):
            for k, v in theirs.items():
                mine.setdefault(k, v)  # type: ignore[arg-type]
        if other.accepted and not self.accepted:
            self.accepted = list(other.accepted)
        for phase, sec in other.seconds.items():
            self.add_time(phase, sec)
        self.aborted = self.aborted or other.aborted


def partition_of(metrics: Mapping[str, Any]) -> int:
    """The ``partition-id`` a site reported (-1 when absent or not a finite number): a label,
    never an identity (the node id the transport authenticates is)."""
    value = metrics.get("partition-id", -1)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return -1
    return int(value)


def numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite scalar entries of a site's metrics (its per-site record)."""
    return {str(k): float(v) for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
