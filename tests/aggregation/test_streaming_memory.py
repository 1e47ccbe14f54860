"""Peak memory of a streamed aggregation does not grow with the number of replies.

Replies are real Flower train replies produced one at a time by a generator; each is read
as read-only views on its message bytes (``record_to_arrays(copy=False)``), folded and
dropped. Peak RSS is the kernel's high-water mark, reset per case (fedagg.memory).
"""

from __future__ import annotations

import gc
import io
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import guarded_fedavg, reply_message
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedagg.accumulate import Accumulator
from fedagg.aggregate import weighted_mean
from fedagg.memory import PeakMemory, peak_rss, reset_peak
from strategies.fedavg import FedAvg
from strategies.wire import arrays_to_record, record_to_arrays

N_PARAMS = 10_000_000
MODEL_BYTES = 4 * N_PARAMS


def _npy(n: int, value: float) -> Array:
    """A float32 Array built in place (its npy bytes plus one copy: 2 x the array at most)."""
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f4", "fortran_order": False,
                                                "shape": (n,)})
    h = head.getvalue()
    buf = bytearray(len(h) + 4 * n)
    buf[:len(h)] = h
    np.frombuffer(buf, np.float32, offset=len(h))[:] = value
    return Array(dtype="float32", shape=(n,), stype="numpy.ndarray", data=bytes(buf))


def _replies(n: int) -> Iterator[Message]:
    """Train replies made one at a time; the generator keeps nothing between them."""
    for i in range(n):
        yield reply_message(i + 1, RecordDict({
            "arrays": ArrayRecord({"0": _npy(N_PARAMS, 0.001 * (i + 1))}),
            "metrics": MetricRecord({"num-examples": 10 + i})}))


def _streamed(n: int) -> tuple[int, np.ndarray]:
    ref = [np.zeros(N_PARAMS, np.float32)]
    gc.collect()
    mem = PeakMemory()
    mem.start()
    acc = Accumulator.for_model(ref)
    for reply in _replies(n):
        _, arrays = record_to_arrays(reply.content["arrays"], copy=False)
        acc.fold(arrays, float(reply.content["metrics"]["num-examples"]))
        del arrays, reply
    mean = acc.mean()[0]
    del acc
    span = mem.stop()
    return span.above_start, mean


class _Grid:
    def get_node_ids(self) -> list[int]:
        return list(range(1, 65))


def _fedavg_round(n: int) -> tuple[int, np.ndarray, FedAvg]:
    """fedagg's FedAvg fed a generator as fedagg's round loop feeds it (``aggregate_stream``:
    the replies straight into its engine; guards on, the run config's defaults)."""
    strategy = guarded_fedavg(min_available_nodes=1)
    strategy.configure_train(1, arrays_to_record([np.zeros(N_PARAMS, np.float32)]),
                             ConfigRecord(), _Grid())
    gc.collect()
    mem = PeakMemory()
    mem.start()
    new, _ = strategy.aggregate_stream(1, _replies(n))
    assert new is not None
    mean = record_to_arrays(new)[1][0][:4].copy()
    del new
    span = mem.stop()
    return span.above_start, mean, strategy


def _listed(n: int) -> int:
    gc.collect()
    mem = PeakMemory()
    mem.start()
    replies = list(_replies(n))  # what a send_and_receive round holds
    arrays = [record_to_arrays(r.content["arrays"], copy=False)[1] for r in replies]
    weighted_mean(arrays, [float(r.content["metrics"]["num-examples"]) for r in replies])
    del arrays, replies
    return mem.stop().above_start


@pytest.mark.skipif(not reset_peak() or peak_rss() is None,
                    reason="needs /proc/self/clear_refs (Linux) to reset the peak RSS")
def test_streamed_peak_memory_does_not_grow_with_the_number_of_replies() -> None:
    few, mean_few = _streamed(2)
    many, mean_many = _streamed(12)
    # the stated bound: the int64 accumulator (2 x a float32 model) plus, at worst, the next
    # reply while the generator builds it (2 x: its buffer and the bytes), or the reply being
    # folded (1 x), or the mean (1 x); block buffers and allocator slack
    assert many <= 4.5 * MODEL_BYTES, many / MODEL_BYTES
    assert many - few <= 0.5 * MODEL_BYTES, (few / MODEL_BYTES, many / MODEL_BYTES)
    w = np.arange(10, 22, dtype=np.float64)
    expected = np.float32(float(np.sum(w * (0.001 * np.arange(1, 13, dtype=np.float32)
                                            ).astype(np.float64)) / w.sum()))
    assert abs(float(mean_many[0]) - float(expected)) <= 1e-6
    assert float(mean_few[0]) != float(mean_many[0])


@pytest.mark.skipif(not reset_peak() or peak_rss() is None,
                    reason="needs /proc/self/clear_refs (Linux) to reset the peak RSS")
def test_the_measurement_sees_a_list_of_replies_grow() -> None:
    """The control: the same replies kept in a list (as send_and_receive hands them over)
    cost one model each, so the streaming test above can fail."""
    few, many = _listed(2), _listed(8)
    assert many - few >= 4 * MODEL_BYTES, (few / MODEL_BYTES, many / MODEL_BYTES)


@pytest.mark.skipif(not reset_peak() or peak_rss() is None,
                    reason="needs /proc/self/clear_refs (Linux) to reset the peak RSS")
def test_fedavg_aggregate_train_on_a_generator_stays_within_its_bound() -> None:
    """Done-when of issue 19: aggregate_train fed a generator of large replies (40 MB each,
    the round guards on): peak memory does not grow with the number of replies."""
    few, mean_few, _ = _fedavg_round(3)
    many, mean_many, strategy = _fedavg_round(12)
    # the accumulator (2 models), the reply in hand or the next one being built (<= 2), then
    # the mean and the new model's record (the accumulator released first)
    assert many <= 4.5 * MODEL_BYTES, many / MODEL_BYTES
    assert many - few <= 0.5 * MODEL_BYTES, (few / MODEL_BYTES, many / MODEL_BYTES)
    assert not strategy.report.refused and strategy.report.accepted == [-1] * 12
    w = np.arange(10, 22, dtype=np.float64)
    expected = float(np.sum(w * (0.001 * np.arange(1, 13, dtype=np.float32)).astype(np.float64))
                     / w.sum())
    assert abs(float(mean_many[0]) - expected) <= 1e-6 and float(mean_few[0]) != expected
