"""The privacy record of a secure round under distributed differential privacy.

When the run has ``privacy.mode = "distributed"`` (docs/privacy.md) every upload request of a
secure round carries ConfigRecord :data:`PRIVACY_KEY`: the public inputs from which server
and sites compute the same distributed discrete Gaussian parameters
(:func:`fedagg.privacy.round_params`, Kairouz, Liu, Steinke, ICML 2021): the run's budget
(``epsilon``, ``delta``, the ``participations`` it is spread over), the clip, the ring, the
round's number of sites and the survivors the noise is sized for, the model's size, and the
round's public rotation seed. Nothing in it depends on any site's data.

A site computes the parameters itself from these inputs, so a server can lower the noise
only by asking for a larger budget in the open; a site refuses a budget above its own
ceiling (:class:`PrivacyRequest`, ``max_epsilon``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flwr.app import ConfigRecord

from fedagg.errors import ProtocolError, explain

__all__ = ["PRIVACY_KEY", "PrivacyRequest"]

PRIVACY_KEY = "fedagg.privacy"
SEED_BYTES = 32
_FIX = "run the same fedagg version on the server and the sites"


@dataclass(frozen=True)
class PrivacyRequest:
    """The public inputs of one round's distributed DP (see the module docstring).

    Attributes
    ----------
    epsilon, delta : float
        The run's budget.
    participations : int
        Rounds the budget is spread over (each site in every round).
    clip : float
        L2 norm each site clips its update to.
    ring_bits : int
        Bits per coordinate of the secure sum.
    num_sites, min_sites : int
        Sites of the round; survivors the noise is sized for.
    dim : int
        The model's size (values of the update).
    seed : bytes
        The round's public rotation seed (32 bytes).
    """

    epsilon: float
    delta: float
    participations: int
    clip: float
    ring_bits: int
    num_sites: int
    min_sites: int
    dim: int
    seed: bytes

    def to_record(self) -> ConfigRecord:
        """The ConfigRecord sent with the upload request."""
        return ConfigRecord({"epsilon": float(self.epsilon), "delta": float(self.delta),
                             "participations": int(self.participations),
                             "clip": float(self.clip), "ring-bits": int(self.ring_bits),
                             "num-sites": int(self.num_sites),
                             "min-sites": int(self.min_sites), "dim": int(self.dim),
                             "seed": bytes(self.seed)})

    @classmethod
    def from_record(cls, rec: ConfigRecord) -> PrivacyRequest:
        """Parse and check a received record.

        Raises
        ------
        ProtocolError
            A missing field, one of the wrong type or outside its range (named).
        """
        def real(name: str, low: float, high: float) -> float:
            v = rec.get(name)
            if (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
                    or not low < v <= high):
                raise ProtocolError(explain(f"{PRIVACY_KEY}.{name}", v,
                                            f"must be a number in ({low:g}, {high:g}]", _FIX))
            return float(v)

        def whole(name: str, low: int, high: int) -> int:
            v = rec.get(name)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise ProtocolError(explain(f"{PRIVACY_KEY}.{name}", v,
                                            f"must be a whole number in [{low}, {high}]", _FIX))
            return int(v)

        seed = rec.get("seed")
        if not isinstance(seed, bytes) or len(seed) != SEED_BYTES:
            raise ProtocolError(explain(f"{PRIVACY_KEY}.seed", type(seed).__name__,
                                        f"must be {SEED_BYTES} bytes", _FIX))
        num_sites = whole("num-sites", 1, 1 << 20)
        return cls(epsilon=real("epsilon", 0.0, 1000.0), delta=real("delta", 0.0, 0.5),
                   participations=whole("participations", 1, 1 << 30),
                   clip=real("clip", 0.0, 1e6), ring_bits=whole("ring-bits", 8, 32),
                   num_sites=num_sites, min_sites=whole("min-sites", 1, num_sites),
                   dim=whole("dim", 1, 1 << 30), seed=seed)
