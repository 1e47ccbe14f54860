"""Module-level (picklable) tasks for the site tests: worker processes import this module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedagg.builtin import BuiltinData
from fedagg.task import SiteData, SiteInfo, StepContext

DATA_CALLS: list[int] = []
"""Partition ids of every ``CountingData`` call in this process."""


@dataclass(frozen=True)
class CountingData:
    """The built-in data, counting how often a site builds it (once per pool, not per round)."""

    inner: BuiltinData

    def __call__(self, site: SiteInfo) -> SiteData:
        DATA_CALLS.append(site.partition_id)
        return self.inner(site)

    def shape(self) -> Any:
        return self.inner.shape()


def raising_step(model: nn.Module, batch: Any, ctx: StepContext) -> torch.Tensor:
    """A user step with a bug on worker 1 at step 2 (redoing the round would raise again)."""
    if ctx.rank == 1 and ctx.step == 2:
        raise ValueError("bug in the user's step")
    x, y = batch
    out: torch.Tensor = nn.functional.cross_entropy(model(x), y)
    return out
