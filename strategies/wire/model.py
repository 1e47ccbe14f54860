"""Which record of a train message is the model, and the model's digest.

fedagg's own records ride beside the model in a train message (:data:`FEDAGG_RECORDS`); the
model is the ArrayRecord ``"arrays"`` (Flower's name) or the one other ArrayRecord
(:func:`model_key`). :func:`model_digest` is what a secure round binds its masks to; server
and site compute it from the same record.
"""

from __future__ import annotations

import hashlib
import json

from flwr.app import ArrayRecord, RecordDict

from fedagg.errors import ProtocolError, explain
from strategies.wire.carry import CARRY_KEY
from strategies.wire.privacy import PRIVACY_KEY
from strategies.wire.secagg import SECAGG_KEYS
from strategies.wire.upload import INSTRUCTION_KEY, PREVIOUS_KEY, VOTES_KEY

__all__ = ["FEDAGG_RECORDS", "model_digest", "model_key"]

FEDAGG_RECORDS = (INSTRUCTION_KEY, PREVIOUS_KEY, VOTES_KEY, CARRY_KEY, PRIVACY_KEY,
                  *SECAGG_KEYS)
"""Names of fedagg's records in a train message (everything else is the user's)."""


def model_key(content: RecordDict) -> str:
    """The name of the model's ArrayRecord: ``"arrays"``, or the one other ArrayRecord.

    Raises
    ------
    ProtocolError
        No ArrayRecord, or several and none named ``"arrays"``.
    """
    recs = [k for k in content.array_records if k not in FEDAGG_RECORDS]
    if "arrays" in recs:
        return "arrays"
    if len(recs) != 1:
        raise ProtocolError(explain("train message array_records", sorted(recs),
                                    "must hold the global model (one ArrayRecord, e.g. 'arrays')",
                                    "send the model as ArrayRecord 'arrays'"))
    return recs[0]


def model_digest(record: ArrayRecord) -> bytes:
    """SHA-256 of a model record as it travels: every array's name, dtype, shape, serialization
    type and bytes, in the record's order (32 bytes).

    What a secure round binds its masks to (:func:`fedagg.secagg.keys.round_binding`): the
    server computes it from the record it sends, the site from the record it receives.
    """
    h = hashlib.sha256(b"fedagg/model-digest/v1\x00")
    for name, arr in record.items():
        head = json.dumps([str(name), str(arr.dtype), list(arr.shape), str(arr.stype),
                           len(arr.data)], separators=(",", ":")).encode()
        h.update(len(head).to_bytes(4, "big") + head)
        h.update(arr.data)
    return h.digest()
