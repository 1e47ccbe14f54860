"""Bad input gives a clear error on every rank, never a hang."""

from __future__ import annotations

import time

import pytest
import torch

from fedagg.collectives import InProcessCommunicator, InProcessGroup, all_reduce, run_inprocess
from fedagg.errors import CollectiveError, CollectiveTimeout, ConfigError


def _all_errors(n: int, fn: object, timeout: float = 5.0) -> list[object]:
    return run_inprocess(n, fn, timeout=timeout, return_exceptions=True)  # type: ignore[call-overload,no-any-return]


def test_mismatched_lengths_raise_collective_error_on_every_rank() -> None:
    def fn(comm: InProcessCommunicator) -> torch.Tensor:
        return all_reduce(torch.ones(10 + comm.rank), algorithm="ring", comm=comm)

    out = _all_errors(3, fn)
    assert all(isinstance(e, CollectiveError) for e in out), out
    assert "numel" in str(out[0]) and "[10, 11, 12]" in str(out[0]) and "Fix:" in str(out[0])


def test_mismatched_dtypes_raise_on_every_rank() -> None:
    def fn(comm: InProcessCommunicator) -> torch.Tensor:
        dtype = torch.float64 if comm.rank == 1 else torch.float32
        return all_reduce(torch.ones(8, dtype=dtype), algorithm="tree", comm=comm)

    out = _all_errors(3, fn)
    assert all(isinstance(e, CollectiveError) for e in out)
    assert "dtype" in str(out[0]) and "float64" in str(out[0])


def test_mismatched_algorithms_raise_on_every_rank() -> None:
    def fn(comm: InProcessCommunicator) -> torch.Tensor:
        return all_reduce(torch.ones(8), algorithm="ring" if comm.rank else "tree", comm=comm)

    out = _all_errors(2, fn)
    assert all(isinstance(e, CollectiveError) and "algorithm" in str(e) for e in out)


def test_unknown_algorithm_on_one_rank_fails_fast_everywhere() -> None:
    def fn(comm: InProcessCommunicator) -> torch.Tensor:
        return all_reduce(
            torch.ones(8), algorithm="butterfly" if comm.rank == 2 else "ring", comm=comm
        )

    t0 = time.monotonic()
    out = _all_errors(3, fn, timeout=30)
    assert time.monotonic() - t0 < 10
    assert isinstance(out[2], ConfigError) and "butterfly" in str(out[2])
    assert all(isinstance(e, CollectiveError) and "ranks [2]" in str(e) for e in out[:2])


def test_non_contiguous_tensor_is_rejected() -> None:
    def fn(comm: InProcessCommunicator) -> torch.Tensor:
        return all_reduce(torch.ones(4, 6).t(), comm=comm)

    out = _all_errors(2, fn)
    assert all(isinstance(e, ConfigError) and "contiguous" in str(e) for e in out)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"algorithm": "butterfly"}, "algorithm"),
        ({"op": "max"}, "op"),
        ({"wire_dtype": "int8"}, "wire_dtype"),
        ({"wire_dtype": "bf16", "algorithm": "native"}, "native"),
        ({"segment_bytes": 0}, "segment_bytes"),
    ],
)
def test_bad_arguments_single_rank(kwargs: dict[str, object], match: str) -> None:
    comm = InProcessGroup(1).communicators()[0]
    with pytest.raises(ConfigError, match=match):
        all_reduce(torch.ones(3), comm=comm, **kwargs)  # type: ignore[arg-type]


def test_unsupported_dtype_and_non_tensor() -> None:
    comm = InProcessGroup(1).communicators()[0]
    with pytest.raises(ConfigError, match="dtype"):
        all_reduce(torch.ones(3, dtype=torch.int64), comm=comm)
    with pytest.raises(ConfigError, match=r"torch\.Tensor"):
        all_reduce([1.0, 2.0], comm=comm)  # type: ignore[arg-type]


def test_missing_peer_times_out_instead_of_hanging() -> None:
    def fn(comm: InProcessCommunicator) -> torch.Tensor | None:
        if comm.rank == 1:
            return None  # never calls all_reduce
        return all_reduce(torch.ones(8), algorithm="ring", comm=comm)

    t0 = time.monotonic()
    out = _all_errors(2, fn, timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert isinstance(out[0], CollectiveTimeout) and "timeout" in str(out[0])
    assert out[1] is None


def test_unchecked_mismatch_is_still_an_error_not_a_hang() -> None:
    def fn(comm: InProcessCommunicator) -> torch.Tensor:
        return all_reduce(torch.ones(10 + comm.rank), algorithm="ring", comm=comm, check=False)

    out = _all_errors(2, fn, timeout=1.0)
    assert all(isinstance(e, CollectiveError) for e in out)


def test_a_crashing_rank_aborts_its_peers() -> None:
    def fn(comm: InProcessCommunicator) -> torch.Tensor:
        if comm.rank == 0:
            raise RuntimeError("boom")
        return all_reduce(torch.ones(8), comm=comm)

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="boom"):
        run_inprocess(3, fn, timeout=30)
    assert time.monotonic() - t0 < 5


def test_default_comm_without_process_group_explains_the_fix() -> None:
    with pytest.raises(CollectiveError, match="init_process_group"):
        all_reduce(torch.ones(3))


def test_group_rejects_bad_world_size() -> None:
    with pytest.raises(ConfigError, match="world_size"):
        InProcessGroup(0)


def test_group_is_clean_after_a_mismatch() -> None:
    """The header messages carry step-0 data; after a mismatch nothing is left in flight."""

    def fn(comm: InProcessCommunicator) -> list[float]:
        with pytest.raises(CollectiveError, match="numel"):
            all_reduce(torch.ones(4096 + comm.rank), algorithm="ring", comm=comm)
        return all_reduce(torch.ones(4096), algorithm="ring", comm=comm)[:2].tolist()

    assert run_inprocess(3, fn, timeout=20) == [[3.0, 3.0]] * 3
