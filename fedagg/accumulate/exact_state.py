"""The plain-data state of an :class:`~fedagg.accumulate.exact.Accumulator`, and back.

:meth:`Accumulator.state_dict` holds only arrays, ints and strings: the tensor specs, the
limbs (brought to canonical form first), their bounds, the exact weight as numerator and
denominator, and the fold counts; :meth:`Accumulator.from_state_dict` refuses a state of
another version or one whose arrays do not match its specs (:class:`~fedagg.errors.ConfigError`).
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np

from fedagg.accumulate.grid import TensorSpec
from fedagg.errors import ConfigError, explain

if TYPE_CHECKING:
    from fedagg.accumulate.exact import Accumulator

__all__ = ["dump_state", "load_state"]

_STATE_VERSION = 1


def dump_state(acc: Accumulator) -> dict[str, Any]:
    """:meth:`Accumulator.state_dict` of ``acc``."""
    for j in range(len(acc.specs)):
        if acc._hi[j] is not None:
            acc._normalize(j, force=True)
    return {
        "version": _STATE_VERSION,
        "specs": [{"shape": list(s.shape), "dtype": s.dtype, "exponent": s.exponent}
                  for s in acc.specs],
        "lo": [a.copy() for a in acc._lo],
        "hi": [None if a is None else a.copy() for a in acc._hi],
        "bound": [str(b) for b in acc._bound],
        "hbound": [str(b) for b in acc._hbound],
        "weight": [str(acc._weight.numerator), str(acc._weight.denominator)],
        "count": acc._count,
        "folds": acc._folds_abs,
    }


def load_state(cls: type[Accumulator], state: dict[str, Any], *, block: int) -> Accumulator:
    """:meth:`Accumulator.from_state_dict`: an accumulator of class ``cls`` from ``state``."""
    if state.get("version") != _STATE_VERSION:
        raise ConfigError(explain("accumulator state.version", state.get("version"),
                                  f"must be {_STATE_VERSION}",
                                  "restore a state written by this fedagg version"))
    try:
        specs = [TensorSpec(tuple(int(d) for d in s["shape"]), str(s["dtype"]),
                            int(s["exponent"])) for s in state["specs"]]
        acc = cls(specs, block=block)
        for j, spec in enumerate(specs):
            lo = np.asarray(state["lo"][j])
            hi = state["hi"][j]
            if lo.dtype != np.int64 or lo.shape != (spec.size,) or (
                    hi is not None and (np.asarray(hi).dtype != np.int64
                                        or np.asarray(hi).shape != (spec.size,))):
                raise ValueError(f"limbs of tensor {j} do not match {spec}")
            acc._lo[j] = lo.copy()
            acc._hi[j] = None if hi is None else np.asarray(hi).copy()
            acc._bound[j] = int(state["bound"][j])
            acc._hbound[j] = int(state["hbound"][j])
        acc._weight = Fraction(int(state["weight"][0]), int(state["weight"][1]))
        acc._count = int(state["count"])
        acc._folds_abs = int(state["folds"])
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ConfigError(explain("accumulator state", type(exc).__name__,
                                  f"is not a valid state ({exc})",
                                  "restore an intact state_dict")) from None
    return acc
