"""Alpha-beta(-gamma) cost model of the all-reduce schedules, and the ``auto`` choice.

The model is the one of Thakur, Rabenseifner & Gropp, "Optimization of collective
communication operations in MPICH", IJHPCA 19(1), 2005, section 4: sending ``m`` bytes costs
``alpha + m beta``, reducing ``m`` bytes costs ``m gamma``. With ``N`` ranks, ``D`` bytes and
``S`` pipelining segments per chunk:

* ring: ``2 (N-1) (alpha + D/N beta) + (N-1) D/N gamma`` (Patarasuk & Yuan 2009);
* tree (pipelined double binary tree of height ``H``, each tree carrying ``D/2`` in ``S``
  segments): ``(2H + S - 1) (alpha + 2 D/S beta) + D gamma``. In the steady state a rank
  sends four segments of ``D / 2S`` per pipeline step (up and down in the tree where it is
  interior, up in the one where it is a leaf), so this tends to ``2 H alpha + 2 D beta``
  (DESIGN.md section 4) -- fewer latency terms than the ring's ``2 (N-1) alpha`` but more
  bandwidth than its ``2 (N-1)/N D beta``;
* hierarchical (chain depth ``g - 1`` in groups of ``g``, tree across ``L`` leaders), the
  same pipeline over all its steps: ``(2 (g-1) + 2 H_L + S - 1) (alpha + 2 D/S beta) +
  D gamma``.

With ``N = 2`` all three schedules are the same exchange (two steps of ``D/2`` each way per
rank), and :func:`predict` uses the ring formula for all of them.

Ranks that share one host also share its aggregate copy rate (loopback TCP is memory copies
done by the CPUs, and with more ranks than cores the ranks queue for them). The max-rate
model of Gropp, Olson & Samfass, "Modeling MPI communication performance on SMP nodes: is it
time to retire the ping pong test", EuroMPI 2016, adds that limit: ``k`` processes that
communicate at once get at most ``R_N / k`` each. Every schedule here moves ``2 (N-1) D``
bytes in total, so with ``beta_node = 1 / R_N`` each algorithm also takes at least
``steps * alpha + 2 (N-1) D beta_node`` and :func:`predict` returns the larger of the two
terms (plus the reduction). When the node limit binds, all schedules cost the same bandwidth
and the one with fewer steps wins -- which is what an oversubscribed host measures.

``alpha``, ``beta`` and ``gamma`` are calibrated by :func:`calibrate` (by default one ring
step with every rank active, the slowest rank kept; or a ping-pong between ranks 0 and 1;
gamma from a local add) or fitted from measurements with :func:`fit_alpha_beta`.
``algorithm="auto"`` picks the scheduled algorithm with the smallest predicted time.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from fedagg.collectives.communicator import Communicator, sendrecv
from fedagg.collectives.plan import DEFAULT_SEGMENT_BYTES, MAX_SEGMENTS
from fedagg.collectives.schedule import SCHEDULED_ALGORITHMS, get_schedule
from fedagg.errors import ConfigError, explain

__all__ = [
    "CALIBRATION_METHODS",
    "CostModel",
    "calibrate",
    "choose_algorithm",
    "fit_alpha_beta",
    "get_default_cost_model",
    "predict",
    "set_default_cost_model",
]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CostModel:
    """Machine parameters of the alpha-beta-gamma model.

    Parameters
    ----------
    alpha : float
        Seconds of latency per message.
    beta : float
        Seconds per byte on the wire (1 / bandwidth).
    gamma : float
        Seconds per byte reduced.
    segment_bytes : int
        Pipelining segment size the executor uses (sets ``S``).
    beta_node : float
        Seconds per byte moved by all ranks together (the node's aggregate rate, shared by
        every rank that communicates at the same time); ``0`` for no shared limit. See
        :func:`predict`.
    """

    alpha: float = 60e-6
    beta: float = 1.0 / 2e9
    gamma: float = 1.0 / 4e9
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    beta_node: float = 0.0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma", "beta_node"):
            value = getattr(self, name)
            if not (isinstance(value, float | int) and math.isfinite(value) and value >= 0):
                raise ConfigError(
                    explain(
                        f"CostModel.{name}",
                        value,
                        "must be a finite float >= 0",
                        "calibrate() or pass a measured value",
                    )
                )
        if self.segment_bytes < 1:
            raise ConfigError(
                explain(
                    "CostModel.segment_bytes",
                    self.segment_bytes,
                    "must be >= 1",
                    "pass e.g. 1 << 20",
                )
            )


_default = CostModel()


def get_default_cost_model() -> CostModel:
    """The model ``auto`` uses when none is passed."""
    return _default


def set_default_cost_model(model: CostModel) -> None:
    """Replace the process-wide default model (e.g. with one from :func:`calibrate`).

    Every rank must use the same model, or ``auto`` may pick different algorithms on
    different ranks (``all_reduce`` detects that and raises CollectiveError).
    """
    global _default
    _default = model


def _segments(nbytes: float, seg: int) -> int:
    return min(MAX_SEGMENTS, max(1, math.ceil(nbytes / seg)))


def predict(
    algorithm: str,
    world_size: int,
    nbytes: int,
    *,
    model: CostModel | None = None,
    group_size: int | None = None,
) -> float:
    """Predicted seconds of one all-reduce of ``nbytes`` bytes over ``world_size`` ranks.

    Parameters
    ----------
    algorithm : str
        ``"ring"``, ``"tree"`` or ``"hierarchical"``.
    world_size : int
        Number of ranks ``N``.
    nbytes : int
        Tensor size ``D`` in bytes (on the wire).
    model : CostModel, optional
        Defaults to :func:`get_default_cost_model`.
    group_size : int, optional
        Group size of ``hierarchical``.
    """
    m = _default if model is None else model
    sched = get_schedule(algorithm, world_size, 0, group_size=group_size)
    n, d = world_size, float(nbytes)
    if n == 1 or nbytes == 0:
        return 0.0
    if algorithm == "ring" or n == 2:
        # with two ranks the double binary tree and the hierarchical schedule are the ring's
        # exchange (2 steps, D/2 each way per rank): the ring formula is exact for all three
        link = 2 * (n - 1) * (m.alpha + d / n * m.beta)
        reduce = (n - 1) * d / n * m.gamma
    else:
        segs = _segments(d / 2, m.segment_bytes)
        link = (sched.num_steps + segs - 1) * (m.alpha + 2 * d / segs * m.beta)
        reduce = d * m.gamma
    # Max-rate term: every schedule here moves 2 (N-1) D bytes in total over all ranks
    # (each element is reduced into N-1 ranks' copies and copied to N-1 ranks); when the
    # ranks share the node's aggregate rate, that volume bounds the time from below.
    node = sched.num_steps * m.alpha + 2 * (n - 1) * d * m.beta_node
    return max(link, node) + reduce


def choose_algorithm(
    world_size: int,
    nbytes: int,
    *,
    model: CostModel | None = None,
    group_size: int | None = None,
) -> str:
    """The scheduled algorithm with the smallest :func:`predict` (ties: ring, tree, hier.)."""
    best = min(
        SCHEDULED_ALGORITHMS,
        key=lambda a: predict(a, world_size, nbytes, model=model, group_size=group_size),
    )
    return best


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of ``t = alpha + size * beta``, clamped to non-negative values.

    Parameters
    ----------
    sizes : sequence of float
        Message sizes in bytes (at least two distinct values).
    seconds : sequence of float
        Measured one-way times.
    """
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ConfigError(
            explain(
                "sizes",
                list(sizes),
                "need >= 2 distinct sizes, one time each",
                "measure at least a small and a large message",
            )
        )
    k = len(sizes)
    mx = sum(sizes) / k
    my = sum(seconds) / k
    sxx = sum((x - mx) ** 2 for x in sizes)
    sxy = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds, strict=True))
    beta = max(sxy / sxx, 0.0)
    alpha = max(my - beta * mx, 0.0)
    return alpha, beta


