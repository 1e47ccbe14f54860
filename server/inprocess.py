"""A Flower :class:`~flwr.serverapp.Grid` that runs a real ClientApp in the same process.

For tests and benchmarks that need the real message path (strategies, ClientApp, mods, records,
``Context.state``) without the start-up cost of the simulation engine. It follows what
Flower's simulation backend does per message (``flwr.server.superlink.fleet.vce``): look up
the node's :class:`~flwr.app.Context`, call the ClientApp, keep the updated context only when
the app returned, and turn an exception into an error reply (``ErrorCode`` 2 for an exception
raised inside the ClientApp). With ``wire=True`` every message and reply goes through Flower's
serialisation (the content-addressed objects of :func:`message_nbytes`) and back; with
``wire=False`` each node gets a deep copy of the message instead (no serialisation cost, but
still no shared mutable records between nodes, which Flower's secaggplus_mod relies on).

Messages are processed one after another, so the measured times are sums of compute.
``drop`` makes nodes vanish (no reply at all, as a node that is unreachable or too late).
"""

from __future__ import annotations

import copy
import random
import time
import uuid
from collections.abc import Callable, Iterable, Sequence

from flwr.app import ArrayRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    no_object_id_recompute,
)
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["InProcessGrid", "nodes_by_partition", "partition_of", "wire_roundtrip"]

_CLIENT_APP_RAISED_EXCEPTION = 2


def wire_roundtrip(message: Message) -> tuple[Message, int]:
    """Serialise ``message`` as Flower ships it and inflate it again; returns (copy, bytes)."""
    with no_object_id_recompute():  # each object id computed once, as Flower's Grid does
        objects = get_all_nested_objects(message)
        contents = {oid: obj.deflate() for oid, obj in objects.items()}
    size = sum(len(c) for c in contents.values())
    out = inflate_object_from_contents(message.object_id, contents)
    assert isinstance(out, Message)
    out.metadata.__dict__.update(copy.copy(message.metadata.__dict__))
    return out, size


class InProcessGrid(Grid):
    """``num_nodes`` virtual SuperNodes running ``client_app`` in this process.

    Parameters
    ----------
    client_app : ClientApp
        The app every node runs.
    num_nodes : int
        Node ``i`` gets ``node_config = {"partition-id": i, "num-partitions": num_nodes}`` and a
        random 64-bit node id (seeded by ``seed``), as in simulation.
    wire : bool
        Round-trip every message through Flower's serialisation.
    seed : int
        Seed of the node ids.
    """

    def __init__(self, client_app: ClientApp | Callable[[Message, Context], Message],
                 num_nodes: int, *, wire: bool = True, seed: int = 0, run_id: int = 1) -> None:
        self.client_app = client_app
        rng = random.Random(seed)
        self.node_ids = sorted(rng.randrange(2**40, 2**63) for _ in range(num_nodes))
        self.contexts = {
            nid: Context(run_id=run_id, node_id=nid,
                         node_config={"partition-id": i, "num-partitions": num_nodes},
                         state=RecordDict(), run_config={})
            for i, nid in enumerate(self.node_ids)
        }
        self.wire = wire
        self.drop: set[int] = set()
        self._run = Run.create_empty(run_id) if hasattr(Run, "create_empty") else None
        self._run_id = run_id
        self._replies: dict[str, Message] = {}
        # This process plays the ServerApp: give it the identity Flower gives one.
        for attr, value in (("_run_id", run_id), ("_node_id", 0), ("_task_id", 1)):
            if getattr(TaskIdentity, attr) is None:
                setattr(TaskIdentity, attr, value)
        self.client_seconds: list[tuple[int, str, float]] = []  # (node, message type, seconds)
        self.bytes_down = 0
        self.bytes_up = 0

    # -- Grid interface --------------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        """Set the run."""
        self._run = run

    @property
    def run(self) -> Run:
        """Run information."""
        assert self._run is not None
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        """A new instruction message."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """Node ids of all nodes (dropped ones included: they are connected, just silent)."""
        return list(self.node_ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Run each message on its node now; replies wait for :meth:`pull_messages`."""
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            msg.metadata.__dict__["_run_id"] = self._run_id
            msg.metadata.__dict__["_src_node_id"] = 1
            ids.append(msg.metadata.message_id)
            reply = self._deliver(msg)
            if reply is not None:
                self._replies[msg.metadata.message_id] = reply
        return ids

    push_messages.replies_ready = True  # type: ignore[attr-defined]
    """Every reply exists once ``push_messages`` returns (``strategies.base.stream_exchange``
    stops waiting when a pull finds none: the silent nodes never answer)."""

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Replies for ``message_ids`` (each returned once)."""
        return [self._replies.pop(m) for m in list(message_ids) if m in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Push, then pull every reply (nodes in :attr:`drop` never answer)."""
        return list(self.pull_messages(self.push_messages(messages)))

    # -- delivery ----------------------------------------------------------------------------
    def _deliver(self, msg: Message) -> Message | None:
        node = msg.metadata.dst_node_id
        if node in self.drop or node not in self.contexts:
            return None
        if self.wire:
            msg, size = wire_roundtrip(msg)
            self.bytes_down += size
        else:  # isolate the node from the server's objects without serialising
            msg = Message(content=_isolate(msg.content),  # type: ignore[call-overload]
                          metadata=copy.copy(msg.metadata))
        context = copy.deepcopy(self.contexts[node])
        t0 = time.perf_counter()
        try:
            reply = self.client_app(msg, context)
            self.contexts[node] = context
        except Exception as exc:
            reason = str(type(exc)) + ":<'" + str(exc) + "'>"
            reply = Message(Error(code=_CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)
        self.client_seconds.append((node, msg.metadata.message_type, time.perf_counter() - t0))
        reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        if self.wire and not reply.has_error():
            reply, size = wire_roundtrip(reply)
            self.bytes_up += size
        return reply


def _isolate(content: RecordDict) -> RecordDict:
    """New record objects (config and metric values copied; Array objects shared, read-only)."""
    out = RecordDict()
    for key, rec in content.items():
        if isinstance(rec, ArrayRecord):
            out[key] = ArrayRecord(dict(rec.items()))
        else:
            out[key] = type(rec)(copy.deepcopy(dict(rec)))  # type: ignore[arg-type]
    return out


def partition_of(grid: InProcessGrid, node_id: int) -> int:
    """The partition id of ``node_id``."""
    return int(grid.contexts[node_id].node_config["partition-id"])


def nodes_by_partition(grid: InProcessGrid) -> Sequence[int]:
    """Node ids ordered by partition id."""
    return sorted(grid.node_ids, key=lambda n: partition_of(grid, n))
