"""A secure FedBuff site's held update: kept after each cohort upload, carried at most once.

Under secure FedBuff (docs/protocols/async-secagg.md) a cohort closes at its quorum; a member
that uploads after that is counted as dropped and its masked upload is never unmasked. Rather
than waste its training, the server may ask it, in its next cohort, to upload that update
again under the new cohort's masks (:class:`strategies.wire.CarryRequest`). The site keeps
the dense update of its last upload in ``Context.state`` (:func:`hold`, float32: 4 bytes per
model parameter) and hands it over
(:func:`take`) only when

* the request names the round of the held update,
* the request's proof equals the drop proof the site computed from the mask key of that
  upload (:func:`fedagg.secagg.keys.drop_proof`): only a server that rebuilt the key from
  Shamir shares — that declared the upload dropped, so that its self mask is never revealed —
  can know it, so no update of the site is in two unmasked sums;
* the held update has the model's size;

and forgets it at its next upload request either way, so an update is carried at most once.
The held update never leaves the site in the clear.
"""

from __future__ import annotations

import hmac

import numpy as np
from flwr.app import ConfigRecord, Context
from numpy.typing import NDArray

from fedagg.errors import ProtocolError, explain
from strategies.wire import CarryRequest, arrays_to_record, record_to_arrays

__all__ = ["HELD_ARRAYS", "HELD_CONFIG", "forget", "hold", "take"]

HELD_CONFIG = "fedagg.carry-held"
HELD_ARRAYS = "fedagg.carry-held-delta"


def hold(ctx: Context, server_round: int, values: NDArray[np.float64], weight: float,
         proof: bytes) -> None:
    """Keep the dense update of this round's upload (until the next upload request)."""
    ctx.state[HELD_CONFIG] = ConfigRecord({"round": int(server_round), "weight": float(weight),
                                           "proof": bytes(proof)})
    # float32: 4 bytes per parameter; the rounding (< 1e-7 relative) is below the fixed-point
    # encoding's error bound for values within the clip range
    ctx.state[HELD_ARRAYS] = arrays_to_record([np.asarray(values, np.float32)], ["delta"])


def forget(ctx: Context) -> None:
    """Drop the held update, if any."""
    for key in (HELD_CONFIG, HELD_ARRAYS):
        if key in ctx.state:
            del ctx.state[key]


def take(ctx: Context, request: CarryRequest, dim: int) -> tuple[NDArray[np.float64], float]:
    """``(scale x held update, its weight)`` for a carry request; the held update is forgotten.

    Raises
    ------
    ProtocolError
        No held update, one of another round, a proof that does not match (the server did not
        show that the upload was dropped), or an update of another size.
    """
    held = ctx.state.config_records.get(HELD_CONFIG)
    arrays = ctx.state.array_records.get(HELD_ARRAYS)
    forget(ctx)
    fix = "the server trains this site afresh in its next cohort"
    if held is None or arrays is None:
        raise ProtocolError(explain(f"site {ctx.node_id}: carry of round {request.round}",
                                    "no held update", "a site carries only the update of its "
                                    "last upload, once", fix))
    if held.get("round") != request.round:
        raise ProtocolError(explain(f"site {ctx.node_id}: carry request round", request.round,
                                    f"must name the held update's round {held.get('round')!r}",
                                    fix))
    proof = held.get("proof")
    if not isinstance(proof, bytes) or not hmac.compare_digest(proof, request.proof):
        raise ProtocolError(explain(f"site {ctx.node_id}: carry proof", "<redacted>",
                                    "must be the drop proof of the held upload's mask key (only a "
                                    "server that removed that upload from its cohort has it)",
                                    fix))
    [values] = record_to_arrays(arrays)[1]
    if values.ndim != 1 or values.size != dim:
        raise ProtocolError(explain(f"site {ctx.node_id}: held update size", values.size,
                                    f"must equal the model's {dim} values", fix))
    weight = held.get("weight")
    assert isinstance(weight, float)
    return np.asarray(values, np.float64) * request.scale, weight
