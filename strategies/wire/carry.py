"""Secure FedBuff's carry record: a late cohort member's update, re-masked in a later cohort.

The asynchronous loop under secure aggregation (docs/protocols/async-secagg.md, "Late members
carry their update") puts ConfigRecord :data:`CARRY_KEY` on every upload request of a cohort:

* ``{"round": -1}`` (*hold*): train as usual, mask the update for this cohort, and keep the
  dense update (``Delta``, float64) and its example weight in ``Context.state`` until the next
  upload request (:mod:`clients.carry`);
* ``{"round": R, "proof": p, "scale": r}`` (*carry*): do not train; mask ``r x Delta`` of the
  held update of round ``R`` for this cohort. The site does it only if ``p`` equals the
  :func:`~fedagg.secagg.keys.drop_proof` of the mask key its round-``R`` upload used — which
  the server can compute only after rebuilding that key from Shamir shares, i.e. after
  declaring the upload dropped, so the update is never in two unmasked sums — and only once.

``scale`` is the staleness correction ``w(s + delta) / w(s)`` of the carried update (the
cohort's sum is folded with the cohort's own staleness weight ``w(s)``), in ``(0, 1]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flwr.app import ConfigRecord

from fedagg.errors import ProtocolError, explain

__all__ = ["CARRY_KEY", "CarryRequest"]

CARRY_KEY = "fedagg.carry"
PROOF_BYTES = 32


@dataclass(frozen=True, repr=False)
class CarryRequest:
    """What the server asks of a secure cohort member about held updates.

    Attributes
    ----------
    round : int
        ``-1``: train and hold the update; else the ``server-round`` of the held update to
        upload instead of training.
    proof : bytes
        The drop proof of that round's upload (32 bytes; empty when holding).
    scale : float
        Factor applied to the carried update, in ``(0, 1]``.
    """

    round: int = -1
    proof: bytes = b""
    scale: float = 1.0

    def __repr__(self) -> str:  # the proof is not a secret, but it is nobody's business
        return f"CarryRequest(round={self.round}, scale={self.scale:g})"

    @property
    def carries(self) -> bool:
        """Whether the site uploads a held update instead of training."""
        return self.round >= 0

    def to_record(self) -> ConfigRecord:
        """The ConfigRecord sent under :data:`CARRY_KEY`."""
        if not self.carries:
            return ConfigRecord({"round": -1})
        return ConfigRecord({"round": int(self.round), "proof": bytes(self.proof),
                             "scale": float(self.scale)})

    @classmethod
    def from_record(cls, rec: ConfigRecord) -> CarryRequest:
        """Parse and check a received record.

        Raises
        ------
        ProtocolError
            A field of the wrong type or outside its range.
        """
        rnd = rec.get("round")
        if isinstance(rnd, bool) or not isinstance(rnd, int) or rnd < -1:
            raise ProtocolError(explain(f"{CARRY_KEY}.round", rnd, "must be an int >= -1",
                                        "run the same fedagg version on the server and sites"))
        if rnd < 0:
            return cls()
        proof, scale = rec.get("proof"), rec.get("scale")
        if not isinstance(proof, bytes) or len(proof) != PROOF_BYTES:
            raise ProtocolError(explain(f"{CARRY_KEY}.proof", "<redacted>",
                                        f"must be {PROOF_BYTES} bytes",
                                        "run the same fedagg version on the server and sites"))
        if (isinstance(scale, bool) or not isinstance(scale, int | float)
                or not math.isfinite(scale) or not 0.0 < scale <= 1.0):
            raise ProtocolError(explain(f"{CARRY_KEY}.scale", scale, "must be in (0, 1]",
                                        "a carried update is only ever scaled down"))
        return cls(int(rnd), proof, float(scale))
