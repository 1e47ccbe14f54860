"""All-reduce algorithms written as schedules.

A :class:`Schedule` is a list of steps; each step is a set of :class:`Transfer` s
``(src, dst, chunk, op)`` with ``op`` in ``{reduce, copy}``. A chunk is a fixed contiguous range
of the flat buffer. Within a step every transfer reads the value its source held at the start
of the step, then the destination adds (``reduce``) or overwrites (``copy``) its own copy of the
chunk. The same schedule is

* executed per rank over a :class:`~fedagg.collectives.communicator.Communicator`
  (:mod:`fedagg.collectives.executor`),
* simulated over an ``[N, D]`` array (:meth:`Schedule.simulate`) for correctness tests,
* counted (bytes and messages per rank) and costed (:mod:`fedagg.collectives.cost`).

This is the representation of MSCCL (Cowan et al., "MSCCLang: Microsoft Collective
Communication Language", ASPLOS 2023), reduced to what intra-site all-reduce needs.

Algorithms
----------
ring
    Reduce-scatter then all-gather, ``2 (N - 1)`` steps, each rank moving ``2 (N-1)/N * D``
    elements (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
    workstations", JPDC 69(2), 2009, section 3).
tree
    Double binary tree: two binary trees, each reducing then broadcasting one half of the
    buffer; a rank that is interior in one tree is a leaf in the other (Sanders, Speck &
    Träff, "Two-tree algorithms for full bandwidth broadcast, reduction and scan", Parallel
    Computing 35(12), 2009; the construction follows NCCL's ``ncclGetDtree``).
hierarchical
    Ranks are split into groups of consecutive ranks ("nodes"). A pipelined ring (chain)
    reduce inside each group to its leader, a double binary tree all-reduce across the group
    leaders, then a pipelined ring (chain) broadcast inside each group.

Pipelining over sub-chunks is done by the executor, which splits every transfer into
segments; it is not spelled out in the schedule.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from fedagg.collectives.transfer import Op, Transfer
from fedagg.collectives.trees import double_binary_tree, merge_steps, tree_steps
from fedagg.errors import ConfigError, explain

__all__ = [
    "SCHEDULED_ALGORITHMS",
    "Schedule",
    "chunk_bounds",
    "default_group_size",
    "get_schedule",
    "hierarchical_schedule",
    "ring_schedule",
    "tree_schedule",
]

SCHEDULED_ALGORITHMS: tuple[str, ...] = ("ring", "tree", "hierarchical")
"""Algorithms that have a schedule (``native`` and ``auto`` do not)."""


@dataclass(frozen=True)
class Schedule:
    """An all-reduce as steps of transfers over fixed chunks of a flat buffer.

    Parameters
    ----------
    algorithm : str
        Name of the algorithm that produced the schedule.
    world_size : int
        Number of ranks ``N``.
    numel : int
        Length ``D`` of the flat buffer, in elements.
    chunks : tuple of (offset, length)
        The chunks transfers refer to; disjoint ranges of ``[0, D)``.
    steps : tuple of tuple of Transfer
        Steps in order. Within a step no rank both sends and receives the same chunk.
    meta : dict
        Algorithm parameters (``group_size``, tree parents, ...), for documentation only.
    cache : dict
        Derived data kept with the schedule (the executor's compiled per-rank plans); not
        part of its value. :func:`get_schedule` returns the same object for the same
        arguments, so a training loop's repeated calls find their plans here.
    """

    algorithm: str
    world_size: int
    numel: int
    chunks: tuple[tuple[int, int], ...]
    steps: tuple[tuple[Transfer, ...], ...]
    meta: dict[str, object] = field(default_factory=dict, compare=False)
    cache: dict[object, object] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        n = self.world_size
        for c, (off, ln) in enumerate(self.chunks):
            if off < 0 or ln < 0 or off + ln > self.numel:
                raise ConfigError(
                    explain(
                        f"schedule.chunks[{c}]",
                        (off, ln),
                        f"must lie in [0, {self.numel})",
                        "fix the schedule generator",
                    )
                )
        for s, step in enumerate(self.steps):
            sent: set[tuple[int, int]] = set()
            received: set[tuple[int, int]] = set()
            for t in step:
                if not (0 <= t.src < n and 0 <= t.dst < n) or t.src == t.dst:
                    raise ConfigError(
                        explain(
                            f"schedule.steps[{s}]",
                            t,
                            f"ranks must be distinct and < {n}",
                            "fix the schedule generator",
                        )
                    )
                if not 0 <= t.chunk < len(self.chunks):
                    raise ConfigError(
                        explain(
                            f"schedule.steps[{s}]",
                            t,
                            "chunk index out of range",
                            "fix the schedule generator",
                        )
                    )
                sent.add((t.src, t.chunk))
                received.add((t.dst, t.chunk))
            if sent & received:
                raise ConfigError(
                    explain(
                        f"schedule.steps[{s}]",
                        sorted(sent & received),
                        "a rank may not send and receive the same chunk in one step",
                        "split the step in two",
                    )
                )

    @property
    def num_steps(self) -> int:
        """Number of steps (the latency term of the cost model)."""
        return len(self.steps)

    def chunk_len(self, chunk: int) -> int:
        """Length of ``chunk`` in elements."""
        return self.chunks[chunk][1]

    def elements_sent(self, rank: int) -> int:
        """Elements ``rank`` sends over the whole schedule."""
        return sum(self.chunk_len(t.chunk) for st in self.steps for t in st if t.src == rank)

    def elements_received(self, rank: int) -> int:
        """Elements ``rank`` receives over the whole schedule."""
        return sum(self.chunk_len(t.chunk) for st in self.steps for t in st if t.dst == rank)

    def messages_sent(self, rank: int) -> int:
        """Non-empty transfers ``rank`` sends (before the executor splits them in segments)."""
        return sum(
            1 for st in self.steps for t in st if t.src == rank and self.chunk_len(t.chunk) > 0
        )

    def program(self, rank: int) -> list[tuple[list[Transfer], list[Transfer]]]:
        """The per-step ``(sends, receives)`` of one rank, in schedule order."""
        out: list[tuple[list[Transfer], list[Transfer]]] = []
        for step in self.steps:
            out.append(([t for t in step if t.src == rank], [t for t in step if t.dst == rank]))
        return out

    def simulate(self, data: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """Run the schedule over an ``[N, D]`` array; row ``r`` is rank ``r``'s buffer.

        Parameters
        ----------
        data : array_like, shape (N, D)
            The input of every rank.

        Returns
        -------
        numpy.ndarray, shape (N, D), float64
            Every rank's buffer after the schedule; each row equals ``data.sum(0)`` for a
            correct all-reduce.
        """
        buf = np.array(data, dtype=np.float64, copy=True)
        if buf.shape != (self.world_size, self.numel):
            raise ConfigError(
                explain(
                    "data.shape",
                    buf.shape,
                    f"must be ({self.world_size}, {self.numel})",
                    "pass one row per rank, each of the schedule's length",
                )
            )
        for step in self.steps:
            snapshot = [
                buf[t.src, off : off + ln].copy()
                for t in step
                for off, ln in (self.chunks[t.chunk],)
            ]
            for t, payload in zip(step, snapshot, strict=True):
                off, ln = self.chunks[t.chunk]
                if t.op is Op.REDUCE:
                    buf[t.dst, off : off + ln] += payload
                else:
                    buf[t.dst, off : off + ln] = payload
        return buf


def _check_sizes(world_size: int, numel: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(
            explain("world_size", world_size, "must be an int >= 1", "pass the number of ranks")
        )
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ConfigError(
            explain("numel", numel, "must be an int >= 0", "pass the flat tensor length")
        )


def chunk_bounds(numel: int, parts: int, offset: int = 0) -> list[tuple[int, int]]:
    """Split ``[offset, offset + numel)`` into ``parts`` near-equal ``(offset, length)`` ranges.

    The first ``numel % parts`` ranges are one element longer; ranges may be empty when
    ``numel < parts``.
    """
    base, extra = divmod(numel, parts)
    out: list[tuple[int, int]] = []
    pos = offset
    for i in range(parts):
        ln = base + (1 if i < extra else 0)
        out.append((pos, ln))
        pos += ln
    return out


def ring_schedule(world_size: int, numel: int) -> Schedule:
    """Ring all-reduce: reduce-scatter then all-gather (Patarasuk & Yuan 2009).

    Rank ``r`` sends to ``r + 1`` and receives from ``r - 1`` (mod ``N``). In reduce-scatter
    step ``s`` it sends chunk ``r - s`` and adds the received chunk ``r - s - 1``; after
    ``N - 1`` steps it holds the full sum of chunk ``r + 1``, which the ``N - 1`` all-gather
    steps copy around the ring.
    """
    _check_sizes(world_size, numel)
    n = world_size
    steps: list[tuple[Transfer, ...]] = []
    for s in range(n - 1):
        steps.append(tuple(Transfer(r, (r + 1) % n, (r - s) % n, Op.REDUCE) for r in range(n)))
    for s in range(n - 1):
        steps.append(tuple(Transfer(r, (r + 1) % n, (r + 1 - s) % n, Op.COPY) for r in range(n)))
    return Schedule("ring", n, numel, tuple(chunk_bounds(numel, n)), tuple(steps))


def tree_schedule(world_size: int, numel: int) -> Schedule:
    """Double binary tree all-reduce; each tree reduces and broadcasts one half of the buffer.

    A node sends its (reduced) half to its parent one step after the last of its children,
    and the root broadcasts back down, so a tree of height ``H`` takes ``2 H`` steps. The
    executor pipelines the halves in segments, giving the pipelined-tree cost
    ``(2 H + S - 1) (alpha + D beta / S)`` (see :mod:`fedagg.collectives.cost`).
    """
    _check_sizes(world_size, numel)
    n = world_size
    chunks = tuple(chunk_bounds(numel, 2))
    first, second = double_binary_tree(n)
    members = list(range(n))
    parts = [tree_steps(first, members, [0], 0), tree_steps(second, members, [1], 0)]
    return Schedule(
        "tree",
        n,
        numel,
        chunks,
        tuple(merge_steps(parts)),
        meta={"parents": (tuple(first), tuple(second))},
    )


def default_group_size(world_size: int) -> int:
    """Default group ("node") size for ``hierarchical``: the integer nearest ``sqrt(N)``."""
    return max(1, round(math.sqrt(world_size)))


def hierarchical_schedule(world_size: int, numel: int, group_size: int | None = None) -> Schedule:
    """Ring (chain) reduce inside groups, double binary tree across leaders, chain broadcast.

    Groups are consecutive ranks ``[g*G, (g+1)*G)``; the last group may be smaller. The group
    leader is its first rank. Inside a group data flows along the chain
    ``last -> ... -> leader`` (reduce) and back (broadcast); pipelined in segments by the
    executor this is NCCL's ring reduce / broadcast.

    Parameters
    ----------
    group_size : int, optional
        Ranks per group; defaults to :func:`default_group_size`.
    """
    _check_sizes(world_size, numel)
    n = world_size
    g = default_group_size(n) if group_size is None else group_size
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ConfigError(
            explain(
                "group_size",
                group_size,
                "must be an int >= 1",
                "pass the number of workers per node, or None",
            )
        )
    g = min(g, n)
    groups = [list(range(s, min(s + g, n))) for s in range(0, n, g)]
    chunks = tuple(chunk_bounds(numel, 2))
    both = [0, 1]
    up: dict[int, list[Transfer]] = {}
    for grp in groups:
        for i in range(len(grp) - 1, 0, -1):
            step = len(grp) - 1 - i
            for c in both:
                up.setdefault(step, []).append(Transfer(grp[i], grp[i - 1], c, Op.REDUCE))
    start = max(len(grp) for grp in groups) - 1
    leaders = [grp[0] for grp in groups]
    first, second = double_binary_tree(len(leaders))
    across = [tree_steps(first, leaders, [0], start), tree_steps(second, leaders, [1], start)]
    start = max((k for p in [up, *across] for k in p), default=-1) + 1
    down: dict[int, list[Transfer]] = {}
    for grp in groups:
        for i in range(len(grp) - 1):
            for c in both:
                down.setdefault(start + i, []).append(Transfer(grp[i], grp[i + 1], c, Op.COPY))
    steps = merge_steps([up, *across, down])
    return Schedule(
        "hierarchical",
        n,
        numel,
        chunks,
        tuple(steps),
        meta={"group_size": g, "groups": tuple(tuple(x) for x in groups)},
    )


@functools.lru_cache(maxsize=256)
def get_schedule(
    algorithm: str, world_size: int, numel: int, *, group_size: int | None = None
) -> Schedule:
    """The schedule of ``algorithm`` (``"ring"``, ``"tree"`` or ``"hierarchical"``).

    Memoized (256 most recent argument tuples): schedules are immutable, and a training loop
    all-reduces the same few bucket sizes every step; the executor's per-rank plans are
    cached on the returned object (:attr:`Schedule.cache`).

    Raises
    ------
    ConfigError
        For an unknown algorithm (``native`` and ``auto`` have no schedule of their own:
        resolve ``auto`` with :func:`fedagg.collectives.cost.choose_algorithm` first).
    """
    if algorithm == "ring":
        return ring_schedule(world_size, numel)
    if algorithm == "tree":
        return tree_schedule(world_size, numel)
    if algorithm == "hierarchical":
        return hierarchical_schedule(world_size, numel, group_size)
    raise ConfigError(
        explain(
            "algorithm",
            algorithm,
            f"has no schedule; known: {list(SCHEDULED_ALGORITHMS)}",
            "pass one of those (resolve 'auto' with choose_algorithm first)",
        )
    )
