"""Secure-aggregation messages <-> Flower records, and Flower node ids <-> site indices.

The Flower-free core (:mod:`fedagg.secagg`) speaks plain dicts of ``int | bytes | ndarray``.
Here they become records of a Flower :class:`~flwr.app.RecordDict`:

* ints and bytes -> one :class:`~flwr.app.ConfigRecord` under :data:`CONFIG_KEY`;
* numpy arrays -> one :class:`~flwr.app.ArrayRecord` under :data:`ARRAYS_KEY`, present only
  when the message has one: since wire version 3 that is only the masked ``uint32`` vector of
  an upload (id lists, generations and share rows are ``bytes`` records of the core, so a
  message pays no ~0.45 kB of array framing for each). Flower ships every array of an
  ArrayRecord as content-addressed chunks of at most 5 MiB, so a large masked vector is
  chunked on the wire, never inlined in a ConfigRecord;
* the public protocol parameters -> a ConfigRecord under :data:`PARAMS_KEY`.

The same conversion stores a site's :meth:`~fedagg.secagg.ClientState.state_dict` in
``Context.state`` (it holds the site's secret keys and never leaves the site).

Site ids of the core must be small (``< 2^31 - 2``, Shamir evaluation points); Flower node ids
are 64-bit. :class:`SiteIndex` assigns each node id a small index that stays fixed for the run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedagg.errors import ConfigError, ProtocolError, UpdateRejected, explain
from fedagg.secagg import Message as SecAggMessage
from fedagg.secagg import MessageDict, SecAggParams
from strategies.wire.arrays import numpy_array, safe_numpy

__all__ = [
    "ARRAYS_KEY",
    "CONFIG_KEY",
    "PARAMS_KEY",
    "SECAGG_KEYS",
    "SECAGG_WIRE",
    "STAGES",
    "SiteIndex",
    "dict_from_records",
    "dict_to_records",
    "pack",
    "params_from_record",
    "params_to_record",
    "strip",
    "unpack",
]

CONFIG_KEY = "secagg-config"
ARRAYS_KEY = "secagg-arrays"
PARAMS_KEY = "secagg-params"
SECAGG_KEYS = (CONFIG_KEY, ARRAYS_KEY, PARAMS_KEY)

SECAGG_WIRE = 4
"""Version of the secure-aggregation records. 4: the masks are bound to the model the round
sent (``RoundRequest.binding``: the round binding of :func:`strategies.wire.model_digest` of
the model record; a canary after the values); 3: a dense or public-support upload carries the
site's metric slots (``fedagg.update.SECURE_METRICS``: the train loss, masked) after its values;
2: every exchange is a ``train`` message and the stage is named in :data:`PARAMS_KEY` (so a
stock ClientApp with the fedagg mod answers them); 1 (fedagg 0.1): setup and unmask were
``query.secagg_*`` messages. A site or server of another version refuses the records, naming
both versions."""
STAGES = ("advertise", "share-keys", "upload", "unmask")
"""Stages of a secure round, in the order the server drives them (docs/protocols/secagg.md)."""

M = TypeVar("M", bound=SecAggMessage)

_PARAM_FIELDS = ("threshold", "num_neighbours", "clip", "frac_bits", "ring_bits", "precision",
                 "weight_scale")


def dict_to_records(data: MessageDict) -> tuple[ConfigRecord, ArrayRecord]:
    """Split a flat protocol dict into (ints and bytes, numpy arrays)."""
    scalars: dict[str, Any] = {}
    arrays: dict[str, Array] = {}
    for key, value in data.items():
        if isinstance(value, np.ndarray):
            arrays[key] = numpy_array(value if value.ndim else value.reshape(1))
        elif isinstance(value, (bytes, bytearray)):
            scalars[key] = bytes(value)
        elif isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
            scalars[key] = int(value)
        else:
            raise ProtocolError(explain(key, type(value).__name__, "must be int, bytes or ndarray",
                                        "fix the protocol message"))
    return ConfigRecord(scalars), ArrayRecord(arrays)


def dict_from_records(config: ConfigRecord, arrays: ArrayRecord, *, copy: bool = True
                      ) -> MessageDict:
    """Inverse of :func:`dict_to_records` (keys of both records, arrays as numpy).

    With ``copy=False`` the arrays are read-only views on the records' npy bytes (the masked
    vector of an upload is read once, never copied); headers are checked against the data
    present before anything is allocated (:func:`strategies.wire.safe_numpy`).
    """
    out: MessageDict = {}
    for key, value in dict(config).items():
        if isinstance(value, (bool, float, str, list)):
            raise ProtocolError(explain(key, type(value).__name__, "must be int or bytes",
                                        "resend the message"))
        out[key] = value
    for key in arrays:
        if key in out:
            raise ProtocolError(explain(key, "duplicate", "a key is in both records", "-"))
        try:
            out[key] = safe_numpy(arrays[key], name=key, copy=copy)
        except UpdateRejected as exc:
            raise ProtocolError(str(exc)) from None
    return out


def pack(content: RecordDict, message: SecAggMessage) -> RecordDict:
    """Add ``message`` to ``content`` (under :data:`CONFIG_KEY`, and :data:`ARRAYS_KEY` when it
    has an array: an empty ArrayRecord would still cost 168 bytes on the wire)."""
    config, arrays = dict_to_records(message.to_dict())
    content[CONFIG_KEY] = config
    if len(arrays):
        content[ARRAYS_KEY] = arrays
    elif ARRAYS_KEY in content:
        del content[ARRAYS_KEY]
    return content


def unpack(content: RecordDict, cls: type[M]) -> M:
    """Read a protocol message of type ``cls`` from ``content`` (arrays: read-only views).

    Raises
    ------
    ProtocolError
        The records are missing or do not hold a valid ``cls`` message.
    """
    config = content.config_records.get(CONFIG_KEY)
    arrays = content.array_records.get(ARRAYS_KEY, ArrayRecord({}))
    if config is None:
        raise ProtocolError(explain("message content", sorted(content.keys()),
                                    f"must hold {CONFIG_KEY!r} (and {ARRAYS_KEY!r} for an "
                                    "upload)", "send a fedagg secure-aggregation message"))
    return cls.from_dict(dict_from_records(config, arrays, copy=False))


def strip(content: RecordDict) -> RecordDict:
    """A copy of ``content`` without the secure-aggregation records (records are shared)."""
    return RecordDict({k: v for k, v in content.items() if k not in SECAGG_KEYS})


def params_to_record(params: SecAggParams, site: int, stage: str = "upload") -> ConfigRecord:
    """Public parameters, the receiving site's index and the stage, for a site."""
    if stage not in STAGES:
        raise ProtocolError(explain(f"{PARAMS_KEY}.stage", stage, f"must be one of {STAGES}",
                                    "use one of the listed stages"))
    rec: dict[str, Any] = {"site": site, "stage": stage, "wire": SECAGG_WIRE}
    for name in _PARAM_FIELDS:
        value = getattr(params, name)
        if value is not None:
            rec[name] = value
    return ConfigRecord(rec)


