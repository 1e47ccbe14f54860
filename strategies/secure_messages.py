"""What the secure strategy sends, and how it takes the replies: its own exchanges with the sites.

Methods of :class:`strategies.secure.SecureAggregation`, defined here and bound in its class
body (``SecureAggregation._message = _message``, ...), so they are called and overridden as
before:

* ``_message`` — one ``train`` message of a protocol stage: the round config, the public
  parameters and the stage's secure-aggregation message;
* ``_exchange`` / ``_sort`` / ``_fail`` — one exchange of the wrapper's own over the Grid:
  deadline, genuine replies only (:func:`strategies.base.exchange`), bytes counted; a site
  that fails or does not answer is dropped with the reason, never retried;
* ``_receive`` — parse one reply and hand it to :class:`fedagg.secagg.ServerState`; a bad
  one drops only its site;
* ``_layout`` / ``_upload_records`` / ``_support`` — what a round's upload request carries
  beyond the protocol: the masked vector's layout, a sparse round's instruction (and the
  previous model, the public vote sum), the round's public support.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fedagg.errors import ConfigError, ProtocolError, VerificationError, explain
from fedagg.secagg import Message as SecAggMessage
from fedagg.update import MaskedLayout, masked_layout
from strategies.base import exchange
from strategies.wire import (
    INSTRUCTION_KEY,
    PARAMS_KEY,
    PREVIOUS_KEY,
    VOTES_KEY,
    Instruction,
    arrays_to_record,
    message_nbytes,
    pack,
    params_to_record,
    unpack,
    votes_record,
)

if TYPE_CHECKING:
    from strategies.secure import SecureAggregation

__all__: list[str] = []  # SecureAggregation's methods (bound in strategies.secure)

_log = logging.getLogger("strategies.secure")  # the name these records had before the split


def _message(self: SecureAggregation, node: int, site: int, stage: str, body: SecAggMessage,
             config: ConfigRecord, group: str, ttl: float,
             extra: dict[str, Any] | None = None) -> Message:
    assert self.params is not None
    content = RecordDict(dict(extra or {}))
    content[self.config_key] = config
    content[PARAMS_KEY] = params_to_record(self.params, site, stage)
    pack(content, body)
    return Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN,
                   group_id=group, ttl=ttl)

def _exchange(self: SecureAggregation, messages: list[Message], timeout: float,
              phase: str) -> list[Message]:
    """One exchange of the wrapper's own: deadline, genuine replies only, bytes counted.

    Replies are filtered (:func:`strategies.base.exchange`): a reply to an earlier
    exchange's message, to a message addressed to another node, or a second reply is
    refused and recorded; error and missing replies are failures. No retries: a
    secure-aggregation message must not be answered twice.
    """
    log = self.round_log
    assert self._grid is not None
    t0 = time.perf_counter()
    replies, refused, bytes_down, _ = (exchange(self._grid, messages, timeout) if messages
                                       else ([], {}, 0, 0))
    log.bytes_down += bytes_down
    log.tick(phase, t0)
    log.exchanges += 1
    for node, why in refused.items():
        log.rejected.setdefault(node, f"{phase}: {why}")
    return self._sort(messages, replies, timeout, phase, count_bytes=True)

def _sort(self: SecureAggregation, messages: Sequence[Message], replies: Iterable[Message],
          timeout: float, phase: str, *, count_bytes: bool) -> list[Message]:
    log = self.round_log
    replies = list(replies)
    answered = {r.metadata.src_node_id for r in replies}
    for m in messages:
        if m.metadata.dst_node_id not in answered:
            self._fail(m.metadata.dst_node_id, f"{phase}: no reply within {timeout:.0f} s")
    ok = []
    for r in replies:
        if r.has_error():
            self._fail(r.metadata.src_node_id, f"{phase}: {r.error.reason}")
            continue
        if count_bytes:
            size = message_nbytes(r)
            log.bytes_up += size
            log.up[phase] = log.up.get(phase, 0) + size
        ok.append(r)
    return ok

def _fail(self: SecureAggregation, node: int, reason: str) -> None:
    self.round_log.failed.setdefault(node, reason)
    _log.warning("secure aggregation: node %d dropped (%s)", node, reason)

def _receive(self: SecureAggregation, reply: Message, cls: type[Any], site_of: dict[int, int],
             accept: Any, phase: str) -> bool:
    """Parse one reply and hand it to the server state; a bad one drops only its site."""
    node = reply.metadata.src_node_id
    sender = site_of.get(node)
    try:
        if sender is None:
            raise ProtocolError(explain("node", node, "is not a participant of this stage",
                                        "drop the reply"))
        msg = unpack(reply.content, cls)
        accept(msg, sender=sender)  # the core refuses a reply in another site's name
    except (ProtocolError, VerificationError, ConfigError) as exc:
        self.round_log.rejected[str(node)] = f"{phase}: {exc}"
        self._fail(node, f"{phase}: invalid reply: {exc}")
        return False
    except Exception as exc:  # never one site's reply past its own rejection
        _log.error("secure aggregation: unexpected %s from node %d's %s reply",
                   type(exc).__name__, node, phase, exc_info=True)
        self.round_log.rejected[str(node)] = f"{phase}: {type(exc).__name__}: {exc}"
        self._fail(node, f"{phase}: invalid reply: {type(exc).__name__}")
        return False
    return True


def _layout(self: SecureAggregation, dim: int, participants: int) -> MaskedLayout:
    """The masked vector of the round (:func:`fedagg.update.masked_layout`)."""
    assert self.params is not None
    return masked_layout(self.history, dim, num_sites=participants,
                         ring_bits=self.params.encoding_for(participants)[1])

def _upload_records(self: SecureAggregation, server_round: int, node: int,
                    keys: list[str]) -> dict[str, Any]:
    """The instruction (and the previous model) of a sparse round."""
    if self.spec.dense:
        return {}
    votes = self.history.votes if self.spec.votes else None
    out: dict[str, Any] = {INSTRUCTION_KEY: Instruction(
        up=self.spec.up, run_seed=self.run_seed, server_round=server_round,
        previous_round=self.history.previous_round if self.spec.needs_previous else -1,
        namespace=self.state_namespace, support=self.spec.support,
        votes_round=-1 if votes is None else votes[0]).to_record()}
    if votes is not None:  # public: the vote sum the server unmasked (counted downward)
        out[VOTES_KEY] = votes_record(votes[1])
    if (self.spec.needs_previous and self.history.previous is not None
            and node not in self.history.fresh):
        out[PREVIOUS_KEY] = arrays_to_record(self.history.previous, keys)
    return out

def _support(self: SecureAggregation, dim: int) -> np.ndarray | None:
    """The round's public support (None: dense or sketch), as the sites compute it."""
    if self.spec.dense or self.spec.sketch:
        self.last_support = None
        return None
    support = self.history.support()
    if support is None or support.size < 1:
        raise ConfigError(explain("compression.up", self.spec.up,
                                  "a secure sparse round needs a support of >= 1 position",
                                  "raise the ratio or k of the sparsifier"))
    self.last_support = support
    return support
