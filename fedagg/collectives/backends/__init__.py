"""Communicator backends: in-process (threads + queues) and torch.distributed (gloo / NCCL).

:mod:`~fedagg.collectives.backends.torch_dist` is imported lazily (it is the only module that
imports torch.distributed).
"""

from __future__ import annotations

from fedagg.collectives.backends.inprocess import (
    InProcessCommunicator,
    InProcessGroup,
    run_inprocess,
)

__all__ = ["InProcessCommunicator", "InProcessGroup", "run_inprocess"]
