"""An in-process Grid whose replies arrive later, out of order, after simulated site times.

:class:`DelayedGrid` extends :class:`server.inprocess.InProcessGrid` (real ClientApp, real
serialisation, real ``Context.state``): each message is still run on its node when it is
pushed, but the reply is held back until its **arrival time**, ``sent + duration``, on the
grid's clock. The duration of a training message comes from a seeded
:class:`fedagg.asyncagg.SpeedModel` keyed by the site's partition id and the message's
``server-round`` (so a message sent again after a resume takes exactly as long); key setup
and unmask messages of secure aggregation, and evaluate messages, take the model's
``latency`` only.

With a :class:`fedagg.asyncagg.VirtualClock` (default) nothing sleeps: the asynchronous loop
asks :meth:`DelayedGrid.next_arrival` and jumps there (a caller that only polls, such as the
synchronous round loop, moves the clock by pulling: see :meth:`DelayedGrid.pull_messages`), so 20 sites with lognormal speeds run
on one machine in the time their training takes, and time-to-accuracy is reported in
simulated seconds. With a :class:`fedagg.asyncagg.WallClock` the replies are held back in
real time instead (``time_scale`` real seconds per simulated second), which the tests use to
check the virtual clock against real waits.

Arrivals are ordered by ``(arrival time, push order)``; replies due at the same instant come
back together, in push order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedagg.asyncagg import SpeedModel, VirtualClock, WallClock
from fedagg.config import RunConfig
from server.inprocess import InProcessGrid
from strategies.wire import CARRY_KEY, PARAMS_KEY, CarryRequest

__all__ = ["DelayedGrid", "site_work", "speed_model"]

Clock = VirtualClock | WallClock


def site_work(cfg: RunConfig) -> dict[int, float]:
    """Each site's training examples over the mean (the built-in data's partitions)."""
    from fedagg.builtin import _partitions

    d = cfg.data
    parts = _partitions(d.dataset, d.data_dir, d.test_fraction, cfg.run.seed, cfg.run.sites,
                        d.partitioner, d.dirichlet_alpha, d.min_partition_size,
                        d.max_train_examples)
    mean = sum(len(p) for p in parts) / max(len(parts), 1)
    return {i: len(p) / mean for i, p in enumerate(parts)}


def speed_model(cfg: RunConfig, work: Mapping[int, float] | None = None) -> SpeedModel:
    """The ``[asynchronous]`` ``sim_*`` settings as a :class:`SpeedModel` (seed: run.seed).

    With ``sim_work = "examples"`` (and no ``work`` given) a job's length is proportional to
    the site's examples (:func:`site_work`, built-in data sets).
    """
    a = cfg.asynchronous
    if work is None and a.sim_work == "examples":
        work = site_work(cfg)
    return SpeedModel(seed=cfg.run.seed, job_seconds=a.sim_job_seconds, sigma=a.sim_sigma,
                      site_sigma=a.sim_site_sigma, factors=tuple(a.sim_factors),
                      latency=a.sim_latency, work=dict(work or {}))


def _trains(msg: Message) -> bool:
    """Whether the message makes the site train (not a key-setup or unmask stage, not an
    evaluation, not secure FedBuff's carry of a held update)."""
    if not msg.has_content() or str(msg.metadata.message_type).startswith("evaluate"):
        return False
    rec = msg.content.config_records.get(PARAMS_KEY)
    if rec is None:
        return True
    carry = msg.content.config_records.get(CARRY_KEY)
    if carry is not None and CarryRequest.from_record(carry).carries:
        return False  # a held update, masked again (clients.carry): no training
    return rec.get("stage") in (None, "upload")


def _server_round(msg: Message) -> int:
    for rec in msg.content.config_records.values() if msg.has_content() else ():
        value = rec.get("server-round")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


class DelayedGrid(InProcessGrid):
    """``num_nodes`` in-process SuperNodes whose replies arrive after simulated durations.

    Parameters
    ----------
    client_app : ClientApp
        The app every node runs.
    num_nodes : int
        Number of nodes (partition ids ``0 .. num_nodes - 1``).
    speed : SpeedModel
        Job durations per partition and ``server-round``.
    clock : VirtualClock or WallClock, optional
        The grid's time (default: a new :class:`VirtualClock` at 0).
    time_scale : float
        Real seconds per simulated second with a wall clock.
    wire, seed, run_id
        As :class:`~server.inprocess.InProcessGrid`.
    """

    def __init__(self, client_app: ClientApp | Callable[[Message, Context], Message],
                 num_nodes: int, *, speed: SpeedModel, clock: Clock | None = None,
                 time_scale: float = 1.0, wire: bool = True, seed: int = 0,
                 run_id: int = 1) -> None:
        super().__init__(client_app, num_nodes, wire=wire, seed=seed, run_id=run_id)
        self.speed = speed
        self.clock: Clock = clock if clock is not None else VirtualClock()
        self.time_scale = float(time_scale)
        self._pending: dict[str, tuple[float, int, Message]] = {}
        self._seq = 0
        self.jobs = 0
        """Training messages delivered (key-setup and unmask stages not counted)."""
        self.arrivals: list[tuple[float, int, str]] = []
        """``(arrival time, partition, "train" | stage)`` of every reply pulled, in order."""

    def duration(self, msg: Message) -> float:
        """Simulated seconds from sending ``msg`` to its reply."""
        node = msg.metadata.dst_node_id
        part = int(self.contexts[node].node_config["partition-id"]) if node in self.contexts \
            else -1
        if not _trains(msg):
            return self.speed.latency
        return self.speed.duration(part, _server_round(msg))

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Run each message on its node now; its reply is due ``duration`` later."""
        ids: list[str] = []
        for msg in list(messages):
            sent = self.clock.now()
            due = sent + self.duration(msg) * (1.0 if self.clock.virtual else self.time_scale)
            self.jobs += int(_trains(msg) and msg.metadata.dst_node_id not in self.drop)
            [mid] = list(super().push_messages([msg]))
            ids.append(mid)
            reply = self._replies.pop(mid, None)
            if reply is not None:
                self._seq += 1
                self._pending[mid] = (due, self._seq, reply)
        return ids

    def next_arrival(self, message_ids: Iterable[str]) -> float | None:
        """The earliest arrival time among the pending replies of ``message_ids``."""
        times = [self._pending[m][0] for m in message_ids if m in self._pending]
        return min(times) if times else None

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Replies of ``message_ids`` due by now, in arrival order (each once).

        For a caller that does not know the virtual clock (the synchronous round loop,
        Flower's ``Strategy.start()``), a pull that finds none of its replies due *waits*: the
        virtual clock moves to the earliest pending arrival among ``message_ids``, as a poll
        on a real Grid would return once that reply came. The asynchronous loop uses
        :meth:`pull_due`, which never moves the clock (it has deadlines of its own).
        """
        ids = list(message_ids)
        if isinstance(self.clock, VirtualClock):
            due = [self._pending[m][0] for m in ids if m in self._pending]
            if due and min(due) > self.clock.now():
                self.clock.advance_to(min(due))
        return self.pull_due(ids)

    def pull_due(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Replies of ``message_ids`` that are due by now, in arrival order (each once)."""
        now = self.clock.now()
        due = sorted((self._pending[m][:2], m) for m in set(message_ids)
                     if m in self._pending and self._pending[m][0] <= now)
        out = []
        for (t, _), mid in due:
            _, _, reply = self._pending.pop(mid)
            node = reply.metadata.src_node_id
            part = int(self.contexts[node].node_config["partition-id"]) \
                if node in self.contexts else -1
            self.arrivals.append((t, part, "reply"))
            out.append(reply)
        return out

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Push, then wait (on the grid's clock) for every reply or the timeout, then pull."""
        ids = list(self.push_messages(messages))
        limit = self.clock.now() + (timeout if timeout is not None else math.inf)
        while True:
            last = max((self._pending[m][0] for m in ids if m in self._pending), default=None)
            if last is None:
                break
            target = min(last, limit)
            if isinstance(self.clock, VirtualClock):
                self.clock.advance_to(target)
                break
            if self.clock.now() >= target:
                break
            time.sleep(min(0.01, max(target - self.clock.now(), 0.0)))
        return list(self.pull_due(ids))

    def state(self) -> dict[str, Any]:
        """Pending replies (for debugging): ``{message id: arrival time}``."""
        return {m: v[0] for m, v in self._pending.items()}
