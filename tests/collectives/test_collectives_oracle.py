"""In-process execution oracle: every algorithm equals a naive sum, for any N and length."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

from fedagg.collectives import (
    CollectiveStats,
    InProcessCommunicator,
    all_reduce,
    get_schedule,
    last_stats,
    run_inprocess,
)
from fedagg.collectives.plan import RIDE_BYTES

ALGS = ("ring", "tree", "hierarchical", "native", "auto")
PRIMES = (2, 3, 7, 13, 101)


def _inputs(
    n: int, d: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(n)]


def _run(xs: list[torch.Tensor], **kw: object) -> list[tuple[torch.Tensor, CollectiveStats | None]]:
    def fn(comm: InProcessCommunicator) -> tuple[torch.Tensor, CollectiveStats | None]:
        t = xs[comm.rank].clone()
        out = all_reduce(t, comm=comm, **kw)  # type: ignore[arg-type]
        assert out is t
        return t, last_stats()

    return run_inprocess(len(xs), fn, timeout=20)


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("n", range(1, 10))
def test_equals_plain_sum(algorithm: str, n: int) -> None:
    for d in sorted({0, 1, max(0, n - 1), n + 1, *PRIMES, 4099}):
        xs = _inputs(n, d, seed=d)
        expected = torch.stack([x.double() for x in xs]).sum(0)
        # small segments so that pipelining over many segments is exercised
        for t, _ in _run(xs, algorithm=algorithm, segment_bytes=256):
            torch.testing.assert_close(t.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algorithm", ("ring", "tree", "hierarchical", "native"))
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.float32, 1e-5), (torch.float64, 1e-12), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)],
)
def test_dtypes_and_avg(algorithm: str, dtype: torch.dtype, tol: float) -> None:
    n, d = 5, 257
    xs = _inputs(n, d, dtype, seed=1)
    expected = torch.stack([x.double() for x in xs]).mean(0)
    results = _run(xs, algorithm=algorithm, op="avg", segment_bytes=128)
    for t, _ in results:
        assert t.dtype == dtype
        torch.testing.assert_close(t.double(), expected, rtol=tol, atol=tol)
    assert all(torch.equal(results[0][0], t) for t, _ in results)  # bit-identical on all ranks


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
@pytest.mark.parametrize("algorithm", ("ring", "tree", "hierarchical"))
def test_low_precision_wire_is_close_and_identical_on_all_ranks(algorithm: str, wire: str) -> None:
    n, d = 6, 1001
    xs = _inputs(n, d, seed=2)
    expected = torch.stack([x.double() for x in xs]).sum(0)
    results = _run(xs, algorithm=algorithm, wire_dtype=wire, segment_bytes=200)
    tol = 5e-2 if wire == "bf16" else 5e-3
    for t, st in results:
        assert t.dtype == torch.float32
        torch.testing.assert_close(t.double(), expected, rtol=tol, atol=tol)
        assert st is not None and st.wire_dtype == ("bfloat16" if wire == "bf16" else "float16")
    assert all(torch.equal(results[0][0], t) for t, _ in results)


@pytest.mark.parametrize("algorithm", ("ring", "tree", "hierarchical"))
@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_counters_match_the_schedule(algorithm: str, n: int) -> None:
    d = 12 * n + 5
    results = _run(_inputs(n, d), algorithm=algorithm)
    sched = get_schedule(algorithm, n, d)
    for rank, (_, st) in enumerate(results):
        assert st is not None
        assert st.algorithm == algorithm and st.rank == rank and st.numel == d
        assert st.bytes_sent == 4 * sched.elements_sent(rank)
        assert st.bytes_received == 4 * sched.elements_received(rank)
        assert st.steps == sched.num_steps
        assert st.header_bytes > 0


def test_ring_counters_are_two_n_minus_one_over_n_of_d() -> None:
    n, d = 4, 4096
    for _, st in _run(_inputs(n, d), algorithm="ring"):
        assert st is not None
        assert st.bytes_sent == 2 * (n - 1) * d * 4 // n
        assert st.messages_sent == 2 * (n - 1)


def test_wire_dtype_halves_bytes_sent() -> None:
    n, d = 4, 4096
    full = _run(_inputs(n, d), algorithm="ring")[0][1]
    half = _run(_inputs(n, d), algorithm="ring", wire_dtype="bf16")[0][1]
    assert full is not None and half is not None
    assert half.bytes_sent * 2 == full.bytes_sent


def test_multidimensional_tensor_and_stats_out_parameter() -> None:
    xs = [torch.full((3, 4), float(r)) for r in range(3)]
    stats = [CollectiveStats() for _ in range(3)]

    def fn(comm: InProcessCommunicator) -> torch.Tensor:
        return all_reduce(
            xs[comm.rank].clone(), algorithm="tree", comm=comm, stats=stats[comm.rank]
        )

    for t in run_inprocess(3, fn):
        assert torch.equal(t, torch.full((3, 4), 3.0))
    assert all(s.algorithm == "tree" and s.seconds > 0 for s in stats)


@given(
    algorithm=hst.sampled_from(("ring", "tree", "hierarchical")),
    n=hst.integers(1, 6),
    d=hst.integers(0, 200),
    seg=hst.integers(4, 512),
    group=hst.integers(1, 4),
)
@settings(max_examples=40, deadline=None)
def test_property_integer_valued_sums_are_exact(
    algorithm: str, n: int, d: int, seg: int, group: int
) -> None:
    xs = [torch.randint(-100, 100, (d,)).float() for _ in range(n)]
    expected = torch.stack(xs).sum(0)
    for t, _ in _run(xs, algorithm=algorithm, segment_bytes=seg, group_size=group):
        assert torch.equal(t, expected)


@pytest.mark.parametrize("algorithm", ("ring", "tree", "hierarchical"))
@pytest.mark.parametrize("n", (2, 3, 4))
def test_step0_data_riding_in_the_header_message(algorithm: str, n: int) -> None:
    """Small first segments travel in the header message, larger ones separately: same sums.

    Counts: ``messages_sent`` includes the riding segments, so it equals the run without the
    header (``check=False``), and ``bytes_sent`` is the schedule's.
    """
    for d, seg in ((4099, 4 << 20), (4099, 1024), (RIDE_BYTES // 4 * n + 2 * n, 4 << 20)):
        xs = _inputs(n, d, seed=d)
        expected = torch.stack([x.double() for x in xs]).sum(0)
        checked = _run(xs, algorithm=algorithm, segment_bytes=seg)
        unchecked = _run(xs, algorithm=algorithm, segment_bytes=seg, check=False)
        sched = get_schedule(algorithm, n, d)
        for rank, ((t, st), (u, su)) in enumerate(zip(checked, unchecked, strict=True)):
            torch.testing.assert_close(t.double(), expected, rtol=1e-5, atol=1e-5)
            assert torch.equal(t, u)
            assert st is not None and su is not None
            assert st.bytes_sent == 4 * sched.elements_sent(rank)
            assert st.messages_sent == su.messages_sent
