"""The upload pipeline's records: the server's instruction, the previous model, the payload.

A train message of a compressed or secure-sparse round carries, besides the model (ArrayRecord
``"arrays"``) and the config (ConfigRecord ``"config"``):

* ConfigRecord :data:`INSTRUCTION_KEY` (:class:`Instruction`): the effective upward spec, the
  downward codec and which arrays it encoded, the public seed and round, the round of the
  previous global model (``topk-aggregate`` supports), the site-state namespace and the
  :data:`UPLOAD_WIRE` version. The site acts only when it is present: the server decides;
* optionally ArrayRecord :data:`PREVIOUS_KEY`: the previous round's global model as sent, for
  a site that did not take part in that round;
* for secure index voting (``vote``), ArrayRecord :data:`VOTES_KEY`: the summed vote table
  of round ``Instruction.votes_round`` (public: what the server unmasked), from which the
  site derives this round's support (:func:`votes_record` / :func:`votes_from_record`).

A compressed reply carries ArrayRecord :data:`REPLY_KEY` with one uint8 array
:data:`PAYLOAD_KEY` (the :func:`fedagg.compression.codec.encode` bytes) next to the usual
MetricRecord, and no dense arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord

from fedagg.errors import CodecError, ProtocolError, UpdateRejected, explain
from strategies.wire.arrays import safe_numpy

__all__ = [
    "INSTRUCTION_KEY",
    "PAYLOAD_KEY",
    "PREVIOUS_KEY",
    "REPLY_KEY",
    "UPLOAD_WIRE",
    "VOTES_KEY",
    "Instruction",
    "payload_bytes",
    "payload_record",
    "votes_from_record",
    "votes_record",
]

INSTRUCTION_KEY = "fedagg.compression"
"""ConfigRecord key of the server's upload instruction in a train message."""
PREVIOUS_KEY = "fedagg.previous-global"
"""ArrayRecord key of the previous global model (as sent), only for sites that lack it."""
REPLY_KEY = "compressed"
"""ArrayRecord key of the compressed update in a reply."""
PAYLOAD_KEY = "payload"
"""Array key (uint8) of the encoded payload inside :data:`REPLY_KEY`."""
VOTES_KEY = "fedagg.votes"
"""ArrayRecord key of the previous round's summed vote table (``vote`` specs)."""
UPLOAD_WIRE = 2
"""Version of the instruction record (1: fedagg 0.1, no ``wire`` field; refused)."""


@dataclass(frozen=True)
class Instruction:
    """What the server asks a site to do with its update in one round.

    Attributes
    ----------
    up : str
        Effective upward spec (:attr:`fedagg.update.UploadSpec.up`).
    down : str
        Downward codec of the global model: ``none``, ``fp16`` or ``bf16``.
    down_encoded : list of int
        Indices of the arrays that were encoded downward.
    run_seed : int
        ``run.seed``, from which the public seed of supports is derived.
    server_round : int
        The round.
    previous_round : int
        Round of the previous global model the server sent (``-1``: none).
    namespace : str
        Suffix of the site's ``Context.state`` keys (several strategies in one run).
    support : str
        ``compression.support`` (informational; :attr:`up` already reflects it).
    votes_round : int
        Round whose summed vote table travels in :data:`VOTES_KEY` (``-1``: none; the site
        then uses the seeded random support).
    """

    up: str
    down: str = "none"
    down_encoded: list[int] = field(default_factory=list)
    run_seed: int = 0
    server_round: int = 0
    previous_round: int = -1
    namespace: str = ""
    support: str = "reveal-indices"
    votes_round: int = -1

    def to_record(self) -> ConfigRecord:
        """As a ConfigRecord."""
        rec = ConfigRecord({"wire": UPLOAD_WIRE, "up": self.up, "down": self.down,
                            "down-encoded": [int(i) for i in self.down_encoded],
                            "run-seed": int(self.run_seed), "server-round": int(self.server_round),
                            "previous-round": int(self.previous_round),
                            "namespace": self.namespace, "support": self.support})
        if self.votes_round >= 0:  # only voting rounds carry it (older sites never see it)
            rec["votes-round"] = int(self.votes_round)
        return rec

    @classmethod
    def from_record(cls, rec: ConfigRecord) -> Instruction:
        """Parse and check a ConfigRecord written by :meth:`to_record`.

        Raises
        ------
        ProtocolError
            Another wire version, or a missing or mistyped field.
        """
        wire = rec.get("wire", 1)
        if wire != UPLOAD_WIRE:
            raise ProtocolError(explain(f"{INSTRUCTION_KEY}.wire", wire,
                                        f"this site speaks upload wire version {UPLOAD_WIRE}",
                                        "run the same fedagg version on the server and the sites"))

        def get(key: str, typ: type | tuple[type, ...]) -> Any:
            value = rec.get(key)
            if not isinstance(value, typ) or isinstance(value, bool):
                raise ProtocolError(explain(f"{INSTRUCTION_KEY}.{key}", value,
                                            f"must be a {typ}", "run the same fedagg version "
                                            "on the server and the sites"))
            return value

        enc = rec.get("down-encoded", [])
        if not isinstance(enc, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                for i in enc):
            raise ProtocolError(explain(f"{INSTRUCTION_KEY}.down-encoded", enc,
                                        "must be a list of ints", "upgrade fedagg"))
        return cls(up=get("up", str), down=get("down", str), down_encoded=[int(e) for e in enc],
                   run_seed=get("run-seed", int), server_round=get("server-round", int),
                   previous_round=get("previous-round", int), namespace=get("namespace", str),
                   support=get("support", str),
                   votes_round=get("votes-round", int) if "votes-round" in rec else -1)


