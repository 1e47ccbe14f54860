"""Injected faults (``[faults]`` of the run config): crash or delay a site, for tests and drills.

Stages: ``"train"`` (in the train handler), ``"upload"`` (after training, before masking: a
secure site drops before uploading) and ``"unmask"`` (a secure site uploaded and drops before
revealing its shares: it is still counted).
"""

from __future__ import annotations

import logging
import time

from clients.settings import SiteSettings
from clients.worker import WorkerFault

__all__ = ["inject_faults", "worker_fault"]

_log = logging.getLogger(__name__)


def inject_faults(s: SiteSettings, stage: str) -> None:
    """Apply ``[faults]``: sleep or raise at ``stage`` when this site and round are named."""
    f = s.cfg.faults
    if f.slow_site == s.partition_id and f.slow_round == s.server_round and stage == "train":
        _log.warning("%s: injected delay of %.1f s (faults.slow_site)", s.name, f.slow_seconds)
        time.sleep(f.slow_seconds)
    if f.crash_site == s.partition_id and f.crash_round == s.server_round and f.crash_stage == stage:
        raise RuntimeError(f"{s.name}: injected crash at stage {stage!r} in round {s.server_round} "
                           "(faults.crash_site)")


def worker_fault(s: SiteSettings) -> WorkerFault | None:
    """The worker fault (``kill_worker`` / ``hang_worker``) of this site and round, if any."""
    f = s.cfg.faults
    if f.worker_fault_site != s.partition_id or f.worker_fault_round != s.server_round:
        return None
    if f.kill_worker is not None:
        return WorkerFault("kill", f.kill_worker, f.worker_fault_step)
    if f.hang_worker is not None:
        return WorkerFault("hang", f.hang_worker, f.worker_fault_step)
    return None
