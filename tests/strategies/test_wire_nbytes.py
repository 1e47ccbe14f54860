"""message_nbytes (computed from sizes, no hashing) == Flower's own serialisation, byte for byte."""

from __future__ import annotations

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies.wire import arrays_to_record, deflated_nbytes, message_nbytes, messages_nbytes

DTYPES = ["float32", "float64", "int64", "uint8", "int16"]

arrays = st.builds(
    lambda shape, dtype, fill, seed: (
        np.full(shape, 0, dtype) if fill == "zeros"
        else np.random.default_rng(seed).integers(0, 100, size=shape).astype(dtype)),
    st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple),
    st.sampled_from(DTYPES), st.sampled_from(["zeros", "random"]), st.integers(0, 3))

names = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)),
                min_size=0, max_size=6)
ints = st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(2**63, 2**64 - 1),
                st.integers(-300, 300))
floats = st.floats(allow_nan=True, allow_infinity=True)
texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)
scalars = st.one_of(ints, floats, st.booleans(), texts, st.binary(max_size=300))
# a list of ints is one protobuf type: all int64, or all uint64 (Flower refuses a mix)
int_lists = st.one_of(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5),
                      st.lists(st.integers(0, 2**64 - 1), max_size=5))
config_values = st.one_of(scalars, int_lists,
                          *(st.lists(x, max_size=5) for x in (floats, st.booleans(), texts,
                                                              st.binary(max_size=40))))
metric_values = st.one_of(ints, floats, int_lists, st.lists(floats, max_size=5))


@st.composite
def contents(draw: st.DrawFn) -> RecordDict:
    rd = RecordDict()
    for name in draw(st.lists(names, max_size=4, unique=True)):
        kind = draw(st.sampled_from(["arrays", "config", "metrics"]))
        if kind == "arrays":
            arrs = draw(st.lists(arrays, max_size=4))
            keys = draw(st.lists(names, min_size=len(arrs), max_size=len(arrs), unique=True))
            rd[name] = arrays_to_record(arrs, keys)
        elif kind == "config":
            rd[name] = ConfigRecord(draw(st.dictionaries(names, config_values, max_size=4)))
        else:
            rd[name] = MetricRecord(draw(st.dictionaries(names, metric_values, max_size=4)))
    return rd


def _reply(content: RecordDict | None, error: str | None = None) -> Message:
    md = Metadata(run_id=3, message_id="m", src_node_id=7, dst_node_id=0,
                  reply_to_message_id="q", group_id="g", created_at=1.5, ttl=60.0,
                  message_type="train")
    if error is not None:
        return Message(error=Error(code=2, reason=error), metadata=md)
    return Message(content=content, metadata=md)


@settings(max_examples=400, deadline=None)
@given(contents(), st.booleans())
def test_equals_flowers_serialisation(content: RecordDict, as_reply: bool) -> None:
    msg = _reply(content) if as_reply else Message(content, dst_node_id=12,
                                                   message_type="train")
    assert message_nbytes(msg) == deflated_nbytes(msg)


def test_error_replies_and_shared_objects() -> None:
    assert message_nbytes(_reply(None, "boom")) == deflated_nbytes(_reply(None, "boom"))
    nan = float("nan")  # equal records count once, NaN and -0.0 included (by their bytes)
    rd = RecordDict({"a": ConfigRecord({"x": [nan, -0.0]}), "b": ConfigRecord({"x": [nan, -0.0]}),
                     "c": ConfigRecord({"x": [nan, 0.0]}), "d": MetricRecord({"x": 1}),
                     "e": MetricRecord({"x": 1.0}), "f": ConfigRecord({"x": True}),
                     "g": ConfigRecord({"x": 1}), "h": ConfigRecord({"": []})})
    msg = Message(rd, dst_node_id=1, message_type="train")
    assert message_nbytes(msg) == deflated_nbytes(msg)
    same = arrays_to_record([np.ones(7, np.float32)] * 3)  # three identical arrays: one object
    rd = RecordDict({"a": same, "b": same, "m": MetricRecord({"x": 1}),
                     "n": MetricRecord({"x": 1})})
    msg = Message(rd, dst_node_id=1, message_type="train")
    assert message_nbytes(msg) == deflated_nbytes(msg)


def test_multi_chunk_arrays_with_repeated_and_distinct_chunks() -> None:
    step = FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE // 4  # float32 values per chunk
    rng = np.random.default_rng(0)
    noisy = rng.standard_normal(2 * step + 11).astype(np.float32)
    zeros = np.zeros(3 * step, np.float32)  # three identical chunks (and the npy header's)
    tail = zeros.copy()
    tail[-1] = 1.0  # same first / middle / last-32-bytes probe? no: the last chunk differs
    tricky = np.zeros(3 * step, np.float32)
    tricky[step + step // 3] = 1.0  # agrees with a zero chunk on every probed byte
    for arrs in ([noisy], [zeros], [zeros, zeros.copy()], [zeros, tail], [tricky, zeros]):
        msg = Message(RecordDict({"arrays": arrays_to_record(arrs)}), dst_node_id=1,
                      message_type="train")
        assert message_nbytes(msg) == deflated_nbytes(msg)


def test_unknown_array_types_fall_back_to_flowers_serialisation() -> None:
    class Tagged(Array):  # type: ignore[misc]
        pass

    arr = Array(np.arange(4, dtype=np.float32))
    rec = ArrayRecord({"x": Tagged(dtype=arr.dtype, shape=arr.shape, stype=arr.stype,
                                   data=arr.data)})
    msg = Message(RecordDict({"arrays": rec}), dst_node_id=1, message_type="train")
    assert message_nbytes(msg) == deflated_nbytes(msg)


@settings(max_examples=50, deadline=None)
@given(st.lists(contents(), min_size=1, max_size=3), st.integers(1, 4))
def test_messages_sharing_content_are_each_counted_whole(shared: list[RecordDict],
                                                         copies: int) -> None:
    msgs = [Message(c, dst_node_id=10 + i, message_type="train")
            for c in shared for i in range(copies)]
    assert messages_nbytes(msgs) == sum(deflated_nbytes(m) for m in msgs)