def payload_record(data: bytes) -> ArrayRecord:
    """Encoded payload bytes -> the reply's ArrayRecord (one uint8 array)."""
    return ArrayRecord({PAYLOAD_KEY: Array(np.frombuffer(data, dtype=np.uint8).copy())})


def payload_bytes(record: ArrayRecord) -> bytes:
    """The reply's ArrayRecord -> encoded payload bytes.

    Raises
    ------
    CodecError
        If the record does not hold exactly one 1-D uint8 array under :data:`PAYLOAD_KEY`.
    """
    keys = list(record.keys())
    if keys != [PAYLOAD_KEY]:
        raise CodecError(explain(f"{REPLY_KEY}.keys", keys[:5], f"must be [{PAYLOAD_KEY!r}]",
                                 "reply with the compression mod's record only"))
    arr = record[PAYLOAD_KEY]
    if arr.dtype != "uint8" or len(arr.shape) != 1:
        raise CodecError(explain(f"{REPLY_KEY}.{PAYLOAD_KEY}", f"{arr.dtype}{arr.shape}",
                                 "must be a 1-D uint8 array", "send codec.encode() bytes"))
    try:  # the npy header is checked against the bytes present before anything is allocated
        data = safe_numpy(arr, name=f"{REPLY_KEY}.{PAYLOAD_KEY}", copy=False)
    except UpdateRejected as exc:
        raise CodecError(str(exc)) from None
    return bytes(np.ascontiguousarray(data, dtype=np.uint8).tobytes())


def votes_record(vote_sum: np.ndarray) -> ArrayRecord:
    """A summed vote table -> ArrayRecord :data:`VOTES_KEY` (counts as uint8 / uint16 / uint32,
    the narrowest that holds them: downward bytes are counted like any others)."""
    table = np.asarray(vote_sum)
    top = int(table.max(initial=0))
    dtype = np.uint8 if top < 2**8 else np.uint16 if top < 2**16 else np.uint32
    return ArrayRecord({"sum": Array(np.ascontiguousarray(table, dtype=dtype))})


def votes_from_record(record: ArrayRecord) -> np.ndarray:
    """ArrayRecord :data:`VOTES_KEY` -> the summed vote table (int64).

    Raises
    ------
    ProtocolError
        Not one 2-D unsigned-integer array ``"sum"``.
    """
    if list(record.keys()) != ["sum"]:
        raise ProtocolError(explain(f"{VOTES_KEY}.keys", list(record.keys())[:5],
                                    "must be ['sum']", "run the same fedagg version on the "
                                    "server and the sites"))
    arr = record["sum"]
    if arr.dtype not in ("uint8", "uint16", "uint32") or len(arr.shape) != 2:
        raise ProtocolError(explain(f"{VOTES_KEY}.sum", f"{arr.dtype}{arr.shape}",
                                    "must be a 2-D unsigned integer table", "-"))
    try:
        table = safe_numpy(arr, name=f"{VOTES_KEY}.sum", copy=True)
    except UpdateRejected as exc:
        raise ProtocolError(str(exc)) from None
    return np.asarray(table, np.int64)