def params_from_record(record: ConfigRecord) -> tuple[int, SecAggParams, str]:
    """``(site index, SecAggParams, stage)`` from :func:`params_to_record`'s record.

    Raises
    ------
    ProtocolError
        Another wire version (the message names both), a bad stage, site or parameter.
    """
    values = dict(record)
    wire = values.pop("wire", 1)
    if wire != SECAGG_WIRE:
        raise ProtocolError(explain(f"{PARAMS_KEY}.wire", wire,
                                    f"this site speaks secure-aggregation wire version "
                                    f"{SECAGG_WIRE}", "run the same fedagg version on the "
                                    "server and the sites"))
    stage = values.pop("stage", None)
    if stage not in STAGES:
        raise ProtocolError(explain(f"{PARAMS_KEY}.stage", stage, f"must be one of {STAGES}",
                                    "run the same fedagg version on the server and the sites"))
    site = values.pop("site", None)
    if not isinstance(site, int) or isinstance(site, bool):
        raise ProtocolError(explain(f"{PARAMS_KEY}.site", site, "must be an int",
                                    "send the site index with every secure-aggregation message"))
    unknown = set(values) - set(_PARAM_FIELDS)
    if unknown:
        raise ProtocolError(explain(PARAMS_KEY, sorted(unknown), "unknown parameters",
                                    "use the same fedagg version on server and sites"))
    try:
        params = SecAggParams(**values)  # type: ignore[arg-type]
    except (TypeError, ValueError, ConfigError) as exc:
        raise ProtocolError(explain(PARAMS_KEY, "parameters", f"are invalid ({exc})",
                                    "run the same fedagg version on the server and the sites")
                            ) from None
    return site, params, str(stage)


class SiteIndex:
    """Stable small index per Flower node id, for the whole run.

    Nodes seen in the first call get ``0, 1, ...`` in the order of their node ids; nodes that
    appear later get the next free index. An index is never reused, so a node that leaves and
    returns keeps its index and a new node never inherits someone else's.
    """

    def __init__(self) -> None:
        self._index: dict[int, int] = {}
        self._node: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._index)

    def indices(self, node_ids: Iterable[int]) -> list[int]:
        """Indices of ``node_ids`` (assigning new ones in sorted node-id order)."""
        ids = [int(n) for n in node_ids]
        for node in sorted(set(ids) - set(self._index)):
            i = len(self._index)
            self._index[node] = i
            self._node[i] = node
        return [self._index[n] for n in ids]

    def node(self, index: int) -> int:
        """The node id of ``index`` (KeyError if unknown)."""
        return self._node[index]

    def index(self, node_id: int) -> int | None:
        """The index of ``node_id``, or None if the node was never seen."""
        return self._index.get(int(node_id))
