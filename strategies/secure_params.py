"""Pure helpers of the secure strategy: flat vectors, core parameters, the aggregate check.

Split from :mod:`strategies.secure` (which re-exports them) to keep one concept per module.
The secure upward spec (what sparse uploads may be) lives in :class:`fedagg.update.UploadSpec`
(``secure=True``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fedagg.config import SecAggConfig
from fedagg.errors import ConfigError, ProtocolError, explain
from fedagg.secagg import SecAggParams

__all__ = ["check_aggregate", "flatten_arrays", "resolve_params", "unflatten_like"]


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
