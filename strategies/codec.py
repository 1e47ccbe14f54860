"""The server side of the update codec seam: a train reply in, one checked :class:`Update` out.

A codec knows one wire form of the sites' updates and turns a reply into the carrier
(:class:`strategies.update.Update`), checking everything about that one reply on its own:

* :class:`PlainCodec` -- the site's whole model in one ArrayRecord (Flower's form, every
  Flower ClientApp's); fedagg's FedAvg and the asynchronous loop decode with it;
* ``strategies.compressed.CompressedCodec`` -- the compressed delta of a fedagg site (payload
  codec, public support, error feedback at the site);
* masked uploads are decoded by the secure strategy's protocol state (they are not updates
  of one site: only their sum is).

The site side of each form is the upload pipeline (:mod:`fedagg.update`), serialised by the
same wire adapter (:mod:`strategies.wire`). A refused reply raises
:class:`~fedagg.errors.UpdateRejected` naming the field, the value, the rule and the fix; it
never reaches an accumulator.

:class:`Consistency` holds what Flower's strategies require of a round's replies taken
together (``flwr.serverapp.exception.InconsistentMessageReplies``: one ArrayRecord and one
MetricRecord each, the same record and array names, the weight present and not a list),
checked one reply at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from flwr.app import Message
from flwr.serverapp.exception import InconsistentMessageReplies

from fedagg.aggregate import cast_update, check_update
from fedagg.errors import UpdateRejected, explain
from strategies.update import Update, node_of
from strategies.wire import record_to_arrays

__all__ = ["MAX_PARTITION_ID", "Consistency", "PlainCodec", "UpdateCodec", "check_metadata"]

MAX_PARTITION_ID = 2**31 - 1
"""Largest ``partition-id`` a reply may carry (larger ones, like non-integers, are refused)."""


class UpdateCodec(Protocol):
    """Turns one train reply into a checked :class:`Update` (or raises UpdateRejected)."""

    def decode(self, reply: Message) -> Update: ...


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_metadata(site: str, metrics: Any, *, weight_key: str = "num-examples",
                   server_round: int | None = None, max_weight: float | None = None) -> float:
    """Type- and range-check the identifiers and the weight of one reply; returns the weight.

    The weight (``weight_key``) must be a finite number > 0 (and <= ``max_weight``); a
    ``server-round`` echo must be the integer ``server_round``; a ``partition-id`` must be an
    integer in ``[0, 2^31)``. Lists, booleans, NaN or Inf in any of them refuse the reply, never
    the round (other metrics are only averaged).

    Raises
    ------
    UpdateRejected
        Naming the field, the value, the rule and the fix.
    """
    weight: Any = metrics.get(weight_key) if hasattr(metrics, "get") else None
    if not (_is_number(weight) and math.isfinite(weight) and weight > 0):
        raise UpdateRejected(explain(f"{site}.metrics.{weight_key}", weight,
                                     "must be a finite number > 0",
                                     "report the number of examples used for training"))
    if max_weight is not None and weight > max_weight:
        raise UpdateRejected(explain(f"{site}.metrics.{weight_key}", weight,
                                     f"must be <= strategy.max_weight = {max_weight}",
                                     "report the real number of examples, or raise "
                                     "strategy.max_weight"))
    if "server-round" in metrics:
        echoed: Any = metrics["server-round"]
        ok = _is_number(echoed) and math.isfinite(echoed) and float(echoed).is_integer()
        if not ok or (server_round is not None and int(echoed) != server_round):
            raise UpdateRejected(explain(
                f"{site}.metrics.server-round", echoed,
                f"must be the current round {server_round}" if server_round is not None
                else "must be an integer",
                "stale reply from an earlier round: it is never aggregated"))
    if "partition-id" in metrics:
        pid: Any = metrics["partition-id"]
        if not (_is_number(pid) and math.isfinite(pid) and float(pid).is_integer()
                and 0 <= pid <= MAX_PARTITION_ID):
            raise UpdateRejected(explain(f"{site}.metrics.partition-id", pid,
                                         f"must be an integer in [0, {MAX_PARTITION_ID}]",
                                         "report the site's partition id (or leave it out)"))
    return float(weight)


@dataclass
class Consistency:
    """Flower's reply-consistency rules, one reply at a time (the first reply sets the names).

    ``check`` raises :class:`InconsistentMessageReplies` with Flower's reasons where Flower's
    ``validate_message_reply_consistency`` raises for the round's replies together.
    """

    weight_key: str = "num-examples"
    arrays: bool = True
    _first: tuple[str, frozenset[str], str, frozenset[str]] | None = field(default=None,
                                                                          repr=False)

    def check(self, reply: Message) -> None:
        content = reply.content
        arecs, mrecs = content.array_records, content.metric_records
        if self.arrays and len(arecs) != 1:
            raise InconsistentMessageReplies(reason="Expected exactly one ArrayRecord in "
                                             "replies. Skipping aggregation.")
        if len(mrecs) != 1:
            raise InconsistentMessageReplies(reason="Expected exactly one MetricRecord in "
                                             "replies, but found more. Skipping aggregation.")
        akey = next(iter(arecs.keys()), "") if self.arrays else ""
        mkey = next(iter(mrecs.keys()))
        akeys = frozenset(content[akey].keys()) if self.arrays else frozenset()
        mkeys = frozenset(content[mkey].keys())
        if self._first is None:
            if self.weight_key not in mkeys:
                raise InconsistentMessageReplies(
                    reason=f"Missing required key `{self.weight_key}` in the MetricRecord of "
                    "reply messages. Cannot average ArrayRecords and MetricRecords. Skipping "
                    "aggregation.")
            self._first = (akey, akeys, mkey, mkeys)
        first_akey, first_akeys, first_mkey, first_mkeys = self._first
        if self.arrays and (akey != first_akey or akeys != first_akeys):
            raise InconsistentMessageReplies(
                reason="All ArrayRecords must have the same keys for aggregation. This "
                "condition wasn't met. Skipping aggregation.")
        if mkey != first_mkey or mkeys != first_mkeys:
            raise InconsistentMessageReplies(
                reason="All MetricRecords must have the same keys for aggregation. This "
                "condition wasn't met. Skipping aggregation.")
        if isinstance(content[mkey][self.weight_key], list):
            raise InconsistentMessageReplies(
                reason=f"Key `{self.weight_key}` in the MetricRecord of reply messages must be "
                "a single value (int or float), but a list was found. Skipping aggregation.")


@dataclass
class PlainCodec:
    """Plain train replies (the site's whole model in one ArrayRecord), checked one by one.

    Parameters
    ----------
    keys, reference : list, optional
        The global model sent this round (its tensor names and arrays): every reply must match
        them (count, names, shapes, dtypes; floats of another precision are cast unless
        ``strict_dtypes``). ``None`` when the strategy was not configured for the round
        (``aggregate_train`` called alone): the first reply then sets names, shapes and dtypes.
    weight_key : str
        The weight's name in the reply's MetricRecord.
    server_round : int, optional
        The round a ``server-round`` echo must name.
    max_norm : float, optional
        Bound on the L2 norm of the reply's model minus the global model.
    max_weight : float, optional
        Bound on the weight.
    strict_dtypes : bool
        Refuse another float precision instead of casting it.
    check_finite : bool
        Check for NaN / Inf here; off only when the consumer folds every update into an
        accumulator that refuses them itself (a streamed FedAvg round: one read per reply).
    """

    keys: list[str] | None = None
    reference: Sequence[np.ndarray] | None = None
    weight_key: str = "num-examples"
    server_round: int | None = None
    max_norm: float | None = None
    max_weight: float | None = None
    strict_dtypes: bool = False
    check_finite: bool = True

    def decode(self, reply: Message) -> Update:
        """The checked update of one reply (views on its bytes, nothing copied).

        Raises
        ------
        UpdateRejected
            An error reply, another record layout, a bad weight / round echo / partition
            id, undecodable arrays, other tensors than the model's, non-finite values or a
            norm above ``max_norm``.
        """
        node = node_of(reply)
        site = f"node {node}" if node is not None else "a reply"
        if reply.has_error():
            raise UpdateRejected(f"{site} replied with an error: {reply.error.reason}")
        content = reply.content
        arecs = list(content.array_records.values())
        mrecs = list(content.metric_records.values())
        if len(arecs) != 1:
            raise UpdateRejected(explain(f"{site}.array_records", len(arecs),
                                         "must hold exactly one ArrayRecord",
                                         "reply with the trained model in one ArrayRecord"))
        if len(mrecs) != 1 or self.weight_key not in mrecs[0]:
            raise UpdateRejected(explain(
                f"{site}.metrics", sorted(mrecs[0].keys()) if mrecs else [],
                f"must hold one MetricRecord with {self.weight_key!r}",
                f"add {self.weight_key!r} (number of training examples) to the metrics"))
        weight = check_metadata(site, mrecs[0], weight_key=self.weight_key,
                                server_round=self.server_round, max_weight=self.max_weight)
        try:
            rkeys, arrays = record_to_arrays(arecs[0], copy=False)
        except UpdateRejected:
            raise
        except Exception as exc:  # malformed array bytes
            raise UpdateRejected(f"{site}.arrays could not be decoded: {exc}") from None
        if self.keys is None or self.reference is None:
            self.keys, self.reference = rkeys, arrays  # the first reply sets the layout
            for j, a in enumerate(arrays):
                if a.dtype.kind not in "fiu":
                    raise UpdateRejected(explain(f"{site}.arrays[{j}].dtype", str(a.dtype),
                                                 "must be a float or integer dtype",
                                                 "send the model's tensors"))
        if rkeys != self.keys:
            raise UpdateRejected(explain(f"{site}.arrays.keys", rkeys[:5],
                                         f"must equal the global model's keys {self.keys[:5]}...",
                                         "send the model of the same architecture"))
        arrays = cast_update(arrays, self.reference, strict=self.strict_dtypes, site=site)
        check_update(arrays, self.reference, max_norm=self.max_norm, site=site,
                     check_finite=self.check_finite)
        return Update(arrays, weight, dict(mrecs[0]), node, "model", round=self.server_round,
                      reply=reply)