def _measure_gamma(nbytes: int = 1 << 22, repeats: int = 5) -> float:
    a = torch.ones(nbytes // 4)
    b = torch.ones(nbytes // 4)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.add_(b)
        best = min(best, time.perf_counter() - t0)
    return best / nbytes


CALIBRATION_METHODS: tuple[str, ...] = ("concurrent", "pingpong")
"""How :func:`calibrate` measures alpha and beta."""


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _time_pingpong(comm: Communicator, sizes: Sequence[int], repeats: int) -> list[float]:
    """Median one-way time per size of a ping-pong between ranks 0 and 1 (others idle)."""
    rank = comm.rank
    times: list[float] = []
    if rank not in (0, 1):
        return times
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32)
        samples: list[float] = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            if rank == 0:
                sendrecv(comm, buf, 1, None, None)
                sendrecv(comm, None, None, buf, 1)
            else:
                sendrecv(comm, None, None, buf, 0)
                sendrecv(comm, buf, 0, None, None)
            samples.append((time.perf_counter() - t0) / 2)
        times.append(_median(samples[1:]))
    return times


def _time_concurrent(comm: Communicator, sizes: Sequence[int], repeats: int) -> list[float]:
    """Time per size of one ring step with every rank active, max over ranks (rank 0 only).

    Every rank sends ``size`` bytes to ``rank + 1`` while it receives ``size`` bytes from
    ``rank - 1`` -- the step of a ring, and the load every schedule step puts on the ranks
    and the machine (all processes busy at once, as in the algorithms themselves). The
    per-rank median over ``repeats`` is gathered on rank 0, which keeps the slowest rank.
    """
    rank, n = comm.rank, comm.world_size
    right, left = (rank + 1) % n, (rank - 1) % n
    mine = torch.zeros(len(sizes), dtype=torch.float64)
    for i, size in enumerate(sizes):
        out = torch.zeros(max(1, size // 4), dtype=torch.float32)
        inc = torch.empty_like(out)
        comm.barrier()
        samples: list[float] = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            sendrecv(comm, out, right, inc, left)
            samples.append(time.perf_counter() - t0)
        mine[i] = _median(samples[1:])
    if rank != 0:
        for req in comm.exchange([(mine, 0)], []):
            req.wait()
        return []
    bufs = [torch.empty_like(mine) for _ in range(1, n)]
    for req in comm.exchange([], [(b, r) for r, b in enumerate(bufs, start=1)]):
        req.wait()
    return torch.stack([mine, *bufs]).amax(0).tolist()


def calibrate(
    comm: Communicator,
    *,
    sizes: Sequence[int] = (8, 1 << 16, 1 << 20, 1 << 22),
    repeats: int = 5,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    method: str = "concurrent",
) -> CostModel:
    """Measure alpha, beta and gamma on this machine; the same model is returned on all ranks.

    Every rank must call it. Rank 0 fits :func:`fit_alpha_beta` to the measured times
    and sends the model to the other ranks.

    Parameters
    ----------
    comm : Communicator
        Transport to calibrate.
    sizes : sequence of int
        Message sizes in bytes (at least two distinct).
    repeats : int
        Timed repeats per size (after one warm-up); the median is kept.
    segment_bytes : int
        Segment size stored in the model (the executor's pipelining segment).
    method : {"concurrent", "pingpong"}
        ``pingpong``: ranks 0 and 1 ping-pong while the others idle and ``alpha``, ``beta``
        are fitted to the one-way times (the textbook measurement; ``beta_node = 0``).
        ``concurrent`` (default): ``beta`` (one link) as with ``pingpong``, then every rank
        exchanges with its ring neighbours at once -- what a schedule step meets with all
        ranks active and competing for the cores -- and the slowest rank's time per step
        gives ``alpha`` (intercept) and ``beta_node`` (slope / N, since all N ranks moved
        the size in each step; the max-rate model, see the module docstring).
    """
    if method not in CALIBRATION_METHODS:
        raise ConfigError(
            explain(
                "method", method, f"must be one of {list(CALIBRATION_METHODS)}", "pick one of those"
            )
        )
    rank, n = comm.rank, comm.world_size
    params = torch.zeros(4, dtype=torch.float64)
    if rank == 0:
        params[2] = _measure_gamma()
    if n >= 2:
        xs = [float(max(4, s)) for s in sizes]
        pingpong = _time_pingpong(comm, sizes, repeats)
        if rank == 0:
            params[0], params[1] = fit_alpha_beta(xs, pingpong)
        if method == "concurrent":
            concurrent = _time_concurrent(comm, sizes, repeats)
            if rank == 0:
                alpha, slope = fit_alpha_beta(xs, concurrent)
                # each of the N ranks moved the size in every step: slope = N * beta_node
                params[0], params[3] = alpha, slope / n
        if rank == 0:
            reqs = comm.exchange([(params, r) for r in range(1, n)], [])
        else:
            reqs = comm.exchange([], [(params, 0)])
        for req in reqs:
            req.wait()
    base = CostModel(segment_bytes=segment_bytes)
    if n < 2:
        return replace(base, gamma=float(params[2]))
    model = CostModel(
        float(params[0]), float(params[1]), float(params[2]), segment_bytes, float(params[3])
    )
    _log.info("calibrated cost model (%s): %s", method, model)
    return model
