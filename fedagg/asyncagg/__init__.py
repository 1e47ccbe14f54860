"""Asynchronous and semi-asynchronous aggregation, Flower-free: the math and the state.

FedBuff (Nguyen et al., AISTATS 2022, "Federated Learning with Buffered Asynchronous
Aggregation", Algorithm 1) and deadline rounds, as plain objects the server loop
(``server/asynchronous.py``) drives over Flower's Grid push / pull:

* :class:`StalenessWeight` — ``w(s)``: constant, polynomial ``(1 + s)^-a``, hinge;
* :class:`UpdateBuffer` — the running, staleness-weighted sum of deltas and its mean;
* :class:`AsyncServerState` — versions, buffer, server optimizer, in-flight dispatches,
  secure cohorts and federated evaluations, with ``state_dict()`` for checkpoints;
* :class:`GuardWindow` — the median-relative guards (norm bombs, weight caps) decided on
  arrival against the last accepted updates;
* :class:`SpeedModel` — seeded per-site durations (fixed factors, lognormal delays);
* :class:`VirtualClock` / :class:`WallClock` — simulated or real time.

See docs/asynchronous.md.
"""

from fedagg.asyncagg.buffer import BufferEntry, BufferResult, UpdateBuffer, Weighting
from fedagg.asyncagg.clock import Clock, VirtualClock, WallClock
from fedagg.asyncagg.guards import DEFAULT_GUARD_WINDOW, GuardWindow, Verdict
from fedagg.asyncagg.speed import SpeedModel
from fedagg.asyncagg.staleness import STALENESS_KINDS, StalenessKind, StalenessWeight
from fedagg.asyncagg.state import Applied, AsyncServerState, Cohort, Evaluation, Job

__all__ = [
    "DEFAULT_GUARD_WINDOW",
    "STALENESS_KINDS",
    "Applied",
    "AsyncServerState",
    "BufferEntry",
    "BufferResult",
    "Clock",
    "Cohort",
    "Evaluation",
    "GuardWindow",
    "Job",
    "SpeedModel",
    "StalenessKind",
    "StalenessWeight",
    "UpdateBuffer",
    "Verdict",
    "VirtualClock",
    "WallClock",
    "Weighting",
]
