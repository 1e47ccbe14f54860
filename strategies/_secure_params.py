"""Pure helpers of the secure strategy: flat vectors, the secure upward spec, core parameters.

Split from :mod:`strategies.secure` (which re-exports them) to keep one concept per module.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from fedagg.config import SecAggConfig
from fedagg.errors import ConfigError, ProtocolError, explain
from fedagg.secagg import SecAggParams
from strategies._compression import effective_spec, stage_names

__all__ = ["Exchange", "check_aggregate", "flatten_arrays", "resolve_params", "secure_spec",
           "unflatten_like"]


def flatten_arrays(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenate arrays into one flat float64 vector (the order of ``arrays``)."""
    if not arrays:
        return np.zeros(0, np.float64)
    return np.concatenate([np.asarray(a, np.float64).reshape(-1) for a in arrays])


def unflatten_like(flat: np.ndarray, like: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Split ``flat`` into arrays of the shapes of ``like`` (float64)."""
    total = sum(int(np.asarray(a).size) for a in like)
    if flat.size != total:
        raise ProtocolError(explain("aggregate size", flat.size, f"must be {total}",
                                    "send updates of the global model's size"))
    out, pos = [], 0
    for a in like:
        n = int(np.asarray(a).size)
        out.append(np.asarray(flat[pos:pos + n], np.float64).reshape(np.shape(a)))
        pos += n
    return out


_PUBLIC_STAGES = ("shared", "block", "aggtopk")


def secure_spec(up: str, support: str) -> str:
    """The upward spec the sites run under secure aggregation (``"none"``: dense).

    Masks cancel only on coordinates that every site sends, so a sparse secure upload must
    use a support derived from public information: ``compression.support`` = ``random``,
    ``block`` or ``topk-aggregate`` (or a ``shared`` / ``block`` / ``aggtopk`` stage written
    out). Allowed stages: that one sparsifier and ``ef``. The values are encoded to fixed point
    in the ring ``Z_2^b`` for masking (``secagg.ring_bits`` / ``secagg.precision``; ``b <= 32``
    bits per value on the wire), so a quantizer stage (``int8``, ``fp16``, ``bf16``) is refused.

    Raises
    ------
    ConfigError
        Own-index sparsifiers (``topk`` / ``randk`` with ``support = "own"``): per-site indices
        cannot be masked and would reveal which coordinates mattered to each site; quantizers;
        anything but the stages above.

    Examples
    --------
    >>> secure_spec("topk:0.01+ef", "random")
    'shared:0.01+ef'
    """
    spec = effective_spec(up, support)
    if spec == "none":
        return spec
    names = stage_names(spec)
    own = [n for n in names if n in ("topk", "randk")]
    if own:
        raise ConfigError(explain(
            "compression.support", support,
            f"'{own[0]}' chooses indices per site; under secure aggregation they cannot be "
            "masked (masks cancel only on a support all sites share) and sending them would "
            "reveal which coordinates mattered to each site",
            f"set compression.support = 'random', 'block' or 'topk-aggregate' (public supports)"
            f" with compression.up = {up!r}, or use strategy.name = 'compressed' if revealing "
            "per-site indices is acceptable"))
    quant = [n for n in names if n in ("int8", "fp16", "bf16")]
    if quant:
        raise ConfigError(explain(
            "compression.up", up,
            f"the quantizer '{quant[0]}' is meaningless under secure aggregation: masked values "
            "are fixed point in a ring of at most 32 bits (secagg.precision / secagg.ring_bits "
            "set the width and precision), so it would only add error; secure "
            "uploads are dense or sparse on a public support",
            "drop the quantizer stage, e.g. compression.up = 'topk:0.01+ef' with "
            "compression.support = 'random'"))
    other = [n for n in names if n not in (*_PUBLIC_STAGES, "ef")]
    if other or not any(n in _PUBLIC_STAGES for n in names):
        raise ConfigError(explain(
            "compression.up", up,
            "secure aggregation accepts one public-support sparsifier (a topk / randk amount "
            "with compression.support = random | block | topk-aggregate) plus optional 'ef'",
            "e.g. compression.up = 'topk:0.01+ef' with compression.support = 'random'"))
    return spec


def resolve_params(sec: SecAggConfig, num_sites: int, *, upload_timeout: float = 600.0
                   ) -> SecAggParams:
    """Core parameters for ``num_sites`` sites: resolves ``k`` and ``t``, checks headroom.

    Raises
    ------
    ConfigError
        The combination cannot work (fewer than 2 sites, ``t > k``, no fixed-point headroom);
        the message names the setting to change.
    """
    if num_sites < 2:
        raise ConfigError(explain("sites per round", num_sites,
                                  "secure aggregation needs at least 2 sites in a round",
                                  "raise run.sites or run.fraction_train"))
    k = SecAggParams(threshold=1, num_neighbours=sec.neighbours).neighbours_for(num_sites)
    t = sec.resolve_threshold(k)
    params = SecAggParams(threshold=t, num_neighbours=sec.neighbours, clip=sec.clip,
                          frac_bits=sec.frac_bits, ring_bits=sec.ring_bits,
                          precision=sec.precision, weight_scale=sec.weight_scale,
                          setup_timeout_s=sec.timeout, upload_timeout_s=upload_timeout,
                          unmask_timeout_s=sec.timeout)
    params.neighbours_for(num_sites)
    params.encoding_for(num_sites)
    return params


@dataclass
class Exchange:
    """Bookkeeping of one secure round (bytes, exchanges, seconds, outcomes)."""

    bytes_down: int = 0
    bytes_up: int = 0
    exchanges: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    up: dict[str, int] = field(default_factory=dict)  # bytes up per phase
    failed: dict[int, str] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)

    def tick(self, phase: str, t0: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - t0
        return now


def check_aggregate(mean: np.ndarray, *, max_norm: float | None, clip: float | None) -> str:
    """Reason to refuse an unmasked mean delta ('' when it is fine): finite, norm, range."""
    flat = np.asarray(mean, np.float64).reshape(-1)
    norm = math.sqrt(float(np.dot(flat, flat))) if flat.size else 0.0  # no D-sized temporaries
    if not math.isfinite(norm) and not bool(np.isfinite(flat).all()):
        return "the unmasked aggregate is not finite"
    if max_norm is not None and norm > max_norm:
        return f"aggregate delta norm {norm:.3g} > strategy.max_update_norm={max_norm}"
    if clip is not None and flat.size and max(float(flat.max()), -float(flat.min())) > clip + 1:
        return "aggregate outside the clip range (corrupted masks?)"
    return ""
