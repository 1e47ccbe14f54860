"""The secure strategy's own exchanges with the sites: messages out, checked replies in.

:class:`SiteExchange` builds a secure-aggregation message (the protocol body packed by the wire
adapter, the public parameters, the round config), runs one exchange of the wrapper's own
(key setup, unmasking) over the Grid it was given, and parses each reply for the protocol
state, dropping only the site whose reply is bad. What it sees goes into the round's
:class:`~strategies.update.RoundReport`: sites that failed or were silent (``errors``), replies
refused (``refused``), bytes and exchanges; bytes up per phase are kept in :attr:`up`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedagg.errors import ConfigError, ProtocolError, VerificationError, explain
from fedagg.secagg import Message as SecAggMessage
from fedagg.secagg import SecAggParams
from strategies.base import ExchangeLog, stream_exchange
from strategies.update import RoundReport
from strategies.wire import (
    PARAMS_KEY,
    SECAGG_KEYS,
    message_nbytes,
    pack,
    params_to_record,
    unpack,
)

__all__ = ["SiteExchange"]

_log = logging.getLogger("strategies.secure")


class SiteExchange:
    """Messages and exchanges of one secure strategy with its sites.

    Parameters
    ----------
    config_key : str
        Name of the ConfigRecord with the round config in every message.
    """

    def __init__(self, config_key: str = "config") -> None:
        self.config_key = config_key
        self.params: SecAggParams | None = None
        self.grid: Grid | None = None
        self.report = RoundReport()
        self.up: dict[str, int] = {}
        """Phase -> bytes up of this round's own exchanges."""
        self.plain_replies = 0
        """Replies of this round that carry a plain model instead of a protocol message (the
        site's ClientApp does not run ``clients.fedagg_mod``)."""
        self.error_replies: list[str] = []
        """The error replies of the last exchange (their reasons)."""

    def new_round(self, grid: Grid) -> RoundReport:
        """Start a round on ``grid``; returns its (fresh) report."""
        self.grid = grid
        self.report = RoundReport()
        self.up = {}
        self.plain_replies = 0
        return self.report

    def message(self, node: int, site: int, stage: str, body: SecAggMessage,
                config: ConfigRecord, group: str, ttl: float,
                extra: dict[str, Any] | None = None) -> Message:
        """The train message carrying ``body`` of ``stage`` to ``node`` (site index ``site``)."""
        assert self.params is not None
        content = RecordDict(dict(extra or {}))
        content[self.config_key] = config
        content[PARAMS_KEY] = params_to_record(self.params, site, stage)
        pack(content, body)
        return Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN,
                       group_id=group, ttl=ttl)

    def run(self, messages: list[Message], timeout: float, phase: str) -> list[Message]:
        """One exchange: deadline, genuine replies only, bytes counted; the good replies.

        Replies are filtered (:class:`strategies.base.ReplyGate`): a reply to an earlier
        exchange's message, to a message addressed to another node, or a second reply is
        refused and recorded; error and missing replies are failures. No retries: a
        secure-aggregation message must not be answered twice.
        """
        assert self.grid is not None
        t0 = time.perf_counter()
        log = ExchangeLog()
        replies = list(stream_exchange(self.grid, messages, timeout, log=log)) if messages else []
        self.report.add_time(phase, time.perf_counter() - t0)
        self.report.exchanges += 1
        self.report.bytes_down += log.bytes_down
        for who, why in log.refused.items():
            self.report.refused.setdefault(who, f"{phase}: {why}")
        return self.sort(messages, replies, timeout, phase)

    def sort(self, messages: Sequence[Message], replies: Iterable[Message], timeout: float,
             phase: str) -> list[Message]:
        """The non-error replies; silent and failed sites recorded, bytes up counted."""
        replies = list(replies)
        answered = {r.metadata.src_node_id for r in replies}
        for m in messages:
            if m.metadata.dst_node_id not in answered:
                self.fail(m.metadata.dst_node_id, f"{phase}: no reply within {timeout:.0f} s")
        ok = []
        self.error_replies = []
        for r in replies:
            if r.has_error():
                self.error_replies.append(r.error.reason or "error reply")
                self.fail(r.metadata.src_node_id, f"{phase}: {r.error.reason}")
                continue
            size = message_nbytes(r)
            self.report.bytes_up += size
            self.up[phase] = self.up.get(phase, 0) + size
            ok.append(r)
        return ok

    def fail(self, node: int, reason: str) -> None:
        """``node`` dropped out of the round (``reason``)."""
        self.report.errors.setdefault(str(node), reason)
        _log.warning("secure aggregation: node %d dropped (%s)", node, reason)

    def receive(self, reply: Message, cls: type[Any], site_of: dict[int, int],
                accept: Callable[..., None], phase: str) -> bool:
        """Parse one reply and hand it to the protocol state; a bad one drops only its site."""
        node = reply.metadata.src_node_id
        sender = site_of.get(node)
        try:
            if sender is None:
                raise ProtocolError(explain("node", node, "is not a participant of this stage",
                                            "drop the reply"))
            if _is_plain_reply(reply):
                self.plain_replies += 1
                raise ProtocolError(explain(
                    f"node {node}'s {phase} reply", "a plain model",
                    "must be a secure-aggregation message",
                    "add clients.fedagg_mod to the site's ClientApp mods "
                    "(ClientApp(mods=[fedagg_mod])) or use clients.make_client_app"))
            msg = unpack(reply.content, cls)
            accept(msg, sender=sender)  # the core refuses a reply in another site's name
        except (ProtocolError, VerificationError, ConfigError) as exc:
            self.report.refused[str(node)] = f"{phase}: {exc}"
            self.fail(node, f"{phase}: invalid reply: {exc}")
            return False
        except Exception as exc:  # never one site's reply past its own rejection
            _log.error("secure aggregation: unexpected %s from node %d's %s reply",
                       type(exc).__name__, node, phase, exc_info=True)
            self.report.refused[str(node)] = f"{phase}: {type(exc).__name__}: {exc}"
            self.fail(node, f"{phase}: invalid reply: {type(exc).__name__}")
            return False
        return True


def _is_plain_reply(reply: Message) -> bool:
    """A reply that is an ordinary train reply (a model and metrics), not a protocol message."""
    content = reply.content
    return (len(content.array_records) >= 1 and len(content.metric_records) >= 1
            and not any(k in SECAGG_KEYS for k in content))
