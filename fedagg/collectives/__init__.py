"""Intra-site collectives: all-reduce as schedules over a small Communicator seam.

Flower-free. See ``docs/architecture/collectives.md`` for the design.

Public API
----------
all_reduce(tensor, *, algorithm="auto", op="sum", comm=None, ...)
    Reduce in place across ranks and return the tensor.
get_schedule(algorithm, world_size, numel) / predict(algorithm, world_size, nbytes)
    The schedule of an algorithm and its predicted time under the cost model.
Communicator, InProcessGroup, run_inprocess, TorchDistCommunicator (lazy)
    Transports.
"""

from __future__ import annotations

from typing import Any

from fedagg.collectives.api import ALGORITHMS, OPS, all_reduce, last_stats
from fedagg.collectives.backends.inprocess import (
    InProcessCommunicator,
    InProcessGroup,
    run_inprocess,
)
from fedagg.collectives.communicator import DEFAULT_TIMEOUT_S, Communicator, Request, sendrecv
from fedagg.collectives.cost import (
    CostModel,
    calibrate,
    choose_algorithm,
    fit_alpha_beta,
    get_default_cost_model,
    predict,
    set_default_cost_model,
)
from fedagg.collectives.executor import CollectiveStats, execute
from fedagg.collectives.schedule import Schedule, get_schedule
from fedagg.collectives.transfer import Op, Transfer

__all__ = [
    "ALGORITHMS",
    "DEFAULT_TIMEOUT_S",
    "OPS",
    "CollectiveStats",
    "Communicator",
    "CostModel",
    "InProcessCommunicator",
    "InProcessGroup",
    "Op",
    "Request",
    "Schedule",
    "TorchDistCommunicator",
    "Transfer",
    "all_reduce",
    "calibrate",
    "choose_algorithm",
    "execute",
    "fit_alpha_beta",
    "get_default_cost_model",
    "get_schedule",
    "last_stats",
    "predict",
    "run_inprocess",
    "sendrecv",
    "set_default_cost_model",
]


def __getattr__(name: str) -> Any:
    if name == "TorchDistCommunicator":
        from fedagg.collectives.backends.torch_dist import TorchDistCommunicator

        return TorchDistCommunicator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
