"""The unit of a schedule: one transfer of one chunk, reduced or copied at the destination."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Op", "Transfer"]


class Op(enum.Enum):
    """What the destination does with a received chunk."""

    REDUCE = "reduce"
    COPY = "copy"


@dataclass(frozen=True)
class Transfer:
    """One message: ``src`` sends its copy of ``chunk`` to ``dst``, which applies ``op``."""

    src: int
    dst: int
    chunk: int
    op: Op
