"""The Flower wire adapter: fedagg's core objects <-> Flower records, for both sides.

One public module used by the strategies (server) and by the client mod / ClientApp (sites):
nothing else converts between Flower records and fedagg's core objects.

* :mod:`strategies.wire.arrays` — numpy arrays <-> ``ArrayRecord`` (npy headers checked
  before allocation: :func:`safe_numpy`), config dicts <-> ``ConfigRecord``, the serialized
  size of a message (:func:`message_nbytes`);
* :mod:`strategies.wire.upload` — the upload pipeline's records: :class:`Instruction`, the
  previous model, the compressed payload, the previous round's vote sum;
* :mod:`strategies.wire.secagg` — secure-aggregation protocol messages, stages and public
  parameters, Flower node ids <-> small site indices;
* :mod:`strategies.wire.carry` — secure FedBuff's record that lets a late cohort member carry
  its update into a later cohort.
"""

from strategies.wire.arrays import (
    arrays_to_record,
    config_to_record,
    deflated_nbytes,
    message_nbytes,
    messages_nbytes,
    npy_record,
    numpy_array,
    record_to_arrays,
    record_to_config,
    reply_metrics,
    safe_numpy,
)
from strategies.wire.carry import CARRY_KEY, CarryRequest
from strategies.wire.model import FEDAGG_RECORDS, model_digest, model_key
from strategies.wire.privacy import PRIVACY_KEY, PrivacyRequest
from strategies.wire.secagg import (
    ARRAYS_KEY,
    CONFIG_KEY,
    PARAMS_KEY,
    SECAGG_KEYS,
    SECAGG_WIRE,
    STAGES,
    SiteIndex,
    dict_from_records,
    dict_to_records,
    pack,
    params_from_record,
    params_to_record,
    strip,
    unpack,
)
from strategies.wire.upload import (
    INSTRUCTION_KEY,
    PAYLOAD_KEY,
    PREVIOUS_KEY,
    REPLY_KEY,
    UPLOAD_WIRE,
    VOTES_KEY,
    Instruction,
    payload_bytes,
    payload_record,
    votes_from_record,
    votes_record,
)

__all__ = [
    "ARRAYS_KEY",
    "CARRY_KEY",
    "CONFIG_KEY",
    "FEDAGG_RECORDS",
    "INSTRUCTION_KEY",
    "PARAMS_KEY",
    "PAYLOAD_KEY",
    "PREVIOUS_KEY",
    "PRIVACY_KEY",
    "REPLY_KEY",
    "SECAGG_KEYS",
    "SECAGG_WIRE",
    "STAGES",
    "UPLOAD_WIRE",
    "VOTES_KEY",
    "CarryRequest",
    "Instruction",
    "PrivacyRequest",
    "SiteIndex",
    "arrays_to_record",
    "config_to_record",
    "deflated_nbytes",
    "dict_from_records",
    "dict_to_records",
    "message_nbytes",
    "messages_nbytes",
    "model_digest",
    "model_key",
    "npy_record",
    "numpy_array",
    "pack",
    "params_from_record",
    "params_to_record",
    "payload_bytes",
    "payload_record",
    "record_to_arrays",
    "record_to_config",
    "reply_metrics",
    "safe_numpy",
    "strip",
    "unpack",
    "votes_from_record",
    "votes_record",
]
