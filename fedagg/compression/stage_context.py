"""What a compression stage factory gets (:class:`StageContext`), and the usage hints that
its errors name.

A spec's stages (:mod:`fedagg.compression.spec`) are built by factories, built-in, of the
secure sparse modes (:mod:`fedagg.compression.stages`) or of plugins; each takes a
:class:`StageContext` and raises ``ctx.error(rule, fix)`` on bad arguments.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from numpy.typing import NDArray

from fedagg.errors import ConfigError, explain

__all__ = ["FIXES", "StageContext", "StageFactory"]

FIXES: dict[str, str] = {
    "none": "write 'none' alone",
    "topk": "e.g. 'topk:0.01', 'topk:k=1000', 'topk:0.01,global'",
    "randk": "e.g. 'randk:0.01' (private indices) or 'randk:0.01,shared'",
    "shared": "e.g. 'shared:0.01'",
    "block": "e.g. 'block:0.01'",
    "aggtopk": "e.g. 'aggtopk:0.01' or 'aggtopk:0.01,random=0.2'",
    "fp16": "write 'fp16' without arguments",
    "bf16": "write 'bf16' without arguments",
    "int8": "e.g. 'int8', 'int8:256', 'int8:chunk=128,nearest'",
}
"""Stage name -> a usage hint (examples), for error messages; stages add theirs on
registration."""


@dataclass(frozen=True)
class StageContext:
    """What a stage factory gets: its arguments plus the public round context.

    Attributes
    ----------
    spec : str
        The whole spec (for messages).
    part : str
        This stage's text, e.g. ``"topk:0.01,global"``.
    name : str
        The normalized stage name.
    args : tuple of str
        Positional arguments.
    kwargs : dict of str to str
        ``key=value`` arguments.
    seed : bytes or None
        Public seed of the federation (shared supports, seeded random-k).
    round : int or None
        Current round.
    previous_aggregate : ndarray or None
        Previous round's public aggregate, flattened (``aggtopk``).
    """

    spec: str
    part: str
    name: str
    args: tuple[str, ...] = ()
    kwargs: dict[str, str] = field(default_factory=dict)
    seed: bytes | None = None
    round: int | None = None
    previous_aggregate: NDArray[Any] | None = None

    def error(self, rule: str, fix: str) -> ConfigError:
        """A :class:`~fedagg.errors.ConfigError` naming the spec, this part, rule and fix."""
        return ConfigError(explain(f"compression spec {self.spec!r}, part", self.part, rule, fix))

    def fix(self) -> str:
        """A usage hint for this stage (built-in stages show examples)."""
        return FIXES.get(self.name, f"see the documentation of the {self.name!r} stage")

    def expect(self, positional: int, keys: set[str]) -> None:
        """Reject more than ``positional`` positional args or keys outside ``keys``."""
        if len(self.args) > positional:
            raise self.error(f"takes at most {positional} positional argument(s)", self.fix())
        bad = sorted(set(self.kwargs) - keys)
        if bad:
            raise self.error(f"unknown option(s) {bad}; known: {sorted(keys)}", self.fix())

    def number(self, text: str, what: str) -> float:
        """Parse a finite float."""
        try:
            x = float(text)
        except ValueError:
            raise self.error(f"{what} {text!r} is not a number", self.fix()) from None
        if not math.isfinite(x):
            raise self.error(f"{what} must be finite", self.fix())
        return x

    def ratio(self, text: str) -> float:
        """Parse a ratio in [0, 1]."""
        x = self.number(text, "ratio")
        if not 0.0 <= x <= 1.0:
            raise self.error(f"ratio {text} must be in [0, 1]", self.fix())
        return x

    def count(self, text: str, what: str = "k") -> int:
        """Parse a non-negative integer."""
        if not text.isdigit():
            raise self.error(f"{what} {text!r} must be a non-negative integer", self.fix())
        return int(text)

    def public(self) -> tuple[bytes, int]:
        """The public ``(seed, round)``, or a ConfigError when the caller did not pass them."""
        if self.seed is None or self.round is None:
            raise self.error(
                "needs the public seed and round",
                "call build_compressor(spec, seed=<public bytes>, round=<round number>)",
            )
        return self.seed, self.round


StageFactory = Callable[[StageContext], Any]
"""A stage factory: ``StageContext -> Compressor | Quantizer``."""
