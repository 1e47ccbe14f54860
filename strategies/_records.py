"""Flower records <-> plain numpy data: the one place that knows both.

Also measures the size of a message as Flower really ships it: since Flower 1.13 a message is a
tree of content-addressed objects (records, arrays, 5 MiB array chunks), each serialized with
``deflate()``; the bytes on the wire are the sum over the distinct objects of the tree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from fedagg.config import flatten, unflatten

__all__ = [
    "arrays_to_record",
    "config_to_record",
    "message_nbytes",
    "record_to_arrays",
    "record_to_config",
    "reply_metrics",
]


def message_nbytes(message: Message) -> int:
    """Serialized size of ``message`` in bytes (all distinct objects of its tree)."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


def arrays_to_record(arrays: Sequence[np.ndarray], keys: Sequence[str] | None = None) -> ArrayRecord:
    """List of numpy arrays -> ArrayRecord (keys ``"0"``, ``"1"``, ... unless given)."""
    names = list(keys) if keys is not None else [str(i) for i in range(len(arrays))]
    return ArrayRecord({k: Array(np.ascontiguousarray(a)) for k, a in zip(names, arrays, strict=True)})


def record_to_arrays(record: ArrayRecord) -> tuple[list[str], list[np.ndarray]]:
    """ArrayRecord -> (keys, numpy arrays) in record order."""
    keys = list(record.keys())
    return keys, [record[k].numpy() for k in keys]


def config_to_record(nested: Mapping[str, Any], **extra: Any) -> ConfigRecord:
    """Nested config dict -> flat ``ConfigRecord`` with dotted keys (None values are dropped)."""
    flat = {k: v for k, v in flatten(nested).items() if v is not None and not isinstance(v, dict)}
    flat.update({k: v for k, v in extra.items() if v is not None})
    return ConfigRecord(flat)


def record_to_config(record: ConfigRecord | Mapping[str, Any]) -> dict[str, Any]:
    """Flat dotted ``ConfigRecord`` -> nested dict (keys without a dot are kept at the top)."""
    return unflatten({k: v for k, v in dict(record).items()})


def reply_metrics(message: Message) -> MetricRecord | None:
    """The first MetricRecord of a reply, or None."""
    recs = list(message.content.metric_records.values())
    return recs[0] if recs else None
