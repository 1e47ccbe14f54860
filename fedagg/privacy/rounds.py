"""One secure round's distributed DP parameters, computed alike by the server and the sites.

A round's :class:`~fedagg.privacy.ddg.DdgParams` follow from public inputs only: the run's
budget (epsilon, delta, the rounds it is spread over), the clip, the ring, the round's number
of sites, the survivors the noise is sized for and the model's size. :func:`round_params`
calibrates them (:func:`fedagg.privacy.calibrate.calibrate_ddg`, Kairouz, Liu, Steinke, ICML
2021, Section 5) and remembers the result, so a run calibrates once per distinct round shape
(a second or two), and every site and the server derive the same parameters without sending
them. :func:`rotation_seed` is the round's public rotation seed, bound to the model the round
sent and its number.
"""

from __future__ import annotations

import functools
import hashlib
import math

from fedagg.privacy.calibrate import calibrate_ddg
from fedagg.privacy.ddg import DdgParams

__all__ = ["min_survivors", "rotation_seed", "round_params"]

_SEED_TAG = b"fedagg/privacy/rotation-seed/v1\x00"


@functools.lru_cache(maxsize=64)
def round_params(*, epsilon: float, delta: float, participations: int, clip: float,
                 ring_bits: int, num_sites: int, min_sites: int, dim: int) -> DdgParams:
    """The round's parameters for a run budget of ``(epsilon, delta)`` over
    ``participations`` rounds (cached: the same inputs give the same object).

    Raises
    ------
    ConfigError
        As :func:`fedagg.privacy.calibrate.calibrate_ddg` (e.g. a ring too small for the
        sum: the message names the smallest ``ring_bits`` that works).
    """
    return calibrate_ddg(clip=float(clip), dim=int(dim), num_sites=int(num_sites),
                         min_sites=int(min_sites), ring_bits=int(ring_bits),
                         epsilon=float(epsilon), delta=float(delta),
                         participations=int(participations)).params


def min_survivors(num_sites: int, dropout_fraction: float) -> int:
    """``ceil((1 - f) n)``, at least 1: the survivors each site's noise share is sized for."""
    return max(1, min(int(num_sites), math.ceil((1.0 - float(dropout_fraction))
                                                 * int(num_sites) - 1e-9)))


def rotation_seed(binding: bytes, server_round: int) -> bytes:
    """The public rotation seed of a round: SHA-256 of the round's model binding
    (:func:`fedagg.secagg.keys.round_binding`) and its number (32 bytes)."""
    return hashlib.sha256(_SEED_TAG + bytes(binding)
                          + int(server_round).to_bytes(8, "big", signed=True)).digest()
